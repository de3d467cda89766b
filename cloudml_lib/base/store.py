"""Where a folder CloudML claims lies: a folder on this machine (`Folder`) or a bucket's prefix
(bucket.py's `Prefix`, through fsspec). The ownership rules are written once against this interface: the
marker and its claim (ownership.py), and the record of what CloudML wrote with its judgement of a path
(ledger.py: listed or not, changed since or not, a changed one kept aside as NAME.kept-N). A store answers
only questions of storage (does it exist, how big, its sha256, read and write a small JSON whole, keep a file
aside, a lock); what they mean for ownership is the rules' business.

What differs between the two is stated by the store, not by a second copy of the rules:
- `adopts`: whether content may prove a place CloudML's without a marker (an earlier release's folder);
  no earlier release wrote to a bucket, so a prefix never is, and its lost record is made again empty.
- `locked()`: processes of one machine take turns on a folder's record (an advisory lock); an object store
  has no lock, so two sessions adding at one moment may lose an entry (CloudML then refuses, later, to
  replace it: the safe side).
- `keep_aside`: a rename on a folder; on a bucket a whole copy (its objects have no rename), checked.
"""

from __future__ import annotations

import hashlib
import os
import stat
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from pathlib import Path

from cloudml_lib.base.errors import shown
from cloudml_lib.base.shapes import Damaged, read_json

_held: set[int] = set()  # descriptors of the folder locks this process holds now


def _close_inherited_locks() -> None:
    """In a child forked while a thread held a folder's lock (DataLoader or preprocessing workers forked
    beside the checkpoint writer's ledger update): its copy of the descriptor is closed, so that the lock is
    released when the parent's update ends, not when the child exits."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class Store(ABC):
    """A claimed folder's storage: paths in it are `rel` (relative, with `/`); "" is the folder itself."""

    noun = "folder"  # what the place is called in messages ("folder", "prefix")
    things = "things"  # what it holds ("things", "objects")
    item = "file"  # one of them ("file", "object")
    adopts = True  # whether content that verifies proves it CloudML's without a marker (see the module)
    # a folder on this machine: this process's thread lock and its appends' fingerprints apply to it
    # (ledger.py), and a file of it that cannot be read is unreadable, not the store's own failure
    local = False

    def key(self, rel: str) -> str | None:
        """`rel`'s key among the files this process appends to (its absolute path); None off this machine."""
        return None

    @property
    @abstractmethod
    def place(self) -> str:
        """What a marker and a ledger record as the place they were written for."""

    def is_here(self, recorded: str | None) -> bool:
        """Whether a marker's or ledger's recorded place is this one."""
        return recorded is not None and recorded == self.place

    @abstractmethod
    def shown(self, rel: str = "") -> str:
        """`rel` as a message names it (a path, a URL)."""

    @abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether something lies at `rel` itself (a link too, not followed)."""

    def holds(self, rel: str) -> bool:
        """Whether anything lies at `rel` or under it."""
        return self.exists(rel)

    @abstractmethod
    def names(self) -> list[str]:
        """The names directly in the folder."""

    @abstractmethod
    def file_size(self, rel: str) -> int | None:
        """The size of the regular file (the object) at `rel`; None where something else lies there (a link,
        a folder); OSError where nothing does. One call: a log's appends ask it at every line."""

    @abstractmethod
    def sha256(self, rel: str, size: int | None = None) -> str | None:
        """The sha256 (hex) of the first `size` bytes at `rel` (all where None); None where it is shorter."""

    @abstractmethod
    def read_json(self, rel: str, shape, limit: int):
        """A small JSON file of the folder (a marker, a ledger), parsed as `shape`. shapes.Damaged: it is not
        that file (too big, not that shape, on a folder not a regular file or unreadable); OSError only for
        the store's own failure (a bucket client's connection or credentials), which says nothing of it."""

    @abstractmethod
    def write_text(self, rel: str, text: str) -> None:
        """`text` written whole at `rel` (never half a file where the store can rename)."""

    @abstractmethod
    def make(self) -> None:
        """The folder made where it is not yet (an object store's prefix exists by its objects)."""

    def unusable(self, kind_name: str) -> str | None:
        """Why the place cannot be a folder of CloudML's at all (words after its name), or None."""
        return None

    @abstractmethod
    def keep_aside(self, rel: str, aside: str) -> None:
        """The file at `rel` kept, its bytes as they are, under the free name `aside`; OSError leaves `rel` as
        it was (and no part of `aside`)."""

    def locked(self):
        """The folder's record held by this process while it is read and written again."""
        return nullcontext()


class Folder(Store):
    """A folder on this machine."""

    local = True

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"Folder({str(self.path)!r})"

    @property
    def place(self) -> str:
        """A digest of the folder's absolute path (`..` and links resolved): it binds a marker to the folder
        it was written in without naming a path of the writer's machine (a run travels with its marker)."""
        real = os.path.realpath(os.path.abspath(self.path))
        return "sha256:" + hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()

    def is_here(self, recorded: str | None) -> bool:
        """Today's digest, or the plain path an earlier release recorded."""
        return recorded in (self.place, os.path.realpath(os.path.abspath(self.path)))

    def key(self, rel: str) -> str | None:
        return os.path.abspath(self.at(rel))

    def at(self, rel: str) -> Path:
        return self.path / rel if rel else self.path

    def shown(self, rel: str = "") -> str:
        return str(self.at(rel))

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.at(rel))

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir())

    def file_size(self, rel: str) -> int | None:
        st = os.lstat(self.at(rel))
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def sha256(self, rel: str, size: int | None = None) -> str | None:
        h = sha256_of(self.at(rel), size)
        return None if h is None else h.hexdigest()

    def read_json(self, rel: str, shape, limit: int):
        try:
            return read_json(self.at(rel), shape, limit)  # a regular file only, never through a link
        except OSError as e:
            raise Damaged(str(e)) from None

    def write_text(self, rel: str, text: str) -> None:
        """Temporary file, then rename (a link there is replaced, never written through)."""
        path = self.at(rel)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            if os.path.lexists(tmp):
                tmp.unlink()
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                tmp.unlink()

    def make(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def unusable(self, kind_name: str) -> str | None:
        if self.path.is_symlink() and not self.path.exists():
            return (
                f"is a symbolic link to {shown(os.readlink(self.path))}, which does not exist (or is a loop "
                "of links); give a real folder"
            )
        if not self.path.is_dir():
            return f"is not a folder, but a folder is needed there (for the {kind_name})"
        return None

    def keep_aside(self, rel: str, aside: str) -> None:
        os.rename(self.at(rel), self.at(aside))  # a rename never replaces, truncates or deletes its bytes

    @contextmanager
    def locked(self):
        """An advisory lock on the folder (flock), so that processes of one machine writing into it
        (cross-validation folds under torchrun) never lose each other's entries; where the file system has
        no such locks (some network mounts), none."""
        try:
            import fcntl

            fd = os.open(self.path, os.O_RDONLY)
        except (ImportError, OSError):
            yield
            return
        _held.add(fd)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass
            yield
        finally:
            _held.discard(fd)
            os.close(fd)  # closing the descriptor releases the lock


def sha256_of(path: str | Path, size: int | None = None):
    """The sha256 (a hashlib object) of `path`'s first `size` bytes (all where None); None where shorter."""
    with open(path, "rb") as f:
        return sha256_read(f, size)


def sha256_read(f, size: int | None = None):
    """The sha256 (a hashlib object) of the first `size` bytes (all where None) read from the open binary
    file `f`; None where it ends sooner."""
    h, left = hashlib.sha256(), size
    while left is None or left > 0:
        chunk = f.read(1 << 20 if left is None else min(left, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        if left is not None:
            left -= len(chunk)
    return None if left else h
