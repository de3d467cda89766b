"""Whether the process that wrote a lock or a temporary folder is still running: on this host its pid
tells; on another host (a new Colab VM on the same Drive) only a heartbeat fresher than STALE_S. The run
lock (core/runlock.py), the checkpoint writer's leftovers and the cache's build folders all judge by this
one rule."""

from __future__ import annotations

import os
import socket
import time

HEARTBEAT_S, STALE_S = 20.0, 90.0


def process_alive(pid: int) -> bool:
    """Is process `pid` of this host running (a pid we may not signal counts as running)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_alive(info: dict) -> bool:
    """Is the process that wrote this lock still running? Same host: its pid tells. Another host
    (a new Colab VM on the same Drive): only a heartbeat fresher than STALE_S."""
    if info.get("host") == socket.gethostname():
        pid = int(info.get("pid", -1))
        return pid != os.getpid() and process_alive(pid)
    return time.time() - float(info.get("heartbeat", 0)) < STALE_S
