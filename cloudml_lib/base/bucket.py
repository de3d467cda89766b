"""A folder in a bucket: an fsspec URL (gs://, s3://, az://, memory://, ...) where CloudML keeps a lasting
folder (data.cache_copy_dir). The counterpart, for an object store, of ownership.py and ledger.py.

A URL is checked when a config is built (`url_problem`): its scheme must be one fsspec knows, and the package
that reads it (gcsfs, s3fs, adlfs: optional) must be installed; nothing is contacted then. Credentials are
fsspec's business: the client's default chain (gcloud, GOOGLE_APPLICATION_CREDENTIALS, AWS profiles and
environment), or fsspec's own configuration (~/.config/fsspec, FSSPEC_<PROTOCOL>_<OPTION>).

A prefix is CloudML's as a folder is: by the same `.cloudml` marker (the kind and the URL it was written for),
written before anything else goes into a prefix that holds nothing; a prefix holding other objects is refused
by name and left untouched (no earlier release wrote to a bucket: nothing is adopted). What CloudML created in
it is listed in the same ledger, `.cloudml-files`, before it is created; anything not listed is never replaced
or deleted. Each object CloudML uploaded is recorded there too, by its size and sha256 (`record`), as a
folder's files are: an object whose content changed since (damaged, or edited) is the user's, and before
CloudML writes where it lies it is moved aside to NAME.kept-N, its bytes as they were, and said
(`set_aside_changed`). An object store has no lock: two sessions that add at the same moment may lose one
entry, which only makes CloudML refuse, later, to replace that entry (the safe side).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass

from cloudml_lib.base.errors import CloudMLError, install_command, shown
from cloudml_lib.base.ledger import LEDGER, LEDGER_LIMIT, LEDGER_SHAPE, is_listed
from cloudml_lib.base.ownership import CLUTTER, MARKER, MARKER_LIMIT, MARKER_SHAPE, Kind
from cloudml_lib.base.shapes import Damaged, parse_json

log = logging.getLogger(__name__)

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
EXAMPLES = "gs://BUCKET/folder (needs gcsfs), s3://BUCKET/folder (s3fs), az://CONTAINER/folder (adlfs)"


def is_url(value) -> bool:
    """Whether a setting names a place by URL (`scheme://...`) rather than a folder."""
    return isinstance(value, str) and SCHEME.match(value) is not None


def url_problem(key: str, url: str, packages: bool = True) -> str | None:
    """What makes `url` unusable for `key`, in words (an unknown scheme, no bucket, and with `packages` the
    scheme's package not installed, with the command that installs it); None where it can be used. Nothing
    is contacted."""
    import fsspec
    from fsspec.registry import known_implementations, registry

    scheme = SCHEME.match(url).group(1).lower()
    if scheme not in registry and scheme not in known_implementations:
        return (
            f"{key}: {shown(url)} has the scheme {scheme}://, which fsspec does not know; valid: a folder, "
            f"or an fsspec URL such as {EXAMPLES}"
        )
    if not url[len(scheme) + 3 :].strip("/"):
        return f"{key}: {shown(url)} names no bucket; give e.g. {scheme}://BUCKET/cloudml/cache"
    if not packages:  # a stored run's config: read as it was written
        return None
    if scheme in ("file", "local"):  # fsspec's local store makes no folders: no copy would ever be made
        return (
            f"{key}: {shown(url)} names a folder on this machine as a URL; write the folder itself: "
            f"{key}: {url[len(scheme) + 3 :] or '/'}"
        )
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        package = known_implementations.get(scheme, {}).get("class", scheme).split(".")[0]
        return (
            f"{key}: {shown(url)} needs the package {package} (it reads {scheme}:// URLs), which is not "
            f"installed. Install it with `{install_command(package)}`, or set {key} to a folder (empty: no "
            "copy)"
        )
    return None


@contextmanager
def errors(url: str):
    """A bucket client's own exceptions (HTTP errors, missing credentials) as OSError naming the URL: what a
    folder's copy raises, so that the callers' rules (a failed copy is a warning) hold for both."""
    try:
        yield
    except (CloudMLError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - gcsfs, s3fs, adlfs and the auth libraries raise their own
        text = str(e) if len(str(e)) <= 300 else str(e)[:297] + "..."
        raise OSError(f"{url}: {type(e).__name__}: {text}") from e


@dataclass(frozen=True)
class Prefix:
    """A folder in a bucket: its URL, the fsspec file system and the path within it."""

    url: str
    fs: object
    root: str

    @property
    def place(self) -> str:
        """The URL a marker records: the file system's own spelling (gcs:// and gs://, a trailing slash:
        one place)."""
        return self.fs.unstrip_protocol(self.root)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def holds(self, rel: str) -> bool:
        """Whether any object lies at `rel` or under it."""
        return self.fs.exists(self.path(rel)) or bool(self.fs.find(self.path(rel)))

    def read_small(self, rel: str, limit: int) -> bytes:
        """A small object's bytes (Damaged: bigger than `limit`, so not the file CloudML wrote)."""
        if self.fs.size(self.path(rel)) > limit:
            raise Damaged(f"{self.url_of(rel)} is bigger than {limit} bytes")
        return self.fs.cat_file(self.path(rel))

    def read_json(self, rel: str, shape, limit: int):
        """A small JSON object of the prefix, parsed as `shape` (Damaged: too big, or not that shape)."""
        return parse_json(self.read_small(rel, limit), shape)

    def write_json(self, rel: str, doc: dict) -> None:
        self.fs.pipe_file(self.path(rel), (json.dumps(doc, indent=0) + "\n").encode())


def open_prefix(url: str) -> Prefix:
    """The prefix `url` names, through fsspec (its client made with fsspec's configuration and the default
    credentials)."""
    from fsspec.core import url_to_fs

    with errors(url):
        fs, root = url_to_fs(url)
    return Prefix(url.rstrip("/"), fs, root.rstrip("/"))


def others_in(prefix: Prefix) -> list[str]:
    """The names directly under the prefix, besides hidden ones (CloudML's marker and ledger) and clutter."""
    try:
        entries = prefix.fs.ls(prefix.root, detail=False)
    except FileNotFoundError:
        return []
    names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
    return sorted(n for n in names if n and not n.startswith(".") and n not in CLUTTER)


def marker_kind(prefix: Prefix) -> str | None:
    """The kind the prefix's marker names; None without one, or where it does not name this prefix (copied
    with the objects, or naming none: it proves nothing here). A marker that is not CloudML's is refused."""
    if not prefix.fs.exists(prefix.path(MARKER)):
        return None
    try:
        doc = prefix.read_json(MARKER, MARKER_SHAPE, MARKER_LIMIT)
    except Damaged as e:
        raise CloudMLError(
            f"{prefix.url_of(MARKER)} is not a marker CloudML wrote ({shown(str(e), 200)}): {prefix.url} "
            "cannot be told to be CloudML's. Move that object away, or choose another place. Nothing was "
            "written."
        ) from None
    return doc["kind"] if doc.get("folder") == prefix.place else None


def claim(prefix: Prefix, kind: Kind) -> Prefix:
    """ownership.claim for a bucket: the prefix marked as CloudML's `kind` (with an empty ledger) before
    anything else is written there; one marked for another kind, or holding other objects, is refused by
    name and left untouched. Returns the prefix."""
    with errors(prefix.url):
        marked = marker_kind(prefix)
        if marked == kind.name:
            return prefix
        if marked is not None:
            raise CloudMLError(
                f"{kind.option} {prefix.url} is CloudML's {marked} folder, not a {kind.name} folder "
                f"({MARKER} says so); give a new or empty prefix for the {kind.name}. Nothing was written."
            )
        others = others_in(prefix)
        if others:
            listed = ", ".join(n if len(n) <= 60 else n[:57] + "..." for n in others[:5]) + (
                f" and {len(others) - 5} more" if len(others) > 5 else ""
            )
            raise CloudMLError(
                f"{kind.option} {prefix.url} holds other objects ({listed}) and is not a CloudML {kind.name} "
                f"folder: CloudML writes only where it can prove the place is its own (its {MARKER} marker), "
                "never among other objects, and it replaces or deletes nothing it did not write. Give a new "
                "or empty prefix (e.g. a subfolder: .../cloudml/cache). Nothing was written."
            )
        prefix.write_json(MARKER, {"kind": kind.name, "by": "CloudML", "folder": prefix.place})
        _write_ledger(prefix, set())
    return prefix


def listed(prefix: Prefix) -> set[str]:
    """The ledger of a claimed prefix; one that is missing or damaged proves nothing CloudML's: it is made
    again empty, never from what happens to be there (what CloudML wrote before stays, not replaced)."""
    return _ledger(prefix)[0]


def _ledger(prefix: Prefix) -> tuple[set[str], dict[str, dict]]:
    """The listed names and the content records (base/ledger.py's format) of a claimed prefix."""
    try:
        doc = prefix.read_json(LEDGER, LEDGER_SHAPE, LEDGER_LIMIT)
        return set(doc["created"]), dict(doc.get("contents", {}))
    except (FileNotFoundError, Damaged) as e:
        log.warning(
            "%s has no readable record of what CloudML wrote there (%s): nothing there is taken as "
            "CloudML's, so no object of it is replaced or deleted; a new record starts empty",
            prefix.url,
            "missing" if isinstance(e, FileNotFoundError) else f"damaged: {shown(str(e), 200)}",
        )
        _write_ledger(prefix, set())
        return set(), {}


def _write_ledger(prefix: Prefix, created: set[str], contents: dict[str, dict] | None = None) -> None:
    doc = {"by": "CloudML", "folder": prefix.place, "created": sorted(created)}
    kept = {rel: c for rel, c in (contents or {}).items() if is_listed(created, rel)}
    prefix.write_json(LEDGER, {**doc, "contents": kept} if kept else doc)


def add(prefix: Prefix, rel: str) -> None:
    """List `rel` (about to be created by CloudML) in the prefix's ledger."""
    with errors(prefix.url):
        created, contents = _ledger(prefix)
        if not is_listed(created, rel):
            _write_ledger(prefix, created | {rel}, contents)


def record(prefix: Prefix, written: dict[str, tuple[int, str]]) -> None:
    """Record what CloudML just uploaded: {rel: (size, sha256)} (each rel listed, or under a listed name)."""
    with errors(prefix.url):
        created, contents = _ledger(prefix)
        contents.update({rel: {"size": size, "sha256": [sha]} for rel, (size, sha) in written.items()})
        _write_ledger(prefix, created, contents)


def _sha256_of(prefix: Prefix, rel: str) -> str:
    h = hashlib.sha256()
    with prefix.fs.open(prefix.path(rel), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def set_aside_changed(prefix: Prefix, rels: list[str]) -> list[str]:
    """Before CloudML writes or removes the objects `rels`: each one whose content is not what CloudML
    recorded uploading (damaged, or edited since) is moved to REL.kept-N, its bytes as they were, and said;
    then every record of `rels` is dropped (a write cut off later leaves an object listed by name alone,
    which CloudML may replace). Returns the names the changed objects were moved to."""
    moved = []
    with errors(prefix.url):
        created, contents = _ledger(prefix)
        for rel in rels:
            rec = contents.get(rel)
            if rec is None or not prefix.fs.exists(prefix.path(rel)):
                continue
            size = prefix.fs.size(prefix.path(rel))
            if size == rec["size"] and _sha256_of(prefix, rel) in rec["sha256"]:
                continue
            n = 1
            while prefix.fs.exists(prefix.path(f"{rel}.kept-{n}")):
                n += 1
            aside = f"{rel}.kept-{n}"
            _copy_whole(prefix, rel, aside, size)
            log.warning(
                "%s was changed after CloudML wrote it (damaged, or edited): it is kept as %s, and CloudML "
                "writes its own in its place",
                prefix.url_of(rel),
                prefix.url_of(aside),
            )
            moved.append(aside)
        if any(rel in contents for rel in rels):
            _write_ledger(prefix, created, {r: c for r, c in contents.items() if r not in rels})
    return moved


def _copy_whole(prefix: Prefix, rel: str, aside: str, size: int) -> None:
    """Copy object `rel` to the free name `aside`; a copy cut off or short is removed (CloudML made it a
    moment ago) and the upload stops, `rel` as it was."""
    try:
        prefix.fs.copy(prefix.path(rel), prefix.path(aside))
        whole = prefix.fs.size(prefix.path(aside)) == size
    except BaseException:
        _remove_own(prefix, aside)
        raise
    if not whole:
        _remove_own(prefix, aside)
        raise OSError(
            f"{prefix.url_of(rel)} could not be copied whole to {prefix.url_of(aside)}: nothing was replaced"
        )


def _remove_own(prefix: Prefix, rel: str) -> None:
    try:
        if prefix.fs.exists(prefix.path(rel)):
            prefix.fs.rm_file(prefix.path(rel))
    except OSError:
        pass  # the next upload takes the next free name


def refuse_unless_mine(prefix: Prefix, rel: str, doing: str) -> None:
    """Raise, naming the objects, where something lies at `rel` that the prefix's ledger does not list."""
    with errors(prefix.url):
        if not prefix.holds(rel) or is_listed(listed(prefix), rel):
            return
    raise CloudMLError(
        f"{prefix.url_of(rel)} was not written by CloudML (its record of what CloudML created, "
        f"{prefix.url_of(LEDGER)}, does not list it), so CloudML does not {doing} it: it is left as it is. "
        "Move it away to let CloudML write its own copy there, or choose another prefix. Nothing was written "
        "to it."
    )
