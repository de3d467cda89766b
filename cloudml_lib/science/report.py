"""RUN_DIR/report.md: a run's results in one page, readable on GitHub and in the notebook, and what the
numbers mean in words.

It is rewritten from the files the run already holds (evaluation.json, plots/, predictions/,
crossval.md, provenance.json), so any command that adds results (train, evaluate, predict, crossval) refreshes
it. Images are linked by paths relative to the run directory.

`shortcomings` is the one rule that says a model is of no use yet (its predictions collapse towards a
constant, or it does not beat the training mean); `baseline_beats` adds the other baselines (baselines.py:
a linear model and trees on the frame's brightness statistics; with ERA5, the physical retrievals and trees on
the atmosphere): where the best of them does at least as well, the network adds nothing yet, and the verdict
says so with both numbers named. `verdict` says it in a sentence, for report.md, the evaluation's text
(evaluate.py) and the notebook, and says whether the frames add anything to the atmosphere
(`atmosphere_verdict`); cross-validation warns by the same rules.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cloudml_lib.base import tables
from cloudml_lib.base.config import LEGACY_VALIDATION
from cloudml_lib.base.outputs import target, write_text
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.network.compile import describe_saved
from cloudml_lib.core.run import provenance
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.science.baselines import (
    ATMOSPHERE,
    ATMOSPHERE_ONLY,
    BASELINES,
    CLOUD_THICKNESS_KM,
    COLD_STATISTIC,
    LAPSE_RATE_K_PER_KM,
)
from cloudml_lib.science.baselines import SHORT as SHORT_NAMES
from cloudml_lib.science.baselines import WORDS as BASELINE_NAMES
from cloudml_lib.science.clouds import BASELINES as CLOUD_BASELINES

REPORT = RunFolder.REPORT

COLLAPSE_STD_RATIO = 0.3  # std(pred)/std(true) below this: the predictions collapse towards a constant
OUT_OF_RANGE_SHARE = 0.1  # a test flight with more of its labels outside the heights trained on is named


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and bool(np.isfinite(v))


def shortcomings(model: dict, baseline: dict) -> list[str]:
    """Why a model's heights are of no use, one clause each ([] when none): its predictions collapse towards a
    constant (std(pred)/std(true) below COLLAPSE_STD_RATIO), or it is no better than predicting the training
    mean (MAE not below the baseline's, or R2 below it). `model` and `baseline`: regression_metrics of the
    same samples. The rule of the evaluation's verdict and of cross-validation's warnings."""
    out = []
    ratio = model.get("std_ratio")
    if _finite(ratio) and ratio < COLLAPSE_STD_RATIO:
        out.append(
            f"the predictions collapse towards a constant (std(pred)/std(true) {ratio:.2f} < "
            f"{COLLAPSE_STD_RATIO})"
        )
    mae, base_mae, r2, base_r2 = (d.get(k) for k in ("mae_km", "r2") for d in (model, baseline))
    worse_mae = _finite(mae) and _finite(base_mae) and mae >= base_mae
    worse_r2 = _finite(r2) and _finite(base_r2) and r2 < base_r2
    if worse_mae or worse_r2:
        out.append(f"the model is no better than predicting the training mean ({_versus(model, baseline)})")
    return out


def _versus(model: dict, baseline: dict) -> str:
    """ "MAE 0.310 vs 0.290 km, R2 -0.35 vs -0.02": the model's numbers against the baseline's."""
    parts = []
    if _finite(model.get("mae_km")) and _finite(baseline.get("mae_km")):
        parts.append(f"MAE {model['mae_km']:.3f} vs {baseline['mae_km']:.3f} km")
    if _finite(model.get("r2")) and _finite(baseline.get("r2")):
        parts.append(f"R2 {model['r2']:.2f} vs {baseline['r2']:.2f}")
    return ", ".join(parts)


def best_baseline(report: dict, name: str | None) -> dict | None:
    """The best baseline (baselines.compare_baselines) on test flight `name` (None: pooled), or None where the
    report holds no baselines (written before they existed)."""
    best = (report.get("baselines") or {}).get("best") or {}
    found = best.get("pooled") if name is None else (best.get("per_flight") or {}).get(name)
    return found if isinstance(found, dict) and isinstance(found.get("name"), str) else None


def baseline_beats(best: dict | None) -> str | None:
    """The clause that says a baseline does at least as well as the network (both MAEs named), or
    None (none does, or the best is the training mean: shortcomings says that)."""
    if not best or best["name"] == "mean" or not _finite(best.get("skill")) or best["skill"] > 0:
        return None
    return (
        f"{BASELINE_NAMES.get(best['name'], best['name'])} does at least as well as the network (MAE "
        f"{best['mae_km']:.3f} km for the baseline, {best['model_mae_km']:.3f} km for the network; skill "
        f"{best['skill']:+.2f}): the network adds nothing yet"
    )


def no_skill(name: str, model: dict, report: dict) -> str | None:
    """The clause that says the model has no skill on a flight (R2 at or below 0, or an MAE not below that of
    the flight's own mean height), or None: beating the training mean is not skill where another flight's
    atmosphere set that mean."""
    r2, mae = model.get("r2"), model.get("mae_km")
    own = (report.get("own_mean_mae_km") or {}).get(name)
    if _finite(r2) and r2 <= 0:
        return f"it has no skill there (R2 {r2:.2f}: no better than the flight's own mean height)"
    if _finite(own) and _finite(mae) and mae >= own:
        return (
            f"it has no skill there (MAE {mae:.3f} km, not below the {own:.3f} km of the flight's own mean "
            "height)"
        )
    return None


def against_words(a: dict) -> tuple[str | None, str]:
    """(the clause of a problem, or None; the words of the difference) for the network against its best
    baseline on a flight (skill.against_best): better or worse only where the interval excludes 0."""
    label = BASELINE_NAMES.get(a["baseline"], a["baseline"])
    low, high = a["interval_km"]
    diff = (
        f"MAE {a['mae_difference_km']:+.3f} km against {label} (95% interval over time blocks {low:+.3f} to "
        f"{high:+.3f} km)"
    )
    if a["call"] == "better":
        return None, f"better than {label}: {diff}"
    if a["call"] == "worse":
        return f"worse than {label}: {diff}", diff
    return (
        f"level with {label}: {diff}, an interval that holds 0, so the network is not shown to add to it",
        diff,
    )


def judged(name: str, model: dict, baseline: dict, report: dict) -> tuple[bool, str] | None:
    """One test flight judged: (useful, the clause that says why): whether the model beats the training mean
    and the best baseline there (with the MAE's interval over time blocks and its skill against that
    baseline) or why not, an R2 that is undefined (labels that do not vary), labels outside the heights
    trained on. None without heights to judge by."""
    if not model.get("n") or not _finite(model.get("mae_km")):
        return None
    best = best_baseline(report, name or None)
    against = (report.get("against_best") or {}).get(name) if name else None
    if not (isinstance(against, dict) and len(against.get("interval_km") or []) == 2):
        against = None  # a report written before it (or a damaged one): the point estimate speaks
    versus, difference = against_words(against) if against else (baseline_beats(best), "")
    problems = [p for p in [*shortcomings(model, baseline), no_skill(name, model, report), versus] if p]
    if problems:
        said = " and ".join(problems)
    else:
        interval = (report.get("mae_interval_km") or {}).get(name)
        said = _versus(model, baseline) + (
            f"; the MAE's 95% interval over time blocks {interval[0]:.3f}-{interval[1]:.3f} km"
            if interval
            else ""
        )
        if best and best["name"] != "mean" and _finite(best.get("skill")):
            said += (
                f"; the best baseline, {BASELINE_NAMES.get(best['name'], best['name'])}, has MAE "
                f"{best['mae_km']:.3f} km: the network's MAE skill against it is {best['skill']:+.2f}"
            )
        said += f"; {difference}" if difference else ""
    if not _finite(model.get("r2")):
        said += f"; R2 is undefined there: its {model['n']} labels do not vary"
    out = (report.get("outside_training_labels") or {}).get(name)
    if out and out["share"] > OUT_OF_RANGE_SHARE:
        span = report.get("training_label_range_km") or [float("nan")] * 2
        said += (
            f"; {out['outside']} of its {out['n']} labels ({out['share']:.0%}, {out['low_km']:.2f}-"
            f"{out['high_km']:.2f} km) lie outside the heights trained on ({span[0]:.2f}-{span[1]:.2f} km): "
            "an extrapolation"
        )
    return not problems, said


def flight_verdicts(report: dict) -> dict:
    """Each test flight's verdict in a sentence, by name."""
    per, base = report.get("per_flight") or {}, report.get("baseline_per_flight") or {}
    one = len(per) == 1
    out = {}
    for name, m in per.items():
        j = judged(name, m, base.get(name) or (report.get("baseline") if one else {}) or {}, report)
        if j is not None:
            out[name] = (
                f"{name}: the model beats {_beaten(report)} ({j[1]})."
                if j[0]
                else f"{name}: not useful yet: {j[1]}."
            )
    return out


def _beaten(report: dict) -> str:
    """What a useful model beats: every baseline, or (a report written before the physical baselines) the
    training mean."""
    return "every baseline" if report.get("baselines") else "predicting the training mean"


def verdict(report: dict) -> str | None:
    """The test result in words, flight by flight (a flight where the model collapses or loses to the baseline
    is called so, whatever the pooled numbers say), then the pooled numbers where there are several flights,
    and the protocol where it was not an untouched test. None without test heights to judge by."""
    model, baseline = report.get("overall") or {}, report.get("baseline") or {}
    if not model.get("n") or not _finite(model.get("mae_km")):
        return None
    per, base = report.get("per_flight") or {}, report.get("baseline_per_flight") or {}
    one = len(per) == 1
    judgements = {
        n: judged(n, m, base.get(n) or (baseline if one else {}) or {}, report) for n, m in per.items()
    }
    judgements = {n: j for n, j in judgements.items() if j is not None}
    if not judgements:  # a report without per-flight numbers: the pooled ones
        judgements = {"the test flights": judged("", model, baseline, report)}
    bad = [n for n, j in judgements.items() if not j[0]]
    if len(judgements) == 1:
        ((name, (useful, why)),) = judgements.items()
        text = (
            f"Verdict: the model beats {_beaten(report)} on {name} ({why})."
            if useful
            else f"Verdict: this model is not useful yet on {name}: {why}."
        )
    else:
        good = [n for n in judgements if n not in bad]
        beaten = "every baseline" if report.get("baselines") else "the training mean"
        pooled = best_baseline(report, None)
        text = (
            "Verdict, flight by flight: "
            + " ".join(flight_verdicts(report).values())
            + (f" The model beats {beaten} on {', '.join(good)}" if good else " It beats it on none")
            + (f" and NOT on {', '.join(bad)}." if bad and good else ".")
            + f" Pooled over the {len(judgements)} test flights (a pooled R2 counts the differences between "
            f"flights as skill): {_versus(model, baseline)}"
            + (
                f"; MAE skill {pooled['skill']:+.2f} against the best baseline there, "
                f"{BASELINE_NAMES.get(pooled['name'], pooled['name'])}."
                if pooled and _finite(pooled.get("skill"))
                else "."
            )
        )
    atmosphere = atmosphere_verdict(report)
    text += f" {atmosphere}" if atmosphere else ""
    disagree = validation_disagrees(report)
    text += f" {disagree}" if disagree else ""
    if report.get("control"):  # a control is meant to lose to the model: no advice to improve it
        return f"Control run ({report['control']}), to compare with the model, not to use: {text}"
    if bad:
        text += advice(report, bad)
    if (report.get("protocol") or {}).get("name") == LEGACY_VALIDATION:
        text += " " + LEGACY_WORDS
    return text


DISAGREE_R2 = 0.3  # the validation data's and the test flights' R2 further apart than this: said


def validation_disagrees(report: dict) -> str | None:
    """The sentence that says the validation data that chose the epoch (and calibrated the intervals) and the
    test flights disagree, R2 further apart than DISAGREE_R2, or None."""
    v = ((report.get("validation") or {}).get("pooled")) or {}
    t = report.get("overall") or {}
    if not (_finite(v.get("r2")) and _finite(t.get("r2")) and abs(v["r2"] - t["r2"]) > DISAGREE_R2):
        return None
    return (
        "The validation data that chose the epoch and calibrated the intervals disagree with the test "
        f"flights (validation R2 {v['r2']:.2f}, bias {v.get('bias_km', float('nan')):+.2f} km; test R2 "
        f"{t['r2']:.2f}, bias {t.get('bias_km', float('nan')):+.2f} km): what was chosen on one may not suit "
        "the other."
    )


def advice(report: dict, bad: list[str]) -> str:
    """What to do where the model is not useful yet on the test flights `bad`: publish a baseline that does as
    well, train longer, and show the network what that baseline saw (a temperature, the atmosphere)."""
    winners = [b["name"] for b in (best_baseline(report, n) for n in bad) if baseline_beats(b)]
    blind = (report.get("radiometry") or {}).get("network_inputs") == "none"
    airless = (report.get("atmosphere") or {}).get("network_inputs", "none") == "none"
    text = (
        " Where a baseline does as well, the network's heights add nothing to it: publish the baseline "
        "beside them (or instead)."
        if winners
        else ""
    )
    tries = (
        ["data.radiometry: statistics (this network never saw a temperature)"] if winners and blind else []
    )
    if airless and any(w in ATMOSPHERE for w in winners):
        tries.append("data.atmosphere: with_frames (this network never saw the atmosphere)")
    return (
        text
        + " Try more epochs, more flights, or check the labels"
        + "".join(f"; or {t}" for t in tries)
        + "."
    )


def atmosphere_verdict(report: dict) -> str | None:
    """Whether the frames add anything to the atmosphere, flight by flight (frames_words), or the one line
    that says the baselines on the atmosphere could not be fitted, and why; None for a report written before
    them."""
    b = report.get("baselines") or {}
    said = frames_words((b.get("beyond_atmosphere") or {}).get("per_flight") or {})
    if said:
        return said
    why = sorted({v for k, v in (b.get("left_out") or {}).items() if k in ATMOSPHERE_ONLY})
    return f"The atmosphere baselines could not be fitted: {'; '.join(why)}." if why else None


def frames_words(per_flight: dict) -> str | None:
    """ "On 3 of 5 test flights the frames add nothing to the atmosphere (...)": each test flight's
    best model that sees the frames against the best on the atmosphere alone (baselines.beyond_atmosphere,
    by flight), both named with their MAE; None without one. The evaluation's verdict and crossval's."""
    per = {n: r for n, r in per_flight.items() if isinstance(r, dict)}
    if not per:
        return None
    parts = []
    for adds in (False, True):
        group = {n: r for n, r in per.items() if r["frames_add"] == adds}
        if group:
            where = (
                f"on {next(iter(group))}" if len(per) == 1 else f"on {len(group)} of {len(per)} test flights"
            )
            said = "; ".join(
                (f"{n}: " if len(per) > 1 else "") + _frames_against(r) for n, r in group.items()
            )
            parts.append(
                f"{where} the frames add {'something' if adds else 'nothing'} to the atmosphere ({said})"
            )
    text = "; ".join(parts)
    return (
        text[0].upper()
        + text[1:]
        + ". (The best model that reads the frames, the network or a baseline on their brightness, against "
        "the best on the atmosphere alone, the LCL retrieval or trees on atmosphere.)"
    )


def _frames_against(r: dict) -> str:
    """ "trees on atmosphere MAE 0.120 km, the best that sees the frames (the network) 0.130 km"."""
    short = lambda k: SHORT_NAMES.get(k, k)  # noqa: E731
    atmosphere = f"{short(r['atmosphere_model'])} MAE {r['atmosphere_mae_km']:.3f} km"
    frames = f"the best that sees the frames ({short(r['frames_model'])}) {r['frames_mae_km']:.3f} km"
    if not r["frames_add"]:
        return f"{atmosphere}, {frames}"
    return f"{frames} against {atmosphere}, MAE skill {_signed(r.get('skill'))}"


LEGACY_WORDS = (
    "This run was trained under the protocol of CloudML 0.2: its best epoch and its intervals were chosen on "
    "these test flights, so these numbers are optimistic (a new run tests on flights nothing was chosen on)."
)


def protocol_words(report: dict) -> str:
    """How the numbers were obtained, in a sentence (a report written before the protocol was recorded: the
    earlier protocol)."""
    p = report.get("protocol") or {}
    if p.get("name") == "untouched_test":
        return (
            f"Test flights {', '.join(p.get('test_flights') or [])}: scored once, at the end; nothing was "
            "chosen "
            f"on them. The best epoch and the intervals were chosen on {_validation_words(p)}."
        )
    return "Test flights scored as CloudML 0.2 did: " + LEGACY_WORDS


def _validation_words(p: dict) -> str:
    parts = p.get("validation") or {}
    if not isinstance(parts, dict) or not parts:
        return "validation data of the training flights"
    whole = [n for n, v in parts.items() if isinstance(v, str)]
    blocks = [n for n, v in parts.items() if isinstance(v, dict)]
    said = []
    if whole:
        said.append(f"the training flight{'s' * (len(whole) > 1)} {', '.join(whole)}, held back whole")
    if blocks:
        said.append(f"the last part in time of {', '.join(blocks)}")
    return " and ".join(said) + f", by the data.validation rule {p.get('rule', '?')}"


BASELINE_WORDS = (
    "Baselines, each fitted on the training flights only (the samples the network was fitted on): *training "
    "mean* predicts the training labels' mean height for every frame; *linear on brightness* is a ridge "
    "regression on the labelled frame's raw brightness statistics (eight percentiles, mean and spread, in "
    "the units the IR file states) and the sun's angles; *trees on brightness* are gradient-boosted trees "
    "on the same; *majority class* says the training flights' commoner of cloud and clear sky everywhere; "
    "*brightness-temperature threshold* says cloud where a frame's 10th-percentile brightness (its coldest "
    "pixels) lies in the window (or below the threshold) that classifies the training flights best. With "
    "ERA5 files beside the flights (fetch-era5): *LCL retrieval* puts the base at the lifting condensation "
    "level of the reanalysis surface air (Romps 2017; no fitted parameter); *cold-top retrieval* puts the "
    f"top {LAPSE_RATE_K_PER_KM} K/km below the 2 m air at the frame's {COLD_STATISTIC} brightness (frames in "
    f"kelvin only) and the base {CLOUD_THICKNESS_KM} km under it; *trees on atmosphere* are the trees on the "
    "ERA5 predictors alone; *trees on atmosphere + brightness* on those and the brightness statistics and "
    "angles together. A model worth using beats them."
)


def paper_lines(report: dict) -> list[str]:
    """What cloud-base papers quote, per test flight (skill.as_papers_report): the median absolute error, the
    shares within the tolerances, the lag-1 autocorrelations and the effective number of independent heights;
    the mean over the flights with how many stand behind it. [] for a report written before it."""
    rec = report.get("as_papers_report")
    if not isinstance(rec, dict) or not rec.get("per_flight"):
        return []
    tols = [t for t in rec.get("tolerances_km") or [] if _finite(t)]
    lines = ["As papers report them (time order within each flight):", ""]
    for name, r in rec["per_flight"].items():
        within = ", ".join(
            f"{r[f'within_{t:g}_km']:.0%} within ±{t:g} km"
            for t in tols
            if _finite(r.get(f"within_{t:g}_km"))
        )
        lag = ", ".join(
            f"{r[k]:.2f} of the {what}"
            for k, what in (("lag1_labels", "labels"), ("lag1_residuals", "residuals"))
            if _finite(r.get(k))
        )
        lag = f"lag-1 autocorrelation {lag}" if lag else ""
        eff = r.get("effective_n")
        lines.append(
            f"- {name}: median |error| {_num(r.get('median_ae_km'))} km; {within}"
            + (f"; {lag}" if lag else "")
            + (f": about {eff:.0f} independent heights of {r.get('n')}" if _finite(eff) else "")
        )
    mean, k = rec.get("mean_over_flights") or {}, rec.get("flights")
    if mean and isinstance(k, int) and k > 1:
        lines.append(
            f"- mean over {k} flights (each a single realisation of its atmosphere: {k - 1} degrees of "
            f"freedom): median |error| {_num(mean.get('median_ae_km'))} km; "
            + ", ".join(
                f"{mean[f'within_{t:g}_km']:.0%} within ±{t:g} km"
                for t in tols
                if _finite(mean.get(f"within_{t:g}_km"))
            )
        )
    return lines


def inputs_words(report: dict) -> list[str]:
    """The domain check of the test flights in words (data/domain.py): each flight's share of labelled frames
    outside the inputs trained on, with the MAE there; [] for an evaluation made before the check."""
    record = report.get("inputs")
    if not isinstance(record, dict):
        return []
    if not record.get("checked"):
        return [f"Test flights' inputs: {record.get('why', 'not checked')}."]
    lines = []
    for name, r in (record.get("per_flight") or {}).items():
        if not isinstance(r, dict):
            continue
        line = str(r.get("words", name))
        if r.get("mae_km_outside") is not None:
            line += f" (MAE {_num(r['mae_km_outside'])} km on those heights"
            line += (
                f", {_num(r['mae_km_inside'])} km on the rest)" if r.get("mae_km_inside") is not None else ")"
            )
        lines.append(line[0].upper() + line[1:] + ".")
    return lines


def any_outside(report: dict) -> bool:
    """Whether a test flight has labelled frames outside the inputs trained on."""
    per = (report.get("inputs") or {}).get("per_flight") or {}
    return any(isinstance(r, dict) and r.get("outside") for r in per.values())


def radiometry_words(report: dict) -> str:
    """What the network saw of the frames' temperatures, and in which units the brightness statistics are."""
    r = report["radiometry"]
    alone = (report.get("atmosphere") or {}).get("network_inputs") == "alone"
    if r.get("network_inputs") == "statistics":
        where = "but not the frames themselves" if alone else "beside its frames"
        seen = f"The network saw the labelled frame's brightness statistics {where}"
        seen += " (data.radiometry: statistics)"
    elif alone:
        seen = f"The network saw nothing of the frames (data.radiometry: {r.get('network_inputs')})"
    else:
        seen = (
            "The network saw the per-frame reading of its frames alone, no temperature (data.radiometry: "
            f"{r.get('network_inputs')})"
        )
    return f"{seen}; the brightness statistics are in {r.get('words') or 'the units the IR files state'}."


def atmosphere_words(report: dict) -> str:
    """What the network saw of the flights' atmosphere (data.atmosphere)."""
    a = report["atmosphere"]
    names = ", ".join(a.get("predictors") or [])
    if a.get("network_inputs") == "alone":
        return f"The network saw the flights' atmosphere from ERA5 ({names}) and the sun's angles, no frames."
    if a.get("network_inputs") == "with_frames":
        return f"The network saw the flights' atmosphere from ERA5 ({names}) beside its frames."
    return "The network saw no reanalysis: the frames and the sun alone (data.atmosphere: none)."


def cloud_verdict(report: dict) -> str | None:
    """The cloud flag in a sentence, by the rule of the heights' verdict: the model against its baselines
    on accuracy and ROC-AUC over all test frames, each number named. None without a model's cloud output."""
    cloud = report.get("cloud") or {}
    model = (cloud.get("model") or {}).get("overall") or {}
    if not model.get("n"):
        return None
    names = {"majority": "the majority class", "bt_threshold": "the brightness-temperature threshold"}
    against = cloud.get("accuracy_against")
    if isinstance(against, dict) and against:
        return cloud_verdict_paired(report, model, against, names)
    beaten_by = []
    for key, words in names.items():
        base = (cloud.get(key) or {}).get("overall") or {}
        worse = [
            f"{label} {model[k]:.3f} for the model, {base[k]:.3f} for {words}"
            for k, label in (("accuracy", "accuracy"), ("roc_auc", "ROC-AUC"))
            if _finite(model.get(k)) and _finite(base.get(k)) and model[k] < base[k]
        ]
        if worse:
            beaten_by.append((key, f"{words} beats it ({'; '.join(worse)})"))
    if beaten_by and report.get("control"):  # a control is meant to lose: no advice to improve or use it
        return "Cloud flag of this control run: " + ", and ".join(w for _, w in beaten_by) + "."
    if beaten_by:
        use = (
            " To write the brightness-temperature threshold's flag in the whole-flight files instead: "
            "predict "
            "--cloud-flag bt_threshold."
            if any(k == "bt_threshold" for k, _ in beaten_by)
            else ""
        )
        return (
            "Cloud flag: the model's cloud / no-cloud is not useful yet: "
            + ", and ".join(w for _, w in beaten_by)
            + "."
            + use
            + " Or train longer or on more flights."
        )
    acc = model.get("accuracy")
    return "Cloud flag: the model beats both baselines" + (f" (accuracy {acc:.3f})." if _finite(acc) else ".")


def cloud_verdict_paired(report: dict, model: dict, against: dict, names: dict) -> str:
    """The cloud verdict on accuracy (the share of frames flagged right), against each baseline by the paired
    difference over time blocks: better or worse only where its interval excludes 0, else level; the other
    flag recommended only where it is better beyond that noise."""
    said, worse, level = [], [], []
    for key, words in names.items():
        a = against.get(key)
        if not (isinstance(a, dict) and len(a.get("interval") or []) == 2 and _finite(a.get("difference"))):
            continue
        low, high = a["interval"]
        diff = (
            f"accuracy {a['difference']:+.3f} against {words} (95% interval over time blocks {low:+.3f} to "
            f"{high:+.3f})"
        )
        (worse if a["call"] == "worse" else level if a["call"] == "level" else said).append((key, diff))
    acc = model.get("accuracy")
    head = f"Cloud flag: accuracy {acc:.3f}; " if _finite(acc) else "Cloud flag: "
    if report.get("control"):
        return head + "of this control run: " + "; ".join(d for _, d in worse + level + said) + "."
    if not worse and not level:
        return head + "the model beats both baselines: " + "; ".join(d for _, d in said) + "."
    text = (
        head
        + "the model's cloud / no-cloud is not shown useful yet: "
        + "; ".join(
            ("worse: " if (k, d) in worse else "level: " if (k, d) in level else "") + d
            for k, d in worse + level + said
        )
        + "."
    )
    if any(k == "bt_threshold" for k, _ in worse):
        text += (
            " The brightness-temperature threshold flags better beyond chance: to write its flag in the "
            "whole-flight files, predict --cloud-flag bt_threshold."
        )
    return text + " Or train longer or on more flights."


def bounds_in_words(c: dict) -> str:
    """build_report's out_of_bounds count as a sentence."""
    where = (
        f"outside {c['low_km']:.2f}..{c['high_km']:.2f} km (the surface to data.cbh_max_km, the heights a "
        "cloud base can have here)"
    )
    if not c["below"] and not c["above"]:
        return f"All {c['n']} predicted heights lie inside {c['low_km']:.2f}..{c['high_km']:.2f} km."
    return (
        f"{c['below'] + c['above']} of {c['n']} predicted heights lie {where}: {c['below']} below, "
        f"{c['above']} above. The metrics keep them as predicted; predict leaves them out (masked)."
    )


def with_verdict(report: dict) -> dict:
    """A stored evaluation (evaluation.json, perhaps written before verdicts or protocols existed) with its
    verdict; one written before the protocol was recorded says it was made under the earlier protocol."""
    if report.get("verdict") and report.get("protocol"):
        return report
    report = {**report, "protocol": report.get("protocol") or {"name": LEGACY_VALIDATION}}
    said = verdict({**report, "verdict": None})
    return {**report, "verdict": said}


def _num(v) -> str:
    return "-" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.3f}")


METRIC_KEYS = ("r2", "mae_km", "rmse_km", "bias_km", "std_ratio", "n")


def metric_rows(report: dict) -> list[tuple[str, dict]]:
    """The report's rows, each saying whose numbers and which flights: per test flight the model's, then the
    training mean's; then, with several flights, the pooled rows, named pooled (report.md and the text report
    alike)."""
    per, base = report["per_flight"], report.get("baseline_per_flight") or {}
    physical = {
        k: v
        for k, v in ((report.get("baselines") or {}).get("methods") or {}).items()
        if k != "mean" and isinstance(v, dict)
    }
    rows = []
    for name, m in per.items():
        rows.append((f"model: flight {name}", m))
        if name in base:
            rows.append((f"baseline (training mean): flight {name}", base[name]))
        for k, v in physical.items():
            if name in (v.get("per_flight") or {}):
                rows.append((f"baseline ({SHORT_NAMES.get(k, k)}): flight {name}", v["per_flight"][name]))
    if len(per) != 1 or not base:
        rows += [
            (f"model: pooled over {len(per)} test flights", report["overall"]),
            (f"baseline (training mean): pooled over {len(per)}", report["baseline"]),
        ]
        rows += [
            (f"baseline ({SHORT_NAMES.get(k, k)}): pooled over {len(per)}", v["overall"])
            for k, v in physical.items()
            if isinstance(v.get("overall"), dict)
        ]
    return rows


def skill_lines(report: dict) -> list[str]:
    """Markdown: per test flight (and pooled), the best baseline, its MAE beside the network's, and the
    network's MAE skill against each baseline ([] without baselines)."""
    b = report.get("baselines") or {}
    best = b.get("best") or {}
    names = [n for n in BASELINES if n in (b.get("methods") or {})]
    rows = []
    places = [(f"flight {k}", v) for k, v in (best.get("per_flight") or {}).items()]
    places += [("pooled", best.get("pooled"))] if len(best.get("per_flight") or {}) != 1 else []
    for where, r in places:
        if not isinstance(r, dict):
            continue
        against = r.get("skill_against") or {}
        rows.append(
            [
                where,
                SHORT_NAMES.get(r["name"], r["name"]),
                _num(r.get("mae_km")),
                _num(r.get("model_mae_km")),
                *(_signed(against.get(n)) for n in names),
            ]
        )
    if not rows:
        return []
    header = ["test", "best baseline", "its MAE km", "network MAE km"]
    header += [f"skill vs {SHORT_NAMES.get(n, n)}" for n in names]
    return [
        "The network against its baselines: MAE skill = 1 - MAE(network) / MAE(baseline); above 0 the "
        "network adds something, at or below 0 the baseline does as well.",
        "",
        *tables.markdown(header, rows).splitlines(),
    ]


def _signed(v) -> str:
    return "-" if not _finite(v) else f"{v:+.2f}"


def height_range_lines(report: dict) -> list[str]:
    """Markdown: the error by height range (thirds of the heights trained on, and outside them) per test
    flight:
    n, the network's MAE and bias, the best baseline's MAE ([] where the report holds none)."""
    by = report.get("by_height") or {}
    rows = []
    for flight, ranges in (by.get("per_flight") or {}).items():
        for r in ranges:
            rows.append(
                [
                    f"flight {flight}",
                    r["range"],
                    r["n"],
                    _num(r.get("mae_km")),
                    _num(r.get("bias_km")),
                    _num(r.get("baseline_mae_km")),
                ]
            )
    if not rows:
        return []
    header = [
        "test",
        "true height km",
        "n",
        "MAE km",
        "bias km",
        f"MAE km of {by.get('baseline', 'baseline')}",
    ]
    return [
        "Error by height range (thirds of the heights trained on, "
        f"{by.get('edges_km', [])}): bias = mean of predicted - true.",
        "",
        *tables.markdown(header, rows).splitlines(),
    ]


def _metrics_table(report: dict) -> list[str]:
    header = ["", "R2", "MAE km", "RMSE km", "bias km", "std(pred)/std(true)", "n"]
    rows = [[name, *(_num(m.get(k)) for k in METRIC_KEYS)] for name, m in metric_rows(report)]
    return tables.markdown(header, rows).splitlines()


def cloud_table(report: dict) -> list[str]:
    """Markdown: cloud / no-cloud metrics of the model and its baselines, overall and per flight."""
    cloud = report.get("cloud")
    if not cloud:
        return []
    words = {
        "model": "model",
        "majority": "baseline (majority class)",
        "bt_threshold": "baseline (brightness-temperature threshold)",
    }
    rows = []
    for method in [m for m in words if m in cloud]:
        per = cloud[method]["per_flight"]
        named = [(f"flight {k}", v) for k, v in per.items()]
        named += [("pooled", cloud[method]["overall"])] if len(per) != 1 else []
        rows += [
            [
                f"{words[method]}: {name}",
                *(_num(m.get(k)) for k in ("accuracy", "f1", "roc_auc", "cloud_share", "n")),
            ]
            for name, m in named
        ]
    header = ["cloud / no-cloud", "accuracy", "F1", "ROC-AUC", "cloudy share", "n"]
    lines = tables.markdown(header, rows).splitlines()
    if "model" not in cloud:
        lines += [
            "",
            "This model has no cloud output (trained by an earlier CloudML, with model.cloud_head: none, or "
            "not finished: a probe is fitted when training ends): only the baselines are scored.",
        ]
    return lines


def coverage_words(v: dict, target: float) -> str:
    """One flight's intervals: their coverage beside the target, or why none is measured there."""
    width = "-" if v.get("mean_width_km") is None else f"{v['mean_width_km']:.2f} km"
    if v.get("calibrated_here"):
        return f"calibrated on this flight's heights (no coverage is measured there), mean width {width}"
    cov = "-" if v.get("coverage") is None else f"{v['coverage']:.0%}"
    return f"coverage {cov} for a {target:.0%} target, mean width {width}"


def interval_lines(report: dict, warnings: bool = True) -> list[str]:
    """The intervals: how they were calibrated, then per test flight their coverage beside the target (only
    where they were not calibrated) and their width; with `warnings`, where they fail a reader in words
    (interval_warnings: test_parts puts those first)."""
    iv = report.get("intervals")
    if not iv:
        return []
    seen = iv.get("calibrated_on")
    legacy = (
        seen is None and (report.get("protocol") or {}).get("name", LEGACY_VALIDATION) == LEGACY_VALIDATION
    )
    lines = [
        f"{iv['coverage_target']:.0%} prediction intervals ({iv['method']}, MAPIE, "
        f"{iv.get('mode', 'pooled')}), calibrated on {iv['calibration']}"
        + (
            ": the test flights themselves (the earlier protocol), so no coverage is measured here; "
            "cross-validation measures it on flights never seen."
            if legacy
            else ". Their coverage is measured on the test flights the calibration did not see."
        ),
        "",
    ]
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    km = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [
        [
            k,
            "calibrated here" if v.get("calibrated_here") or legacy else pct(v["coverage"]),
            f"{iv['coverage_target']:.0%}",
            km(v["mean_width_km"]),
            v["n"],
        ]
        for k, v in iv["per_flight"].items()
    ]
    header = ["test flight", "coverage", "target", "mean width km", "n"]
    said = interval_warnings(iv, report.get("training_label_range_km")) if warnings else []
    return lines + tables.markdown(header, rows).splitlines() + ([""] + said if said else [])


def short_of_target(coverage: float, n: int, target: float) -> bool:
    """Whether a coverage on n heights falls below the target by more than binomial noise (one-sided 2.5%:
    fewer heights inside than a calibration that holds the target would give 97.5% of the time)."""
    from scipy.stats import binom

    return n > 0 and binom.cdf(round(coverage * n), n, target) < 0.025


def interval_warnings(iv: dict, label_range) -> list[str]:
    """The intervals in words where they fail a reader: a test flight whose coverage falls below the target
    by more than its binomial noise, and intervals too wide to inform (half the span of the heights trained
    on, or more)."""
    out, target = [], iv.get("coverage_target")
    for name, v in (iv.get("per_flight") or {}).items():
        cov, n = v.get("coverage"), v.get("n")
        if _finite(cov) and isinstance(n, int) and _finite(target) and short_of_target(cov, n, target):
            out.append(
                f"On {name} the intervals hold {cov:.0%} of {n} heights for a {target:.0%} target: short of "
                "it by more than chance (binomial, one-sided 2.5%). Calibrated on other data, they do not "
                "hold on this flight: calibrate across flights (a cross-validation's intervals.json, "
                "`predict --calibration CROSSVAL_DIR`)."
            )
    widths = [
        v["mean_width_km"] for v in (iv.get("per_flight") or {}).values() if _finite(v.get("mean_width_km"))
    ]
    if (
        widths
        and label_range
        and len(label_range) == 2
        and _finite(label_range[0])
        and _finite(label_range[1])
    ):
        span = float(label_range[1]) - float(label_range[0])
        if span > 0 and max(widths) >= 0.5 * span:
            out.append(
                f"The intervals are {max(widths):.2f} km wide, half or more of the span of the heights "
                f"trained on ({label_range[0]:.2f}-{label_range[1]:.2f} km): too wide to inform a height."
            )
    return out


def validation_lines(report: dict) -> list[str]:
    """The best model on the validation data that chose it: shown as such, never as a test score."""
    v = report.get("validation")
    if not v:
        return []
    rows = [
        [f"validation: {k}", *(_num(m.get(key)) for key in METRIC_KEYS)] for k, m in v["per_flight"].items()
    ]
    return [
        "The best model on the validation data that chose its epoch (and calibrated the intervals): not a "
        "test score, since it was chosen on these numbers.",
        "",
        *tables.markdown(
            ["", "R2", "MAE km", "RMSE km", "bias km", "std(pred)/std(true)", "n"], rows
        ).splitlines(),
    ]


def epoch_lines(history: list[dict], best_epoch) -> list[str]:
    """The validation score of every epoch (metrics.jsonl), the chosen one marked: how stable it is."""
    if not history:
        return []
    rows = [
        [
            f"{h['epoch']}{' (best)' if h['epoch'] == best_epoch else ''}",
            *(_num(h.get(k)) for k in ("val_loss", "r2", "mae_km", "bias_km")),
        ]
        for h in history
    ]
    return [
        "The validation score of every epoch (the validation data of the training flights; the best "
        "validation loss chose the model):",
        "",
        *tables.markdown(["epoch", "validation loss", "R2", "MAE km", "bias km"], rows).splitlines(),
    ]


def test_section(report: dict, history: list[dict] | None = None) -> list[str]:
    """The test flights: how they were scored, the verdict, the metrics per flight, predictions outside the
    bounds, clouds, intervals, the validation score of the chosen model and of every epoch."""
    head, more = test_parts(report, history, cloud_verdict_first=False)
    return ["## Test flights", "", *head, *more]


def test_parts(
    report: dict, history: list[dict] | None = None, cloud_verdict_first: bool = True
) -> tuple[list[str], list[str]]:
    """test_section in two parts: what a reader needs first (how the flights were scored, the verdicts in
    words, the metrics beside the baselines') and the rest (the skill against each baseline, heights by
    range, the cloud flag's table, the baselines explained, the radiometry, the intervals, the validation
    scores), which the notebook folds.
    `cloud_verdict_first`: the cloud flag's verdict in the first part (the notebook), else after its table."""
    report = with_verdict(report)
    head = [protocol_words(report), ""]
    head += [report["verdict"], ""] if report.get("verdict") else []
    head += [" ".join(inputs_words(report)), ""] if any_outside(report) else []
    clouds = cloud_verdict(report) if report.get("cloud") else None
    head += [clouds, ""] if clouds and cloud_verdict_first else []
    head += [f"Best model from epoch {report.get('best_epoch', '?')}; metrics in km.", ""]
    head += [f"Note: {report['best_model']}.", ""] if isinstance(report.get("best_model"), str) else []
    head += _metrics_table(report) + [""]
    head += paper_lines(report) + [""] if paper_lines(report) else []
    short = (
        interval_warnings(report["intervals"], report.get("training_label_range_km"))
        if report.get("intervals")
        else []
    )
    head += [" ".join(short), ""] if short else []  # intervals that do not hold: said first, not folded
    # the skill against each baseline: the table above holds their numbers, the verdict the best one's
    more = skill_lines(report) + [""] if report.get("baselines") else []
    more += height_range_lines(report) + [""] if report.get("by_height") else []
    more += [bounds_in_words(report["out_of_bounds"]), ""] if report.get("out_of_bounds") else []
    if report.get("cloud"):
        more += cloud_table(report) + [""]
        more += [clouds, ""] if clouds and not cloud_verdict_first else []
    more += [BASELINE_WORDS, ""]
    more += [radiometry_words(report), ""] if report.get("radiometry") else []
    more += [atmosphere_words(report), ""] if report.get("atmosphere") else []
    more += [" ".join(inputs_words(report)), ""] if inputs_words(report) and not any_outside(report) else []
    more += interval_lines(report, warnings=False) + [""] if report.get("intervals") else []
    more += validation_lines(report) + [""] if report.get("validation") else []
    more += epoch_lines(history or [], report.get("best_epoch")) + [""] if history else []
    return head, more


def format_cloud(report: dict) -> str:
    """A plain-text table: accuracy, F1 and ROC-AUC per method, overall and per flight."""
    num = lambda v: f"{v:10.3f}" if v is not None else f"{'-':>10s}"  # noqa: E731
    rows = []
    for method in [m for m in ("model", *CLOUD_BASELINES) if m in report]:
        per = report[method]["per_flight"]
        rows += [(f"{method}: flight {k}", v) for k, v in per.items()]
        if len(per) != 1:
            rows.append((f"{method}: pooled", report[method]["overall"]))
    width = max(28, *(len(r[0]) for r in rows))
    lines = [
        f"{'cloud / no-cloud':{width}s}" + "".join(f"  {h:>10s}" for h in ("accuracy", "F1", "ROC-AUC", "n"))
    ]
    for name, m in rows:
        lines.append(
            f"{name:{width}s}  {num(m['accuracy'])}  {num(m['f1'])}  {num(m['roc_auc'])}  {m['n']:10d}"
        )
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """The report as plain text (the log, the notebook's folded output): the protocol, the metrics table, then
    clouds, intervals, bounds and the verdicts."""
    rows = metric_rows(report)
    extra = ""
    if report.get("cloud"):
        extra += "\n\n" + format_cloud(report["cloud"])
    if report.get("intervals"):
        extra += (
            "\n\n"
            + " ".join(interval_lines(report)[:1])
            + " "
            + "; ".join(
                f"flight {k}: " + coverage_words(v, report["intervals"]["coverage_target"])
                for k, v in report["intervals"]["per_flight"].items()
            )
        )
        said = interval_warnings(report["intervals"], report.get("training_label_range_km"))
        extra += "\n" + " ".join(said) if said else ""
    # every column 10 wide with two spaces between: no two column names can run together
    head = ("R2", "MAE km", "RMSE km", "bias km", "std ratio", "n")
    width = max(28, *(len(name) for name, _ in rows))
    lines = [protocol_words(report)]
    lines += [f"Note: {report['best_model']}."] if isinstance(report.get("best_model"), str) else []
    lines += [f"{'':{width}s}" + "".join(f"  {h:>10s}" for h in head)]
    num = lambda v: f"{v:10.3f}" if v is not None else f"{'-':>10s}"  # noqa: E731 (null from JSON)
    for name, m in rows:
        cells = [num(m[k]) for k in METRIC_KEYS[:-1]] + [f"{m['n']:10d}"]
        lines.append(f"{name:{width}s}" + "".join(f"  {c}" for c in cells))
    if report.get("out_of_bounds"):
        extra += "\n\n" + bounds_in_words(report["out_of_bounds"])
    if with_verdict(report).get("verdict"):
        extra += "\n\n" + with_verdict(report)["verdict"]
    if inputs_words(report):
        extra += "\n\n" + " ".join(inputs_words(report))
    if cloud_verdict(report):
        extra += "\n" + cloud_verdict(report)
    return "\n".join(lines) + extra


def build_report_md(folder: RunFolder) -> str:
    out = [f"# CloudML run `{folder.path.name}`", ""]
    files = RunFiles(folder.path)
    report = files.evaluation()
    if report:
        history = [r for r in files.metrics() if r.get("kind") == "epoch"]
        out += test_section(report, history)
    run = files.run_info()
    if run:
        out += [
            "## Training",
            "",
            f"Device: {run.get('device', '?')}; {run.get('processes', 1)} process(es); batch "
            f"size {run.get('batch_size', '?')}; {run.get('total_steps', '?')} optimizer steps planned.",
            "",
            f"torch.compile: {describe_saved(run.get('compile'))}.",
            "",
        ]
    out += provenance.markdown(files.provenance())
    for name, title in (("plots/curves.png", "Training curves"), ("plots/scatter.png", "Predicted vs true")):
        if (folder.path / name).is_file():
            out += [f"## {title}", "", f"![{title}]({name})", ""]
    predicted = RunFiles(folder.path / "predictions")
    out += whole_flights_section(folder, predicted.predictions_summary())
    files.damaged += predicted.damaged
    crossval = folder.path / "crossval.md"
    if crossval.is_file():
        out += ["## Cross-validation", "", *crossval.read_text().splitlines()[1:], ""]
    if files.damaged:
        out += ["## Files that could not be read", "", *(f"- {d}" for d in files.damaged), ""]
    return "\n".join(out)


def whole_flights_section(folder: RunFolder, counts: dict) -> list[str]:
    """Each flight predicted into RUN_DIR/predictions: its files, its counts in words, its two figures."""
    flights = sorted((folder.path / "predictions").glob("*_cbh.nc"))
    if not flights:
        return []
    out = ["## Whole flights", ""]
    for nc in flights:
        flight = nc.name[: -len("_cbh.nc")]
        out += [
            f"### {flight}",
            "",
            f"Data: `predictions/{nc.name}` (NetCDF, CF) and `predictions/{flight}_cbh.csv`. "
            + counts_in_words(counts.get(flight)),
            "",
            f"![CBH along flight {flight}](predictions/{flight}_cbh_along_flight.png)",
            "",
            f"![Track of flight {flight}](predictions/{flight}_track.png)",
            "",
        ]
    return out


def counts_in_words(c: dict | None) -> str:
    """One flight's summary.json counts as a sentence ("" without them)."""
    if not c:
        return ""
    parts = [f"{c['predicted']} of {c['frames']} frames predicted"]
    if c["blank"]:
        parts.append(f"{c['blank']} blank frames (no finite pixel, or no contrast) have no height")
    if c["no_time"]:
        parts.append(f"{c['no_time']} frame{'s' * (c['no_time'] != 1)} without a usable time left out")
    if c["filled_pixels"]:
        parts.append(f"{c['filled_pixels']} non-finite pixels filled with their frame's median")
    if "cloud" in c:
        parts.append(f"{c['cloud']} frames cloudy, {c['clear_sky']} clear sky (no height)")
    if c.get("cloud_above_range") or c.get("cloud_below_range"):
        parts.append(
            f"{c.get('cloud_above_range', 0)} frames with cloud only above the range (high cloud) and "
            f"{c.get('cloud_below_range', 0)} with a base below it (no height for either)"
        )
    masked = c.get("height_below_surface", 0) + c.get("height_above_ceiling", 0)
    if masked:
        parts.append(
            f"{masked} predicted heights could not be a cloud base and are left out (missing, flagged in "
            f"cloud_base_height_qc): {c.get('height_below_surface', 0)} below the surface, "
            f"{c.get('height_above_ceiling', 0)} above the upper bound"
        )
    if c.get("height_outside_labels"):
        parts.append(
            f"{c['height_outside_labels']} heights lie outside the labels' range the model learned from: "
            "extrapolations, kept and flagged 3 in cloud_base_height_qc"
        )
    if c.get("inputs_vs_training"):
        parts.append(str(c["inputs_vs_training"]))
    if c.get("cpl_cloud_agreement") is not None:
        parts.append(
            f"the cloud flag agrees with the CPL lidar on {c['cpl_cloud_agreement']:.0%} of the frames it "
            "profiled"
        )
    if c.get("cpl_inside_interval") is not None:
        parts.append(
            f"{c['cpl_inside_interval']:.0%} of the CPL heights lie inside the intervals"
            + (
                " (the intervals were calibrated on this flight's heights: no measure of their coverage)"
                if c.get("interval_calibrated_here")
                else " (a flight the calibration did not see)"
            )
        )
    return "; ".join(parts) + "."


def write_report(folder: RunFolder) -> Path:
    """The report.md of a run or a cross-validation, from its files (report.new.md beside a report.md the user
    edited: outputs.target)."""
    return write_text(target(folder.report), build_report_md(folder))
