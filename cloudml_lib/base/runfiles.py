"""The files a run folder holds, read as untrusted: one reader per file, each checking the type and shape of
what it reads before anything uses it.

A reader returns the file's content, or an empty value when the file is missing (a run that has not
written it yet) or damaged: unreadable, not JSON or YAML, or the wrong shape. A damaged file is named in
`RunFiles.damaged` as "damaged: FILE (what is wrong)", so a command shows everything else it can and then
says what it could not read. Nothing here raises for a file's content; a reader never follows a symlink
out of the folder it reads (a link is "damaged", not read).

The shapes (base/shapes.py) say what the readers' users rely on.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.files import NotRegularFile, read_bytes
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.shapes import (
    ANY,
    BOOL,
    INT,
    NUM,
    OPT_INT,
    OPT_NUM,
    OPT_TEXT,
    TEXT,
    Damaged,
    ListOf,
    MapOf,
    Maybe,
    Obj,
    OneOf,
    Scalar,
    Shape,
    first_line,
    kind_of,
    parse_json,
    unicode_problem,
)
from cloudml_lib.base.yamlfile import loads

MAX_BYTES = 64 * 2**20  # a run's JSON or YAML file is kilobytes; a bigger one is not what a run wrote
TRIAL_STATES = ("running", "complete", "pruned", "failed")


# ----------------------------------------------------------------------------- shapes, and their check


METRIC_KEYS = ("r2", "mae_km", "rmse_km", "bias_km", "std_ratio")
METRIC_SET = Obj({k: OPT_NUM for k in METRIC_KEYS} | {"n": OPT_INT}, required=(*METRIC_KEYS, "n"))
CLOUD_SCORES = Obj({"overall": MapOf(OPT_NUM), "per_flight": MapOf(MapOf(OPT_NUM))})
CLOUD = Obj(
    {"threshold": OPT_NUM, "train_cloud_share": OPT_NUM, "bt_window": Maybe(ListOf(OPT_NUM))}
    | {m: CLOUD_SCORES for m in ("model", "bt_threshold", "majority")}
    | {
        "accuracy_against": MapOf(
            Obj(
                {"difference": NUM, "interval": ListOf(NUM), "call": TEXT},
                required=("difference", "interval"),
            )
        )
    }
)
COVERAGE = Obj(
    {"coverage": OPT_NUM, "mean_width_km": OPT_NUM, "n": OPT_INT, "calibrated_here": BOOL},
    required=("coverage", "mean_width_km", "n"),
)
PROTOCOL = Obj(
    {"name": TEXT, "words": TEXT, "rule": TEXT, "why": TEXT, "test_flights": ListOf(TEXT)}
    | {"validation": MapOf(ANY)},
    required=("name",),
)
# The height baselines (science/baselines.py BASELINES) and what the report says of the best of them
# (a record of an earlier release names the first three; the four of the atmosphere came with ERA5)
HEIGHT_BASELINES = (
    "mean",
    "linear",
    "trees",
    "physical",
    "cold_top",
    "atmosphere_trees",
    "atmosphere_brightness_trees",
)
BEST_BASELINE = Obj(
    {"name": OneOf(HEIGHT_BASELINES), "mae_km": NUM, "model_mae_km": NUM, "skill": OPT_NUM}
    | {"skill_against": MapOf(OPT_NUM)},
    required=("name", "mae_km", "model_mae_km", "skill"),
)
# Whether the frames add anything to the atmosphere on a test flight (baselines.beyond_atmosphere)
BEYOND_ATMOSPHERE = Obj(
    {
        "frames_model": OneOf(("network", *HEIGHT_BASELINES)),
        "frames_mae_km": NUM,
        "atmosphere_model": OneOf(HEIGHT_BASELINES),
        "atmosphere_mae_km": NUM,
        "skill": OPT_NUM,
        "frames_add": BOOL,
    },
    required=("frames_model", "frames_mae_km", "atmosphere_model", "atmosphere_mae_km", "frames_add"),
)
BASELINES = Obj(
    {
        "statistics": ListOf(TEXT),
        "fitted_on": TEXT,
        "methods": MapOf(
            Obj({"overall": METRIC_SET, "per_flight": MapOf(METRIC_SET)}, required=("overall",))
        ),
        "best": Obj({"per_flight": MapOf(Maybe(BEST_BASELINE)), "pooled": Maybe(BEST_BASELINE)}),
        "left_out": MapOf(TEXT),  # baseline -> why (absent: written before the atmosphere's)
        "beyond_atmosphere": Obj(
            {"per_flight": MapOf(Maybe(BEYOND_ATMOSPHERE)), "pooled": Maybe(BEYOND_ATMOSPHERE)}
        ),
    },
    required=("methods", "best"),
)
HEIGHT_RANGE = Obj(
    {"range": TEXT, "n": INT, "mae_km": OPT_NUM, "bias_km": OPT_NUM, "baseline_mae_km": OPT_NUM},
    required=("range", "n", "mae_km", "bias_km"),
)
BY_HEIGHT = Obj(
    {"edges_km": ListOf(NUM), "baseline": OPT_TEXT, "per_flight": MapOf(ListOf(HEIGHT_RANGE))},
    required=("per_flight",),
)
RADIOMETRY = Obj({"network_inputs": TEXT, "units": MapOf(TEXT), "words": TEXT}, required=("network_inputs",))
# What the network saw of the flights' atmosphere (data.atmosphere; absent: written before the setting)
ATMOSPHERE_SEEN = Obj({"network_inputs": TEXT, "predictors": ListOf(TEXT)}, required=("network_inputs",))
# The domain check of the test flights (data/domain.py; absent: written before it)
INPUTS = Obj(
    {
        "checked": BOOL,
        "why": TEXT,
        "threshold": NUM,
        "per_flight": MapOf(
            Obj(
                {
                    "frames": INT,
                    "outside": INT,
                    "mae_km_outside": OPT_NUM,
                    "mae_km_inside": OPT_NUM,
                    "words": TEXT,
                },
                required=("frames", "outside", "words"),
            )
        ),
    },
    required=("checked",),
)
# The calibration methods intervals.json may name (intervals.METHODS maps each to its score).
INTERVAL_METHODS = ("conformal_absolute", "conformal_gamma")
EVALUATION = Obj(
    {
        "overall": METRIC_SET,
        "baseline": METRIC_SET,
        "per_flight": MapOf(METRIC_SET),
        "baseline_per_flight": MapOf(METRIC_SET),
        "train_mean_km": OPT_NUM,
        "best_epoch": OPT_INT,
        "step": OPT_INT,  # the training step of the weights it scored (the end of a run writes it)
        "weights_sha256": OPT_TEXT,  # checkpoint.weights_sha256 of the weights it scored (since 0.3.1)
        "cloud": Maybe(CLOUD),
        "verdict": OPT_TEXT,
        "control": OPT_TEXT,  # a control run's kind (model.scalars_only), judged without advice
        "protocol": PROTOCOL,  # how the numbers were obtained (splits.py); absent: the earlier protocol
        "flight_verdicts": MapOf(TEXT),
        "baselines": BASELINES,  # absent: written before the physical baselines
        "by_height": BY_HEIGHT,
        "radiometry": RADIOMETRY,
        "atmosphere": ATMOSPHERE_SEEN,
        "inputs": INPUTS,
        "no_height_label": ListOf(TEXT),  # test flights scored for their cloud flag alone
        "against_best": MapOf(
            Obj(
                {"mae_difference_km": NUM, "interval_km": ListOf(NUM), "baseline": TEXT, "call": TEXT},
                required=("mae_difference_km", "interval_km", "baseline", "call"),
            )
        ),
        "own_mean_mae_km": MapOf(NUM),
        "as_papers_report": Obj(
            {
                "tolerances_km": ListOf(NUM),
                "per_flight": MapOf(MapOf(OPT_NUM)),
                "mean_over_flights": MapOf(NUM),
                "flights": INT,
            },
            required=("tolerances_km", "per_flight"),
        ),
        "mae_interval_km": MapOf(Maybe(ListOf(NUM))),
        "training_label_range_km": ListOf(NUM),
        "outside_training_labels": MapOf(MapOf(NUM)),
        "validation": Obj({"pooled": METRIC_SET, "per_flight": MapOf(METRIC_SET)}, required=("pooled",)),
        "out_of_bounds": Obj(
            {"low_km": NUM, "high_km": NUM, "below": INT, "above": INT, "n": INT},
            required=("low_km", "high_km", "below", "above", "n"),
        ),
        "intervals": Obj(
            {
                "method": TEXT,
                "coverage_target": NUM,
                "calibration": OPT_TEXT,
                "mode": TEXT,
                "calibrated_on": ListOf(TEXT),
                "overall": COVERAGE,
                "per_flight": MapOf(COVERAGE),
            },
            required=("overall",),
        ),
    },
    required=("overall", "per_flight", "baseline"),
)
COMPILE = Obj(
    {"requested": BOOL, "active": BOOL, "break_reasons": ListOf(ANY)}
    | {k: OPT_TEXT for k in ("what", "mode", "why", "fallback", "cache")}
    | {k: OPT_INT for k in ("graphs", "graph_breaks", "recompiles", "cache_hits")}
    | {"compile_s": OPT_NUM}
)
RUN_INFO = Obj(
    {
        k: OPT_INT
        for k in (
            "processes",
            "machines",
            "total_steps",
            "steps_per_epoch",
            "epochs",
            "batch_size",
            "start_step",
        )
    }
    | {"device": OPT_TEXT, "started_at": OPT_NUM, "compile": Maybe(COMPILE)}
    | {
        "expected": Maybe(MapOf(ANY)),
        "measured": Maybe(MapOf(ANY)),
        "segments": Maybe(ListOf(ANY)),  # one per start of the run
        "end": Maybe(MapOf(ANY)),  # what the run's end took against its expected time
    }  # core/machine/timing.py checks their insides
)
FOLD = Obj(
    {m: METRIC_SET for m in ("model", "scalars_only", "validation", *HEIGHT_BASELINES)}
    | {"cloud": Maybe(CLOUD), "warnings": ListOf(TEXT), "mae_interval_km": Maybe(ListOf(NUM))}
    | {"protocol": TEXT, "best_baseline": Maybe(BEST_BASELINE), "left_out": MapOf(TEXT)},
    required=("model", "warnings"),
)
MEAN_STD = Obj({"mean": OPT_NUM, "std": OPT_NUM})
# method -> metric -> mean and std over the folds; beside them the network's skill against each fold's best
# baseline, one mean and std (commands/crossval.py: skill_verdict)
SUMMARY = MapOf(MapOf(MEAN_STD), named={"skill_vs_best_baseline": MEAN_STD})
# the adaptation curve of one test flight (science/adapt.py): per N, the network and the baselines on the part
# scored, the best baseline, the paired difference against it, the intervals' coverage there
ADAPT_POINT = Obj(
    {"n": INT, "network": METRIC_SET, "baselines": MapOf(METRIC_SET), "best_baseline": OPT_TEXT}
    | {"against_best": Maybe(MapOf(ANY)), "intervals": Maybe(MapOf(ANY))},
    required=("n", "network", "baselines"),
)
ADAPT_FLIGHT = Obj(
    {
        "labels": INT,
        "gap_frames": INT,
        "gap_from": TEXT,
        "left_out": MapOf(TEXT),
        "curve": ListOf(ADAPT_POINT),
    }
    | {"scored_labels": INT, "scored_from_frame": INT, "baselines_left_out": MapOf(TEXT)}
    | {"words": ListOf(TEXT), "error": TEXT},
    required=("curve",),
)
ADAPTATION = Obj(
    {"labels": ListOf(INT), "per_flight": MapOf(ADAPT_FLIGHT), "summary": ListOf(MapOf(ANY))}
    | {"verdicts": ListOf(TEXT)},
    required=("labels", "per_flight"),
)
CROSSVAL = Obj(
    {"folds": MapOf(FOLD), "summary": SUMMARY, "warnings": ListOf(TEXT), "verdicts": ListOf(TEXT)}
    | {"protocol": TEXT, "pooled": METRIC_SET, "undefined": MapOf(MapOf(ListOf(TEXT)))}
    | {"adaptation": Maybe(ADAPTATION), "fold_by": OneOf(("flight", "campaign")), "held_out": TEXT},
    required=("summary",),
)
TRIAL = Obj(
    {"number": INT, "params": MapOf(ANY), "state": OneOf(TRIAL_STATES), "value": OPT_NUM, "note": OPT_TEXT},
    required=("number", "params", "state"),
)
SWEEP = Obj(
    {"config": MapOf(ANY), "space": Obj({"params": MapOf(ANY)}), "trials": INT, "config_file": OPT_TEXT}
    | {"protocol": TEXT},  # absent: a sweep started by CloudML 0.2
    required=("config", "space", "trials"),
)
RECORD = Obj(
    {"kind": TEXT, "epoch": INT, "step": INT, "time_s": OPT_NUM}
    | {k: Scalar("any_number", True) for k in ("loss", "train_loss", "val_loss", "r2", "mae_km", "rmse_km")},
    required=("kind",),
)
INTERVALS = Obj(
    {
        "method": TEXT,
        "coverage": NUM,
        "n": INT,
        "source": TEXT,
        "pred_km": ListOf(NUM),
        "true_km": ListOf(NUM),
        "mode": OneOf(("pooled", "per_flight")),  # with `group` (each pair's flight) and `flights`
        "group": ListOf(TEXT),
        "flights": ListOf(TEXT),
        "weights_sha256": TEXT,  # the weights calibrated (checkpoint.weights_sha256); earlier ends: none
    },
    required=("method", "coverage", "n", "source", "pred_km", "true_km"),
)
INTERVALS_MIN = 20  # intervals.MIN_CALIBRATION: the fewest heights a calibration is made of
COUNTS_KEPT = ("predicted", "frames", "blank", "no_time", "filled_pixels")
COUNTS = Obj(
    {
        k: INT
        for k in (
            *COUNTS_KEPT,
            "cloud",
            "clear_sky",
            "height_below_surface",
            "height_above_ceiling",
            "height_outside_labels",
            "cloud_above_range",
            "cloud_below_range",
            "inputs_outside_training",
            "height_inputs_outside",
            "cpl_interval_n",
        )
    }
    | {k: OPT_NUM for k in ("cpl_cloud_agreement", "cpl_inside_interval")}
    | {"interval_calibrated_here": BOOL, "inputs_vs_training": OPT_TEXT},
    required=COUNTS_KEPT,
)
PREDICTIONS_SUMMARY = MapOf(COUNTS)
PROVENANCE = Obj(
    {
        "label_definition": MapOf(ANY),
        "inputs": MapOf(ANY),
        "flights": MapOf(
            Obj(
                {
                    "counts": MapOf(ANY),
                    "match": MapOf(ANY),
                    "files": MapOf(Obj({"name": TEXT, "sha256": TEXT}, required=("name", "sha256"))),
                }
            )
        ),
    }
)
LAST_RUN = Obj(
    {
        "preset": TEXT,
        "epochs": INT,
        "run_name": TEXT,
        "heldout": ListOf(TEXT),
        "crossval": BOOL,
        "whole_flights": BOOL,
        "started": NUM,
    },
    required=("preset", "epochs", "run_name"),
)
CONFIG_LEAF = 64  # a config value is a scalar or a short list of them (model.channels)
CONFIG_VALUES = 5000


# ---------------------------------------------------------------------------------------- the readers


# The reader (a RunFiles method) of each file a command writes and another reads back, by the file's name
# in its folder: the tests read back every such file each command writes (tests/conftest.py:
# assert_reads_back), so that a writer and its reader cannot disagree unseen.
READERS = {
    "config.yaml": "config",
    "evaluation.json": "evaluation",
    "run.json": "run_info",
    "provenance.json": "provenance",
    "intervals.json": "intervals",
    "metrics.jsonl": "metrics",
    "trial.json": "trial",
    "sweep.json": "sweep",
    "crossval.json": "crossval",
    "fold.json": "fold",
    "last_run.json": "last_run",
    "summary.json": "predictions_summary",
}


@dataclass
class RunFiles:
    """The files of one run folder (a run, a fold, a trial, a cross-validation or a sweep); each reader
    returns the file's checked content or its empty value, and adds a damaged file to `damaged`."""

    folder: Path
    damaged: list[str] = field(default_factory=list)

    def config(self) -> dict | None:
        """config.yaml: {section: {key: value}}; None when missing or damaged (never read as empty)."""
        text = self._text(RunLayout.CONFIG)
        if text is None:
            return None
        try:
            doc = loads(text, str(RunLayout(self.folder).config))
        except (yaml.YAMLError, CloudMLError, ValueError) as e:  # ValueError: over 4300 digits
            return self._damage(RunLayout.CONFIG, f"not YAML: {first_line(e)}")
        except RecursionError:
            return self._damage(RunLayout.CONFIG, "nested too deep to be a config")
        problem = _config_problem(doc) or unicode_problem(doc)
        return self._damage(RunLayout.CONFIG, problem) if problem else _plain(doc)

    def evaluation(self) -> dict:
        return self._json(RunLayout.EVALUATION, EVALUATION) or {}

    def run_info(self) -> dict:
        return self._json(RunLayout.RUN_INFO, RUN_INFO) or {}

    def crossval(self) -> dict:
        return self._json("crossval.json", CROSSVAL) or {}

    def fold(self) -> dict | None:
        return self._json("fold.json", FOLD)

    def trial(self) -> dict:
        return self._json(RunLayout.TRIAL, TRIAL) or {}

    def sweep(self) -> dict | None:
        return self._json("sweep.json", SWEEP)

    def provenance(self) -> dict:
        return self._json(RunLayout.PROVENANCE, PROVENANCE) or {}

    def predictions_summary(self) -> dict:
        """summary.json of a predictions folder (this folder is one): flight -> counts and variables."""
        return self._json("summary.json", PREDICTIONS_SUMMARY) or {}

    def intervals(self) -> dict | None:
        cal = self._json(RunLayout.INTERVALS, INTERVALS)
        if cal is None:
            return None
        if cal["method"] not in INTERVAL_METHODS:
            return self._damage(
                RunLayout.INTERVALS,
                f"method is {shown(cal['method'])}, not one of {', '.join(INTERVAL_METHODS)}",
            )
        if len(cal["pred_km"]) != len(cal["true_km"]):
            return self._damage(RunLayout.INTERVALS, "pred_km and true_km differ in length")
        if "group" in cal and len(cal["group"]) != len(cal["pred_km"]):
            return self._damage(RunLayout.INTERVALS, "group and pred_km differ in length")
        if not 0.5 <= cal["coverage"] < 1.0:  # train.interval_coverage's range
            return self._damage(
                RunLayout.INTERVALS, f"coverage {shown(cal['coverage'])} is not between 0.5 and 1"
            )
        usable = sum(
            1
            for p, t in zip(cal["pred_km"], cal["true_km"])
            if p is not None and t is not None and p > 0 and t > 0 and math.isfinite(p) and math.isfinite(t)
        )
        if usable < INTERVALS_MIN:  # as intervals.calibrate: fewer heights calibrate nothing
            return self._damage(RunLayout.INTERVALS, f"{usable} usable heights, fewer than {INTERVALS_MIN}")
        return cal

    def last_run(self) -> dict | None:
        """last_run.json of the notebooks' CloudML folder: the choice the newest run started with."""
        return self._json("last_run.json", LAST_RUN)

    def metrics(self) -> list[dict]:
        """metrics.jsonl's records; a last line cut by a kill is skipped without a word, a bad line before
        it is named (and skipped)."""
        text = self._text(RunLayout.METRICS, limit=None)
        if text is None:
            return []
        lines, out, bad = text.split("\n"), [], []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                if i < len(lines) - (lines[-1] == ""):  # not the last line: damage, not a kill
                    bad.append(f"line {i} is not JSON")
                continue
            problem = RECORD.problem(record, f"line {i}") or unicode_problem(record)
            (bad.append(problem) if problem else out.append(record))
        if bad:
            self._damage(
                RunLayout.METRICS,
                "; ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""),
            )
        return out

    # the two steps every reader shares

    def _text(self, name: str, limit: int | None = MAX_BYTES) -> str | None:
        path = self.folder / name
        try:
            if path.is_symlink():
                return self._damage(name, "a symbolic link, not a file a run wrote")
            if not os.path.lexists(path):
                return None
            if limit is not None and path.stat().st_size > limit:
                return self._damage(name, f"{path.stat().st_size} bytes, more than a run writes")
            return read_bytes(path, limit, follow=False).decode("utf-8")  # a FIFO is refused, not waited on
        except UnicodeDecodeError:
            return self._damage(name, "not text (binary bytes)")
        except NotRegularFile as e:
            return self._damage(name, e.strerror.split(" is ", 1)[-1])
        except CloudMLError as e:
            return self._damage(name, str(e))
        except OSError as e:
            return self._damage(name, f"cannot be read: {e.strerror or e}")

    def _json(self, name: str, shape: Shape):
        text = self._text(name)
        if text is None:
            return None
        try:
            return parse_json(text, shape)
        except Damaged as e:
            return self._damage(name, str(e))

    def _damage(self, name: str, why: str) -> None:
        why = why.encode("utf-8", "backslashreplace").decode("utf-8")  # a key the file holds may not print
        self.damaged.append(f"damaged: {self.folder / name} ({why})")
        return None


def _config_problem(doc) -> str | None:
    """A run's config: sections of settings (a section may hold another: data.keys), each value a scalar
    or a short list of scalars or of flat mappings (data.flights); a few thousand values at most, so a
    YAML alias bomb is refused before anything walks it whole."""
    if not isinstance(doc, dict):
        return f"the file is {kind_of(doc)}, expected sections (data:, model:, train:, ...)"
    budget = [CONFIG_VALUES]
    for section, values in doc.items():
        if not isinstance(values, dict):
            return f"{_name(section)} is {kind_of(values)}, expected a section of settings"
        if problem := _section_problem(values, _name(section), budget, depth=1):
            return problem
    return None


def _section_problem(values: dict, where: str, budget: list[int], depth: int) -> str | None:
    for key, v in values.items():
        budget[0] -= 1 + (len(v) if isinstance(v, (list, dict)) else 0)
        if budget[0] < 0:
            return f"more than {CONFIG_VALUES} values, more than any config holds"
        here = f"{where}.{_name(key)}"
        if isinstance(v, dict) and depth < 3:
            if problem := _section_problem(v, here, budget, depth + 1):
                return problem
        elif not _is_config_value(v):
            return f"{here} is {shown(v)}, expected a value or a short list of values"
    return None


def _is_config_value(v) -> bool:
    if not isinstance(v, list):
        return _is_scalar(v)
    return len(v) <= CONFIG_LEAF and all(
        _is_scalar(x) or (isinstance(x, dict) and len(x) <= CONFIG_LEAF and all(map(_is_scalar, x.values())))
        for x in v
    )


def _is_scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool, dt.date))


def _name(key) -> str:
    return str(key)[:60]


def _plain(doc: dict) -> dict:
    """A config with YAML dates written as text (an unquoted 2023-03-02 is a date to YAML)."""

    def plain(v):
        return (
            [plain(x) for x in v] if isinstance(v, list) else v.isoformat() if isinstance(v, dt.date) else v
        )

    return {str(s): {str(k): plain(v) for k, v in values.items()} for s, values in doc.items()}


def numbered_folders(folder: Path) -> list[Path]:
    """The sub-folders named by a plain number (trials/0, trials/1, ...), in order; other names ignored."""
    try:
        found = [p for p in Path(folder).iterdir() if re.fullmatch(r"[0-9]{1,9}", p.name) and p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: int(p.name))
