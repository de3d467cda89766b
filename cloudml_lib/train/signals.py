"""A stop asked for by a signal: SIGTERM and a first Ctrl-C stop at the next step boundary, with a
checkpoint; a second Ctrl-C stops at once."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

log = logging.getLogger(__name__)


class StopRequest:
    def __init__(self):
        self.signum: int | None = None

    @property
    def asked(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        if self.signum is None:
            raise RuntimeError("no stop was asked")
        return signal.Signals(self.signum).name

    def ask(self, signum: int = signal.SIGTERM) -> None:
        """A stop decided elsewhere (another process was asked): as if this one had received `signum`."""
        self.signum = self.signum or signum

    @contextmanager
    def trapped(self):
        """Signal handlers for the duration of the loop (only the main thread can install them)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum, frame):
            if self.signum is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signum = signum
            log.info(  # a stop asked for (Ctrl-C, the notebook's stop, a scheduler): nothing is wrong
                "%s received: stopping after the current step with a checkpoint (Ctrl-C again to stop "
                "at once)",
                signal.Signals(signum).name,
            )

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
