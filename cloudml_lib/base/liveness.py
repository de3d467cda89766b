"""Whether the process that wrote a lock or a temporary folder is still running: on this host its pid
tells; on another host (a new Colab VM on the same Drive) only a heartbeat fresher than STALE_S. The run
lock (core/run/runlock.py), the checkpoint writer's leftovers and the cache's build folders all judge by this
one rule. And whether a worker process is moving: `beat()` at each step of work (a training step, an
evaluation), read by the process that handed it the work (commands/trialpool.py), which names a worker
that has gone quiet and stops one frozen."""

from __future__ import annotations

import os
import socket
import time

HEARTBEAT_S, STALE_S = 20.0, 90.0


PID_MAX = 2**22  # Linux's largest pid_max; 0 and negative numbers name process groups, never one process


def valid_pid(pid) -> bool:
    """Could `pid` be one process's number (a whole number from 1 to PID_MAX)?"""
    return isinstance(pid, int) and not isinstance(pid, bool) and 1 <= pid <= PID_MAX


def process_alive(pid: int) -> bool:
    """Is process `pid` of this host running (a pid we may not signal counts as running)? A number no process
    can have (0 and -1 signal groups of processes; 2**31 and above overflow) is no running process, and nor
    is a process that has ended but was not yet reaped (a zombie, as a killed trainer is until the system's
    first process collects it): it can write nothing more."""
    if not valid_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return process_state(pid) not in ("Z", "X")


def stat_fields(pid: int) -> list[bytes]:
    """Process `pid`'s fields in Linux's /proc/PID/stat after its command name (which may hold spaces): the
    state letter first (field 3). OSError where there is no such file."""
    with open(f"/proc/{int(pid)}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def process_state(pid: int) -> str | None:
    """Process `pid`'s state letter where the system says (Linux's /proc: R running, S sleeping, Z ended and
    not yet reaped, ...); None elsewhere or when it cannot be read."""
    try:
        return stat_fields(pid)[0].decode("ascii", "replace")
    except (OSError, IndexError):
        return None


def process_started(pid: int) -> float | None:
    """When process `pid` of this host started (epoch seconds), where the system says (Linux's /proc);
    None elsewhere or when it cannot be read."""
    try:
        fields = stat_fields(pid)
        with open("/proc/stat", "rb") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start, in ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


PID_REUSE_SLACK_S = 5.0  # /proc's boot time is whole seconds; a lock is written after its process starts


def holder_alive(info: dict) -> bool:
    """Is the process that wrote this lock still running? Same host: its pid tells, unless a process that
    started after the lock was written holds that pid now (the writer died and the number was given again:
    a restarted Colab VM does). Another host (a new Colab VM on the same Drive): only a heartbeat fresher
    than STALE_S. Pid 1 is the system's first process (or a container's own command), never known to have
    written a lock: it holds one only while the lock's heartbeat is fresh, as another host's would."""
    if info.get("host") == socket.gethostname():
        pid = info.get("pid")
        if pid == os.getpid() or not process_alive(pid):
            return False
        if pid == 1:
            return heartbeat_fresh(info)
        started, written = process_started(pid), info.get("started")
        if (
            started is not None
            and isinstance(written, (int, float))
            and started > written + PID_REUSE_SLACK_S
        ):
            return False  # another process under a reused pid
        return True
    return heartbeat_fresh(info)


def heartbeat_fresh(info: dict) -> bool:
    beat = info.get("heartbeat")
    return isinstance(beat, (int, float)) and not isinstance(beat, bool) and time.time() - beat < STALE_S


_progress = None  # a shared double (multiprocessing's RawValue) this process's beats go to; None: nowhere


def report_progress_to(slot) -> None:
    """From now on, `beat()` writes the time into `slot` (a worker's, read by its owner)."""
    global _progress
    _progress = slot


def beat() -> None:
    """This process made progress now (a training step, an evaluation): cheap, and nothing where no owner
    watches."""
    if _progress is not None:
        _progress.value = time.time()
