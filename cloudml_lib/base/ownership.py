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

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.shapes import OPT_TEXT, TEXT, Damaged, Obj, read_json

log = logging.getLogger(__name__)

MARKER = ".cloudml"
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
    """A folder's place as a marker records it: a digest of its absolute path (`..` and links resolved). It
    binds the marker to the folder it was written in without naming a path of the writer's machine (a run or
    an export travels to a colleague with its marker)."""
    real = os.path.realpath(os.path.abspath(folder))
    return "sha256:" + hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()


def recorded_here(recorded: str | None, folder: str | Path) -> bool:
    """Whether a marker's recorded place is `folder`: today's digest, or the plain path an earlier release
    recorded."""
    return recorded in (where(folder), os.path.realpath(os.path.abspath(folder)))


def marker_kind(folder: Path, proven: bool = True) -> str | None:
    """The kind a folder's marker names; None without a marker, or where the marker does not prove it: one
    written for another folder (it records the folder it was written in: a marker copied or moved with a
    folder proves nothing there), or one that names no folder (as earlier releases wrote them, or a copy of
    such a run's); such a folder is judged by its content, as an earlier release's. `proven=False`: the kind
    any marker of CloudML's names (the ledger's claimed folder: the nearest that holds one). A marker that is
    no marker of CloudML's (a link, a folder, not its JSON) is refused: it may be someone else's file."""
    path = Path(folder) / MARKER
    if not os.path.lexists(path):
        return None
    try:
        doc = read_json(path, MARKER_SHAPE, MARKER_LIMIT)
        written_in = doc.get("folder")
        return (
            doc["kind"]
            if not proven or (written_in is not None and recorded_here(written_in, folder))
            else None
        )
    except (OSError, Damaged) as e:
        raise CloudMLError(
            f"{path} is not a marker CloudML wrote ({shown(str(e), 200)}): the folder {folder} cannot be "
            "told to be CloudML's. Move that file away, or choose another folder. Nothing was written."
        ) from None


def others_in(folder: Path) -> list[str]:
    """What a folder holds besides hidden entries (.ipynb_checkpoints, .DS_Store, CloudML's own temporary
    files) and a file system's clutter."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name not in CLUTTER)


def check(folder: str | Path, kind: Kind) -> str:
    """How `folder` is CloudML's `kind`, without writing: "new" (not there), "empty", "marked", or
    "adopted: why" (an earlier release's, by its content). Anything else raises, naming the folder."""
    folder = Path(folder)
    if not os.path.lexists(folder):
        return "new"
    if folder.is_symlink() and not folder.exists():
        raise CloudMLError(
            f"{kind.option} {folder} is a symbolic link to {shown(os.readlink(folder))}, which does not "
            "exist (or is a loop of links); give a real folder. Nothing was written."
        )
    if not folder.is_dir():
        raise CloudMLError(
            f"{kind.option} {folder} is not a folder, but a folder is needed there (for the {kind.name}). "
            "Nothing was written."
        )
    marked = marker_kind(folder)
    if marked == kind.name:
        return "marked"
    if marked is not None:
        raise CloudMLError(
            f"{kind.option} {folder} is CloudML's {marked} folder, not a {kind.name} folder ({MARKER} says "
            f"so); give a new or empty folder for the {kind.name}, or {kind.fits}. Nothing was written."
        )
    others = others_in(folder)
    if not others:
        return "empty"
    why = kind.adopt(folder)
    if why:
        return f"adopted: {why}"
    listed = ", ".join(n if len(n) <= 60 else n[:57] + "..." for n in others[:5])
    listed += f" and {len(others) - 5} more" if len(others) > 5 else ""
    raise CloudMLError(
        f"{kind.option} {folder} holds other things ({listed}) and is not a CloudML {kind.name} "
        f"folder: CloudML writes only into a folder it can prove is its own (its {MARKER} marker, or the "
        f"files of an earlier CloudML {kind.name} that verify), never among other files, and it deletes, "
        f"truncates or appends to nothing it did not write. Give a new or empty folder, or {kind.fits}. "
        "Nothing was written."
    )


def claim(folder: str | Path, kind: Kind) -> Path:
    """`check`, then the folder made (where needed) and marked as CloudML's `kind`, before anything else is
    written into it; an adopted folder is said once (its marker is written now). Returns the folder."""
    folder = Path(folder)
    how = check(folder, kind)
    if how == "marked":
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_marker(folder, kind.name)
    except OSError as e:
        raise CloudMLError(
            f"{kind.option} {folder}: cannot make or write this folder ({e.strerror or e}); give a folder "
            "CloudML can write into (on Colab, under /content/drive/MyDrive or /content). Nothing was "
            "written."
        ) from None
    if how.startswith("adopted"):
        log.info(
            "%s: a %s folder CloudML wrote, by its content (%s), but not marked for this place (moved or "
            "copied here, or written by an earlier release); adopted, and marked as CloudML's (%s)",
            folder,
            kind.name,
            how.split(": ", 1)[1],
            MARKER,
        )
    return folder


def write_marker(folder: Path, kind: str) -> None:
    """The marker, written whole (temporary file, then rename: a link there is replaced, never written
    through)."""
    path = Path(folder) / MARKER
    if os.path.islink(path):
        raise CloudMLError(
            f"{path} is a symbolic link (to {os.readlink(path)}), where CloudML writes its marker; it never "
            "writes through a link. Remove the link (its target is not touched) or choose another folder. "
            "Nothing was written."
        )
    tmp = path.with_name(f".{MARKER}.tmp-{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            tmp.unlink()
        tmp.write_text(json.dumps({"kind": kind, "by": "CloudML", "folder": where(folder)}) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def is_marked(folder: str | Path, kind: str) -> bool:
    """Whether `folder` carries CloudML's marker of `kind` (a damaged marker is not)."""
    try:
        return marker_kind(Path(folder)) == kind
    except CloudMLError:
        return False
