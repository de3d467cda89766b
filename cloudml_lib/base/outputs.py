"""How result files are written: atomically, and with the file named in any disk error.

JSON for the user is `json_safe` first: NaN and infinity become null, which every JSON reader accepts.
Every file a command writes for the user (evaluation.json, predictions.csv, report.md, plots,
NetCDF, crossval.md, run.json, config.yaml) goes through `atomic_path`: it is written under a
hidden temporary name in its own folder and renamed into place only when complete, so a full
disk or a kill never leaves a 0-byte or half-written file where a good one was expected, and the
temporary file is removed on failure. An OSError raised without a file name (a `write()` on a
full disk says only "No space left on device") gets the final path attached, so the message a
user sees always names the file. Checkpoints have their own commit protocol (checkpoint.py).

A file a command writes is never written through a symbolic link: a link found where one of its files
belongs (metrics.jsonl, train.log, run.json, best.pt, evaluation.json, a prediction, ...) is refused,
naming it, and its target is left untouched (`refuse_link`; appends open with O_NOFOLLOW, and only a regular
file: a FIFO is refused, never waited on). Which folders a command may write into is ownership.py's; within a
claimed folder, a file that exists is replaced or appended to only where the folder's ledger lists it as
CloudML's (ledger.py), and each file written is listed there.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError

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
    """Yields a temporary path beside `path`; renamed to `path` when the block ends without error, its size
    and sha256 recorded in the folder's ledger. Where `path` is CloudML's by name but was changed since
    CloudML wrote it (damaged on Drive, or edited), it is first renamed NAME.kept-N, its bytes as they are,
    and said (`set_aside`; a document for people goes beside it instead: `target`). A file CloudML did not
    write is refused, naming it."""
    from cloudml_lib.base import ledger

    path = Path(path)
    refuse_link(path)
    set_aside(path)
    ledger.refuse_unless_mine(path, "replace")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if os.path.lexists(tmp):  # a leftover, or a link: the writer must create a file of its own
            tmp.unlink()
        yield tmp
        # listed (with what it holds) first: a kill between the two never leaves a file of CloudML's unlisted
        ledger.add(path, content=tmp)
        os.replace(tmp, path)  # replaces a name, never writes through one
    except OSError as e:
        raise named(e, path) from None
    except RuntimeError as e:
        free = free_bytes(path.parent)
        if free is not None and free < NEARLY_FULL_BYTES:  # a library's disk error in other words
            raise OSError(errno.ENOSPC, f"No space left on device ({e})", str(path)) from None
        raise
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


_said_aside: set[str] = set()


def target(path: str | Path) -> Path:
    """Where a document for people (report.md, crossval.md, a model card) is written: `path`, or where a
    user edited it since CloudML wrote it, NAME.new.EXT beside it (the edited file kept; said once)."""
    import logging

    from cloudml_lib.base import ledger

    path = Path(path)
    if not ledger.changed(path):
        return path
    new = path.with_name(f"{path.stem}.new{path.suffix}")
    if str(path) not in _said_aside:
        _said_aside.add(str(path))
        logging.getLogger(__name__).warning(
            "%s was edited after CloudML wrote it: it is kept as it is, and the new one is %s (move or "
            "delete the edited file to have CloudML write %s again).",
            path,
            new,
            path.name,
        )
    return new


def set_aside(path: str | Path) -> Path | None:
    """A file CloudML writes again (evaluation.json, run.json, a sweep's journal) that was changed since
    CloudML wrote it (damaged, or edited): renamed to NAME.kept-N beside it, its bytes as they are, and said
    (ledger.set_aside_changed, the rule a bucket's objects follow too); the new file then takes the name.
    Returns the new name, or None where nothing needed to move."""
    from cloudml_lib.base import ledger

    place = ledger.place_of(path) if ledger.changed(path) else None
    if place is None:
        return None
    store, rel = place
    kept = ledger.set_aside_changed(store, [rel])
    return store.at(kept[0]) if kept else None


def write_text(path: str | Path, text: str) -> Path:
    """`text` written atomically to `path`; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def append_text(path: str | Path, text: str) -> None:
    """Append to a log-like file (metrics.jsonl); a failure names the file."""
    try:
        with open_append(path) as f:
            f.write(text)
    except OSError as e:
        raise named(e, path) from None


class Appending:
    """A text file CloudML appends to: each write is flushed and kept in the ledger's fingerprint of the
    file (its size and the sha256 of what CloudML wrote), so that a later start knows the file is still
    CloudML's without reading it again at every line."""

    def __init__(self, path: str | Path, f):
        self.path, self._f = path, f

    def write(self, text: str) -> int:
        from cloudml_lib.base import ledger

        n = self._f.write(text)
        self._f.flush()  # on disk before its fingerprint: a ledger written meanwhile never records more
        ledger.appended(self.path, text.encode("utf-8"), os.fstat(self._f.fileno()).st_size)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def refuse_link(path: str | Path) -> None:
    """A file a command writes must not be a symbolic link: writing through it would change a file outside
    the folder (truncate it, append to it). The link is named and left as it is, and so is its target."""
    path = Path(path)
    if path.is_symlink():
        raise CloudMLError(
            f"{path} is a symbolic link (to {os.readlink(path)}), where CloudML writes a file of its own; it "
            "never writes through a link, which would change a file outside the folder. Remove the link "
            f"(rm '{path}'; its target is not touched) or choose another folder. Nothing was written to it."
        )


def refuse_special(path: str | Path) -> None:
    """A file a command writes must be a regular file, or nothing yet: a FIFO, a socket or a device there
    would block the command for ever or receive what it writes, and a folder there is not its file. It is
    named and left as it is."""
    from cloudml_lib.base.files import what_is

    what = what_is(path)
    if what is not None:
        raise CloudMLError(
            f"{path} is {what}, where CloudML writes a file of its own. Move it away (it is left as it is) "
            "or choose another folder. Nothing was written."
        )


def open_append(path: str | Path):
    """`path` opened for appending text (created if missing), never through a symbolic link (O_NOFOLLOW:
    no moment between a check and the open), and only a regular file: a FIFO named metrics.jsonl or
    train.log is refused at once, never waited on (files.open_fd checks the open descriptor)."""
    from cloudml_lib.base import ledger
    from cloudml_lib.base.files import NotRegularFile, open_fd

    refuse_link(path)  # where O_NOFOLLOW does not exist (Windows)
    ledger.refuse_unless_mine(path, "append to or truncate")
    if not os.path.lexists(path):
        ledger.add(path)  # listed before it exists (a kill between the two leaves nothing unlisted)
    ledger.appending(path)  # its fingerprint, from what it holds now
    try:
        fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, follow=False)
    except NotRegularFile as e:
        raise CloudMLError(
            f"{e.strerror}: CloudML appends its records to a file of its own there. Move it away (it is left "
            "as it is), or choose another folder. Nothing was written to it."
        ) from None
    except OSError as e:
        if Path(path).is_symlink():  # ELOOP: a link appeared since
            refuse_link(path)
        raise named(e, path) from None
    return Appending(path, os.fdopen(fd, "a", encoding="utf-8"))


def json_safe(obj):
    """NaN and infinity (e.g. R2 of a constant target) become null, which every JSON reader accepts."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
