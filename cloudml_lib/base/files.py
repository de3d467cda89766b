"""Opening a file the kit reads: never a wait for ever, never a file of unbounded size.

Every file CloudML reads or appends to is a regular file at the moment it is opened: it is opened without
blocking (a FIFO named `metrics.jsonl`, `.lock` or `train.log` would otherwise block the open, or the read,
for ever), and the open descriptor itself is checked (no moment between a check and the open). Files CloudML
writes are never read through a symbolic link where the caller says so (`follow=False`); links to the user's
data files stay readable. A size limit refuses a file too big to be what it should be before it is read.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError


class NotRegularFile(OSError):
    """A path that is not a regular file (a FIFO, a device, a socket, a folder) where one is read."""


def what_is(path: str | Path) -> str | None:
    """What stands at `path` where a regular file should (a FIFO, a socket, a folder...); None when nothing
    does, or a regular file or a symbolic link (links are judged by their callers)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISLNK(mode) else _what(mode)


def _what(mode: int) -> str:
    for test, word in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def open_fd(path: str | Path, flags: int, follow: bool = True, mode: int = 0o644) -> int:
    """A descriptor of `path` opened with `flags`, without blocking, and checked to be a regular file (the
    descriptor is switched back to blocking for the reads and writes that follow)."""
    flags |= os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO opened for writing without blocking, with no reader
            raise NotRegularFile(0, f"{path} is a FIFO (named pipe), not a file", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(0, f"{path} is {_what(st.st_mode)}, not a file", str(path))
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def open_regular(path: str | Path, follow: bool = True):
    """`path` opened for reading bytes, a regular file (streamed reads: hashing, copying)."""
    fd = open_fd(path, os.O_RDONLY, follow)
    with open(fd, "rb") as f:
        yield f


def read_bytes(path: str | Path, limit: int | None = None, follow: bool = True) -> bytes:
    """The whole of a regular file, refused (CloudMLError naming it) when it is over `limit` bytes."""
    with open_regular(path, follow) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise CloudMLError(
                f"{path} is {size:,} bytes, more than such a file can be ({limit:,}): not read"
            )
        if limit is None:
            return f.read()
        data = f.read(size + 1)  # what fstat says, and one more to see growth: never a buffer of `limit`
        while len(data) <= limit and (more := f.read(min(1 << 20, limit + 1 - len(data)))):  # it grew
            data += more
        return data


def read_text(path: str | Path, limit: int | None = None, follow: bool = True) -> str:
    """A regular file's text (UTF-8), refused when over `limit` bytes or not UTF-8."""
    data = read_bytes(path, limit, follow)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CloudMLError(f"{path} is not UTF-8 text (byte {e.start}): not read") from None
