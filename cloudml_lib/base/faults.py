"""Fault injection for the tests: nothing in here runs unless CLOUDML_KILL_AT is set.

CLOUDML_KILL_AT="name:n[:SIGNAL]" sends this process SIGKILL (or SIGNAL) the n-th time the point `name` is
reached. Points: "start" (`python -m cloudml_lib` before anything is imported), "setup" (the trainer's set-up
begins), "cache-block" (a block of frames written to a cache being built), "step" (after each optimizer step;
a checkpoint still being written is committed first, so which one a resume finds never races the writer's
thread: the kills inside a write are the next two), "commit-copied" (state.pt copied, no manifest yet),
"commit-renamed" (folder in place, no commit marker yet), "committed" (a checkpoint written whole, in the
writer's thread), "probe-fitted" (the run is trained and its cloud probe is in best.pt, its evaluation not
written), "end-written" (every file of the run's end is written but evaluation.json and report.md),
"sweep-told" (a sweep trial's result is in the local study, its copy in the sweep folder not refreshed).
Under torchrun, CLOUDML_KILL_RANK=r limits it to the process of rank r. CLOUDML_KILL_ONCE=PATH limits it to
one process of all that share the variable (a trial pool's workers): the first to create PATH."""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def point(name: str, settle=None) -> None:
    """A fault point: returns at once unless CLOUDML_KILL_AT names it (and this process's rank); `settle()`
    runs just before this point's own kill."""
    spec = os.environ.get("CLOUDML_KILL_AT")
    if not spec or os.environ.get("CLOUDML_KILL_RANK", os.environ.get("RANK", "0")) != os.environ.get(
        "RANK", "0"
    ):
        return
    where, n, sig = (spec.split(":") + ["", ""])[:3]
    if where != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(n or 1):
        if not _first_of_all(os.environ.get("CLOUDML_KILL_ONCE")):
            return
        if settle is not None:
            settle()
        os.kill(os.getpid(), getattr(signal, sig) if sig else signal.SIGKILL)


def _first_of_all(path: str | None) -> bool:
    """Whether this process is the first to reach here of all those given `path` (None: every one is)."""
    if not path:
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def at_start() -> None:
    """The "start" point, whose default signal is SIGINT: a stop before the library is imported."""
    spec = os.environ.get("CLOUDML_KILL_AT", "")
    if spec.startswith("start:"):
        os.kill(os.getpid(), getattr(signal, (spec + "::SIGINT").split(":")[2] or "SIGINT"))
