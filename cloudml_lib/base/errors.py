"""Exceptions a user can cause, and what a disk error means in words. The CLI prints these as one short
message and exits with status 2; a notebook shows them as a red Problem (colab/show.py)."""

from __future__ import annotations

import errno
from pathlib import Path


class CloudMLError(Exception):
    """A problem the user can fix (config, data, paths); the message says what and how."""


class ConfigError(CloudMLError):
    """A config file or override is invalid."""


class DataError(CloudMLError):
    """A flight file, key or value is missing or unusable."""


class TransientError(CloudMLError):
    """A cause of the moment, not of the settings (a full disk, a folder gone read-only, Drive gone): the same
    work succeeds once it is fixed. A sweep's trial it stops is left to resume, never marked failed."""


class ArgumentTypeError(CloudMLError, TypeError):
    """A Python API argument of the wrong type: the message names the argument (`run_dir=`) and what is
    valid. A TypeError too, as Python's convention is."""


class ArgumentValueError(CloudMLError, ValueError):
    """A Python API argument of the right type and a wrong value (named, with what is valid)."""


ECHO_CHARS = 120  # a value echoed in a message is cut to this; a YAML alias bomb must not become megabytes


def shown(value, limit: int = ECHO_CHARS) -> str:
    """`value` as a message shows it: its repr, bounded in length and depth without walking all of it."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 8
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def in_notebook_session() -> bool:
    """This process is a notebook's kernel, or a command a notebook started (colab/live.py sets
    CLOUDML_PARENT_PID): what the user types goes into a notebook cell."""
    import os
    import sys

    if os.environ.get("CLOUDML_PARENT_PID"):
        return True
    ipython = sys.modules.get("IPython")
    try:
        return ipython is not None and ipython.get_ipython() is not None
    except AttributeError:
        return False


def install_command(requirement: str) -> str:
    """The command that installs an optional package where the user is: `%pip install ...` in a notebook
    cell (it installs into the kernel's own environment), `pip install ...` in a terminal."""
    quoted = f"'{requirement}'" if any(c in requirement for c in "<>=!") else requirement
    return f"{'%pip' if in_notebook_session() else 'pip'} install {quoted}"


# ------------------------------------------------------------------------- disk errors, in words

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY = (errno.EROFS,)
NO_PERMISSION = (errno.EACCES, errno.EPERM)


def _file_in_the_way(path: Path) -> Path | None:
    """The first part of `path` that exists and is a file (where a folder was expected)."""
    for p in [path, *path.parents]:
        if p.exists():
            return p if not p.is_dir() else None
    return None


def explain_os_error(e: OSError, places: dict[str, str] | None = None, resumes: bool = True) -> str | None:
    """A full or read-only disk, a permission, a file where a folder belongs, in words; None for other
    OS errors. Without a file name in the error, `places` (what the command writes to) are named.
    `resumes`: the command continues from a checkpoint (train, crossval) when run again."""
    if e.filename:
        where = str(e.filename)
    else:
        known = [f"{k} {v}" for k, v in (places or {}).items() if v]
        where = "a disk this command writes to (" + (", ".join(known) or "its output folders") + ")"
    again = (
        "then run the same command again: it continues from the last checkpoint, nothing written before is "
        "lost."
        if resumes
        else "then run the same command again; nothing written before is lost."
    )
    if e.errno in DISK_FULL:
        return (
            f"no space left on the disk holding {where} ({e.strerror or e}). Free space there (old runs, "
            f"caches you no longer use), {again}"
        )
    if e.errno in READ_ONLY:
        return (
            f"cannot write {where}: the disk or folder is read-only ({e.strerror}). Make it writable, or "
            f"choose another --run-dir / data.cache_dir, {again}"
        )
    if e.errno in NO_PERMISSION:
        return (
            f"permission denied for {where} ({e.strerror}): this user may not read or write it. Fix its "
            f"permissions (chmod), or choose another --run-dir / data.cache_dir, {again}"
        )
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and e.filename:
        blocker = _file_in_the_way(Path(e.filename))
        if blocker is not None:
            return (
                f"{blocker} is not a folder, but a folder is needed there (for {e.filename}). Point the "
                "setting "
                "that names it (--run-dir, --out, data.cache_dir, data.cache_copy_dir) at a folder, or move "
                "it away."
            )
    if e.errno == errno.EISDIR and e.filename:
        return (
            f"{e.filename} is a folder, but a file is needed there. "
            "Move the folder away or choose another path."
        )
    if e.errno in (errno.ENAMETOOLONG, errno.ELOOP) and e.filename:
        return (
            f"{shown(str(e.filename))}: {e.strerror} (a name of over 255 characters, a path of over 4096, or "
            "symbolic links that point in a circle). Give a shorter path, or fix the links."
        )
    if e.errno == errno.EIO:
        return (
            f"input/output error on {where} ({e.strerror}). On Colab this happens when Google Drive "
            f"disconnects: run the first cells again to remount it, {again}"
        )
    return None
