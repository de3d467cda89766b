"""Which samples play which role in a run: three roles, never mixed.

- **test**: the flights of `data.test_flights`, scored once, at the end; nothing is chosen on them (not the
  best epoch, early stopping, the cloud probe, the intervals, a sweep's best trial) and nothing is fitted on
  them;
- **validation**: data drawn from the training flights that choose the best epoch, stop early and calibrate
  the intervals, by the rule of `data.validation`: a whole training flight (`flight`: the one whose label
  count is closest to the median), the last part in time of each training flight (`time_blocks`, after a gap
  that neither side uses: neighbouring frames are nearly identical, so random frames would leak), or named
  flights;
- **fit**: everything else of the training flights: what the model, its scalers, the cloud probe and the
  baselines are fitted on.

A run made before `data.validation` existed chose on its test flights (LEGACY_VALIDATION): its split says so,
and it keeps that reading when it continues. `Split.record()` is what run.json and evaluation.json keep.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from cloudml_lib.base.config import LEGACY_VALIDATION, DataConfig
from cloudml_lib.base.errors import ConfigError
from cloudml_lib.data.cache import FlightCache

log = logging.getLogger(__name__)

MIN_BLOCK_LABELS = 5  # a training flight with fewer height labels gives no validation block (it only trains)
WHOLE = "the whole flight"


@dataclass(frozen=True)
class Block:
    """The frames of one training flight held back for validation: [first, end); before `first` a gap of
    `gap` frames neither the validation nor the fitting uses."""

    first: int
    end: int
    gap: int
    labels: int  # height labels in the block
    of: int  # height labels of the flight

    def words(self) -> str:
        return (
            f"frames {self.first}-{self.end - 1} ({self.labels} of its {self.of} labels, the last in time), "
            f"after a gap of {self.gap} frames"
        )


@dataclass(frozen=True)
class Split:
    """The run's roles: test flight names, and per training flight held back for validation either the whole
    flight (None) or a time Block. `rule`: flight, time_blocks, named, or LEGACY_VALIDATION."""

    test: tuple[str, ...]
    validation: dict = field(default_factory=dict)  # flight name -> None (whole) or Block
    rule: str = "flight"
    why: str = ""  # how the rule was chosen, in words

    @property
    def legacy(self) -> bool:
        return self.rule == LEGACY_VALIDATION

    def record(self) -> dict:
        """Plain types for run.json and evaluation.json."""
        return {
            "rule": self.rule,
            "why": self.why,
            "test_flights": list(self.test),
            "validation": {
                name: WHOLE
                if b is None
                else {"first_frame": b.first, "end_frame": b.end, "gap_frames": b.gap}
                for name, b in self.validation.items()
            },
        }

    def words(self) -> str:
        """The split in a sentence, for the log and the reports."""
        if self.legacy:
            return (
                f"validation on the test flights {', '.join(self.test)} (the protocol of runs made before "
                "CloudML 0.3: the best epoch and the intervals were chosen on the flights the run is scored "
                "on, so its test numbers are optimistic)"
            )
        parts = [f"{n}: {WHOLE if b is None else b.words()}" for n, b in self.validation.items()]
        return f"validation by rule {self.rule} ({self.why}): " + "; ".join(parts)

    def parts(self, caches: list[FlightCache]) -> tuple[list, list, list]:
        """(fit, validation, test): the caches cut to each role's samples (FlightCache.part)."""
        fit, val, test = [], [], []
        for c in caches:
            if c.name in self.test:
                test.append(c)
                if self.legacy:
                    val.append(c)
                continue
            if c.name not in self.validation:
                fit.append(c)
                continue
            block = self.validation[c.name]
            if block is None:
                val.append(c)
                continue
            f = c.frame_index
            val.append(c.part(np.flatnonzero((f >= block.first) & (f < block.end))))
            fit.append(c.part(np.flatnonzero(f < block.first - block.gap)))
        return fit, val, test


def label_counts(caches: list[FlightCache]) -> dict[str, int]:
    return {c.name: int(c.has_height.sum()) for c in caches}


def choose_split(caches: list[FlightCache], data: DataConfig) -> Split:
    """The roles of `caches` by data.test_flights and data.validation (a ConfigError where the rule cannot be
    met, naming it and what would work)."""
    test = tuple(c.name for c in caches if c.name in data.test_flights)
    training = [c for c in caches if c.name not in data.test_flights]
    rule = data.validation
    if rule == LEGACY_VALIDATION:
        return Split(test, {}, LEGACY_VALIDATION, "kept from the run's earlier release")
    if not training:
        raise ConfigError("data.test_flights: every flight is a test flight; leave at least one for training")
    if isinstance(rule, list):
        return Split(test, {n: None for n in rule}, "named", "data.validation names them")
    if rule == "auto":
        many = len(training) >= 3
        why = f"auto: {len(training)} training flights, " + (
            "so a whole flight" if many else "fewer than 3, so the last part of each"
        )
        rule = "flight" if many else "time_blocks"
    else:
        why = f"data.validation: {rule}"
    if rule == "flight":
        name = median_flight(label_counts(training), data.overweight_flight)
        return Split(
            test, {name: None}, "flight", why + "; the flight whose label count is nearest the median"
        )
    return Split(test, time_blocks(training, data), "time_blocks", why)


def median_flight(counts: dict[str, int], overweight: str = "") -> str:
    """The training flight whose label count (`counts`: flight -> height labels) is closest to the median of
    the training flights' counts (the first of a tie, in the flights' order); the over-weighted flight only
    where no other is left."""
    if len(counts) < 2:
        raise ConfigError(
            "data.validation: flight needs two training flights (one to validate on); use time_blocks"
        )
    median = float(np.median(list(counts.values())))
    candidates = [n for n in counts if n != overweight] or list(counts)
    return min(candidates, key=lambda n: (abs(counts[n] - median), candidates.index(n)))


def counts_by_role(samples: dict[str, int], data: DataConfig) -> tuple[int, int]:
    """(samples trained on, validation samples) the rule gives flights of these sample counts, without the
    caches (the picker's expected time; a time block's gap is left out)."""
    training = {n: k for n, k in samples.items() if n not in data.test_flights}
    rule = data.validation
    if rule == LEGACY_VALIDATION:
        return sum(training.values()), sum(k for n, k in samples.items() if n in data.test_flights)
    if rule == "auto":
        rule = "flight" if len(training) >= 3 else "time_blocks"
    if isinstance(rule, list) or (rule == "flight" and len(training) >= 2):
        held = set(rule) if isinstance(rule, list) else {median_flight(training, data.overweight_flight)}
        val = sum(k for n, k in training.items() if n in held)
        return sum(training.values()) - val, val
    val = sum(int(round(data.validation_share * k)) for k in training.values() if k >= MIN_BLOCK_LABELS)
    return sum(training.values()) - val, val


def time_blocks(training: list[FlightCache], data: DataConfig) -> dict:
    """Per training flight with enough labels: its last data.validation_share of height labels (in frame
    order, the flight's time) as a Block, the gap before it at least one window (data.temporal_frames)."""
    gap = max(int(data.validation_gap_frames), int(data.temporal_frames))
    out = {}
    for c in training:
        frames = np.sort(c.frame_index[c.has_height])
        n = frames.size
        k = max(1, int(round(data.validation_share * n)))
        if n < MIN_BLOCK_LABELS or n - k < 1:
            log.info(
                "flight %s: %d height labels, too few for a validation block (%d or more): it only trains",
                c.name,
                n,
                MIN_BLOCK_LABELS,
            )
            continue
        first = int(frames[n - k])
        out[c.name] = Block(first, int(c.frame_index.max()) + 1, gap, k, n)
    if not out:
        raise ConfigError(
            f"data.validation time_blocks: no training flight has {MIN_BLOCK_LABELS} or more height labels "
            "to hold some back for validation "
            f"({', '.join(f'{n} {k}' for n, k in label_counts(training).items())}"
            "); add a flight, or make one a validation flight by name (data.validation: [NAME])"
        )
    return out


def check_parts(fit: list[FlightCache], val: list[FlightCache], split: Split) -> None:
    """Each role has height labels to work with, said by name where one has none."""
    if not any(c.has_height.any() for c in fit):
        raise ConfigError(
            "the split leaves no height label to train on ("
            + split.words()
            + "); add a training flight, or choose another data.validation"
        )
    empty = [c.name for c in val if not c.has_height.any()]
    if empty:
        raise ConfigError(
            f"the validation data of {', '.join(empty)} hold no height label ({split.words()}); choose "
            "another "
            "data.validation"
        )
