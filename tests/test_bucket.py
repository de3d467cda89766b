"""The cache's lasting copy in a bucket (data.cache_copy_dir: an fsspec URL), with fsspec's in-memory file
system standing in for gs:// and s3://."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from cloudml_lib.base import bucket, ledger
from cloudml_lib.base.config import build_config
from cloudml_lib.base.errors import CloudMLError, ConfigError
from cloudml_lib.base.ownership import claim, marker_kind
from cloudml_lib.data import cache as cache_mod
from cloudml_lib.data.cache import cache_folders, cache_key, check_folder_settings, load_flight_cache

URL = "memory://bucket/cloudml/cache"


@pytest.fixture
def store():
    """fsspec's memory file system, empty before and after the test: {path: bytes} of what it holds."""

    def clear():
        MemoryFileSystem.store.clear()
        MemoryFileSystem.pseudo_dirs[:] = [""]

    clear()
    fs = MemoryFileSystem()
    yield lambda: {p: fs.cat_file(p) for p in fs.find("/")}
    clear()


def _flip(path: str, at: int = -3) -> None:
    fs = MemoryFileSystem()
    raw = bytearray(fs.cat_file(path))
    raw[at] ^= 0xFF  # same size, one byte changed
    fs.pipe_file(path, bytes(raw))


def test_a_built_cache_is_uploaded_and_a_new_machine_copies_it(tiny_config, tmp_path, store, monkeypatch):
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = URL
    built = load_flight_cache(flight, data)
    assert built.source == "built"
    held = store()
    name = f"/bucket/cloudml/cache/{built.path.name}"
    for f in ("samples.npz", "frames.npy", "meta.json"):
        assert held[f"{name}/{f}"] == (built.path / f).read_bytes()
    assert json.loads(held["/bucket/cloudml/cache/.cloudml"])["kind"] == "preprocessing cache"
    assert json.loads(held["/bucket/cloudml/cache/.cloudml-files"])["created"] == [built.path.name]

    data.cache_dir = str(tmp_path / "second_machine")  # a new VM: its local disk holds no cache
    monkeypatch.setattr(cache_mod, "_build", lambda *a: pytest.fail("rebuilt although a valid copy exists"))
    copied = load_flight_cache(flight, data)
    assert copied.source == "copied" and copied.path.parent == tmp_path / "second_machine"
    for f in ("samples.npz", "frames.npy", "meta.json"):
        assert (copied.path / f).read_bytes() == (built.path / f).read_bytes()
    np.testing.assert_array_equal(copied.frames.read(copied.windows[3]), built.frames.read(built.windows[3]))
    assert load_flight_cache(flight, data).source == "reused"
    assert store() == held  # reading the copy wrote nothing to the bucket


def test_a_damaged_copy_in_the_bucket_is_named_and_rebuilt(tiny_config, tmp_path, store, caplog):
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = URL
    built = load_flight_cache(flight, data)
    frames = f"/bucket/cloudml/cache/{built.path.name}/frames.npy"
    _flip(frames)
    data.cache_dir = str(tmp_path / "second_machine")
    again = load_flight_cache(flight, data)
    assert again.source == "built"
    assert f"memory://bucket/cloudml/cache/{built.path.name}/frames.npy does not match" in caplog.text
    assert "rebuilding" in caplog.text
    assert (again.path / "frames.npy").read_bytes() == (built.path / "frames.npy").read_bytes()
    assert store()[frames] == (built.path / "frames.npy").read_bytes()  # the copy is repaired too
    assert not list(again.path.parent.glob("*.tmp-*")), "a temporary copy was left behind"


def test_an_object_changed_since_cloudml_uploaded_it_is_kept_aside_never_overwritten(
    tiny_config, tmp_path, store, caplog, monkeypatch
):
    """The bucket's ledger records each object CloudML uploaded (size and sha256), as a folder's ledger does:
    one whose content changed since (damaged, or edited: the same size, one byte) is moved to NAME.kept-1,
    its bytes as they were, and said, before CloudML's own copy goes in its place (it was overwritten
    without a word); the kept copy is the user's, though it lies in the flight's listed folder. An upload
    cut off after the records were dropped leaves names alone: replaced."""
    from cloudml_lib.data import cachefiles

    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = URL
    built = load_flight_cache(flight, data)
    name = built.path.name
    contents = json.loads(store()["/bucket/cloudml/cache/.cloudml-files"])["contents"]
    for f in ("samples.npz", "frames.npy", "meta.json"):
        local = (built.path / f).read_bytes()
        assert contents[f"{name}/{f}"] == {"size": len(local), "sha256": [hashlib.sha256(local).hexdigest()]}
    samples = f"/bucket/cloudml/cache/{name}/samples.npz"
    _flip(samples, at=100)
    edited = store()[samples]
    data.cache_dir = str(tmp_path / "second_machine")
    again = load_flight_cache(flight, data)
    assert again.source == "built"
    held = store()
    assert held[f"{samples}.kept-1"] == edited and held[samples] == (built.path / "samples.npz").read_bytes()
    assert ledger.judge(prefix := bucket.open_prefix(URL), f"{name}/samples.npz.kept-1") == ("unlisted", "")
    said = f"{URL}/{name}/samples.npz was changed after CloudML wrote it (damaged, or edited): it is "
    said += "kept, as it is, as "
    assert said + f"{URL}/{name}/samples.npz.kept-1" in caplog.text

    def cut(*a):
        raise OSError("the connection dropped")

    monkeypatch.setattr(cachefiles, "_stream", cut)  # the records dropped, then the upload cut off
    with pytest.raises(OSError, match="the connection dropped"):
        cachefiles.upload_flight_cache(again.path, prefix, "save")
    monkeypatch.undo()
    assert not json.loads(store()["/bucket/cloudml/cache/.cloudml-files"]).get("contents")
    cachefiles.upload_flight_cache(again.path, prefix, "save")  # what the cut left: listed by name alone
    assert not MemoryFileSystem().exists(f"{samples}.kept-2")
    assert store()[samples] == (built.path / "samples.npz").read_bytes()


def test_a_kept_copy_cut_off_is_removed_and_the_changed_object_left_as_it_was(
    tiny_config, tmp_path, store, monkeypatch
):
    """The copy that keeps a changed object aside, cut off short: the upload stops naming both, the object
    stays as it was, and the short copy (CloudML's, made a moment before) is not left behind as if it were
    the user's bytes."""
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = URL
    built = load_flight_cache(flight, data)
    samples = f"/bucket/cloudml/cache/{built.path.name}/samples.npz"
    _flip(samples, at=100)
    edited = store()[samples]
    fs = MemoryFileSystem()
    monkeypatch.setattr(
        MemoryFileSystem, "copy", lambda self, a, b, **kw: fs.pipe_file(b, fs.cat_file(a)[:50])
    )
    prefix = bucket.open_prefix(URL)
    with pytest.raises(OSError, match="samples.npz.kept-1.*nothing was replaced"):
        ledger.set_aside_changed(prefix, [f"{built.path.name}/samples.npz"])
    assert store()[samples] == edited and not fs.exists(f"{samples}.kept-1")
    monkeypatch.undo()
    assert ledger.set_aside_changed(prefix, [f"{built.path.name}/samples.npz"]) == [
        f"{built.path.name}/samples.npz.kept-1"
    ]
    assert store()[f"{samples}.kept-1"] == edited


def test_a_partial_upload_is_not_used(tiny_config, tmp_path, store, caplog, monkeypatch):
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = URL
    built = load_flight_cache(flight, data)
    meta = f"/bucket/cloudml/cache/{built.path.name}/meta.json"
    MemoryFileSystem().rm_file(meta)  # an upload cut off before its last object
    data.cache_dir = str(tmp_path / "second_machine")
    copies = []
    monkeypatch.setattr(cache_mod, "download_flight_cache", lambda *a: copies.append(a))
    again = load_flight_cache(flight, data)
    assert again.source == "built" and not copies
    assert f"{built.path.name} is incomplete (no meta.json" in caplog.text
    assert store()[meta] == (again.path / "meta.json").read_bytes()  # uploaded whole this time


def test_a_prefix_holding_other_objects_is_refused_and_left_untouched(tiny_config, tmp_path, store):
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    fs = MemoryFileSystem()
    fs.pipe_file("/bucket/theirs/notes.txt", b"keep me")
    data.cache_copy_dir = "memory://bucket/theirs"
    before = store()
    theirs = r"data.cache_copy_dir memory://bucket/theirs holds other objects \(notes.txt\)"
    with pytest.raises(CloudMLError, match=theirs):
        load_flight_cache(flight, data)
    assert store() == before

    # CloudML's own prefix, but an object it did not write where this flight's cache would go
    data.cache_copy_dir, data.cache_dir = URL, str(tmp_path / "second_machine")
    claim(bucket.open_prefix(URL), cache_mod.CACHE)
    name = f"{flight.name}-{cache_key(flight, data)}"
    fs.pipe_file(f"/bucket/cloudml/cache/{name}/mine.txt", b"a user's")
    before = store()
    with pytest.raises(CloudMLError, match=rf"{URL}/{name} was not written by CloudML"):
        load_flight_cache(flight, data)
    assert store() == before


def test_a_prefix_is_cloudmls_by_a_marker_naming_it_and_a_ledger_never_built_from_what_is_there(store):
    """A marker that names no URL (or another) proves nothing: the prefix holding other objects is refused.
    A claimed prefix whose ledger is gone gets an empty one: another tool's object there is never replaced."""
    fs = MemoryFileSystem()
    fs.pipe_file("/bucket/copied/.cloudml", b'{"kind": "preprocessing cache", "by": "CloudML"}')
    fs.pipe_file("/bucket/copied/theirs.bin", b"keep me")
    copied = bucket.open_prefix("memory://bucket/copied")
    assert marker_kind(copied) is None
    before = store()
    with pytest.raises(CloudMLError, match=r"holds other objects \(theirs.bin\)"):
        claim(copied, cache_mod.CACHE)
    assert store() == before
    prefix = claim(bucket.open_prefix(URL), cache_mod.CACHE)
    ledger.list_at(prefix, "another-flight")
    fs.rm_file("/bucket/cloudml/cache/.cloudml-files")  # the ledger lost
    fs.pipe_file("/bucket/cloudml/cache/flight-key/frames.npy", b"another tool's")
    with pytest.raises(CloudMLError, match="was not written by CloudML"):
        ledger.refuse_at(prefix, "flight-key", "replace")
    assert ledger.listed(prefix) == set() and fs.cat_file("/bucket/cloudml/cache/flight-key/frames.npy") == (
        b"another tool's"
    )


def test_a_failed_upload_is_a_warning(tiny_config, store, caplog, monkeypatch):
    """A bucket client's own error (here at the first write) is said, and the run goes on."""
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = URL

    def refused(*a, **k):
        raise RuntimeError("403 Forbidden: caller does not have storage.objects.create access")

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", refused)
    built = load_flight_cache(flight, data)
    assert built.source == "built" and (built.path / "frames.npy").is_file()
    assert f"could not copy its cache to {URL}/{built.path.name}" in caplog.text
    assert "RuntimeError: 403 Forbidden" in caplog.text


def test_a_url_is_checked_when_the_config_is_built_and_kept_as_written(monkeypatch):
    from fsspec.registry import known_implementations

    data = build_config({"data": {"cache_copy_dir": URL, "cache_dir": "c"}}).data
    assert data.cache_copy_dir == URL  # not made a path, as a relative folder is
    check_folder_settings(data)  # no folder to check
    assert cache_folders(data) == (Path("c").absolute(),)  # a bucket is not searched for flight files
    monkeypatch.setitem(  # a scheme whose package is not installed (as gcsfs for gs:// off Colab)
        known_implementations, "cloudmltest", {"class": "cloudml_absent_pkg.FS", "err": "install it"}
    )
    monkeypatch.delenv("CLOUDML_PARENT_PID", raising=False)
    with pytest.raises(ConfigError) as e:
        build_config({"data": {"cache_copy_dir": "cloudmltest://bucket/cache"}})
    needs = "data.cache_copy_dir: 'cloudmltest://bucket/cache' needs the package cloudml_absent_pkg"
    assert needs in str(e.value)
    monkeypatch.setenv("CLOUDML_PARENT_PID", "1")  # a command a notebook started: a cell's command
    with pytest.raises(ConfigError, match="`%pip install cloudml_absent_pkg`"):
        build_config({"data": {"cache_copy_dir": "cloudmltest://bucket/cache"}})
    stored = build_config({"data": {"cache_copy_dir": "cloudmltest://bucket/cache"}}, packages=False)
    assert stored.data.cache_copy_dir == "cloudmltest://bucket/cache"  # a stored run's: evaluated elsewhere
    with pytest.raises(ConfigError, match=r"scheme nosuch://, which fsspec does not know; valid: .*gs://"):
        build_config({"data": {"cache_copy_dir": "nosuch://bucket/cache"}})
    with pytest.raises(ConfigError, match=r"data.cache_dir: 'memory://b/c' is a URL, but .* a folder"):
        build_config({"data": {"cache_dir": "memory://b/c"}})
    with pytest.raises(ConfigError) as e:  # fsspec's local store makes no folders: refused before anything
        build_config({"data": {"cache_copy_dir": "file:///tmp/copies"}})
    assert "'file:///tmp/copies' names a folder on this machine as a URL; write the folder itself: " in str(
        e.value
    )
    assert str(e.value).rstrip().endswith("data.cache_copy_dir: /tmp/copies")


def test_a_stored_config_whose_bucket_package_is_missing_builds_the_cache(tiny_config, caplog, monkeypatch):
    """A run trained with gs:// evaluated where gcsfs is not installed: its cache is built, said twice."""
    from fsspec.registry import known_implementations

    monkeypatch.setitem(known_implementations, "cloudmltest", {"class": "cloudml_absent_pkg.FS", "err": "no"})
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = "cloudmltest://bucket/cache"
    built = load_flight_cache(flight, data)
    assert built.source == "built"
    assert "could not use the cache copy in cloudmltest://bucket/cache/" in caplog.text
    assert "could not copy its cache to cloudmltest://bucket/cache/" in caplog.text


@pytest.fixture(params=["folder", "bucket prefix"])
def place(request, tmp_path, store):
    """A new place of either store: a folder on this machine, or a prefix in fsspec's memory bucket."""
    from cloudml_lib.base.store import Folder

    return Folder(tmp_path / "place") if request.param == "folder" else bucket.open_prefix(URL)


def test_a_folder_and_a_bucket_prefix_follow_one_set_of_ownership_rules(place):
    """The marker, the ledger and their rules are written once, for store.py's interface: the same calls
    claim either place, list and record what CloudML writes, find a changed file the user's and keep it
    aside as NAME.kept-N, and refuse what CloudML did not write, in the same words but for the noun."""
    from cloudml_lib.base.ownership import check
    from cloudml_lib.core.run.runfolder import RUN

    assert check(place, cache_mod.CACHE) == "new"
    claim(place, cache_mod.CACHE)
    assert marker_kind(place) == cache_mod.CACHE.name and check(place, cache_mod.CACHE) == "marked"
    ledger.list_at(place, "a.txt")  # listed before it is created
    place.write_text("a.txt", "one")
    ledger.record_at(place, {"a.txt": (3, hashlib.sha256(b"one").hexdigest())})
    assert ledger.judge(place, "a.txt") is None and ledger.listed(place) == {"a.txt"}
    place.write_text("a.txt", "two")  # the same size, other bytes: edited since
    assert ledger.judge(place, "a.txt") == (
        "changed",
        "its content is not what CloudML wrote (its sha256 differs)",
    )
    assert ledger.set_aside_changed(place, ["a.txt"]) == ["a.txt.kept-1"]
    assert place.sha256("a.txt.kept-1") == hashlib.sha256(b"two").hexdigest()  # its bytes, as they were
    assert ledger.judge(place, "a.txt.kept-1") == ("unlisted", "")  # the user's from now on
    assert ledger.judge(place, "a.txt") is None  # CloudML's name again, listed by name alone
    place.write_text("theirs.txt", "x")
    noun = "folder" if place.noun == "folder" else "prefix"
    with pytest.raises(CloudMLError, match=rf"theirs.txt was not written by CloudML \(its {noun}'s record"):
        ledger.refuse_at(place, "theirs.txt", "replace")
    assert place.sha256("theirs.txt") == hashlib.sha256(b"x").hexdigest()
    with pytest.raises(CloudMLError, match=f"is CloudML's {cache_mod.CACHE.name} folder, not a run folder"):
        check(place, RUN)  # claimed for another kind: named


def test_a_prefixs_record_damaged_copied_or_deleted_is_said_and_starts_again_empty(
    store, caplog, monkeypatch
):
    """Whatever becomes of a prefix's ledger, nothing there is taken as CloudML's: one too big to be its
    ledger (or a marker too big to be its marker) is named as such, never reported as the bucket's failure
    (that stopped every upload for good); one copied with a marker from another prefix is replaced by an
    empty one when the prefix is claimed (a user's object under a name it listed was replaced); one deleted
    since is said (it was silent)."""
    monkeypatch.setattr(ledger, "_said", set())  # said once a process: as in a process of its own
    fs = MemoryFileSystem()
    prefix = claim(bucket.open_prefix(URL), cache_mod.CACHE)
    fs.pipe_file("/bucket/cloudml/cache/.cloudml-files", b" " * (ledger.LEDGER_LIMIT + 1))
    with caplog.at_level("WARNING"):
        ledger.list_at(prefix, "flight-a")
    assert ledger.listed(prefix) == {"flight-a"} and ".cloudml-files is damaged" in caplog.text
    fs.pipe_file("/bucket/other/.cloudml", b" " * 5000)
    with pytest.raises(CloudMLError, match="is not a marker CloudML wrote"):
        marker_kind(bucket.open_prefix("memory://bucket/other"))

    copied = {".cloudml": b"", ".cloudml-files": b""}
    for name in copied:  # a marker and a ledger copied from CloudML's prefix, nothing else
        copied[name] = fs.cat_file(f"/bucket/cloudml/cache/{name}")
        fs.pipe_file(f"/bucket/copy/{name}", copied[name])
    into = claim(bucket.open_prefix("memory://bucket/copy"), cache_mod.CACHE)
    assert ledger.listed(into) == set()
    fs.pipe_file("/bucket/copy/flight-a/frames.npy", b"the user's")
    with pytest.raises(CloudMLError, match="flight-a was not written by CloudML"):
        ledger.refuse_at(into, "flight-a", "replace")

    fs.rm_file("/bucket/cloudml/cache/.cloudml-files")
    with caplog.at_level("WARNING"):
        assert ledger.listed(prefix) == set()
    assert f"{URL} has no record of what CloudML wrote there (.cloudml-files is missing)" in caplog.text


def test_a_bucket_failing_while_its_objects_are_checked_is_its_failure_not_a_users_edit(store, monkeypatch):
    """A client error (a 503) while CloudML reads back an object it uploaded: the bucket's failure, raised as
    one (a failed copy is a warning), never "changed since": that kept CloudML's own object aside as the
    user's, for good, and said it was edited."""
    fs = MemoryFileSystem()
    prefix = claim(bucket.open_prefix(URL), cache_mod.CACHE)
    ledger.list_at(prefix, "f")
    fs.pipe_file("/bucket/cloudml/cache/f/frames.npy", b"CloudML's")
    ledger.record_at(prefix, {"f/frames.npy": (9, hashlib.sha256(b"CloudML's").hexdigest())})

    def unavailable(*a, **k):
        raise RuntimeError("503 Service Unavailable")

    monkeypatch.setattr(MemoryFileSystem, "_open", unavailable)
    with pytest.raises(OSError, match="503 Service Unavailable"):
        ledger.set_aside_changed(prefix, ["f/frames.npy"])
    monkeypatch.undo()
    assert not fs.exists("/bucket/cloudml/cache/f/frames.npy.kept-1")
    assert ledger.judge(prefix, "f/frames.npy") is None


def test_a_buckets_network_calls_never_hold_up_a_folders_record(store, tmp_path):
    """The process's thread lock guards the folders' records (and the appends' fingerprints); a bucket's
    calls (a slow read, a copy of gigabytes) ran under it and held up the checkpoint writer's ledger."""
    import threading

    prefix = claim(bucket.open_prefix(URL), cache_mod.CACHE)
    held, release = threading.Event(), threading.Event()

    def folder_update():
        with ledger._lock:  # another thread in a folder's ledger update
            held.set()
            release.wait(10)

    thread = threading.Thread(target=folder_update)
    thread.start()
    held.wait(10)
    try:
        listed = threading.Thread(target=ledger.list_at, args=(prefix, "flight-a"), daemon=True)
        listed.start()
        listed.join(5)
        assert not listed.is_alive(), "the bucket's ledger waited for a folder's thread lock"
    finally:
        release.set()
        thread.join(10)
    assert ledger.listed(prefix) == {"flight-a"}
