"""A folder in a bucket: an fsspec URL (gs://, s3://, az://, memory://, ...) where CloudML keeps a lasting
folder (data.cache_copy_dir). Its storage, for the ownership rules of ownership.py and ledger.py.

A URL is checked when a config is built (`url_problem`): its scheme must be one fsspec knows, and the package
that reads it (gcsfs, s3fs, adlfs: optional) must be installed; nothing is contacted then. Credentials are
fsspec's business: the client's default chain (gcloud, GOOGLE_APPLICATION_CREDENTIALS, AWS profiles and
environment), or fsspec's own configuration (~/.config/fsspec, FSSPEC_<PROTOCOL>_<OPTION>).

A prefix is CloudML's as a folder is, by the same rules written once (store.py's interface, which `Prefix`
implements): the `.cloudml` marker (the kind and the URL it was written for), written before anything else
goes into a prefix that holds nothing (ownership.claim), a prefix holding other objects refused by name and
left untouched (no earlier release wrote to a bucket: nothing is adopted); and the same ledger,
`.cloudml-files` (ledger.py), listing what CloudML created before it is created and recording each object it
uploaded by its size and sha256. Anything not listed is never replaced or deleted; an object whose content
changed since (damaged, or edited) is the user's, and before CloudML writes where it lies it is copied aside
to NAME.kept-N, its bytes as they were, and said (ledger.set_aside_changed). An object store has no lock: two
sessions that add at the same moment may lose one entry, which only makes CloudML refuse, later, to replace
that entry (the safe side).
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass

from cloudml_lib.base.errors import CloudMLError, install_command, shown
from cloudml_lib.base.shapes import Damaged, parse_json
from cloudml_lib.base.store import Store, sha256_read

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
    except (
        CloudMLError,
        OSError,
        Damaged,
    ):  # Damaged: what CloudML found wrong with an object, not the client
        raise
    except Exception as e:  # noqa: BLE001 - gcsfs, s3fs, adlfs and the auth libraries raise their own
        text = str(e) if len(str(e)) <= 300 else str(e)[:297] + "..."
        raise OSError(f"{url}: {type(e).__name__}: {text}") from e


@dataclass(frozen=True)
class Prefix(Store):
    """A folder in a bucket (store.py's interface, as a folder on this machine): its URL, the fsspec file
    system and the path within it. Each call's client errors are OSError naming the URL (`errors`)."""

    url: str
    fs: object
    root: str

    noun = "prefix"
    things = "objects"
    item = "object"
    adopts = False  # no earlier release wrote to a bucket: what lies there proves nothing CloudML's

    @property
    def place(self) -> str:
        """The URL a marker records: the file system's own spelling (gcs:// and gs://, a trailing slash:
        one place)."""
        return self.fs.unstrip_protocol(self.root)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def shown(self, rel: str = "") -> str:
        return self.url_of(rel) if rel else self.url

    def exists(self, rel: str) -> bool:
        """An object at `rel`; the prefix itself ("") exists by what it holds."""
        with errors(self.url):
            return self.holds(rel) if not rel else self.fs.exists(self.path(rel))

    def holds(self, rel: str) -> bool:
        """Whether any object lies at `rel` or under it."""
        with errors(self.url):
            return self.fs.exists(self.path(rel)) or bool(self.fs.find(self.path(rel)))

    def names(self) -> list[str]:
        with errors(self.url):
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})

    def file_size(self, rel: str) -> int | None:
        with errors(self.url):
            info = self.fs.info(self.path(rel))
        return int(info["size"]) if info.get("type") == "file" else None

    def sha256(self, rel: str, size: int | None = None) -> str | None:
        with errors(self.url), self.fs.open(self.path(rel), "rb") as f:
            h = sha256_read(f, size)
        return None if h is None else h.hexdigest()

    def read_small(self, rel: str, limit: int) -> bytes:
        """A small object's bytes (Damaged: bigger than `limit`, so not the file CloudML wrote)."""
        with errors(self.url):
            if self.fs.size(self.path(rel)) > limit:
                raise Damaged(f"{self.url_of(rel)} is bigger than {limit} bytes")
            return self.fs.cat_file(self.path(rel))

    def read_json(self, rel: str, shape, limit: int):
        """A small JSON object of the prefix, parsed as `shape` (Damaged: too big, or not that shape)."""
        return parse_json(self.read_small(rel, limit), shape)

    def write_text(self, rel: str, text: str) -> None:
        with errors(self.url):
            self.fs.pipe_file(self.path(rel), text.encode())

    def make(self) -> None:
        """Nothing: a prefix exists by its objects."""

    def keep_aside(self, rel: str, aside: str) -> None:
        """A whole copy (an object store has no rename; the original is then written over by CloudML); a
        copy cut off or short is removed (CloudML made it a moment ago) and OSError says so, `rel` as it
        was."""
        with errors(self.url):
            size = self.fs.size(self.path(rel))
            try:
                self.fs.copy(self.path(rel), self.path(aside))
                whole = self.fs.size(self.path(aside)) == size
            except BaseException:
                self._remove_own(aside)
                raise
            if not whole:
                self._remove_own(aside)
                raise OSError(
                    f"{self.url_of(rel)} could not be copied whole to {self.url_of(aside)}: nothing was "
                    "replaced"
                )

    def _remove_own(self, rel: str) -> None:
        try:
            if self.fs.exists(self.path(rel)):
                self.fs.rm_file(self.path(rel))
        except Exception:  # noqa: BLE001 - the next copy takes the next free name
            pass


def open_prefix(url: str) -> Prefix:
    """The prefix `url` names, through fsspec (its client made with fsspec's configuration and the default
    credentials)."""
    from fsspec.core import url_to_fs

    with errors(url):
        fs, root = url_to_fs(url)
    return Prefix(url.rstrip("/"), fs, root.rstrip("/"))
