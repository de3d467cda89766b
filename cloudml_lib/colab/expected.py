"""The picker's expected time of a run as chosen, on the hardware at hand (core/machine/timing.py: how it is
found): each choice's step is timed once, in a thread of its own, so that the picker answers while it is
measured ("measuring..."), and remembered for the session; an earlier run on the same kind of device with
the same step is used first. The epoch's length comes from the preprocessing cache the setup notebook built.
"""

from __future__ import annotations

import atexit
import json
import math
import threading
from collections.abc import Callable
from pathlib import Path

from cloudml_lib.base.config import MIN_FRAME_SIDE, Config
from cloudml_lib.colab.drive import Workspace, cached_samples, frame_shape
from cloudml_lib.core.machine import estimate
from cloudml_lib.core.machine.timing import (
    CONTROL_SHARE,
    Expected,
    StepTime,
    device_name,
    end_seconds,
    end_share,
    from_flops,
    from_runs,
    signature,
    timed,
)
from cloudml_lib.core.network.compile import this_device
from cloudml_lib.core.network.inference import eval_batch_size
from cloudml_lib.data.splits import counts_by_role

T4_NAME = "T4"  # the one GPU whose peak rate the kit states (estimate.T4_FP16_FLOPS)
_RUNNING: list[threading.Thread] = []  # measuring threads, waited for when the interpreter exits


@atexit.register
def _wait_at_exit() -> None:
    """A thread still inside torch when Python exits would abort the process ("terminate called"): a
    measurement takes seconds, so the exit waits for it."""
    for thread in list(_RUNNING):
        thread.join(120)


class ExpectedTimes:
    """Expected times of the picker's choices. `on_ready` is called (from the measuring thread) when a
    step's time becomes known, so that the note can say it."""

    def __init__(self, ws: Workspace, on_ready: Callable[[], None]):
        self.ws, self.on_ready = ws, on_ready
        self.device = this_device()
        self.device_name = device_name(self.device)
        self.known: dict[str, StepTime | str] = {}  # a step's key -> its time, or why there is none
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self._frames: dict[Path, tuple[int, int] | None] = {}
        self._samples: dict[str, dict[str, int]] = {}

    def forget(self) -> None:
        """Look at the flights and the cache again (the picker's recheck: Drive may have synced)."""
        self._frames.clear()
        self._samples.clear()

    def frame(self, cfg: Config) -> tuple[int, int] | None:
        """The frame the network sees: the flights' frames cropped (data.swath_slice) and downsampled."""
        folder = Path(cfg.data.dir)
        if folder not in self._frames:
            self._frames[folder] = frame_shape(folder)
        raw, d = self._frames[folder], cfg.data
        if raw is None:
            return None
        return ((min(d.swath_slice[1], raw[0]) - d.swath_slice[0]) // d.downsample, raw[1] // d.downsample)

    def of(self, cfg: Config, epochs: int, measure: bool = True) -> Expected | str:
        """The expected time of a run of `cfg` for `epochs`, or in words why it is not known yet; without
        `measure`, only from an earlier run (nothing timed)."""
        frame, batch = self.frame(cfg), cfg.train.batch_size
        if frame is None:
            return "Expected time: known once flights are in the data folder."
        if min(frame) < MIN_FRAME_SIDE:  # the flights' frames are smaller than the preset's crop
            return "Expected time: not known for frames this small (see the preset's problem above)."
        if not isinstance(batch, int):
            return "Expected time: known once training starts and chooses the batch (train.batch_size: auto)."
        shape = estimate.StepShape.of(cfg, None, frame=frame)
        sig = signature(shape, batch)
        key = json.dumps(sig, sort_keys=True)
        with self.lock:
            step = self.known.get(key)
            if step is None:
                step = from_runs(self.ws.runs, self.device_name, sig)
                if step is None and not measure:
                    return "Expected time: no earlier run of this step here."
                if step is None:
                    self.known[key] = "measuring"
                    self._measure(key, shape, batch)
                    step = "measuring"
                else:
                    self.known[key] = step
        if isinstance(step, str):
            where = "the GPU" if self.device.type == "cuda" else "the CPU"
            return (
                f"Expected time: measuring... (a few timed steps on {where})"
                if step == "measuring"
                else f"Expected time: {step}."
            )
        steps, val_batches, read = self._epoch(cfg, batch)
        return Expected(
            step,
            steps,
            val_batches,
            epochs,
            step_samples=batch * cfg.train.grad_accum_steps,
            end_samples=read,
            share=end_share(self.ws.runs, self.device_name),
        )

    def crossval(self, cfg: Config, epochs: int, controls: bool = True, measure: bool = True) -> float | None:
        """The expected time of a cross-validation of `cfg` (commands/crossval.py: each flight the test flight
        once, a model run per fold and, with `controls`, its scalars-only control at CONTROL_SHARE of it): per
        fold, its epochs at its own number of training samples and its end, at the run's epoch time per
        sample. None where the run's own expected time is not known yet."""
        from cloudml_lib.commands.crossval import fold_config

        run = self.of(cfg, epochs, measure)
        samples = self.samples(cfg)
        if not isinstance(run, Expected) or run.epoch_s is None or not run.step_samples or len(samples) < 2:
            return None
        per = run.epoch_s / (run.steps_per_epoch * run.step_samples)  # seconds per sample of an epoch
        total = 0.0
        for held in samples:
            fold = fold_config(cfg, held)
            train, _ = counts_by_role(samples, fold.data)
            seconds = epochs * per * train + end_seconds(per, self.end_samples(fold), run.share[0])
            total += seconds * (1 + (CONTROL_SHARE if controls else 0.0))
        return total

    def samples(self, cfg: Config, count: str = "samples") -> dict[str, int]:
        """The cached samples per flight of the run's data (cached_samples), read once per recheck."""
        root = f"{cfg.data.cache_dir}|{cfg.data.dir}|{count}"
        if root not in self._samples:
            self._samples[root] = cached_samples(cfg, count)
        return self._samples[root]

    def end_samples(self, cfg: Config) -> int:
        """The samples the end of a run of `cfg` reads: every cloud-labelled frame of the validation and test
        data, and of the training part where a cloud probe is fitted on it (science/finish.py)."""
        frames = self.samples(cfg, "cloud_samples")
        train, val = counts_by_role(frames, cfg.data)
        test = sum(k for n, k in frames.items() if n in cfg.data.test_flights)
        return (train if cfg.model.cloud_head == "probe" else 0) + val + test

    def _epoch(self, cfg: Config, batch: int) -> tuple[int | None, int, int]:
        """(training steps per epoch, validation forwards per epoch, the samples the run's end reads) from
        the cached samples."""
        samples = self.samples(cfg)
        if not samples:
            return None, 0, 0
        train, val = counts_by_role(samples, cfg.data)
        steps = math.ceil(math.ceil(train / batch) / cfg.train.grad_accum_steps)
        quick = val * cfg.train.quick_val_fraction
        return steps, math.ceil(quick / eval_batch_size(batch)), self.end_samples(cfg)  # Evaluator's batch

    def _measure(self, key: str, shape: estimate.StepShape, batch: int) -> None:
        def work() -> None:
            try:
                found: StepTime | str = timed(shape, batch, self.device)
            except Exception as e:  # an out-of-memory, a torch that cannot: the FLOPs, or words
                peak = estimate.T4_FP16_FLOPS if T4_NAME in self.device_name else 0.0
                why = str(e).splitlines()[0][:120] if str(e) else ""
                found = from_flops(shape, batch, peak) or f"not measured here ({type(e).__name__}: {why})"
            with self.lock:
                self.known[key] = found
            self.on_ready()

        thread = threading.Thread(target=work, name="cloudml-expected-time", daemon=True)
        self.threads.append(thread)
        _RUNNING.append(thread)
        thread.start()

    def wait(self, timeout: float = 600.0) -> None:
        """Until every measurement started has ended (the tests; a notebook never waits)."""
        for thread in list(self.threads):
            thread.join(timeout)
