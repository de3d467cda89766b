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

The rules are written once for any store (store.py): a folder on this machine, or a bucket's prefix
(bucket.py's `Prefix`), whose ledger is the same file; `read_record`, `judge`, `refuse_at`, `list_at`,
`record_at` and `set_aside_changed` take the store and a path in it. The functions that take a path of this
machine (`mine`, `add`, `drop`, `delete`, ...) find its claimed folder and call them. What a bucket lacks is
the store's to say: no adoption (a lost ledger there is made again empty) and no lock.

Temporary files named by CloudML's own pattern (`.NAME.tmp-PID`, `.trash-*`) are not listed: they exist
only during a write, and a leftover one is recognised by that name and its dead process.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.ownership import LEDGER, MARKER, kind_named, ledger_text, marker_kind, others_in
from cloudml_lib.base.shapes import BOOL, INT, TEXT, Damaged, ListOf, MapOf, Obj
from cloudml_lib.base.store import Folder, Store, sha256_of

log = logging.getLogger(__name__)

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


@contextmanager
def _holding(store: Store):
    """What a change of `store`'s record holds: on a folder, this process's thread lock (the appends'
    fingerprints, the checkpoint writer's thread) and the folder's lock; on a bucket, only what the store
    has (none: its network calls never hold up a folder's record)."""
    with _lock if store.local else nullcontext(), store.locked():
        yield


def _lock_of_its_own() -> None:
    """In a child forked while a thread of its parent held the thread lock (a command forked beside the
    checksum thread): its copy would stay held for ever, since the thread that holds it does not exist in
    the child. (The folder locks' descriptors: store.py closes them.)"""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_lock_of_its_own)
_said: set[str] = set()


# ------------------------------------------------------------------------------------------ the record
# Written once for every store (store.py: a folder on this machine, a bucket's prefix).


def read_record(store: Store) -> tuple[set[str], dict[str, dict]] | None:
    """The listed paths and the contents recorded; None where the store has no ledger yet, or a damaged one
    (named once)."""
    if not store.exists(LEDGER):
        if not store.adopts:  # claim wrote one: it was deleted since
            _say_once(
                f"ledger-missing:{store.shown(LEDGER)}",
                f"{store.shown()} has no record of what CloudML wrote there ({LEDGER} is missing): nothing "
                "there is taken as CloudML's, so no object of it is replaced or deleted; the record starts "
                "again empty",
            )
        return None
    try:
        doc = store.read_json(LEDGER, LEDGER_SHAPE, LEDGER_LIMIT)
        if not store.adopts and not store.is_here(doc.get("folder")):
            raise Damaged(f"it was written for {doc.get('folder')}, not for this place (copied with it)")
    except Damaged as e:  # a bucket client's own failure (OSError) says nothing of the ledger: raised
        _say_once(
            f"ledger:{store.shown(LEDGER)}",
            f"{store.shown(LEDGER)} is damaged ({e}); it is made again from what in {store.shown()} verifies "
            "as CloudML's"
            + (
                ""
                if store.adopts
                else " (nothing: no object there is taken as CloudML's, replaced or deleted)"
            ),
        )
        return None
    return set(doc["created"]), dict(doc.get("contents", {}))


def write_record(store: Store, created: set[str], contents: dict[str, dict]) -> None:
    """The ledger written whole, the fingerprints of this process's appends in a folder brought up to date."""
    contents = {rel: c for rel, c in contents.items() if is_listed(created, rel)}
    mine_here = [g for g in _growing.values() if _growing.get(store.key(g.rel) or "") is g]
    for growth in mine_here:
        if is_listed(created, growth.rel):
            contents[growth.rel] = growth.record()
    store.write_text(LEDGER, ledger_text(store, created, contents))
    for growth in mine_here:
        growth.dirty = False


def record_of(store: Store) -> tuple[set[str], dict[str, dict]]:
    """The ledger of `store`, made first where it has none (or a damaged one): from what verifies as its
    kind's own, on a store that adopts; else empty, never from what happens to be there."""
    with _lock if store.local else nullcontext():
        found = read_record(store)
        if found is None:
            found = _start(store)
        return found


def listed(place: Path | Store) -> set[str]:
    """The ledger of the claimed folder (or prefix) `place`, made first where it has none."""
    return record_of(place if isinstance(place, Store) else Folder(place))[0]


def start(home: Path, entries: list[str] | None = None) -> set[str]:
    """Write `home`'s ledger: `entries` (a new or empty folder: none), or, where not given, what verifies as
    the kind's own by its rule (ownership.Kind.owned), each file of it recorded as it is now (`_as_found`)."""
    return _start(Folder(home), entries)[0]


def _start(store: Store, entries: list[str] | None = None) -> tuple[set[str], dict[str, dict]]:
    """start's ledger: the listed paths and the content records it wrote."""
    contents: dict[str, dict] = {}
    if entries is None and not store.adopts:
        return set(), {}  # a store that adopts nothing: empty (written with the first entry it lists)
    if entries is None:
        home = store.path
        proven = marker_kind(store)
        kind = kind_named(proven or marker_kind(store, proven=False) or "")
        if proven is None:  # a marker that proves nothing by itself (copied, or naming no folder):
            # the kind's own where the content verifies as an earlier release's (its adoption), else nothing
            adopted = kind is not None and kind.owned is not None and kind.adopt(home)
            entries = kind.owned(home) if adopted else []
        else:
            entries = kind.verified(home) if kind is not None else others_in(store)
        # the files of a kind with a rule for what it writes (a run's); a cache's have checksums of their own
        contents = _as_found(store, entries) if kind is not None and kind.owned is not None else {}
    with _lock:
        write_record(store, set(entries), contents)
    return set(entries), contents


APPENDED = (
    ".log",
    ".jsonl",
)  # the files CloudML appends to (train.log, metrics.jsonl); the others it writes whole


def _as_found(store: Store, entries: list[str]) -> dict[str, dict]:
    """The content records of a ledger made from what verified (an earlier release's folder, or one whose
    ledger was lost): each listed file as it is now, by its size and sha256, as CloudML records a file it
    wrote whole; a file it appends to (APPENDED) by the fingerprint of what it holds, which may grow. From
    then on a change to what it holds (an edit, a cut, for a file written whole an addition too) makes it
    the user's, as in a folder whose ledger CloudML kept; listed by name alone, a verified file was CloudML's
    for good whatever was done to it later. Folders (checkpoints: their own checksums) stay listed by name."""
    found = {}
    for rel in entries:
        try:
            size = store.file_size(rel)
            if size is None:
                continue
            h = store.sha256(rel, size)
        except OSError:
            continue  # unreadable now: listed by name, as before
        if h is not None:
            found[rel] = {"size": size, "sha256": [h]}
            if rel.endswith(APPENDED):
                found[rel]["grows"] = True
    return found


KEPT = re.compile(r"\.kept-[0-9]+$")  # NAME.kept-N: a changed file kept for the user (set_aside_changed)


def is_listed(created: set[str], rel: str) -> bool:
    """Whether `rel` or a folder above it is listed; a file (or a folder) kept aside as NAME.kept-N, and what
    it holds, never is, whatever folder it lies in (a bucket's flight cache, a listed folder of a run): it
    holds the user's bytes."""
    parts = rel.split("/")
    if any(KEPT.search(part) for part in parts):  # a file kept aside, or what a folder kept aside holds
        return False
    return any("/".join(parts[:i]) in created for i in range(1, len(parts) + 1))


# ------------------------------------------------------------------------------------------ judging


def differs(store: Store, rel: str, rec: dict) -> str | None:
    """How the file at `rel` differs from what CloudML recorded writing (words), or None where it matches."""
    try:
        size = store.file_size(rel)
        if size is None:
            return "it is no longer a file"
        if rec.get("grows"):
            growth = _growing.get(store.key(rel) or "")
            if growth is not None and growth.size == size:
                return None  # this process wrote all of it (a stat: nothing read again per append)
            if size < rec["size"]:
                return f"it holds {size} bytes, of the {rec['size']} CloudML wrote"
            h = store.sha256(rel, rec["size"])
        else:
            if size != rec["size"]:
                return f"it holds {size} bytes where CloudML wrote {rec['size']}"
            h = store.sha256(rel)
    except OSError as e:
        if not store.local:
            raise  # a bucket client's failure (a 503, credentials) says nothing of what the object holds
        return f"it cannot be read ({e.strerror or e})"
    if h is None or h not in rec["sha256"]:
        return "its content is not what CloudML wrote (its sha256 differs)"
    return None


def judge(store: Store, rel: str) -> tuple[str, str] | None:
    """None where CloudML may replace, truncate, append to or delete what lies at `rel` (nothing, or what
    the ledger lists and, where its content was recorded, still holds what CloudML wrote); else why not:
    ("unlisted", "") or ("changed", how)."""
    return _verdict(store, rel) if store.holds(rel) else None


def _verdict(store: Store, rel: str) -> tuple[str, str] | None:
    """judge's verdict on what lies at `rel` (known to be there)."""
    created, contents = record_of(store)
    if not is_listed(created, rel):
        return "unlisted", ""
    rec = contents.get(rel)
    how = None if rec is None else differs(store, rel, rec)
    return None if how is None else ("changed", how)


def not_mine_words(
    store: Store, rel: str, doing: str, found: tuple[str, str] | None, shown: str | None = None
) -> str:
    """The words for what CloudML leaves alone at `rel` (judge's `found`; `shown`: its name as the caller
    gave it): what it would have done, and what the user can do."""
    path = shown or store.shown(rel)
    if found is not None and found[0] == "changed":
        return (
            f"{path} was changed after CloudML wrote it ({found[1]}), so it is yours now: CloudML does not "
            f"{doing} it, and it is left as it is. Move it out of the {store.noun} (or rename it) to let "
            f"CloudML write its own {store.item} there, or choose another {store.noun}."
        )
    return (
        f"{path} was not written by CloudML (its {store.noun}'s record of what CloudML created, "
        f"{store.shown(LEDGER)}, does not list it), so CloudML does not {doing} it: it is left as it is. "
        f"Move it out of the {store.noun} to let CloudML write its own {store.item} there, or choose another "
        f"{store.noun}."
    )


def refuse_at(store: Store, rel: str, doing: str) -> None:
    """Raise, naming it, where something lies at `rel` that is not CloudML's (a write that cannot go
    elsewhere)."""
    found = judge(store, rel)
    if found is not None:
        raise CloudMLError(not_mine_words(store, rel, doing, found) + " Nothing was written to it.")


def set_aside_changed(store: Store, rels: list[str]) -> list[str]:
    """Before CloudML writes again the files `rels` (each listed, or under a listed folder): each whose
    content is not what CloudML recorded writing (damaged, or edited since) is kept, its bytes as they are, as
    REL.kept-N (a name CloudML does not list: the user's), and said; then every record of `rels` is dropped.
    A name the keeping moved away (a folder's rename) is no longer listed either: a write cut off after it
    leaves nothing there CloudML may replace. An object a bucket copied aside stays where it was, listed by
    name, for CloudML's upload to write over. Returns the names they were kept as."""
    moved = []
    with _holding(store):
        created, contents = record_of(store)
        for rel in rels:
            rec = contents.get(rel)
            if rec is None or not store.exists(rel) or differs(store, rel, rec) is None:
                continue
            n = 1
            while store.exists(f"{rel}.kept-{n}"):
                n += 1
            aside = f"{rel}.kept-{n}"
            store.keep_aside(rel, aside)
            log.warning(
                "%s was changed after CloudML wrote it (damaged, or edited): it is kept, as it is, as %s; "
                "CloudML writes its own %s in its place.",
                store.shown(rel),
                store.shown(aside),
                rel.rsplit("/", 1)[-1],
            )
            moved.append(aside)
        # a name the keeping moved away (a rename) is no longer CloudML's: a write cut off after it leaves
        # nothing of CloudML's there; an object copied aside stays, CloudML's to write over
        kept = {rel for rel in (aside.rsplit(".kept-", 1)[0] for aside in moved) if not store.exists(rel)}
        for rel in kept:
            _growing.pop(store.key(rel) or "", None)
        if any(rel in contents for rel in rels) or kept & created:
            write_record(store, created - kept, {r: c for r, c in contents.items() if r not in rels})
    return moved


def list_at(store: Store, rel: str) -> None:
    """List `rel` (about to be created by CloudML) in the store's ledger."""
    with _holding(store):
        created, contents = record_of(store)
        if not is_listed(created, rel):
            write_record(store, created | {rel}, contents)


def record_at(store: Store, written: dict[str, tuple[int, str]]) -> None:
    """Record what CloudML just wrote whole: {rel: (size, sha256)} (each listed, or under a listed name)."""
    with _holding(store):
        created, contents = record_of(store)
        contents.update({rel: {"size": size, "sha256": [sha]} for rel, (size, sha) in written.items()})
        write_record(store, created, contents)


# ---------------------------------------------------------------------- a path on this machine


def located(path: str | Path) -> str:
    """`path` made absolute as the system finds it: a `..` after a linked folder leads to the parent of the
    link's target, not back to the folder the text names (os.path.abspath drops the two by their text, and a
    ledger would judge another file than the one written)."""
    text = os.fspath(path)
    if os.sep + ".." + os.sep not in os.sep + text + os.sep:
        return os.path.abspath(text)
    head, name = os.path.split(os.path.join(os.getcwd(), text).rstrip(os.sep))
    if name in ("..", "."):
        return os.path.realpath(os.path.join(head, name))
    return os.path.join(os.path.realpath(head), name)


def home_of(path: str | Path) -> Path | None:
    """The claimed folder `path` lies in (the nearest folder above it with a valid marker of CloudML's,
    however deep: a user's files five folders below a run's tensorboard/ are judged by the run's ledger as
    those one below are); None where it lies in none (a command's own output file chosen by the user)."""
    here = Path(located(path)).parent
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
    return Path(located(path)).relative_to(Path(os.path.abspath(home))).as_posix()


def place_of(path: str | Path) -> tuple[Folder, str] | None:
    """(its claimed folder, its path there) for an existing `path` a ledger judges; None where none does (it
    does not exist, lies in no claimed folder, or is the folder's marker or ledger itself)."""
    if not os.path.lexists(path):
        return None
    home = home_of(path)
    if home is None:
        return None
    rel = _rel(home, path)
    return None if rel in (LEDGER, MARKER) else (Folder(home), rel)


def _judge(path: str | Path) -> tuple[str, str] | None:
    place = place_of(path)  # None where nothing lies there
    return None if place is None else _verdict(*place)


def mine(path: str | Path) -> bool:
    """Whether CloudML may replace, truncate, append to or delete `path`: it does not exist yet, it lies in
    no claimed folder, or its claimed folder's ledger lists it (or a folder above it) and, where its content
    was recorded, it still holds what CloudML wrote."""
    return _judge(path) is None


def unlisted(path: str | Path) -> bool:
    """Whether `path` stands in a claimed folder whose ledger does not list it (not written there by CloudML,
    or left by a state of the folder that another ledger, put back, does not know). By name alone: no file
    is read to compare its content (a start asks this of best.pt and the end's files)."""
    place = place_of(path)
    return place is not None and not is_listed(record_of(place[0])[0], place[1])


def changed(path: str | Path) -> bool:
    """Whether `path` is listed as CloudML's but was changed by someone else since CloudML wrote it."""
    found = _judge(path)
    return found is not None and found[0] == "changed"


class _Growth:
    """The fingerprint of a file this process appends to: its size and the running sha256 of all of it, kept
    as one value (`state`) that an append replaces whole. A signal's handler (SIGTERM, raised as
    KeyboardInterrupt) or the checkpoint writer's thread writing the ledger between two separate updates
    would otherwise record a hash of more bytes than the size says, which the next start takes for a
    user's edit and refuses the run's own log."""

    def __init__(self, home: Path, rel: str, size: int, h):
        self.home, self.rel, self.state, self.dirty = home, rel, (size, h), True

    @property
    def size(self) -> int:
        return self.state[0]

    def grown(self, data: bytes) -> None:
        size, h = self.state
        h = h.copy()
        h.update(data)
        self.state = (size + len(data), h)  # one assignment: never half of an append

    def record(self) -> dict:
        size, h = self.state
        return {"size": size, "sha256": [h.hexdigest()], "grows": True}


_growing: dict[str, _Growth] = {}  # absolute path -> its fingerprint, for the files this process appends to


def appending(path: str | Path) -> None:
    """`path` (CloudML's: checked before) is about to be appended to by this process: its fingerprint starts
    from all it holds now (read once; then kept as the appends go)."""
    key = located(path)
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
        h = sha256_of(path) if size else hashlib.sha256()
    except OSError:
        return
    with _lock:
        _growing[key] = _Growth(home, _rel(home, path), size, h)


def appended(path: str | Path, data: bytes, end: int | None = None) -> None:
    """`data` was appended to `path` by this process, which then holds `end` bytes (kept in its fingerprint;
    written with the ledger). Where the file does not end where this process's appends add up to (a line
    cut by a signal before it was counted, a signal's handler writing its own line in between, a failed
    write's bytes flushed with the next), the fingerprint is dropped, unwritten: the ledger keeps its last
    record, a part of what the file holds, which verifies; the next start fingerprints it all again. No
    lock is taken here: a logging handler's thread may be the one writing."""
    key = located(path)
    growth = _growing.get(key)
    if growth is None:
        return
    if end is not None and growth.size + len(data) != end:
        _growing.pop(key, None)
        return
    growth.grown(data)
    growth.dirty = True


def truncating(path: str | Path, size: int) -> None:
    """`path` (CloudML's, appended to) is about to be cut to its first `size` bytes: the fingerprint of those
    is written first, so that a kill between the two leaves a file that is longer than its record, which
    verifies."""
    home = home_of(path)
    if home is None:
        return
    h = sha256_of(path, size)
    if h is None:
        return
    with _lock:
        _growing[located(path)] = _Growth(home, _rel(home, path), size, h)
    flush()


def flush() -> None:
    """Write the fingerprints of this process's appends that the ledgers do not hold yet."""
    with _lock:
        homes = {g.home for g in _growing.values() if g.dirty}
    for home in homes:
        try:
            store = Folder(home)
            with _holding(store):
                write_record(store, *record_of(store))
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
    rel, store = _rel(home, path), Folder(home)
    with _holding(store):
        created, contents = record_of(store)
        before = dict(contents)
        changed_ = change(created, contents, rel)
        growing = any(g.dirty and g.home == home for g in _growing.values())
        if changed_ != created or contents != before or growing:
            write_record(store, changed_, contents)


def add(path: str | Path, content: Path | None = None) -> None:
    """List `path` (about to be created or replaced by CloudML) in its claimed folder's ledger; where
    `content` is given (the finished file about to be renamed to `path`), its size and sha256 are recorded
    as `path`'s, the previous record kept beside it until the next write; where not, any record of `path` is
    dropped (listed by name, as what such a write leaves)."""
    record = None
    if content is not None:
        record = {"size": os.stat(content).st_size, "sha256": [sha256_of(content).hexdigest()]}

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

    _growing.pop(located(path), None)
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
    """Whether a listed folder holds a file whose recorded content was changed since, or a file kept aside
    for the user (NAME.kept-N): both are kept when it goes."""
    home = home_of(folder)
    if home is None:
        return False
    if any(KEPT.search(p.name) for p in folder.rglob("*.kept-*")):
        return True
    rel = _rel(home, folder)
    store = Folder(home)
    contents = record_of(store)[1]
    inside = [c for c in contents if c.startswith(rel + "/")]
    return any(differs(store, c, contents[c]) for c in inside if store.exists(c))


def not_mine(path: str | Path, doing: str, found: tuple[str, str] | None = None) -> str:
    """The words for a path CloudML leaves alone (judged once: `found`, else now): what it would have done,
    and what the user can do."""
    place = place_of(path)
    store, rel = place if place is not None else (Folder(Path(path).parent), Path(path).name)
    return not_mine_words(store, rel, doing, found or _judge(path), shown=str(path))


def refuse_unless_mine(path: str | Path, doing: str) -> None:
    """Raise, naming the file, where `path` exists and is not CloudML's (a write that cannot go elsewhere)."""
    found = _judge(path)
    if found is not None:
        raise CloudMLError(not_mine(path, doing, found) + " Nothing was written to it.")


def skip_unless_mine(path: str | Path, doing: str) -> bool:
    """True where `path` may be deleted; otherwise False, said once (a clean-up that can leave it)."""
    found = _judge(path)
    if found is None:
        return True
    _say_once(f"{doing}:{located(path)}", not_mine(path, doing, found))
    return False


def _say_once(key: str, words: str) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(words)
