"""Who may write into a run folder: the lock `RUN_DIR/.lock`, a small JSON file (host, pid, start,
heartbeat) refreshed every 20 s by a background thread. A second trainer is refused while the
holder is alive: same host and its pid exists, or another host whose heartbeat is fresh. A lock left
by a dead runtime (its pid is gone, or its heartbeat is over 90 s old, as after a Colab disconnect)
is taken over with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.files import NotRegularFile
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.liveness import holder_alive
from cloudml_lib.base.shapes import INT, NUM, TEXT, Damaged, Obj, read_json

log = logging.getLogger(__name__)


HEARTBEAT_S, STALE_S = 20.0, 90.0


LOCK = ".lock"


LOCK_LIMIT = 4096  # bytes: a lock is a line of JSON


LOCK_SHAPE = Obj({"host": TEXT, "pid": INT, "started": NUM, "heartbeat": NUM}, required=("host", "pid"))


def read_lock(path: Path) -> dict | None:
    """A lock file's holder ({host, pid, started, heartbeat}); None where it is missing, being written or
    damaged (not JSON, not an object with a host and a pid, nested too deep). A lock that is not a regular
    file (a FIFO, a folder) is refused, naming it: it is waited on by nobody, and not CloudML's to remove."""
    try:
        return read_json(path, LOCK_SHAPE, LOCK_LIMIT)
    except NotRegularFile as e:
        raise CloudMLError(
            f"{e.strerror}: the run lock of this folder is a file CloudML writes. Move it away (it is left "
            "as it is), or choose another folder. Nothing was written."
        ) from None
    except (OSError, Damaged):
        return None


def lock_holder(run: RunLayout) -> str | None:
    """host:pid of a live process holding the run's lock, or None."""
    lock = run.path / LOCK
    if not os.path.lexists(lock):
        return None
    try:
        info = read_lock(lock)
    except CloudMLError:  # not a file (a FIFO): no process holds the run by it
        return None
    return f"{info.get('host')}:{info.get('pid')}" if info and holder_alive(info) else None


def in_use(path: Path, other: dict) -> str:
    """Why `path` (a lock whose holder is alive) refuses: what is waited for, in words that hold."""
    beat = other.get("heartbeat")
    age = f"{time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else "never (an older release)"
    where = f"{path.parent} is in use by another trainer (host {other.get('host')}, pid {other.get('pid')}"
    if other.get("host") == socket.gethostname() and other.get("pid") != 1:
        return (
            f"{where}, a running process of this machine; last heartbeat {age}). Wait for it to finish or "
            "stop it: the lock is taken over once that process has ended. If that process is no CloudML "
            f"trainer (its number given again to another program), delete {path}."
        )
    return (
        f"{where}, last heartbeat {age}). Wait for it to finish or stop it; if that runtime is gone, the "
        f"lock is taken over automatically {STALE_S:.0f} s after its last heartbeat (or delete {path})."
    )


class RunLock:
    def __init__(self, run: RunLayout):
        self.path = run.path / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        return read_lock(self.path)

    def _write(self) -> None:
        tmp = self.path.with_name(f"{LOCK}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(dict(self.me, heartbeat=time.time())))
        os.replace(tmp, self.path)

    def acquire(self) -> None:
        """Take the lock atomically: create it with O_EXCL (one creator wins); a lock whose holder is
        gone is first renamed away (one renamer wins) and checked to be the one judged stale."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        unreadable_since = None
        for _ in range(60):
            if self._create():
                break
            other = self._read()
            if other is None and self.path.exists():  # being created right now, or damaged
                age = time.time() - self._mtime()
                unreadable_since = unreadable_since or time.monotonic()
                if age < STALE_S:
                    if time.monotonic() - unreadable_since < 2.0:
                        time.sleep(0.05)
                        continue
                    raise CloudMLError(
                        f"the run lock {self.path} exists but cannot be read ({self._why_unreadable()}); it "
                        "was written "
                        f"{age:.0f} s ago. If another trainer is starting on this run right now, wait for "
                        "it. If not, "
                        f"delete {self.path}, or wait {STALE_S - age:.0f} s: a damaged lock is taken over "
                        "once it is "
                        f"{STALE_S:.0f} s old."
                    )
            elif other is not None and holder_alive(other):
                raise CloudMLError(in_use(self.path, other))
            if self._take_over(other):
                break
        else:
            raise CloudMLError(f"could not take the run lock {self.path}; another process keeps creating it")
        self._thread = threading.Thread(target=self._beat, name="cloudml-lock", daemon=True)
        self._thread.start()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(dict(self.me, heartbeat=time.time())))
            f.flush()
            os.fsync(f.fileno())
        return True

    def _why_unreadable(self) -> str:
        try:
            read_json(self.path, LOCK_SHAPE, LOCK_LIMIT)
            return "unknown"
        except OSError as e:
            return e.strerror or str(e)
        except Damaged as e:
            return f"not the JSON object a lock holds: {e}"

    def _mtime(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _take_over(self, stale: dict | None) -> bool:
        """Rename the stale lock away, then create ours. If what we renamed is not the lock we judged
        stale (another process took over in between), put it back and let the caller look again."""
        aside = self.path.with_name(f"{LOCK}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = read_lock(aside)
        if moved != stale:
            try:
                os.link(aside, self.path)  # fails if a lock exists again: then that one stands
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        if stale is not None:
            beat = stale.get("heartbeat")
            log.warning(
                "Taking over the run lock left by host %s, pid %s (last heartbeat %s; that process is gone)",
                stale.get("host"),
                stale.get("pid"),
                f"{time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else "never",
            )
        return self._create()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except OSError as e:
                log.warning("could not refresh the run lock (%s)", e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = self._read()
        if current and current.get("pid") == self.me["pid"] and current.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)
