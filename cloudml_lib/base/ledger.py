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

A file CloudML writes whole (outputs.atomic_path: run.json, evaluation.json, report.md, a prediction) is
recorded with its size and sha256, and a file it appends to (train.log, metrics.jsonl) with its size and the
sha256 of what CloudML wrote (its fingerprint, kept as the appends go and written with the ledger's next
write, at the end of the process, or when the log closes). A listed file whose content no longer matches was
changed by someone else since: it is the user's from then on (never replaced, truncated, appended to or
deleted; named once). An appended file may be longer than its record (a process killed after its last record):
its recorded part must match. Folders (checkpoints, the folds') and files written by their own protocols (the
cache's, whose checksums are their own; best.pt) are listed by name (their next write drops any record of
their content), as are the files of a ledger written before content was recorded. A ledger made from what
verifies records each file it lists as it was found (its size and sha256; an appended one's as a fingerprint
that may grow): changed later, it is the user's.

Temporary files named by CloudML's own pattern (`.NAME.tmp-PID`, `.trash-*`) are not listed: they exist
only during a write, and a leftover one is recognised by that name and its dead process.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import stat
import threading
from contextlib import contextmanager
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.ownership import MARKER, kind_named, marker_kind, others_in, where
from cloudml_lib.base.shapes import BOOL, INT, TEXT, Damaged, ListOf, MapOf, Obj, read_json

log = logging.getLogger(__name__)

LEDGER = ".cloudml-files"
# a file's content as CloudML wrote it: its size and sha256 (a file written whole: the newest and the one
# before, so that a kill between the record and the rename leaves the file that stands there CloudML's), or
# for a file CloudML appends to ("grows"), the sha256 of its first `size` bytes
CONTENT_SHAPE = Obj({"size": INT, "sha256": ListOf(TEXT), "grows": BOOL}, required=("size", "sha256"))
LEDGER_SHAPE = Obj(
    {"by": TEXT, "folder": TEXT, "created": ListOf(TEXT), "contents": MapOf(CONTENT_SHAPE)},
    required=("created",),
)
LEDGER_LIMIT = 8 << 20  # bytes: a run lists some hundred paths; a bigger file is not CloudML's ledger

_lock = threading.RLock()
_held: set[int] = set()  # descriptors of the folder locks this process holds now


def _drop_inherited_locks() -> None:
    """In a child forked while a thread held a folder lock (DataLoader or preprocessing workers forked beside
    the checkpoint writer's or the hashing thread's ledger update): the child's copy of the descriptor is
    closed, so that the lock is released when the parent's update ends, not when the child exits; and the
    child gets a thread lock of its own (its copy of one a parent's thread held would stay held for ever)."""
    global _lock
    _lock = threading.RLock()
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


def _read(home: Path) -> tuple[set[str], dict[str, dict]] | None:
    """The listed paths and the contents recorded; None where the folder has no ledger yet, or a damaged one
    (named once)."""
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
    return set(doc["created"]), dict(doc.get("contents", {}))


def _write(home: Path, created: set[str], contents: dict[str, dict]) -> None:
    """The ledger written whole, the fingerprints of this process's appends in `home` brought up to date."""
    contents = {rel: c for rel, c in contents.items() if is_listed(created, rel)}
    for growth in list(_growing.values()):
        if growth.home == home and is_listed(created, growth.rel):
            contents[growth.rel] = growth.record()
    tmp = home / f".{LEDGER}.tmp-{os.getpid()}"
    try:
        if os.path.lexists(tmp):
            tmp.unlink()
        doc = {"by": "CloudML", "folder": where(home), "created": sorted(created), "contents": contents}
        tmp.write_text(json.dumps(doc, indent=0, sort_keys=True))
        os.replace(tmp, home / LEDGER)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    for growth in _growing.values():
        if growth.home == home:
            growth.dirty = False


def _record(home: Path) -> tuple[set[str], dict[str, dict]]:
    with _lock:
        found = _read(home)
        if found is None:
            found = _start(home)
        return found


def listed(home: Path) -> set[str]:
    """The ledger of the claimed folder `home`, made first where it has none (from its kind's rule)."""
    return _record(home)[0]


def start(home: Path, entries: list[str] | None = None) -> set[str]:
    """Write `home`'s ledger: `entries` (a new or empty folder: none), or, where not given, what verifies as
    the kind's own by its rule (ownership.Kind.owned), each file of it recorded as it is now (`_as_found`)."""
    return _start(home, entries)[0]


def _start(home: Path, entries: list[str] | None = None) -> tuple[set[str], dict[str, dict]]:
    """start's ledger: the listed paths and the content records it wrote."""
    contents: dict[str, dict] = {}
    if entries is None:
        proven = marker_kind(home)
        kind = kind_named(proven or marker_kind(home, proven=False) or "")
        if proven is None:  # a marker that proves nothing by itself (copied, or naming no folder):
            # the kind's own where the content verifies as an earlier release's (its adoption), else nothing
            adopted = kind is not None and kind.owned is not None and kind.adopt(home)
            entries = kind.owned(home) if adopted else []
        else:
            entries = kind.verified(home) if kind is not None else others_in(home)
        # the files of a kind with a rule for what it writes (a run's); a cache's have checksums of their own
        contents = _as_found(home, entries) if kind is not None and kind.owned is not None else {}
    with _lock:
        _write(home, set(entries), contents)
    return set(entries), contents


APPENDED = (
    ".log",
    ".jsonl",
)  # the files CloudML appends to (train.log, metrics.jsonl); the others it writes whole


def _as_found(home: Path, entries: list[str]) -> dict[str, dict]:
    """The content records of a ledger made from what verified (an earlier release's folder, or one whose
    ledger was lost): each listed file as it is now, by its size and sha256, as CloudML records a file it
    wrote whole; a file it appends to (APPENDED) by the fingerprint of what it holds, which may grow. From
    then on a change to what it holds (an edit, a cut, for a file written whole an addition too) makes it
    the user's, as in a folder whose ledger CloudML kept; listed by name alone, a verified file was CloudML's
    for good whatever was done to it later. Folders (checkpoints: their own checksums) stay listed by name."""
    found = {}
    for rel in entries:
        path = home / rel
        try:
            if path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            h = _sha256(path, size)
        except OSError:
            continue  # unreadable now: listed by name, as before
        if h is not None:
            found[rel] = {"size": size, "sha256": [h.hexdigest()]}
            if path.suffix in APPENDED:
                found[rel]["grows"] = True
    return found


def is_listed(created: set[str], rel: str) -> bool:
    parts = rel.split("/")
    return any("/".join(parts[:i]) in created for i in range(1, len(parts) + 1))


# ------------------------------------------------------------------------------------------ contents


def _sha256(path: str | Path, size: int | None = None):
    """The sha256 (a hashlib object) of `path`'s first `size` bytes (all where None); None where shorter."""
    h, left = hashlib.sha256(), size
    with open(path, "rb") as f:
        while left is None or left > 0:
            chunk = f.read(1 << 20 if left is None else min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return None if left else h


def _differs(path: str | Path, rec: dict) -> str | None:
    """How `path` differs from what CloudML recorded writing (words), or None where it matches."""
    try:
        st = os.stat(path)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            return "it is no longer a file"
        if rec.get("grows"):
            growth = _growing.get(os.path.abspath(path))
            if growth is not None and growth.size == size:
                return None  # this process wrote all of it (a stat: nothing read again per append)
            if size < rec["size"]:
                return f"it holds {size} bytes, of the {rec['size']} CloudML wrote"
            h = _sha256(path, rec["size"])
        else:
            if size != rec["size"]:
                return f"it holds {size} bytes where CloudML wrote {rec['size']}"
            h = _sha256(path)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if h is None or h.hexdigest() not in rec["sha256"]:
        return "its content is not what CloudML wrote (its sha256 differs)"
    return None


def _place(path: str | Path) -> tuple[Path, str] | None:
    """(its claimed folder, its path there) for an existing `path` a ledger judges; None where none does (it
    does not exist, lies in no claimed folder, or is the folder's marker or ledger itself)."""
    if not os.path.lexists(path):
        return None
    home = home_of(path)
    if home is None or Path(os.path.abspath(path)) == Path(os.path.abspath(home)) / LEDGER:
        return None
    if Path(path).name == MARKER and Path(os.path.abspath(path)).parent == Path(os.path.abspath(home)):
        return None
    return home, _rel(home, path)


def _judge(path: str | Path) -> tuple[str, str] | None:
    """None where CloudML may replace, truncate, append to or delete `path`; else why not: ("unlisted", "")
    or ("changed", how)."""
    place = _place(path)
    if place is None:
        return None
    home, rel = place
    created, contents = _record(home)
    if not is_listed(created, rel):
        return "unlisted", ""
    rec = contents.get(rel)
    how = None if rec is None else _differs(path, rec)
    return None if how is None else ("changed", how)


def mine(path: str | Path) -> bool:
    """Whether CloudML may replace, truncate, append to or delete `path`: it does not exist yet, it lies in
    no claimed folder, or its claimed folder's ledger lists it (or a folder above it) and, where its content
    was recorded, it still holds what CloudML wrote."""
    return _judge(path) is None


def unlisted(path: str | Path) -> bool:
    """Whether `path` stands in a claimed folder whose ledger does not list it (not written there by CloudML,
    or left by a state of the folder that another ledger, put back, does not know). By name alone: no file
    is read to compare its content (a start asks this of best.pt and the end's files)."""
    place = _place(path)
    return place is not None and not is_listed(_record(place[0])[0], place[1])


def changed(path: str | Path) -> bool:
    """Whether `path` is listed as CloudML's but was changed by someone else since CloudML wrote it."""
    found = _judge(path)
    return found is not None and found[0] == "changed"


class _Growth:
    """The fingerprint of a file this process appends to: its size and the running sha256 of all of it."""

    def __init__(self, home: Path, rel: str, size: int, h):
        self.home, self.rel, self.size, self.hash, self.dirty = home, rel, size, h, True

    def record(self) -> dict:
        return {"size": self.size, "sha256": [self.hash.hexdigest()], "grows": True}


_growing: dict[str, _Growth] = {}  # absolute path -> its fingerprint, for the files this process appends to


def appending(path: str | Path) -> None:
    """`path` (CloudML's: checked before) is about to be appended to by this process: its fingerprint starts
    from all it holds now (read once; then kept as the appends go)."""
    key = os.path.abspath(path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = 0
    except OSError:
        return  # the open that follows names the problem
    growth = _growing.get(key)
    if growth is not None and growth.size == size:
        return  # this process's own appends: kept as they go
    home = home_of(path)
    if home is None:
        return
    try:
        h = _sha256(path) if size else hashlib.sha256()
    except OSError:
        return
    with _lock:
        _growing[key] = _Growth(home, _rel(home, path), size, h)


def appended(path: str | Path, data: bytes) -> None:
    """`data` was appended to `path` by this process (kept in its fingerprint; written with the ledger)."""
    growth = _growing.get(os.path.abspath(path))
    if growth is not None:
        growth.hash.update(data)
        growth.size += len(data)
        growth.dirty = True


def truncating(path: str | Path, size: int) -> None:
    """`path` (CloudML's, appended to) is about to be cut to its first `size` bytes: the fingerprint of those
    is written first, so that a kill between the two leaves a file that is longer than its record, which
    verifies."""
    home = home_of(path)
    if home is None:
        return
    h = _sha256(path, size)
    if h is None:
        return
    with _lock:
        _growing[os.path.abspath(path)] = _Growth(home, _rel(home, path), size, h)
    flush()


def flush() -> None:
    """Write the fingerprints of this process's appends that the ledgers do not hold yet."""
    with _lock:
        homes = {g.home for g in _growing.values() if g.dirty}
    for home in homes:
        try:
            with _lock, _folder_lock(home):
                created, contents = _record(home)
                _write(home, created, contents)
        except OSError:
            pass  # a full disk, a folder gone: the record stays shorter, which the next start accepts


atexit.register(flush)


def _forget_growth() -> None:
    _growing.clear()  # a forked child appends to files of its own, if any


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_growth)


# ------------------------------------------------------------------------------------------ changes


def _update(path: str | Path, change) -> None:
    """`change(listed, contents, rel)` (the new listed set; `contents` changed in place) applied to the ledger
    of the claimed folder `path` lies in; nothing where it lies in none."""
    home = home_of(path)
    if home is None:
        return
    rel = _rel(home, path)
    with _lock, _folder_lock(home):
        created, contents = _record(home)
        before = dict(contents)
        changed_ = change(created, contents, rel)
        growing = any(g.dirty and g.home == home for g in _growing.values())
        if changed_ != created or contents != before or growing:
            _write(home, changed_, contents)


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


def add(path: str | Path, content: Path | None = None) -> None:
    """List `path` (about to be created or replaced by CloudML) in its claimed folder's ledger; where
    `content` is given (the finished file about to be renamed to `path`), its size and sha256 are recorded
    as `path`'s, the previous record kept beside it until the next write; where not, any record of `path` is
    dropped (listed by name, as what such a write leaves)."""
    record = None
    if content is not None:
        record = {"size": os.stat(content).st_size, "sha256": [_sha256(content).hexdigest()]}

    def change(created, contents, rel):
        if record is not None:
            before = contents.get(rel)
            kept = before["sha256"][:1] if before and not before.get("grows") else []
            hashes = record["sha256"] + [h for h in kept if h not in record["sha256"]]
            contents[rel] = dict(record, sha256=hashes)
        else:  # written by a protocol that records no content (a checkpoint, best.pt): a record of what was
            contents.pop(rel, None)  # there before would make CloudML's next write of it look like a user's
        return created if is_listed(created, rel) else created | {rel}

    _update(path, change)


def drop(path: str | Path) -> None:
    """Take `path` (just deleted or moved by CloudML), and what it held, out of its folder's ledger."""

    def change(created, contents, rel):
        for c in [c for c in contents if c == rel or c.startswith(rel + "/")]:
            del contents[c]
        return {c for c in created if c != rel and not c.startswith(rel + "/")}

    _growing.pop(os.path.abspath(path), None)
    _update(path, change)


def delete(path: str | Path) -> bool:
    """Delete `path` (a file, or a folder with what it holds) where the ledger lists it; in a folder that is
    not listed itself, only the listed entries go. What is left is named once. True where all of it went."""
    import shutil

    path = Path(path)
    if not os.path.lexists(path):
        return True
    if path.is_dir() and not path.is_symlink() and os.path.lexists(path / MARKER):
        return _delete_claimed(path)
    if mine(path):
        if path.is_dir() and not path.is_symlink():
            if _changed_inside(path):
                return all([delete(child) for child in sorted(path.iterdir())])
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        drop(path)
        return not os.path.lexists(path)
    if path.is_dir() and not path.is_symlink():
        return all([delete(child) for child in sorted(path.iterdir())])
    skip_unless_mine(path, "delete")
    return False


def _delete_claimed(folder: Path) -> bool:
    """A claimed folder itself: what its ledger allows goes, each by the rules; the marker, the ledger and
    the folder last, and only where nothing else is left."""
    rest = [p for p in sorted(folder.iterdir()) if p.name not in (MARKER, LEDGER)]
    if not all([delete(child) for child in rest]):
        return False
    for name in (LEDGER, MARKER):
        (folder / name).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def _changed_inside(folder: Path) -> bool:
    """Whether a listed folder holds a file whose recorded content was changed since (kept when it goes)."""
    home = home_of(folder)
    if home is None:
        return False
    rel = _rel(home, folder)
    contents = _record(home)[1]
    inside = [c for c in contents if c.startswith(rel + "/")]
    return any(_differs(home / c, contents[c]) for c in inside if os.path.lexists(home / c))


def not_mine(path: str | Path, doing: str) -> str:
    """The words for a path CloudML leaves alone: what it would have done, and what the user can do."""
    found = _judge(path)
    if found is not None and found[0] == "changed":
        return (
            f"{path} was changed after CloudML wrote it ({found[1]}), so it is yours now: CloudML does not "
            f"{doing} it, and it is left as it is. Move it out of the folder (or rename it) to let CloudML "
            "write its own file there, or choose another folder."
        )
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
