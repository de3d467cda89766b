"""What CloudML wrote in a folder of its own: the record every deletion, truncation and overwrite obeys.

A folder CloudML claims (ownership.py: its `.cloudml` marker) keeps beside the marker a ledger,
`.cloudml-files`: the paths, relative to the folder, of every file and folder CloudML created there. A path
is CloudML's when it, or a folder above it inside the claimed folder, is listed. Before a command replaces,
truncates, appends to or deletes a path that exists, it asks `mine`; anything not listed (a user's notes,
another tool's `tensorboard/` event file or `checkpoints/step-*`, a report written by hand) is left
byte-identical and named once. A path is listed just before CloudML creates it (a kill between the two never
leaves a file of CloudML's unlisted).

The ledger is made at the first file CloudML writes or deletes in the folder, from what verifies there as the
kind's own (`Kind.owned`; a new or empty folder: nothing, so from then on exactly what CloudML created; an
earlier release's folder or one marked before ledgers: e.g. a run's committed checkpoints and the files a run
writes by name), never from everything it holds. A damaged ledger is named and made again the same way. It is
written whole (temporary file, then rename) by the one process that holds the folder (the run lock; rank 0 of
a DDP run), or by processes of one machine under an advisory lock on the folder (cross-validation folds), and
under a thread lock (checkpoints commit from a thread).

Temporary files named by CloudML's own pattern (`.NAME.tmp-PID`, `.trash-*`) are not listed: they exist
only during a write, and a leftover one is recognised by that name and its dead process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.ownership import MARKER, kind_named, marker_kind, others_in, where
from cloudml_lib.base.shapes import TEXT, Damaged, ListOf, Obj, read_json

log = logging.getLogger(__name__)

LEDGER = ".cloudml-files"
LEDGER_SHAPE = Obj({"by": TEXT, "folder": TEXT, "created": ListOf(TEXT)}, required=("created",))
LEDGER_LIMIT = 8 << 20  # bytes: a run lists some hundred paths; a bigger file is not CloudML's ledger

_lock = threading.RLock()
_held: set[int] = set()  # descriptors of the folder locks this process holds now


def _drop_inherited_locks() -> None:
    """In a child forked while a thread held a folder lock (DataLoader or preprocessing workers forked beside
    the checkpoint writer's or the hashing thread's ledger update): the child's copy of the descriptor is
    closed, so that the lock is released when the parent's update ends, not when the child exits."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)
_said: set[str] = set()


def home_of(path: str | Path) -> Path | None:
    """The claimed folder `path` lies in (the nearest folder above it with a valid marker of CloudML's,
    however deep: a user's files five folders below a run's tensorboard/ are judged by the run's ledger as
    those one below are); None where it lies in none (a command's own output file chosen by the user)."""
    here = Path(os.path.abspath(path)).parent
    while True:
        if os.path.lexists(here / MARKER):
            try:
                return here if marker_kind(here, proven=False) is not None else None
            except CloudMLError:
                return None
        if here.parent == here:
            return None
        here = here.parent


def _rel(home: Path, path: str | Path) -> str:
    return Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(home))).as_posix()


def _read(home: Path) -> set[str] | None:
    """The listed paths; None where the folder has no ledger yet, or a damaged one (named once)."""
    path = home / LEDGER
    if not os.path.lexists(path):
        return None
    try:
        doc = read_json(path, LEDGER_SHAPE, LEDGER_LIMIT)
    except (OSError, Damaged) as e:
        _say_once(
            f"ledger:{path}",
            f"{path} is damaged ({e}); it is made again from what in {home} verifies as CloudML's",
        )
        return None
    return set(doc["created"])


def _write(home: Path, created: set[str]) -> None:
    tmp = home / f".{LEDGER}.tmp-{os.getpid()}"
    try:
        if os.path.lexists(tmp):
            tmp.unlink()
        doc = {"by": "CloudML", "folder": where(home), "created": sorted(created)}
        tmp.write_text(json.dumps(doc, indent=0))
        os.replace(tmp, home / LEDGER)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def listed(home: Path) -> set[str]:
    """The ledger of the claimed folder `home`, made first where it has none (from its kind's rule)."""
    with _lock:
        created = _read(home)
        if created is None:
            created = start(home)
        return created


def start(home: Path, entries: list[str] | None = None) -> set[str]:
    """Write `home`'s ledger: `entries` (a new or empty folder: none), or, where not given, what verifies as
    the kind's own by its rule (ownership.Kind.owned)."""
    if entries is None:
        proven = marker_kind(home)
        kind = kind_named(proven or marker_kind(home, proven=False) or "")
        if proven is None:  # a marker that proves nothing by itself (copied, or naming no folder):
            # the kind's own where the content verifies as an earlier release's (its adoption), else nothing
            adopted = kind is not None and kind.owned is not None and kind.adopt(home)
            entries = kind.owned(home) if adopted else []
        else:
            entries = kind.verified(home) if kind is not None else others_in(home)
    with _lock:
        _write(home, set(entries))
    return set(entries)


def is_listed(created: set[str], rel: str) -> bool:
    parts = rel.split("/")
    return any("/".join(parts[:i]) in created for i in range(1, len(parts) + 1))


def mine(path: str | Path) -> bool:
    """Whether CloudML may replace, truncate, append to or delete `path`: it does not exist yet, it lies in
    no claimed folder, or its claimed folder's ledger lists it (or a folder above it)."""
    if not os.path.lexists(path):
        return True
    home = home_of(path)
    if home is None or Path(os.path.abspath(path)) == Path(os.path.abspath(home)) / LEDGER:
        return True
    if Path(path).name == MARKER and Path(os.path.abspath(path)).parent == Path(os.path.abspath(home)):
        return True
    return is_listed(listed(home), _rel(home, path))


def _update(path: str | Path, change) -> None:
    """`change(listed, rel)` (the new set) applied to the ledger of the claimed folder `path` lies in; nothing
    where it lies in none."""
    home = home_of(path)
    if home is None:
        return
    rel = _rel(home, path)
    with _lock, _folder_lock(home):
        created = listed(home)
        changed = change(created, rel)
        if changed != created:
            _write(home, changed)


@contextmanager
def _folder_lock(home: Path):
    """An advisory lock on the claimed folder while its ledger is read and rewritten: processes of one
    machine that write into one folder (cross-validation folds under torchrun) never lose each other's
    entries. Where the file system has no such locks (some network mounts), only the thread lock holds."""
    try:
        import fcntl

        fd = os.open(home, os.O_RDONLY)
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


def add(path: str | Path) -> None:
    """List `path` (about to be created by CloudML) in its claimed folder's ledger."""
    _update(path, lambda created, rel: created if is_listed(created, rel) else created | {rel})


def drop(path: str | Path) -> None:
    """Take `path` (just deleted or moved by CloudML), and what it held, out of its folder's ledger."""
    _update(path, lambda created, rel: {c for c in created if c != rel and not c.startswith(rel + "/")})


def delete(path: str | Path) -> bool:
    """Delete `path` (a file, or a folder with what it holds) where the ledger lists it; in a folder that is
    not listed itself, only the listed entries go. What is left is named once. True where all of it went."""
    import shutil

    path = Path(path)
    if not os.path.lexists(path):
        return True
    if mine(path):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        drop(path)
        return not os.path.lexists(path)
    if path.is_dir() and not path.is_symlink():
        return all([delete(child) for child in sorted(path.iterdir())])
    skip_unless_mine(path, "delete")
    return False


def not_mine(path: str | Path, doing: str) -> str:
    """The words for a path CloudML leaves alone: what it would have done, and what the user can do."""
    home = home_of(path)
    return (
        f"{path} was not written by CloudML (its folder's record of what CloudML created, "
        f"{Path(home or '.') / LEDGER}, does not list it), so CloudML does not {doing} it: it is left as it "
        "is. "
        "Move it out of the folder to let CloudML write its own file there, or choose another folder."
    )


def refuse_unless_mine(path: str | Path, doing: str) -> None:
    """Raise, naming the file, where `path` exists and is not CloudML's (a write that cannot go elsewhere)."""
    if not mine(path):
        raise CloudMLError(not_mine(path, doing) + " Nothing was written to it.")


def skip_unless_mine(path: str | Path, doing: str) -> bool:
    """True where `path` may be deleted; otherwise False, said once (a clean-up that can leave it)."""
    if mine(path):
        return True
    _say_once(f"{doing}:{os.path.abspath(path)}", not_mine(path, doing))
    return False


def _say_once(key: str, words: str) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(words)
