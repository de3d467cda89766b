"""The package's log: every module logs through `logging.getLogger(__name__)` under "cloudml_lib"; this
module decides where those lines go: the console (without breaking a progress bar) and, for a run,
RUN_DIR/train.log (a full disk said once, in words).

On the console a warning starts with "Warning: " and an error with "Problem: " (level_word): the notebook
runs each command as a subprocess and reads its lines, and the level word is how it tells a warning (amber)
or a problem (red) from progress, whatever the message says. train.log keeps logging's own level names."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from tqdm.auto import tqdm
from tqdm.std import TqdmDefaultWriteLock
from tqdm.std import tqdm as tqdm_base

from cloudml_lib.base.layout import RunLayout

PACKAGE_LOGGER = "cloudml_lib"
# The word a console line starts with: a warning's, an error's (INFO and below: none). live.py reads them.
WARNING_WORD, PROBLEM_WORD = "Warning: ", "Problem: "


def level_word(levelno: int) -> str:
    return PROBLEM_WORD if levelno >= logging.ERROR else WARNING_WORD if levelno >= logging.WARNING else ""


class _ConsoleFormatter(logging.Formatter):
    """The message, after its level word for a warning or an error (only the first line of a multi-line
    message carries it: a table under it stays aligned)."""

    def format(self, record: logging.LogRecord) -> str:
        return level_word(record.levelno) + super().format(record)


class _TqdmHandler(logging.StreamHandler):
    """Console lines that do not break a running progress bar."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)

    def handleError(self, record):
        pass  # the console is gone (a closed pipe): there is no one to tell


def _console_lock_of_its_own() -> None:
    """In a forked child (a DataLoader worker, a forked run): tqdm's console lock is a lock of the child's
    own. tqdm's default lock pairs a thread lock with a cross-process semaphore that a fork shares with its
    parent: a child killed while it held it (SIGKILL, the kernel's out-of-memory killer) left it held for
    good, and the parent's next log line or progress bar waited forever; a thread lock another thread held
    at the fork stays held in the child's copy. A user's own workers that pass tqdm's lock on (tqdm's
    `initializer=tqdm.set_lock, initargs=(tqdm.get_lock(),)`) still share it: their initializer runs after
    this."""
    TqdmDefaultWriteLock.mp_lock = None  # a lock made from now on: the thread lock alone
    TqdmDefaultWriteLock.th_lock = threading.RLock()
    classes = [tqdm_base]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "_lock" in vars(cls):  # a lock tqdm made in the parent (get_lock sets it on the class asked)
            cls.set_lock(TqdmDefaultWriteLock())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_console_lock_of_its_own)


class _RunLogFile(logging.FileHandler):
    """train.log. A line that cannot be written (a full disk) is said once on screen, in words, instead
    of logging's "--- Logging error ---" traceback at every line; the run goes on, and so does the log
    on screen. Once writing works again (space freed), the file continues."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.failing, self._failed_now = False, False

    def _open(self):
        from cloudml_lib.base.outputs import open_append

        return open_append(self.baseFilename)  # never through a symbolic link (refused, naming it)

    def close(self):
        from cloudml_lib.base import ledger

        super().close()
        ledger.flush()  # the log's fingerprint (what CloudML wrote in it) into its folder's ledger

    def emit(self, record):
        self._failed_now = False
        super().emit(record)
        if not self._failed_now:
            self.failing = False

    def handleError(self, record):
        self._failed_now = True
        if self.failing:
            return
        self.failing = True
        e = sys.exc_info()[1]
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        print(
            f"warning: {self.baseFilename} cannot be written ({why}); the log continues on screen only. "
            "Free space on that disk to keep the file complete.",
            file=sys.stderr,
            flush=True,
        )


def attach_run_log(
    run: RunLayout | None = None, console=None, screen: logging.Handler | None = None
) -> logging.Logger:
    """The package logger prints to the console and, with a run directory, to train.log.

    It does not propagate: Colab's root logger already has a handler, which would print twice.
    `console` is the stream for screen lines (default stdout); `screen`, a handler of its own for them (the
    notebook's: colab/live.py NotebookLog, which says the level word itself).
    """
    logger = logging.getLogger(PACKAGE_LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handlers = []
    if run is not None:  # first: a train.log that cannot be opened leaves the console's handler as it was
        file = _RunLogFile(run.log)
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        handlers.append(file)
    for h in [h for h in logger.handlers if getattr(h, "_cloudml", False)]:
        logger.removeHandler(h)
        h.close()
    if screen is None:
        screen = _TqdmHandler(console or sys.stdout)
        screen.setFormatter(_ConsoleFormatter("%(message)s"))
    handlers.insert(0, screen)
    for h in handlers:
        h._cloudml = True
        logger.addHandler(h)
    return logger


def to_run_log(message: str, level: int = logging.ERROR) -> bool:
    """`message` into the attached train.log only (the console has said it already, e.g. the CLI's
    "error: ..." line): a failure the notebook shows is in the run's own log too. Returns whether a run log
    was attached."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    files = [h for h in logger.handlers if isinstance(h, _RunLogFile)]
    if files:
        record = logger.makeRecord(logger.name, level, __file__, 0, "%s", (message,), None)
        for h in files:
            h.handle(record)
    return bool(files)
