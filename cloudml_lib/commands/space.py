"""A sweep's search space: a small YAML of config keys with ranges or choices, and how trials are scored.

    objective: validation    # validation: each trial's validation data (never its test flights); crossval:
                             # the mean of the nested folds' validation scores
    metric: mae_km           # mae_km | rmse_km (minimised) or r2 (maximised)
    sampler: tpe             # tpe | random
    seed: 0                  # the same seed and history give the same trials
    pruner: median           # none | median (not crossval): stop a trial worse than the median at an epoch
    prune_after_epochs: 1    # no trial is pruned before it trained this many epochs
    prune_startup_trials: 2  # nor before this many trials finished
    params:
      train.learning_rate: {low: 1.0e-4, high: 1.0e-2, log: true}
      model.dropout: {low: 0.0, high: 0.4}
      data.temporal_frames: {choices: [3, 5]}

Validated like a config before any work: each key must be a config key that changes the model or its
training, and every value the space can produce is checked against the user's config (its range, its
choices and the rules between keys), so a bad key or range is refused with the key named.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cloudml_lib.base.config import Config, build_config, value_type
from cloudml_lib.base.errors import ConfigError, shown
from cloudml_lib.base.yamlfile import read_yaml

# held_out (chosen on the test flights) is the objective of sweeps started by CloudML 0.2: kept for them alone
OBJECTIVES = ("validation", "crossval", "held_out")
LEGACY_OBJECTIVE = "held_out"
METRICS = {"mae_km": "minimize", "rmse_km": "minimize", "r2": "maximize"}
SAMPLERS = ("tpe", "random")
PRUNERS = ("none", "median")
# Where the data lives and how runs are saved: not hyperparameters.
NOT_SWEPT = (
    "data.dir",
    "data.cache_dir",
    "data.cache_copy_dir",
    "data.flights",
    "data.test_flights",
    "data.validation",  # the data that compare the trials: the same for all of them
    "data.validation_share",
    "data.validation_gap_frames",
    "data.keys",
    "checkpoint",
    "train.device",
)
RANGE_KEYS, CHOICE_KEYS = {"low", "high", "log", "step"}, {"choices"}
MAX_CHECKED = 64  # an integer range with at most this many values has each one checked
MAX_SEED = 2**32 - 1  # numpy's, under Optuna's samplers: trial n draws with seed + n
FLIGHT_KEYS = ("data.overweight_flight", "data.test_flights", "train.pretrain_flight")


@dataclass
class Space:
    objective: str = "validation"
    metric: str = "mae_km"
    sampler: str = "tpe"
    seed: int = 0
    pruner: str = "none"
    prune_after_epochs: int = 1
    prune_startup_trials: int = 2
    params: dict = field(default_factory=dict)  # config key -> {"low", "high", "log", "step"} or {"choices"}

    @property
    def direction(self) -> str:
        return METRICS[self.metric]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_fields() -> dict[str, type]:
    """Every leaf key of a config ("train.learning_rate") and its type."""
    out = {}
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            out[f"{section.name}.{f.name}"] = "section" if dataclasses.is_dataclass(tp) else value_type(tp)[0]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_spec(key: str, spec, tp, problems: list[str]) -> None:
    where = f"params.{key}"
    if not isinstance(spec, dict) or not spec:
        problems.append(
            f"{where}: expected {{low: .., high: ..}} (a range, optional log: true / step) or "
            f"{{choices: [..]}}, got {shown(spec)}"
        )
        return
    keys = set(spec)
    if keys & CHOICE_KEYS:
        if keys - CHOICE_KEYS:
            problems.append(f"{where}: give either choices or low/high, not both ({', '.join(sorted(keys))})")
        elif not isinstance(spec["choices"], list) or not spec["choices"]:
            problems.append(f"{where}.choices: expected a non-empty list, got {shown(spec['choices'])}")
        return
    unknown = keys - RANGE_KEYS
    if unknown:
        problems.append(
            f"{where}: unknown {', '.join(sorted(unknown))}; a range has low, high, and optionally "
            "log (true/false) or step; a list of values is choices: [..]"
        )
        return
    if tp not in (int, float):
        problems.append(f"{where}: {key} is not a number, so it takes choices: [..], not a range")
        return
    lo, hi = spec.get("low"), spec.get("high")
    if not (_number(lo) and _number(hi)):
        problems.append(f"{where}: low and high must both be numbers, got low {shown(lo)}, high {shown(hi)}")
    elif tp is int and not (float(lo).is_integer() and float(hi).is_integer()):
        problems.append(f"{where}: {key} is an integer, so low and high must be integers (got {lo}, {hi})")
    elif not lo < hi:
        problems.append(f"{where}: low ({lo}) must be below high ({hi}); for one value, set it in the config")
    elif spec.get("log") and lo <= 0:
        problems.append(f"{where}: a log range needs low > 0 (got {lo})")
    if "log" in spec and not isinstance(spec["log"], bool):
        problems.append(f"{where}.log: expected true/false, got {shown(spec['log'])}")
    step = spec.get("step")
    if step is not None and (not _number(step) or step <= 0 or (tp is int and not float(step).is_integer())):
        problems.append(
            f"{where}.step: expected a positive {'integer' if tp is int else 'number'}, got {shown(step)}"
        )
    elif step is not None and spec.get("log"):
        problems.append(
            f"{where}: step and log cannot be combined (Optuna samples a log range without steps)"
        )
    elif step is not None and _number(lo) and _number(hi) and lo < hi:
        _check_step(where, lo, hi, step, problems)


def _check_step(where: str, lo, hi, step, problems: list[str]) -> None:
    """A step that fits its range: smaller than it, and high reached from low in whole steps."""
    span = hi - lo
    if step > span:
        problems.append(
            f"{where}.step: {step} is larger than the range {lo}..{hi} ({span}): only low could be drawn; "
            "choose a smaller step, or set the value in the config"
        )
        return
    steps = span / step
    if abs(steps - round(steps)) > 1e-9 * max(1.0, steps):
        top = lo + math.floor(steps + 1e-9) * step
        problems.append(
            f"{where}: high ({hi}) is not reached from low ({lo}) in steps of {step}; "
            f"use high: {top:.10g} (or another step)"
        )


def values_to_check(spec: dict, tp) -> list:
    """The values a spec can produce that a config check covers: each choice, each integer of a short
    range, else both ends (a range of any size is never listed whole)."""
    if "choices" in spec:
        return list(spec["choices"])
    lo, hi = spec["low"], spec["high"]
    if tp is int:
        step = int(spec.get("step") or 1)
        values = range(int(lo), int(hi) + 1, step)
        return list(values) if len(values) <= MAX_CHECKED else [values[0], values[-1]]
    return [float(lo), float(hi)]


def check_values(base: dict, params: dict, fields: dict) -> list[str]:
    """Each value alone on top of the user's config, checked by the config's own rules."""
    problems = []
    for key, spec in params.items():
        for value in values_to_check(spec, fields[key]):
            try:
                build_config(trial_raw(base, {key: value}))
            except ConfigError as e:
                detail = "; ".join(line.strip(" -") for line in str(e).splitlines()[1:]) or str(e)
                problems.append(
                    f"params.{key}: the value {shown(value)} is not valid with this config ({detail})"
                )
    return problems


def build_space(raw: dict, base: dict, source: str = "space") -> Space:
    """A validated Space; every problem at once, each naming the key (a ConfigError)."""
    problems: list[str] = []
    known = {f.name for f in dataclasses.fields(Space)}
    kwargs = {}
    for key, value in (raw or {}).items():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.5)
            problems.append(
                f"{key}: unknown key"
                + (f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(known))}")
            )
            continue
        kwargs[key] = value
    space = Space(**kwargs)
    _check_settings(space, problems)
    fields = config_fields()
    _check_params(space, fields, problems)
    if not problems:
        problems += check_values(base, space.params, fields)
    if problems:
        raise ConfigError(f"{source} has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return space


def _check_settings(space: Space, problems: list[str]) -> None:
    """The sweep's own settings: objective, metric, sampler, pruner and their numbers."""
    for name, valid in (
        ("objective", OBJECTIVES),
        ("metric", tuple(METRICS)),
        ("sampler", SAMPLERS),
        ("pruner", PRUNERS),
    ):
        if getattr(space, name) not in valid:
            problems.append(
                f"{name}: {shown(getattr(space, name))} is not valid; choose one of {', '.join(valid)}"
            )
    for name in ("seed", "prune_after_epochs", "prune_startup_trials"):
        value = getattr(space, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
            problems.append(f"{name}: expected a whole number from 0 to {MAX_SEED}, got {shown(value)}")
    if space.pruner != "none" and space.objective == "crossval":
        problems.append(
            "pruner: pruning stops a trial on its per-epoch metric, which a cross-validation (several "
            "runs per trial) does not have; use pruner: none with objective: crossval"
        )


def _check_params(space: Space, fields: dict, problems: list[str]) -> None:
    """Each swept key: a config key that says how the model learns, with a valid range or choices."""
    if not isinstance(space.params, dict) or not space.params:
        problems.append(
            "params: expected a mapping of config keys to ranges or choices, e.g. "
            "train.learning_rate: {low: 1.0e-4, high: 1.0e-2, log: true}"
        )
        space.params = {}
    for key, spec in space.params.items():
        if key not in fields or fields[key] == "section":
            close = difflib.get_close_matches(
                str(key), sorted(k for k, t in fields.items() if t != "section"), n=1
            )
            problems.append(
                f"params.{key}: not a config key"
                + (
                    f"; did you mean '{close[0]}'?"
                    if close
                    else " (keys are section.name, e.g. train.learning_rate)"
                )
            )
        elif any(key == n or key.startswith(n + ".") for n in NOT_SWEPT):
            problems.append(
                f"params.{key}: says where the data is or how runs are saved, not how the model "
                "learns; it cannot be swept"
            )
        else:
            _check_spec(key, spec, fields[key], problems)


def load_space(path: str | Path, base: dict) -> Space:
    """The search space file, validated against the user's config `base` (a raw config dict)."""
    raw = read_yaml(
        path,
        what="--space",
        example="configs/sweeps/demo.yaml",
        sections="objective, metric, sampler, seed, pruner and params",
    )
    return build_space(raw, base, source=str(path))


def choice_label(value) -> object:
    """Optuna's choices are plain scalars: a list (model.channels) is offered as its YAML text."""
    return (
        yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, (list, dict)) else value
    )


def suggest(trial, space: Space) -> dict:
    """The trial's values: drawn by the sampler, or the stored ones for a trial already asked (a resumed
    one)."""
    fields = config_fields()
    params = {}
    for key, spec in space.params.items():
        if "choices" in spec:
            labels = [choice_label(c) for c in spec["choices"]]
            params[key] = spec["choices"][labels.index(trial.suggest_categorical(key, labels))]
        elif fields[key] is int:
            params[key] = trial.suggest_int(
                key,
                int(spec["low"]),
                int(spec["high"]),
                step=int(spec.get("step") or 1),
                log=bool(spec.get("log")),
            )
        else:
            params[key] = trial.suggest_float(
                key, float(spec["low"]), float(spec["high"]), step=spec.get("step"), log=bool(spec.get("log"))
            )
    return params


def distributions(space: Space) -> dict:
    """The Optuna distribution of each swept key, as `suggest` draws it (a study rebuilt from trial folders
    must hold the same)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    fields, out = config_fields(), {}
    for key, spec in space.params.items():
        if "choices" in spec:
            out[key] = CategoricalDistribution([choice_label(c) for c in spec["choices"]])
        elif fields[key] is int:
            out[key] = IntDistribution(
                int(spec["low"]),
                int(spec["high"]),
                log=bool(spec.get("log")),
                step=int(spec.get("step") or 1),
            )
        else:
            out[key] = FloatDistribution(
                float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")), step=spec.get("step")
            )
    return out


def check_flights(space: Space, base: dict) -> None:
    """Flight names the space can set (data.overweight_flight, ...) against the flights the config finds,
    before any trial: a name that is not a flight would fail every trial drawing it."""
    swept = [k for k in space.params if k in FLIGHT_KEYS and "choices" in space.params[k]]
    if not swept:
        return
    from cloudml_lib.data.flights import prepare_flights

    cfg = build_config(base)
    names = [f.name for f in prepare_flights(cfg.data, check_names=False)[0].flights]
    problems = []
    for key in swept:
        for value in space.params[key]["choices"]:
            chosen = value if isinstance(value, list) else [value]
            unknown = [v for v in chosen if v and v not in names]
            if unknown:
                problems.append(
                    f"params.{key}: {shown(unknown)} {'is' if len(unknown) == 1 else 'are'} not among the "
                    f"flights found ({', '.join(names)})"
                )
    if problems:
        raise ConfigError(f"the space has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))


def trial_raw(base: dict, params: dict) -> dict:
    """The user's raw config with a trial's values set."""
    raw = copy.deepcopy(base)
    for key, value in params.items():
        section, name = key.split(".", 1)
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][name] = value
    return raw
