"""TensorBoard event files of a run: written on local disk, committed to `RUN_DIR/tensorboard/` with
each checkpoint, continued without repeated steps after a resume.

Why local first: an event file grows by small appends, each a round trip on Google Drive, and a kill
mid-append leaves half a record there. Here the writer appends to a file in the checkpoint writer's
local folder; at each checkpoint the files are flushed and copied whole (temporary file, then rename)
into the run folder, *before* the checkpoint itself is committed. So the run folder never lacks a step
that a checkpoint has: a kill between the two leaves events ahead of the resume point, never behind.

Resume: each start writes a new event file. A resumed one begins with TensorBoard's purge marker at
the first step after the resume point (`purge_step`), so TensorBoard drops the older files' values from
that step on (those of the steps being trained again) and every curve holds one value per step.
A fresh start removes event files a previous attempt left without a checkpoint.

TensorBoard reads a folder's event files in the order of their names, and a purge applies to the files
read before it: so the run folder names each start's file by the nanosecond it began (torch names it by
the second and the process id, and two starts in the same second, the later one in a process with a lower
id, were read the wrong way round: the resumed file's purge marker came first and the curves lost steps).

The `tensorboard` package is optional: without it nothing is written and the run says how to enable it.
Only rank 0 writes; elsewhere every method does nothing.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from cloudml_lib.base import ledger
from cloudml_lib.base.errors import install_command
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.outputs import atomic_path

log = logging.getLogger(__name__)

EVENTS_DIR = RunLayout.TENSORBOARD


def has_tensorboard() -> bool:
    """The package torch.utils.tensorboard writes with (found, not imported: it is slow to import)."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def events_dir(run: RunLayout) -> Path:
    return run.path / EVENTS_DIR


class Events:
    """One start's event file. `start_step`: the resume point's step (0 for a fresh run)."""

    def __init__(self, run: RunLayout, local_dir: Path | None, start_step: int, fresh: bool):
        self.run, self.writer, self.enabled = run, None, False
        if local_dir is None:  # not rank 0
            return
        if not has_tensorboard():
            log.info(
                "TensorBoard curves are off: the tensorboard package is not installed. To have them, run "
                "`%s` and start the run again (it resumes); metrics.jsonl and the live curves work "
                "without it.",
                install_command("tensorboard"),
            )
            return
        if fresh:  # a previous attempt's files, never checkpointed (only those CloudML wrote: ledger.py)
            ledger.delete(events_dir(self.run))
        self.local, self.enabled = Path(local_dir) / EVENTS_DIR, True
        # TensorBoard discards what older files hold from this step on: those steps are trained again
        self.purge_step = None if fresh else start_step + 1
        self.started_ns = time.time_ns()  # names this start's files in the run folder (sorted after earlier)

    def _writer(self):
        """The SummaryWriter, made at the first value (a finished run opened again leaves no empty file)."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.local.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(self.local), purge_step=self.purge_step, flush_secs=30)
        return self.writer

    def scalars(self, step: int, values: dict) -> None:
        """Each finite number in `values` under its tag (e.g. "train/loss")."""
        if not self.enabled:
            return
        for tag, value in values.items():
            if isinstance(value, (int, float)) and value == value and abs(value) != float("inf"):
                self._writer().add_scalar(tag, float(value), step)

    def epoch(self, record: dict, memory: str, compiled: str) -> None:
        """An epoch's validation metrics, its training loss and learning rate; the memory and compile
        facts."""
        self.scalars(
            record["step"],
            {
                "val/loss": record["val_loss"],
                "val/r2": record["r2"],
                "val/mae_km": record["mae_km"],
                "val/rmse_km": record["rmse_km"],
                "val/cloud_accuracy": record["cloud_accuracy"],
                "train/epoch_loss": record["train_loss"],
                "epoch/lr": record["lr"],
                "epoch/time_s": record["time_s"],
            },
        )
        self.text(record["step"], "memory", memory)
        self.text(record["step"], "compile", compiled)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self._writer().add_text(tag, text, step)

    def image(self, step: int, tag: str, pixels) -> None:
        """A figure of the run (the evaluation scatter, as science/plots.py reads it: height x width x RGB,
        floats in 0..1) shown in TensorBoard's images tab."""
        if self.enabled:
            self._writer().add_image(tag, pixels, step, dataformats="HWC")

    def mark(self) -> dict[str, int]:
        """Flush, and the size of each local event file now: what the next commit copies (the files only
        grow)."""
        if self.writer is None:
            return {}
        self.writer.flush()
        return {p.name: p.stat().st_size for p in self.local.glob("events.out.tfevents.*")}

    def commit(self, marks: dict[str, int]) -> None:
        """Copy each file's first `marks[name]` bytes into RUN_DIR/tensorboard (atomic per file)."""
        if not marks:
            return
        target = events_dir(self.run)
        target.mkdir(parents=True, exist_ok=True)
        for name, size in marks.items():
            with open(self.local / name, "rb") as src:
                data = src.read(size)
            with atomic_path(target / self.committed_name(name)) as tmp:
                Path(tmp).write_bytes(data)

    def committed_name(self, local: str) -> str:
        """A local file's name in the run folder: torch's `events.out.tfevents.<second>.<host>.<pid>.<n>`
        with the start's nanosecond in place of its second, so that the names sort as the starts began (an
        earlier release's files, named by the second, sort before: their second's digits end where these go
        on)."""
        prefix = "events.out.tfevents."
        rest = (
            local[len(prefix) :].split(".", 1)[1]
            if local.startswith(prefix) and "." in local[len(prefix) :]
            else local
        )
        return f"{prefix}{self.started_ns:019d}.{rest}"

    def close(self) -> None:
        """Commit everything written (a stop after the last checkpoint: a resume purges what is ahead)."""
        if self.writer is None:
            return
        try:
            self.commit(self.mark())
        except OSError as e:
            log.warning(
                "TensorBoard events could not be copied to %s (%s); the curves up to the last checkpoint "
                "are there.",
                events_dir(self.run),
                e,
            )
        self.writer.close()
        self.writer = None


FINAL_EVENTS = "events.out.tfevents.final"  # the end of a run's values, one file replaced whole


def write_final_events(run: RunLayout, step: int, scalars: dict, images: dict) -> None:
    """The end of a run's TensorBoard values (the test metrics as final/* scalars, the scatter figure) at
    the trained step, in a file of their own in RUN_DIR/tensorboard: written locally, then copied whole, so
    that an end run again replaces it instead of adding a second point."""
    if not has_tensorboard():
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        events = Events(run, Path(tmp), step, fresh=False)
        events.purge_step = None  # nothing of the training's files is dropped
        events.scalars(step, scalars)
        for tag, pixels in images.items():  # {tag: height x width x RGB}, drawn by the science layer
            events.image(step, tag, pixels)
        if events.writer is None:
            return
        events.writer.close()
        (written,) = (Path(tmp) / EVENTS_DIR).glob("events.out.tfevents.*")
        target = events_dir(run)
        target.mkdir(parents=True, exist_ok=True)
        with atomic_path(target / FINAL_EVENTS) as out:
            Path(out).write_bytes(written.read_bytes())
