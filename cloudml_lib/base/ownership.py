"""Which folders CloudML may write into or clean: those it can prove are its own.

A folder is CloudML's by a marker CloudML wrote itself (`.cloudml`, a small JSON file naming the folder's
kind: a run, a cross-validation, a sweep, predictions, demo flights, a preprocessing cache, a staging folder),
written first, before anything else goes into a folder CloudML makes or finds empty. A folder written by an
earlier release has no marker: it is adopted when its content verifies as that kind (each kind's rule lives
with the layer that knows the files: a committed checkpoint whose checksum matches, a readable crossval.json,
a demo version file, ...); the marker is then written first, and the adoption said once. Anything else (a home
or Drive folder, another project's `tensorboard/` or `checkpoints/`, a user's `metrics.jsonl`) is refused with
the folder named, and left byte-identical: no command deletes, truncates or appends to what CloudML cannot
prove it wrote.

`check` decides without writing (a command's early checks: a config or data error must leave nothing
behind); `claim` decides and marks.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.shapes import OPT_TEXT, TEXT, Damaged, Obj
from cloudml_lib.base.store import Folder, Store

log = logging.getLogger(__name__)

MARKER = ".cloudml"
LEDGER = ".cloudml-files"  # beside the marker: what CloudML created in the folder (ledger.py keeps it)
MARKER_SHAPE = Obj({"kind": TEXT, "by": OPT_TEXT, "folder": OPT_TEXT}, required=("kind",))
MARKER_LIMIT = 4096  # bytes: a marker is a line of JSON; anything bigger is not CloudML's
CLUTTER = ("Thumbs.db", "desktop.ini", "lost+found")  # what a file manager or a file system leaves


@dataclass(frozen=True)
class Kind:
    """A kind of folder CloudML writes: its name in the marker and in messages, the option that names it,
    what an earlier release's folder of this kind holds that proves it (`adopt`: the reason, or None),
    which folder would fit instead (for the refusal), and the command that continues one (commands' names
    are the kinds' own, so that the run folder's rules name none)."""

    name: str
    option: str
    adopt: Callable[[Path], str | None]
    fits: str
    owned: Callable[[Path], list[str]] | None = None  # what of a folder claimed without a ledger verifies
    continued_by: str = ""  # the command line (after `python -m cloudml_lib`) that continues such a folder

    def __post_init__(self):
        _KINDS[self.name] = self

    def verified(self, folder: Path) -> list[str]:
        """The paths of `folder` that are this kind's own (ledger.py's start for a folder without a ledger):
        by the kind's rule, or, without one, what the folder holds (its adoption verified it)."""
        return self.owned(folder) if self.owned is not None else others_in(folder)


_KINDS: dict[str, Kind] = {}


def kind_named(name: str) -> Kind | None:
    """The Kind a marker names (defined where its layer knows the files; None for one not imported)."""
    return _KINDS.get(name)


def where(folder: str | Path) -> str:
    """A folder's place as a marker records it (store.Folder.place: a digest of its absolute path)."""
    return Folder(folder).place


def recorded_here(recorded: str | None, folder: str | Path) -> bool:
    """Whether a marker's recorded place is `folder`: today's digest, or the plain path an earlier release
    recorded."""
    return Folder(folder).is_here(recorded)


def as_store(place: str | Path | Store) -> Store:
    """A claimed folder's store: a folder on this machine given by its path, or a store itself (a bucket's
    prefix)."""
    return place if isinstance(place, Store) else Folder(place)


def marker_kind(place: str | Path | Store, proven: bool = True) -> str | None:
    """The kind a folder's (or a prefix's) marker names; None without a marker, or where the marker does not
    prove it: one written for another place (it records the place it was written in: a marker copied or
    moved with a folder proves nothing there), or one that names no place (as earlier releases wrote them, or
    a copy of such a run's); such a folder is judged by its content, as an earlier release's. `proven=False`:
    the kind any marker of CloudML's names (the ledger's claimed folder: the nearest that holds one). A
    marker that is no marker of CloudML's (a link, a folder, not its JSON) is refused: it may be someone
    else's file."""
    store = as_store(place)
    if not store.exists(MARKER):
        return None
    try:
        doc = store.read_json(MARKER, MARKER_SHAPE, MARKER_LIMIT)
    except Damaged as e:  # a bucket client's own failure (OSError) says nothing of the marker: raised
        raise CloudMLError(
            f"{store.shown(MARKER)} is not a marker CloudML wrote ({shown(str(e), 200)}): the {store.noun} "
            f"{store.shown()} cannot be told to be CloudML's. Move that {store.item} away, or choose another "
            f"{store.noun}. Nothing was written."
        ) from None
    return doc["kind"] if not proven or store.is_here(doc.get("folder")) else None


def proves(place: str | Path, kind: Kind) -> bool:
    """Whether CloudML can prove a folder on this machine its `kind`'s: its marker, written for it, or an
    earlier release's content that verifies (the kind's `adopt`: one file, e.g. a copied best.pt, proves
    nothing). Another tool's folder of the same names is not. A damaged marker proves nothing."""
    try:
        if marker_kind(place) == kind.name:
            return True
    except CloudMLError:
        return False  # a damaged marker: not told to be CloudML's
    return kind.adopt(Path(place)) is not None


def others_in(place: str | Path | Store) -> list[str]:
    """What a folder holds besides hidden entries (.ipynb_checkpoints, .DS_Store, CloudML's own marker,
    ledger and temporary files) and a file system's clutter."""
    return [n for n in as_store(place).names() if not n.startswith(".") and n not in CLUTTER]


def check(place: str | Path | Store, kind: Kind) -> str:
    """How `place` (a folder, or a bucket's prefix) is CloudML's `kind`, without writing: "new" (not there),
    "empty", "marked", or "adopted: why" (an earlier release's folder, by its content; a store that adopts
    nothing, never). Anything else raises, naming the place."""
    store = as_store(place)
    if not store.exists(""):
        return "new"
    problem = store.unusable(kind.name)
    if problem:
        raise CloudMLError(f"{kind.option} {store.shown()} {problem}. Nothing was written.")
    marked = marker_kind(store)
    if marked == kind.name:
        return "marked"
    if marked is not None:
        raise CloudMLError(
            f"{kind.option} {store.shown()} is CloudML's {marked} folder, not a {kind.name} folder ({MARKER} "
            f"says so); give a new or empty {store.noun} for the {kind.name}, or {kind.fits}. Nothing was "
            "written."
        )
    others = others_in(store)
    if not others:
        return "empty"
    why = kind.adopt(store.path) if isinstance(store, Folder) and store.adopts else None
    if why:
        return f"adopted: {why}"
    listed = ", ".join(n if len(n) <= 60 else n[:57] + "..." for n in others[:5])
    listed += f" and {len(others) - 5} more" if len(others) > 5 else ""
    proof = f"its {MARKER} marker" + (
        f", or the files of an earlier CloudML {kind.name} that verify" if store.adopts else ""
    )
    raise CloudMLError(
        f"{kind.option} {store.shown()} holds other {store.things} ({listed}) and is not a CloudML "
        f"{kind.name} folder: CloudML writes only into a {store.noun} it can prove is its own ({proof}), "
        f"never among other {store.things}, and it deletes, truncates or appends to nothing it did not "
        f"write. Give a new or empty {store.noun}{'' if store.adopts else ' (e.g. a subfolder)'}, or "
        f"{kind.fits}. Nothing was written."
    )


def claim(place: str | Path | Store, kind: Kind):
    """`check`, then the folder made (where needed) and marked as CloudML's `kind`, before anything else is
    written into it; an adopted folder is said once (its marker is written now). Returns the folder (a
    Path), or the store given."""
    store = as_store(place)
    claimed = place if isinstance(place, Store) else Path(place)
    how = check(store, kind)
    if how == "marked":
        return claimed
    try:
        store.make()
        write_marker(store, kind.name)
        if not store.adopts:  # its record starts empty, over any copied with the marker: a prefix holds no
            store.write_text(LEDGER, ledger_text(store, set(), {}))  # earlier release's files to adopt
    except OSError as e:
        if not isinstance(store, Folder):
            raise  # a bucket client's error: its caller's rules (a failed copy is a warning) hold
        raise CloudMLError(
            f"{kind.option} {store.shown()}: cannot make or write this folder ({e.strerror or e}); give a "
            "folder CloudML can write into (on Colab, under /content/drive/MyDrive or /content). Nothing was "
            "written."
        ) from None
    if how.startswith("adopted"):
        log.info(
            "%s: a %s folder CloudML wrote, by its content (%s), but not marked for this place (moved or "
            "copied here, or written by an earlier release); adopted, and marked as CloudML's (%s)",
            store.shown(),
            kind.name,
            how.split(": ", 1)[1],
            MARKER,
        )
    return claimed


def ledger_text(place: str | Path | Store, created: set[str], contents: dict[str, dict]) -> str:
    """A ledger as CloudML writes it (ledger.py: what it listed and recorded in `place`)."""
    doc = {"by": "CloudML", "folder": as_store(place).place, "created": sorted(created), "contents": contents}
    return json.dumps(doc, indent=0, sort_keys=True)


def write_marker(place: str | Path | Store, kind: str) -> None:
    """The marker, written whole (on a folder: temporary file, then rename; a link there is replaced, never
    written through)."""
    store = as_store(place)
    if isinstance(store, Folder) and os.path.islink(store.at(MARKER)):
        path = store.at(MARKER)
        raise CloudMLError(
            f"{path} is a symbolic link (to {os.readlink(path)}), where CloudML writes its marker; it never "
            "writes through a link. Remove the link (its target is not touched) or choose another folder. "
            "Nothing was written."
        )
    store.write_text(MARKER, json.dumps({"kind": kind, "by": "CloudML", "folder": store.place}) + "\n")


def is_marked(folder: str | Path, kind: str) -> bool:
    """Whether `folder` carries CloudML's marker of `kind` (a damaged marker is not)."""
    try:
        return marker_kind(Path(folder)) == kind
    except CloudMLError:
        return False
