"""How result files are written: atomically, and with the file named in any disk error.

JSON for the user is `json_safe` first: NaN and infinity become null, which every JSON reader accepts.
Every file a command writes for the user (evaluation.json, predictions.csv, report.md, plots,
NetCDF, crossval.md, run.json, config.yaml) goes through `atomic_path`: it is written under a
hidden temporary name in its own folder and renamed into place only when complete, so a full
disk or a kill never leaves a 0-byte or half-written file where a good one was expected, and the
temporary file is removed on failure. An OSError raised without a file name (a `write()` on a
full disk says only "No space left on device") gets the final path attached, so the message a
user sees always names the file. Checkpoints have their own commit protocol (checkpoint.py).
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

# HDF5-based writers may report a full disk as RuntimeError("NetCDF: HDF error"); below this much free
# space such an error is taken to be a full disk.
NEARLY_FULL_BYTES = 64 << 20


def named(e: OSError, path: str | Path) -> OSError:
    """The same error, naming `path` when it named no file."""
    if e.filename:
        return e
    return type(e)(e.errno, e.strerror or str(e), str(path))


def free_bytes(path: str | Path) -> int | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@contextmanager
def atomic_path(path: str | Path):
    """Yields a temporary path beside `path`; renamed to `path` when the block ends without error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        raise named(e, path) from None
    except RuntimeError as e:
        free = free_bytes(path.parent)
        if free is not None and free < NEARLY_FULL_BYTES:  # a library's disk error in other words
            raise OSError(errno.ENOSPC, f"No space left on device ({e})", str(path)) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def append_text(path: str | Path, text: str) -> None:
    """Append to a log-like file (metrics.jsonl); a failure names the file."""
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        raise named(e, path) from None


def json_safe(obj):
    """NaN and infinity (e.g. R2 of a constant target) become null, which every JSON reader accepts."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
