"""A trained model a colleague can load without CloudML: `python -m cloudml_lib export --run-dir RUN`.

The folder (RUN/export/ unless --out names another) holds:
- model.pt2            the network as a torch.export program (plain torch: torch.export.load(...).module()),
                       taking the frames and the scalar inputs of a batch of windows and giving the cloud
                       base height in km (and the probability of the cloud flag where the model has one);
- weights.safetensors  the best weights (best.pt's, the epoch chosen on the validation data), by the names
                       the program's module uses: load_state_dict(safetensors.torch.load_file(...));
- preprocessing.json   what the inputs are and how to make them from the ER-2 files: the frame preprocessing
                       step by step with its settings, the scalar inputs in order with their formulas and the
                       scalers fitted on the training flights, the window, the outputs and their units;
- MODEL_CARD.md        what the model was trained on and how well it did: the flights by role, each test
                       flight's skill beside the baselines on the same flight, the verdict, the intervals'
                       coverage, the label range and the limits.
Nothing of CloudML is needed to run it: tests/test_export.py loads the folder in a process where cloudml_lib
cannot be imported and reproduces CloudML's predictions to float rounding.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import torch

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.outputs import atomic_path, target, write_text
from cloudml_lib.base.ownership import Kind, claim
from cloudml_lib.base.resources import package_version
from cloudml_lib.core.run.checkpoint import Key, weights_sha256
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.status import RunState, run_state
from cloudml_lib.data.dataset import STAT_NAMES, Scalers
from cloudml_lib.science.evaluate import load_run_model

log = logging.getLogger(__name__)

PROGRAM, WEIGHTS, SPEC, CARD = "model.pt2", "weights.safetensors", "preprocessing.json", "MODEL_CARD.md"
EXPORT_FILES = (PROGRAM, WEIGHTS, SPEC, CARD)
FORMAT = 1  # of preprocessing.json


def adopt_export(folder: Path) -> str | None:
    """An export of an earlier CloudML, proved by two files, never by one: its preprocessing.json saying
    CloudML wrote it (read without following a link, at most 1 MB), beside its program."""
    from cloudml_lib.base.files import read_text

    try:
        spec = json.loads(read_text(Path(folder) / SPEC, limit=1 << 20, follow=False))
    except (OSError, ValueError, CloudMLError):
        return None
    written = spec.get("written_by") if isinstance(spec, dict) else None
    if isinstance(written, str) and written.startswith("CloudML") and (Path(folder) / PROGRAM).is_file():
        return f"its {SPEC} says CloudML wrote it, beside {PROGRAM}"
    return None


EXPORT = Kind("export", "--out", adopt_export, "a folder of an earlier export")


class _Exported(torch.nn.Module):
    """The network with its outputs in physical units: height in km, the cloud flag as a probability."""

    def __init__(self, model: torch.nn.Module, scalers: Scalers):
        super().__init__()
        self.model = model
        self.register_buffer("cbh_mean_km", torch.tensor(float(scalers.cbh_mean)), persistent=True)
        self.register_buffer("cbh_std_km", torch.tensor(float(scalers.cbh_std)), persistent=True)
        self.cloud = bool(getattr(model, "cloud_output", False))

    def forward(self, frames: torch.Tensor, scalars: torch.Tensor):
        out = self.model(frames, scalars)
        height = out.height.float() * self.cbh_std_km + self.cbh_mean_km
        if self.cloud and out.cloud_logit is not None:
            return height, torch.sigmoid(out.cloud_logit.float())
        return (height,)


class _WindowMax(torch.nn.Module):
    """MaxPool2d(2) as the program computes it: the max of each 2 x 2 window (an odd last row or column
    dropped), the same numbers. torch 2.11's export guards max_pool2d's output size on the parity of the
    frame's rows and columns (its meta rounds with a branch), so a free frame size failed there ("Constraints
    violated (cols, rows)"); windows taken by unfold carry no such guard. For the program only: in training,
    max_pool2d's gradient (to one element of a tie) is the network's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unfold(2, 2, 2).unfold(3, 2, 2).amax(dim=(-2, -1))


def _plain_2x2(pool: torch.nn.Module) -> bool:
    """A MaxPool2d of 2 x 2 windows, stride 2, no padding, dilation or ceil mode (the network's)."""
    pair = lambda v, n: v in (n, (n, n))  # noqa: E731
    return (
        isinstance(pool, torch.nn.MaxPool2d)
        and pair(pool.kernel_size, 2)
        and pair(pool.stride, 2)
        and pair(pool.padding, 0)
        and pair(pool.dilation, 1)
        and not pool.ceil_mode
    )


def _for_export(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each 2 x 2 max pooling computed as _WindowMax (no parameter changes: the same names)."""
    for module in list(model.modules()):
        for child, sub in list(module.named_children()):
            if _plain_2x2(sub):
                setattr(module, child, _WindowMax())
    return model


def export_run(run: RunFolder, out: str | Path | None = None) -> Path:
    """Write a run's best model as a folder a colleague loads without CloudML (the module's docstring);
    returns the folder."""
    from safetensors.torch import save

    rm = load_run_model(run, command="export", channels_last=False)
    cfg, ckpt = rm.cfg, rm.ckpt
    scalers = Scalers.from_dict(ckpt[Key.SCALERS])
    wrapped = _Exported(_for_export(rm.model.float().cpu().eval()), scalers).eval()
    frames, scalars = _example(cfg, scalers)
    program = _program(wrapped, frames, scalars)
    folder = claim(Path(out) if out else run.path / "export", EXPORT)
    weights = {k: v.detach().cpu().contiguous() for k, v in wrapped.state_dict().items()}
    written_by = f"CloudML {package_version()}"
    # each file made by Python's open, as any new file of the user's (their umask: readable by the colleague
    # it is for; safetensors' own writer made weights.safetensors 0600); a cut write leaves no half file
    blob = save(weights, metadata={"written_by": written_by, "run": run.path.name})
    with atomic_path(folder / WEIGHTS) as tmp:
        tmp.write_bytes(blob)
    buffer = io.BytesIO()  # torch.export.save to a buffer: a temporary name not ending in .pt2 is warned of
    torch.export.save(program, buffer)
    with atomic_path(folder / PROGRAM) as tmp:
        tmp.write_bytes(buffer.getvalue())
    evaluation = run.files.evaluation()
    write_text(folder / SPEC, json.dumps(specification(cfg, scalers, wrapped.cloud, run), indent=1))
    weights_line = f"- Weights: `{WEIGHTS}`, sha256 {hashlib.sha256(blob).hexdigest()}."
    write_text(target(folder / CARD), model_card(cfg, ckpt, evaluation, run, weights_line))
    log.info("Exported %s's best model to %s (%s)", run.path.name, folder, ", ".join(EXPORT_FILES))
    return folder


def _example(cfg, scalers: Scalers) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs for tracing: 2 windows of T frames (the program takes any batch and any frame of at least
    MIN_SIDE rows and columns: the network pools its features over the frame)."""
    n_scalars = 3 + (len(STAT_NAMES) if scalers.radiometry else 0) + scalers.n_atmosphere
    return torch.zeros(2, int(cfg.data.temporal_frames), 64, 96), torch.zeros(2, n_scalars)


MIN_SIDE = 16  # three 2x2 poolings leave at least 2 x 2
TESTED_TORCH = "2.11.0"  # Colab's (constraints/colab.txt; tests/test_colab_twin.py exports there)


def _program(wrapped: torch.nn.Module, frames: torch.Tensor, scalars: torch.Tensor):
    """torch.export of the wrapped network, its batch and frame size free."""
    dim = torch.export.Dim
    batch, rows, cols = dim("batch", min=1, max=1 << 16), dim("rows", min=MIN_SIDE), dim("cols", min=MIN_SIDE)
    try:
        with torch.no_grad():
            return torch.export.export(
                wrapped,
                (frames, scalars),
                dynamic_shapes={"frames": {0: batch, 2: rows, 3: cols}, "scalars": {0: batch}},
            )
    except Exception as e:  # torch.export raises many types
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        raise CloudMLError(
            f"export: torch.export of torch {torch.__version__} could not export the network with a free "
            f"batch and frame size ({why}). Nothing was written; the run is untouched. CloudML's export is "
            f"tested on torch {TESTED_TORCH} (Colab's) and on the newest release: install one of them "
            f"(pip install 'torch=={TESTED_TORCH}') and export again."
        ) from None


def specification(cfg, scalers: Scalers, cloud: bool, run: RunFolder) -> dict:
    """preprocessing.json: the inputs, how to make them, the outputs."""
    d = cfg.data
    scalar_names = ["zenith_standardised", "sin_azimuth", "cos_azimuth"]
    if scalers.radiometry:
        scalar_names += [f"{name}_scaled" for name in STAT_NAMES]
    scalar_names += [f"{name}_standardised" for name in scalers.atmosphere or []]
    return {
        "format": FORMAT,
        "written_by": f"CloudML {package_version()}",
        "run": run.path.name,
        "torch": torch.__version__,
        "load": (
            "program = torch.export.load('model.pt2').module(); program.load_state_dict("
            "safetensors.torch.load_file('weights.safetensors')); outputs = program(frames, scalars)"
        ),
        "inputs": {
            "frames": _frames_spec(d),
            "scalars": {
                "shape": ["batch", len(scalar_names)],
                "dtype": "float32",
                "order": scalar_names,
                "of": "each window's centre frame",
                "formulas": _scalar_formulas(d, scalers),
                "scalers": scalers.to_dict(),
            },
            "navigation": _nav_spec(d),
            "window": {
                "frames": int(d.temporal_frames),
                "rule": (
                    "the T frames centred on the frame predicted (first = index - T // 2), shifted inside "
                    "the flight at its ends: first = min(max(index - T // 2, 0), n_frames - T)"
                ),
            },
        },
        "outputs": _outputs_spec(cloud, cfg),
    }


def _frames_spec(d) -> dict:
    return {
        "shape": ["batch", int(d.temporal_frames), "rows", "columns"],
        "dtype": "float32",
        "size": (
            f"rows = ({int(d.swath_slice[1])} - {int(d.swath_slice[0])}) // {int(d.downsample)}, columns = "
            f"the raw frame's columns // {int(d.downsample)} (the program takes any size from {MIN_SIDE})"
        ),
        "source": f"the IR file's {d.keys.ir_signal} (frames on the first axis)",
        "steps": [
            f"keep rows {int(d.swath_slice[0])} to {int(d.swath_slice[1])} (end excluded) of the raw frame",
            "replace non-finite pixels by the median of the finite ones (none finite: blank, no answer)",
            f"average blocks of {int(d.downsample)} x {int(d.downsample)} pixels (the rows and columns that "
            "do not fill a block are dropped)",
            "scale to 0..1 by the frame's own minimum and maximum (a frame without contrast is blank)",
            f"scikit-image exposure.equalize_adapthist(x, clip_limit={float(d.clahe_clip_limit)})"
            if float(d.clahe_clip_limit) > 0
            else "no CLAHE (data.clahe_clip_limit 0)",
            "standardise by the frame's own mean and standard deviation: (x - mean) / (std + 1e-6)",
            "round to float16, then back to float32 (as CloudML's cache holds the frames)",
        ],
    }


def _nav_spec(d) -> dict:
    """Where the sun angles and the heading of each frame come from, and how a nav record is matched to a
    frame (data/navigation.py), as the run read them."""
    from cloudml_lib.data.navigation import NAV_MATCH_TOLERANCE_S

    k = d.keys
    if d.angles_source == "cpl":
        return {
            "source": "the CPL lidar file's own angles, per labelled profile (data.angles_source: cpl)",
            "variables": {"solar_zenith_deg": k.cpl_zenith, "sun_azimuth_deg": k.cpl_azimuth},
            "match": (
                f"each profile's time ({k.cpl_time}) to the nearest IR frame time ({k.ir_time}) within "
                f"{float(d.match_tolerance_s):g} s"
            ),
        }
    return {
        "source": (
            "the flight's nav file: the HDF nav (*_nav.hdf) or the ICARTT MetNav text (*_MetNav_ER2_*.ict)"
        ),
        "variables": {
            "hdf": {
                "solar_zenith_deg": k.nav_zenith,
                "sun_azimuth_deg": k.nav_azimuth,
                "true_heading_deg": k.nav_heading,
                "time": k.nav_time,
            },
            "icartt_columns": {
                "solar_zenith_deg": k.ict_zenith,
                "sun_azimuth_deg": k.ict_azimuth,
                "true_heading_deg": k.ict_heading,
                "time_s_of_day": k.ict_time,
            },
        },
        "match": (
            f"HDF nav without {k.nav_time}: nav row i is IR frame i (rows beyond the frames unused, "
            f"frames beyond the rows without nav). With a time axis (the HDF's {k.nav_time}, the "
            f"ICARTT's {k.ict_time} from 00 UTC of the file's date): each frame ({k.ir_time}, epoch "
            f"seconds) takes the nearest usable record within {NAV_MATCH_TOLERANCE_S:g} s, else it has "
            "no nav. A record is unusable with a fill value, a solar zenith outside 0..180 deg or a sun "
            "azimuth outside -180..360 deg"
        ),
        "unknown": "a frame without nav: zenith_standardised, sin_azimuth and cos_azimuth all 0",
    }


def _scalar_formulas(d, scalers: Scalers) -> list[str]:
    azimuth = (
        "the sun azimuth minus the aircraft's true heading, modulo 360 (degrees)"
        if d.sun_azimuth == "relative"
        else "the sun azimuth from north, as the nav file gives it (degrees)"
    )
    out = [
        "zenith_standardised = (solar zenith angle in degrees - sza_mean) / sza_std; 0 where unknown",
        f"sin_azimuth, cos_azimuth = sin and cos of {azimuth}; both 0 where unknown",
    ]
    if scalers.radiometry:
        out.append(
            f"the raw frame's brightness statistics over the finite values of the kept rows, in "
            f"{scalers.radiometry_units} (the IR file's units after its scale_factor and add_offset; "
            "float32): percentiles "
            f"{', '.join(n for n in STAT_NAMES if n.startswith('p'))}, mean: (value - radiometry_offset) / "
            "radiometry_scale; std: std / radiometry_scale; 0 where not finite"
        )
    if scalers.atmosphere:
        out.append(
            "the flight's atmosphere from ERA5 at the labelled frame (CloudML's data/predictors.py, "
            "interpolated linearly in time and bilinearly in space; units in era5.PREDICTORS): "
            + ", ".join(
                f"{n}_standardised = ({n} - {m:.6g}) / {s:.6g}"
                for n, m, s in zip(scalers.atmosphere, scalers.atmosphere_mean, scalers.atmosphere_std)
            )
            + "; 0 where not finite"
        )
    return out


def _outputs_spec(cloud: bool, cfg) -> dict:
    out = {"cloud_base_height_km": "output 0, (batch,): the cloud base height in km above the surface"}
    if cloud:
        out["cloud_probability"] = (
            f"output 1, (batch,): the probability of the cloud flag ({cfg.data.cloud_flag}); CloudML gives a "
            f"height only where it reaches model.cloud_threshold = {float(cfg.model.cloud_threshold)}"
        )
    return out


def not_these_weights(evaluation: dict, ckpt: dict, state: RunState) -> str | None:
    """None where evaluation.json scored exactly the weights best.pt holds (checkpoint.weights_sha256; an
    earlier release's evaluation, without it, by the run's state alone); else why its skill is not theirs."""
    if not evaluation:
        return "the run has no evaluation.json (run `evaluate` on it, then export again)"
    recorded = evaluation.get("weights_sha256")
    if recorded is None:
        return None if state.kind == "finished" else f"the run is {state.words}"
    if recorded != weights_sha256(ckpt[Key.MODEL]):
        return (
            "evaluation.json scored other weights than best.pt holds now (best.pt was replaced after the "
            "evaluation): run `evaluate` on the run, then export again"
        )
    return None


def model_card(cfg, ckpt: dict, evaluation: dict, run: RunFolder, weights_line: str = "") -> str:
    """MODEL_CARD.md: what the model was trained on and how well it did, in words and numbers (test skill
    only where the evaluation scored these very weights)."""
    state = run_state(run, check_lock=False)
    unproven = not_these_weights(evaluation, ckpt, state)
    protocol = evaluation.get("protocol") or {}
    tests = protocol.get("test_flights") or list(cfg.data.test_flights)
    validation = protocol.get("validation") or {}
    trained = [
        f"{f.name} (part)" if f.name in validation else f.name
        for f in cfg.data.flights
        if f.name not in tests and validation.get(f.name) != "the whole flight"
    ]
    lines = [
        f"# Model card: CloudML run {run.path.name}",
        "",
        f"Cloud base height (km) from {int(cfg.data.temporal_frames)} consecutive NASA ER-2 thermal-IR "
        f"frames and the solar angles, trained and exported by CloudML {package_version()} (inputs and "
        f"outputs: `{SPEC}`).",
        "",
        "## Data",
        f"- Trained on: {', '.join(trained) or 'see the run config'}.",
        f"- Validation (the epoch chosen on it): {_validation_words(protocol)}.",
        f"- Test flights (nothing trained or chosen on them): {', '.join(tests) or 'none'}.",
        f"- Labels: the CPL lidar's cloud base, {float(cfg.data.cbh_min_km):g} to "
        f"{float(cfg.data.cbh_max_km):g} km.",
        *([weights_line] if weights_line else []),
        *(
            []
            if state.kind == "finished"
            else [
                f"- Training: the run is {state.words}; these are its best weights so far, not a "
                "finished run's."
            ]
        ),
        "",
        "## How well it did",
        *_proven_skill_lines(evaluation, tests, unproven),
        "",
        "## Limits",
        *_limit_lines(evaluation, ckpt),
    ]
    return "\n".join(lines) + "\n"


def _proven_skill_lines(evaluation: dict, tests: list[str], unproven: str | None) -> list[str]:
    """The test skill where it is these weights' (`unproven`: why not, from not_these_weights)."""
    if unproven is not None:
        return [f"Not evaluated on these weights: {unproven}."]
    if evaluation.get("weights_sha256"):
        other = evaluation.get("best_model")  # best.pt put back or replaced (evaluate says so)
        return _skill_lines(evaluation, tests) + (["", f"Note: {other}."] if isinstance(other, str) else [])
    return _skill_lines(evaluation, tests) + [
        "",
        "(An evaluation of an earlier release, which records no checksum of the weights it scored: matched "
        "to these weights by the run's state alone.)",
    ]


def _validation_words(protocol: dict) -> str:
    validation = protocol.get("validation") or {}
    return "; ".join(f"{k}: {v}" for k, v in validation.items()) or "not recorded"


def _num(v, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and np.isfinite(v) else "-"


def _skill_lines(evaluation: dict, tests: list[str]) -> list[str]:
    """Each test flight's MAE and R2 beside the best baseline's on the same flight, and the verdict."""
    per = evaluation.get("per_flight") or {}
    best = ((evaluation.get("baselines") or {}).get("best") or {}).get("per_flight") or {}
    intervals = (evaluation.get("intervals") or {}).get("per_flight") or {}
    if not per:
        return ["Not evaluated: the run has no evaluation.json (run `evaluate` on it, then export again)."]
    lines = [
        "| test flight | samples | MAE km | R2 | best baseline | its MAE km | skill | interval coverage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for flight in tests:
        m, b, c = per.get(flight) or {}, best.get(flight) or {}, intervals.get(flight) or {}
        lines.append(
            f"| {flight} | {m.get('n', '-')} | {_num(m.get('mae_km'))} | {_num(m.get('r2'))} | "
            f"{b.get('name', '-')} | {_num(b.get('mae_km'))} | {_num(b.get('skill'), '+.2f')} | "
            f"{_num(c.get('coverage'), '.0%')} |"
        )
    verdict = evaluation.get("verdict")
    if isinstance(verdict, str) and verdict:
        lines += ["", verdict if verdict.startswith("Verdict") else f"Verdict: {verdict}"]
    return lines


def _limit_lines(evaluation: dict, ckpt: dict) -> list[str]:
    out = [
        "- Skill is measured on the test flights above only; a flight over other surfaces, seasons or cloud "
        "regimes may differ.",
        "- Heights outside the range of the training labels are extrapolations (CloudML flags them).",
        "- The frames must be preprocessed exactly as `preprocessing.json` says; another CLAHE gives other "
        "numbers.",
    ]
    verdict = evaluation.get("verdict")
    if isinstance(verdict, str) and "baseline" in verdict.lower():
        out.append("- The verdict above names a baseline: read it before using the network's heights.")
    return out
