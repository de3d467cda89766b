"""The files of a cache folder: frames.npy written block by block with its sha256, checked against it later,
copied whole to and from the lasting copy (data.cache_copy_dir: a folder, or a bucket's prefix), and the
leftovers of killed builds removed."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from cloudml_lib.base import bucket, faults, ledger
from cloudml_lib.base.bucket import Prefix
from cloudml_lib.base.errors import DataError
from cloudml_lib.base.liveness import holder_alive
from cloudml_lib.base.ownership import Kind
from cloudml_lib.base.shapes import ANY, INT, TEXT, Damaged, MapOf, Maybe, Obj, parse_json, read_json

log = logging.getLogger(__name__)

COPY_CHUNK = 16 << 20
DATA_FILES = ("samples.npz", "frames.npy")  # a copy's files before its meta.json, which marks it complete
# meta.json's checksum of each data file (samples.npz's since 0.3.1: a cache built before has frames' alone)
RECORDED = {"frames.npy": "frames_sha256", "samples.npz": "samples_sha256"}


def unlike_recorded(meta: dict, name: str, sha: str) -> bool:
    """Whether data file `name`'s sha256 differs from the one its meta.json recorded (none recorded: no)."""
    expected = meta.get(RECORDED[name])
    return isinstance(expected, str) and sha != expected


def write_frames(path: Path, shape: tuple, blocks, bar) -> Written:
    """frames.npy from the preprocessed blocks, in order, with plain writes (a memory map's dirty pages would
    count in the process's RSS); returns what was written (Written)."""
    blank, p10, filled, row = np.zeros(shape[0], bool), np.zeros(shape[0], np.float32), 0, 0
    stats, radiometry = None, None
    h = hashlib.sha256()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header,
        {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float16)), "fortran_order": False, "shape": shape},
    )
    h.update(header.getvalue())  # frames_sha256 covers the whole file
    with open(path, "wb") as f:
        f.write(header.getvalue())
        for block in blocks:
            data = np.ascontiguousarray(block.frames, np.float16).tobytes()
            f.write(data)
            h.update(data)
            n = len(block.index)
            blank[row : row + n], p10[row : row + n] = block.blank, block.p10
            if stats is None:
                stats, radiometry = np.zeros((shape[0], block.stats.shape[1]), np.float32), block.radiometry
            stats[row : row + n] = block.stats
            filled += int(block.filled.sum())
            row += n
            bar.update(n)
            faults.point("cache-block")
        f.flush()
        os.fsync(f.fileno())
    assert row == shape[0], f"{path}: {row} frames written of {shape[0]}"
    return Written(h.hexdigest(), filled, blank, p10, stats, radiometry)


class Written(NamedTuple):
    """What write_frames wrote: frames.npy's sha256, the non-finite pixels filled, and per row its blank flag,
    frame_p10, frame_statistics, and the file's Radiometry."""

    sha256: str
    filled: int
    blank: np.ndarray
    p10: np.ndarray
    stats: np.ndarray | None
    radiometry: object


def in_background(fn, *args):
    """Run fn(*args) in a daemon thread (hashing and file reads release the GIL) while the workers preprocess;
    returns a function that waits for its result. A stop does not wait for it."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller, in its thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="cloudml-input-sha256")
    thread.start()

    def result():
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def temporary(final: Path) -> Path:
    """Where `final` is built or copied first: named after this host and process, so a leftover can be
    judged."""
    return final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_stale_builds(final: Path) -> None:
    """Folders `<final>.tmp-<host>-<pid>` left by a build or copy that was killed: removed once their process
    is gone. The run lock's rule judges them (runlock.holder_alive): on this host the pid tells; a folder
    written from another machine (a second Colab VM on the same Drive) counts as alive while a file in it
    changed in the last STALE_S seconds."""
    for p in final.parent.glob(f"{final.name}.tmp-*"):
        host, _, pid = p.name[len(final.name) + len(".tmp-") :].rpartition("-")
        if not pid.isdigit():
            continue
        host = host or socket.gethostname()  # `.tmp-<pid>`: an earlier version, on this host
        if host == socket.gethostname() and int(pid) == os.getpid():
            continue
        try:
            newest = max([f.stat().st_mtime for f in p.iterdir()] + [p.stat().st_mtime])
        except OSError:
            continue
        if not holder_alive({"host": host, "pid": int(pid), "heartbeat": newest}) and ledger.skip_unless_mine(
            p, "delete"
        ):
            log.info("removing %s, left by an interrupted cache build or copy", p)
            ledger.delete(p)


def make_temporary(tmp: Path) -> None:
    """The folder a build or copy writes into first, listed in its cache folder's ledger before it is made
    (an earlier one of this process, killed, removed first where the ledger lists it)."""
    ledger.delete(tmp)
    ledger.refuse_unless_mine(tmp, "replace")
    ledger.add(tmp)
    tmp.mkdir(parents=True)


def put_in_place(tmp: Path, final: Path) -> None:
    """A complete build or copy renamed into place, replacing an earlier cache that CloudML wrote there; a
    folder that its cache folder's ledger does not list (the user's) is refused and left as it is."""
    ledger.refuse_unless_mine(final, "replace")
    ledger.add(final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    ledger.drop(tmp)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(COPY_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_cache(cache) -> str | None:
    """None if frames.npy (and samples.npz, where recorded) still match the checksums recorded when the cache
    was built; otherwise why not."""
    for name in DATA_FILES:
        path = Path(cache.path) / name
        try:
            actual = sha256_of(path)
        except OSError as e:
            return f"flight {cache.name}: cannot read the preprocessing cache {path} ({e.strerror or e})"
        if unlike_recorded(cache.meta, name, actual):
            return (
                f"flight {cache.name}: the preprocessing cache {cache.path} is corrupt: {name} no longer "
                "matches the checksum recorded when it was built (bit rot on the disk, or a damaged copy)"
            )
    return None


CACHE_META_LIMIT = 64 << 20  # bytes: a flight cache's meta.json (labels and counts of a long flight)
# What the cache's readers index in a flight cache's meta.json (other keys are allowed).
CACHE_META = Obj(
    {
        "flight": TEXT,
        "cached_frames": INT,
        "n_frames": INT,
        "bytes": INT,
        "frames_sha256": TEXT,
        "samples_sha256": TEXT,
        "counts": MapOf(ANY),
        "preprocess": MapOf(ANY),
        "match": Maybe(MapOf(ANY)),
    },
    required=("flight", "cached_frames", "n_frames", "counts", "preprocess"),
)


def copy_flight_cache(src: Path, dst: Path, desc: str) -> None:
    """Copy one complete flight cache folder: under a temporary name, meta.json last, frames.npy's
    sha256 checked against the one recorded when it was built, then renamed into place."""
    try:
        meta = read_json(src / "meta.json", CACHE_META, CACHE_META_LIMIT)
    except Damaged as e:
        raise DataError(f"{src / 'meta.json'} is not a cache's meta.json ({e})") from None
    tmp = temporary(dst)
    remove_stale_builds(dst)
    make_temporary(tmp)
    names = (*DATA_FILES, "meta.json")
    bar = tqdm(total=sum((src / n).stat().st_size for n in names), unit="B", unit_scale=True, desc=desc)
    try:
        for name in names:
            with open(src / name, "rb") as fin, open(tmp / name, "wb") as fout:
                sha = _stream(fin, fout, bar)
                os.fsync(fout.fileno())
            if name in RECORDED and unlike_recorded(meta, name, sha):
                raise DataError(f"{src / name} does not match its recorded checksum (corrupted copy)")
        put_in_place(tmp, dst)
    finally:
        bar.close()
        ledger.delete(tmp)


def _stream(fin, fout, bar) -> str:
    """Copy one open file to another in chunks; returns the sha256 of what was copied."""
    h = hashlib.sha256()
    for chunk in iter(lambda: fin.read(COPY_CHUNK), b""):
        fout.write(chunk)
        h.update(chunk)
        bar.update(len(chunk))
    fout.flush()
    return h.hexdigest()


def stored_copy(prefix: Prefix, name: str) -> str:
    """What a bucket holds of the flight cache `name`: "whole" (its meta.json, written last, is there),
    "partial" (objects without a meta.json: an upload that was cut off) or "none"."""
    with bucket.errors(prefix.url_of(name)):
        if prefix.fs.exists(prefix.path(f"{name}/meta.json")):
            return "whole"
        return "partial" if prefix.holds(name) else "none"


def download_flight_cache(prefix: Prefix, name: str, dst: Path, desc: str) -> None:
    """copy_flight_cache from a bucket: the flight cache `name` of `prefix` into the folder `dst`, under a
    temporary name, frames.npy's sha256 checked against its meta.json's (a copy without one is refused),
    meta.json written last, then renamed into place."""
    src = prefix.url_of(name)
    with bucket.errors(src):
        try:
            meta = prefix.read_small(f"{name}/meta.json", CACHE_META_LIMIT)
            meta_doc = parse_json(meta, CACHE_META)
        except Damaged as e:
            raise DataError(f"{src}/meta.json is not a cache's meta.json ({e})") from None
        if not isinstance(meta_doc.get("frames_sha256"), str):
            raise DataError(f"{src}/meta.json records no checksum of frames.npy: the copy cannot be checked")
        sizes = [prefix.fs.size(prefix.path(f"{name}/{n}")) for n in DATA_FILES]
        tmp = temporary(dst)
        remove_stale_builds(dst)
        make_temporary(tmp)
        bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=desc)
        try:
            for n in DATA_FILES:
                with prefix.fs.open(prefix.path(f"{name}/{n}"), "rb") as fin, open(tmp / n, "wb") as fout:
                    sha = _stream(fin, fout, bar)
                    os.fsync(fout.fileno())
                if unlike_recorded(meta_doc, n, sha):
                    raise DataError(f"{src}/{n} does not match its recorded checksum (a damaged copy)")
            (tmp / "meta.json").write_bytes(meta)
            put_in_place(tmp, dst)
        finally:
            bar.close()
            ledger.delete(tmp)


def upload_flight_cache(src: Path, prefix: Prefix, desc: str) -> None:
    """copy_flight_cache to a bucket (claimed: ownership.claim): the flight cache folder `src`, under its own
    name. An object store has no rename, so the data files go first and meta.json, which marks a copy
    complete, last; an earlier copy's meta.json is removed before any of its files changes, so that no mix
    of two copies ever looks whole. Objects there that CloudML did not write (its ledger) are refused by
    name."""
    name, url = src.name, prefix.url_of(src.name)
    meta = (src / "meta.json").read_bytes()
    try:
        meta_doc = parse_json(meta, CACHE_META)
    except Damaged as e:
        raise DataError(f"{src / 'meta.json'} is not a cache's meta.json ({e})") from None
    ledger.refuse_at(prefix, name, "replace")
    ledger.list_at(prefix, name)  # listed before it is created
    # an object changed since CloudML uploaded it (its ledger's record) is kept aside, never overwritten
    ledger.set_aside_changed(prefix, [f"{name}/{n}" for n in ("meta.json", *DATA_FILES)])
    bar = tqdm(total=sum((src / n).stat().st_size for n in DATA_FILES), unit="B", unit_scale=True, desc=desc)
    written = {}
    try:
        with bucket.errors(url):
            if prefix.fs.exists(prefix.path(f"{name}/meta.json")):
                prefix.fs.rm_file(prefix.path(f"{name}/meta.json"))
            for n in DATA_FILES:
                with open(src / n, "rb") as fin, prefix.fs.open(prefix.path(f"{name}/{n}"), "wb") as fout:
                    sha = _stream(fin, fout, bar)
                if unlike_recorded(meta_doc, n, sha):
                    raise DataError(f"{src / n} does not match its recorded checksum; not copied to {url}")
                if prefix.fs.size(prefix.path(f"{name}/{n}")) != (src / n).stat().st_size:
                    raise OSError(f"{url}/{n}: the bucket holds another size than the {n} sent")
                written[f"{name}/{n}"] = ((src / n).stat().st_size, sha)
            prefix.fs.pipe_file(prefix.path(f"{name}/meta.json"), meta)  # last: the copy is whole from here
            written[f"{name}/meta.json"] = (len(meta), hashlib.sha256(meta).hexdigest())
            ledger.record_at(prefix, written)
    finally:
        bar.close()


def adopt_cache(folder: Path) -> str | None:
    """A preprocessing cache of an earlier CloudML: a flight's cache folder whose meta.json it wrote (with the
    checksum of its frames)."""
    for meta in sorted(Path(folder).glob("*/meta.json"))[:20]:
        try:
            doc = read_json(meta, CACHE_META, CACHE_META_LIMIT)
        except (OSError, Damaged):
            continue
        if isinstance(doc.get("frames_sha256"), str):
            return f"its {meta.parent.name}/meta.json is a flight cache's"
    return None


CACHE = Kind(
    "preprocessing cache", "data.cache_dir", adopt_cache, "a folder of its own for the cache (e.g. cache/)"
)
