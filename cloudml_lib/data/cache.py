"""The preprocessing cache: each flight's needed frames preprocessed once into a float16 .npy file.

Layout, one folder per flight and settings: `<cache_dir>/<flight>-<key>/` with
- `frames.npy`  (M, H, W) float16: every frame some sample's window uses, preprocessed;
- `samples.npz` per sample (every frame a usable CPL profile matched): `windows` (N, T) rows of
  frames.npy, `frame_index`, `cbh_km` (NaN: no height label), `cloud` (1 cloud, 0 clear sky),
  `layer_base_km` (the base of the cloud flag's layer, cpl.flag_layer; NaN: clear sky), `frame_p10` (the 10th
  percentile of the labelled frame's raw values, for the brightness-temperature baseline), `frame_stats`
  (N, K) (the labelled frame's radiometric statistics, preprocess.STAT_NAMES, in the units the IR file
  states: the network's data.radiometry inputs and the baselines'), `sza_deg`, `saa_deg`, `heading_deg`
  (NaN: none, flips off), `lat`, `lon`;
- `meta.json`   the settings, counts, sizes, frames.npy's sha256 and what the IR file's numbers are
  (`radiometry`: units, unpacking); written last, so a folder without it is incomplete.

The key hashes the flight's files (name, size, modification time, and a sample of their content:
17 blocks of 64 KiB spread over each file) and every setting that changes the arrays, the CLAHE
backend's reading included (preprocess.py; the frames are made by its worker processes; skimage and torch
are one reading, the same frames), so a change
rebuilds only what it affects and an unchanged cache is reused. A folder
is built under a temporary name and renamed into place, so an interrupted build leaves nothing
that looks complete. Reading a sample is one positioned read of the .npy file (FrameStore):
no HDF5 reopen, no CLAHE, and no memory map whose pages would add to the process's RSS.

On Colab the cache lives on the VM's local disk (`data.cache_dir`), because reading it through
the Drive mount (FUSE) would slow every epoch; `data.cache_copy_dir` keeps a lasting copy on Drive, or in a
bucket (an fsspec URL: gs://, s3://, ...; base/bucket.py). A flight's cache missing locally is copied back
from there (its sha256 checked on the way) instead of being rebuilt, and a freshly built one is copied there:
into a folder under a temporary name, then renamed; into a bucket, which has no rename, meta.json last. The
local folder stays the training format in both cases (positioned reads of indexed samples: exact resume).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from cloudml_lib.base import bucket, ledger
from cloudml_lib.base.bucket import is_url
from cloudml_lib.base.config import DataConfig, FlightConfig
from cloudml_lib.base.errors import DataError, shown
from cloudml_lib.base.outputs import named
from cloudml_lib.base.ownership import claim
from cloudml_lib.base.shapes import read_json
from cloudml_lib.data import cpl, er2, navigation
from cloudml_lib.data.cachefiles import (
    CACHE,
    CACHE_META,
    CACHE_META_LIMIT,
    copy_flight_cache,
    download_flight_cache,
    in_background,
    make_temporary,
    put_in_place,
    remove_stale_builds,
    sha256_of,
    stored_copy,
    temporary,
    unlike_recorded,
    upload_flight_cache,
    write_frames,
)
from cloudml_lib.data.hashing import MEMO, input_files
from cloudml_lib.data.preprocess import (
    SKIMAGE,
    STAT_NAMES,
    UNSTATED,
    Backend,
    FramePool,
    FrameSpec,
    Radiometry,
    output_shape,
    resolve_backend,
    resolve_workers,
)

log = logging.getLogger(__name__)

CACHE_VERSION = 8  # 3: blank frames flagged, their labels dropped; 4: match statistics; 5: heading;
# 6: cloud / no-cloud samples and the frame statistic of the baseline; 7: the flag layer's base per sample;
# 8: the labelled frame's radiometric statistics and the IR file's units (the frames themselves unchanged)
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 64 << 10  # the content check of the cache key: 1 MiB per file
MAX_EMPTY_FRAME_SHARE = 0.05  # above this share of blank frames (no usable pixel) a flight is refused


def build_windows(
    frame_index: np.ndarray, n_frames: int, t: int, policy: str
) -> tuple[np.ndarray, np.ndarray]:
    """T-frame windows centred on each labelled frame; returns (windows (N, T), kept mask).

    shift: a window that would leave the flight is moved inside it (the labelled frame is then
    off-centre); pad: frames outside the flight repeat the first/last frame; drop: such labels
    are removed.
    """
    if n_frames < t:
        raise DataError(f"a flight has {n_frames} frames, fewer than data.temporal_frames={t}")
    offsets = np.arange(t) - t // 2  # (T,)
    raw = frame_index[:, None] + offsets[None, :]  # (N, T)
    inside = (raw >= 0).all(axis=1) & (raw < n_frames).all(axis=1)
    if policy == "drop":
        return raw[inside], inside
    if policy == "pad":
        return np.clip(raw, 0, n_frames - 1), np.ones(len(raw), bool)
    start = np.clip(raw[:, 0], 0, n_frames - t)
    return start[:, None] + np.arange(t)[None, :], np.ones(len(raw), bool)


def content_sample(path: Path) -> str:
    """A cheap content check: the hash of SAMPLE_BLOCKS blocks spread over the file and its last block.
    A file rewritten with the same name, size and time (a copy that keeps times, a reprocessed file)
    almost always changes some of them; a change confined to the bytes between them is not seen."""
    h, size = hashlib.sha256(), path.stat().st_size
    with open(path, "rb") as f:
        for k in range(SAMPLE_BLOCKS + 1):
            f.seek(max(0, min(size - SAMPLE_BYTES, k * size // SAMPLE_BLOCKS)))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def cache_key(flight: FlightConfig, data: DataConfig, backend: Backend = SKIMAGE) -> str:
    files = []
    for role, path in er2.flight_paths(flight, data).items():
        st = path.stat()
        files.append([role, path.name, st.st_size, st.st_mtime_ns, content_sample(path)])
    settings = {
        "version": CACHE_VERSION,
        "files": files,
        "date": flight.date,
        "swath_slice": data.swath_slice,
        "downsample": data.downsample,
        "clahe_clip_limit": data.clahe_clip_limit,
        "t": data.temporal_frames,
        "edge_policy": data.edge_policy,
        "cbh": [data.cbh_min_km, data.cbh_max_km],
        "time_format": data.ir_time_format,
        "keys": vars(data.keys),
        "labels": cpl.label_definition(data),
        "angles_source": data.angles_source,
    }
    # absent: scikit-image's reading (skimage, or torch: the same frames), so earlier caches stay valid
    if backend.reading != SKIMAGE.reading:
        settings["clahe_backend"] = backend.reading
    if any(
        navigation.is_icartt(p) for p in er2.flight_paths(flight, data).values()
    ):  # absent: other nav files
        settings["icartt_reader"] = navigation.ICARTT_READER
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


class FrameStore:
    """Reads rows of a frames.npy file with positioned reads; safe to use from DataLoader workers."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            self.offset = f.tell()
        if fortran or len(shape) != 3 or np.dtype(dtype) != np.float16:
            raise DataError(
                f"{self.path}: an array of shape {shape} ({np.dtype(dtype)}, "
                f"{'Fortran' if fortran else 'C'} order), not the (frames, rows, columns) float16 frames a "
                "cache holds"
            )
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.frame_bytes = int(np.prod(shape[1:])) * self.dtype.itemsize
        self._fd, self._pid = None, None

    def _file(self) -> int:
        if self._pid != os.getpid():  # a forked worker opens its own descriptor
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def read(self, rows: np.ndarray) -> np.ndarray:
        """Frames at `rows` (any order, repeats allowed) -> (len(rows), H, W)."""
        fd, out = self._file(), np.empty((len(rows),) + tuple(self.shape[1:]), self.dtype)
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            buf = os.pread(fd, self.frame_bytes * (j - i), self.offset + int(rows[i]) * self.frame_bytes)
            out[i:j] = np.frombuffer(buf, self.dtype).reshape((j - i,) + tuple(self.shape[1:]))
            i = j
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fd"], state["_pid"] = None, None
        return state


@dataclass
class FlightCache:
    """One flight's cached samples."""

    name: str
    path: Path
    frames: FrameStore
    windows: np.ndarray  # (N, T) rows of frames.npy
    frame_index: np.ndarray  # (N,) labelled IR frame
    cbh_km: np.ndarray  # (N,) NaN: no height label (clear sky, or a cloud outside the label range)
    cloud: np.ndarray  # (N,) int8: 1 cloud below the aircraft, 0 clear sky
    layer_base_km: np.ndarray  # (N,) base of the cloud flag's layer (cpl.flag_layer), NaN: clear sky
    frame_p10: np.ndarray  # (N,) 10th percentile of the labelled frame's raw values (frame_p10)
    frame_stats: np.ndarray  # (N, K) the labelled frame's radiometric statistics (preprocess.STAT_NAMES)
    sza_deg: np.ndarray  # (N,)
    saa_deg: np.ndarray  # (N,) sun azimuth from the ground, degrees from north
    heading_deg: np.ndarray  # (N,) aircraft true heading, NaN where none
    meta: dict
    source: str = "reused"  # reused, copied (from data.cache_copy_dir) or built
    seconds: float = 0.0  # time to make it ready
    # (N, P) the atmosphere's predictors at each labelled frame (data/predictors.py attach; not cached: read
    # from the ERA5 files each time), NaN where a frame has no position; None: not read
    atmosphere: np.ndarray | None = None
    atmosphere_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.cbh_km)

    @property
    def has_height(self) -> np.ndarray:
        return np.isfinite(self.cbh_km)

    @property
    def backend(self) -> str:
        """The CLAHE backend its frames were made with (caches before the choice: scikit-image)."""
        return self.meta.get("preprocess", {}).get("backend", SKIMAGE.name)

    @property
    def frame_shape(self) -> tuple[int, int]:
        return tuple(self.frames.shape[1:])

    @property
    def radiometry(self) -> Radiometry:
        """What frame_stats' numbers are (the IR file's stated units and unpacking)."""
        r = self.meta.get("radiometry") or {}
        return Radiometry(
            str(r.get("units", UNSTATED)), float(r.get("scale", 1.0)), float(r.get("offset", 0.0))
        )

    def part(self, rows: np.ndarray) -> FlightCache:
        """The samples `rows` of this flight (a validation block, the part trained on): the same frames
        file, name and record."""
        rows = np.asarray(rows, np.int64)
        per_sample = (
            "windows",
            "frame_index",
            "cbh_km",
            "cloud",
            "layer_base_km",
            "frame_p10",
            "frame_stats",
        )
        per_sample += ("sza_deg", "saa_deg", "heading_deg")
        part = replace(self, **{k: getattr(self, k)[rows] for k in per_sample})
        return part if self.atmosphere is None else replace(part, atmosphere=self.atmosphere[rows])


def _open(path: Path) -> FlightCache:
    meta = read_json(path / "meta.json", CACHE_META, CACHE_META_LIMIT)  # Damaged: the cache is rebuilt
    # labels, angles, statistics: read once, and what is checked is what is loaded
    samples = (path / "samples.npz").read_bytes()
    if unlike_recorded(meta, "samples.npz", hashlib.sha256(samples).hexdigest()):
        raise DataError(f"cache {path}: samples.npz no longer matches the checksum recorded at its build")
    arrays = np.load(io.BytesIO(samples))
    store = FrameStore(path / "frames.npy")
    expected = store.offset + store.frame_bytes * store.shape[0]
    if (path / "frames.npy").stat().st_size != expected or store.shape[0] != meta["cached_frames"]:
        raise DataError(
            f"cache {path} is incomplete (frames.npy has the wrong size); delete the folder to rebuild"
        )
    return FlightCache(
        name=meta["flight"],
        path=path,
        frames=store,
        windows=arrays["windows"],
        frame_index=arrays["frame_index"],
        cbh_km=arrays["cbh_km"],
        cloud=arrays["cloud"],
        layer_base_km=arrays["layer_base_km"],
        frame_p10=arrays["frame_p10"],
        frame_stats=_stats(arrays, path, meta),
        sza_deg=arrays["sza_deg"],
        saa_deg=arrays["saa_deg"],
        heading_deg=arrays["heading_deg"],
        meta=meta,
    )


def _stats(arrays, path: Path, meta: dict) -> np.ndarray:
    """samples.npz's frame_stats, checked: one row of len(STAT_NAMES) numbers per sample, as meta.json names
    them (a cache is derived data: a wrong one is rebuilt)."""
    stats = arrays["frame_stats"]
    names = (meta.get("radiometry") or {}).get("statistics")
    if (
        stats.ndim != 2
        or stats.shape != (len(arrays["cbh_km"]), len(STAT_NAMES))
        or names != list(STAT_NAMES)
    ):
        raise DataError(f"cache {path}: frame_stats of shape {stats.shape} ({names}), not one row per sample")
    return stats


def _build(flight: FlightConfig, data: DataConfig, final: Path, backend: Backend, pool: FramePool) -> None:
    tmp = temporary(final)
    remove_stale_builds(final)
    try:
        _build_into(tmp, flight, data, final, backend, pool)
    except BaseException:  # Ctrl-C, SIGTERM, a bad file, a full disk: no half cache stays
        ledger.delete(tmp)
        raise


def _build_into(
    tmp: Path, flight: FlightConfig, data: DataConfig, final: Path, backend: Backend, pool: FramePool
) -> None:
    labels = cpl.read_flight_labels(flight, data)
    windows, kept = build_windows(labels.frame_index, labels.n_frames, data.temporal_frames, data.edge_policy)
    needed = np.unique(windows)  # sorted raw frame indices
    make_temporary(tmp)
    spec = FrameSpec.of(data)
    shape = (len(needed),) + output_shape(spec, labels.frame_shape[1])
    _check_space(flight, shape, tmp)
    ir = er2.flight_paths(flight, data)["ir"]
    files = in_background(input_files, er2.flight_paths(flight, data), cache_root(data))  # reads each file
    t0 = time.perf_counter()
    # leave=True: a closed notebook widget shows "model not found" (ipywidgets 8); a full bar is a record
    bar = tqdm(total=len(needed), desc=f"cache {flight.name}", unit="frame")
    blocks = pool.blocks(ir, data.keys.ir_signal, flight.name, needed, spec, backend)
    try:
        written = write_frames(tmp / "frames.npy", shape, blocks, bar)
    finally:
        blocks.close()  # on a stop: the workers are stopped before the folder is removed
        bar.close()
    seconds = time.perf_counter() - t0
    sha, filled, blank = written.sha256, written.filled, written.blank
    if blank.sum() > MAX_EMPTY_FRAME_SHARE * len(needed):
        raise DataError(
            f"flight {flight.name}: {int(blank.sum())} of the {len(needed)} frames its samples use are "
            f"blank (entirely NaN/inf, or every pixel equal) in {ir} '{data.keys.ir_signal}', more "
            f"than {MAX_EMPTY_FRAME_SHARE:.0%}; training on them would learn from empty images. Check the "
            "file (a failed download or conversion?), or leave the flight out (data.flights)."
        )
    keep, on_blank = _write_samples(tmp, labels, kept, windows, needed, written)
    meta = _meta(
        flight, data, final, labels, shape, _counts(labels, kept, keep, on_blank, filled, blank), sha
    )
    meta.update(
        radiometry={**written.radiometry._asdict(), "statistics": list(STAT_NAMES)},
        files=files(),
        bytes=int((tmp / "frames.npy").stat().st_size),
        samples_sha256=sha256_of(tmp / "samples.npz"),
        preprocess={
            "backend": backend.name,
            "device": backend.device,
            "workers": pool.workers,
            "seconds": round(seconds, 2),
            "frames_per_s": round(len(needed) / max(seconds, 1e-9), 1),
        },
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    put_in_place(tmp, final)
    if filled or blank.any():
        log.warning(
            "flight %s: %d non-finite pixels replaced by their frame's median; %d blank frames (no usable "
            "pixel or no contrast) set to zero, %d labels on them dropped",
            flight.name,
            filled,
            int(blank.sum()),
            int(on_blank.sum()),
        )


def _meta(
    flight: FlightConfig, data: DataConfig, final: Path, labels, shape: tuple, counts: dict, sha: str
) -> dict:
    """meta.json: what the cache holds and how it was made (its files, preprocessing and sizes added by the
    caller)."""
    return {
        "flight": flight.name,
        "key": final.name.rsplit("-", 1)[-1],
        "version": CACHE_VERSION,
        "cached_frames": shape[0],
        "frame_shape": list(shape[1:]),
        "n_frames": labels.n_frames,
        "temporal_frames": data.temporal_frames,
        "edge_policy": data.edge_policy,
        "counts": counts,
        "match": labels.match,
        "labels": cpl.label_definition(data),
        "heading": labels.heading_note,
        "frames_sha256": sha,
        "created": time.time(),
    }


def _check_space(flight: FlightConfig, shape: tuple, tmp: Path) -> None:
    need, free = int(np.prod(shape)) * 2, shutil.disk_usage(tmp).free
    if need > 0.95 * free:
        raise DataError(
            f"flight {flight.name}: its cache needs {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB are "
            f"free in {tmp.parent}; free space there, set data.cache_dir to another disk, or set "
            "data.downsample: 2 (a quarter of the size)"
        )


def _write_samples(
    tmp: Path,
    labels,
    kept: np.ndarray,
    windows: np.ndarray,
    needed: np.ndarray,
    written,
) -> tuple[np.ndarray, np.ndarray]:
    """samples.npz: each kept label, its window (rows of frames.npy), angles and its frame's radiometric
    statistics (`written`: cachefiles.Written). A label whose own frame is blank has no image to learn from:
    dropped (its neighbours stay zeros). Returns (kept, labels on a blank frame)."""
    blank = written.blank
    on_blank = np.zeros_like(kept)
    on_blank[kept] = blank[np.searchsorted(needed, labels.frame_index[kept])]
    keep = kept & ~on_blank
    windows = windows[keep[kept]]  # windows holds the kept labels' rows only
    own = np.searchsorted(needed, labels.frame_index[keep])  # each sample's own (labelled) frame
    kept = ("frame_index", "cbh_km", "cloud", "layer_base_km", "sza_deg", "saa_deg", "heading_deg")
    per_sample = {k: getattr(labels, k)[keep] for k in (*kept, "lat", "lon")}
    np.savez(
        tmp / "samples.npz",
        windows=np.searchsorted(needed, windows).astype(np.int32),  # (N, T) rows
        frame_p10=written.p10[own],
        frame_stats=written.stats[own],
        **per_sample,
    )
    return keep, on_blank


def _counts(
    labels, kept: np.ndarray, keep: np.ndarray, on_blank: np.ndarray, filled: int, blank: np.ndarray
) -> dict:
    """The label counts of meta.json: the CPL filters' and what the cache itself removed."""
    height = np.isfinite(labels.cbh_km)
    return dict(
        labels.counts,
        edge_dropped=int((~kept & height).sum()),
        blank_frame=int((on_blank & height).sum()),
        samples=int((keep & height).sum()),
        cloud_samples=int(keep.sum()),
        clear_sky=int((keep & (labels.cloud == 0)).sum()),
        nan_sza=int(np.isnan(labels.sza_deg[keep]).sum()),
        nan_saa=int(np.isnan(labels.saa_deg[keep]).sum()),
        no_heading=int(np.isnan(labels.heading_deg[keep]).sum()),
        filled_pixels=filled,
        empty_frames=int(blank.sum()),
    )


def cache_root(data: DataConfig) -> Path:
    return Path(data.cache_dir) if data.cache_dir else Path(data.dir) / "cache"


def cache_folders(data: DataConfig) -> tuple[Path, ...]:
    """The folders that hold caches, skipped where flight files are searched: the cache, and its lasting copy
    where that is a folder (not a bucket)."""
    copy = data.cache_copy_dir
    return (cache_root(data),) + ((Path(copy),) if copy and not is_url(copy) else ())


def check_folder_settings(data: DataConfig) -> None:
    """data.dir, the cache and its copy must be folders (or not exist yet): a file there is named
    before any work, not met as NotADirectoryError halfway through."""
    settings = [
        ("data.dir", data.dir),
        ("data.cache_dir", str(cache_root(data)) if data.cache_dir else ""),
        ("data.cache_copy_dir", data.cache_copy_dir),
    ]
    for key, value in settings:
        if not value or is_url(value):  # a bucket (data.cache_copy_dir) is checked when the config is built
            continue
        for p in [Path(value), *Path(value).parents]:
            if p.exists():
                if not p.is_dir():
                    what = "is a file" if p == Path(value) else f"lies inside {p}, which is a file"
                    raise DataError(
                        f"{key}: {value} {what}; it must be a folder. Point {key} at a folder "
                        "(it is created when missing), or move the file away."
                    )
                break


def _try_open(path: Path) -> FlightCache | None:
    if not os.path.lexists(path / "meta.json"):
        return None
    try:
        return _open(path)
    except Exception as e:  # noqa: BLE001 - a cache is derived data: whatever is wrong with it, it is rebuilt
        log.warning(
            "cache %s is unusable (%s: %s): it is built again", path, type(e).__name__, shown(str(e), 300)
        )
        return None


def _log_built(cache: FlightCache, data: DataConfig, seconds: float) -> None:
    c, how = cache.meta["counts"], cache.meta["preprocess"]
    workers = f"{how['workers']} worker processes" if how["workers"] else "this process"
    log.info(
        "flight %s: cached %d samples with a height and %d with a cloud flag only (%d clear sky) (%d frames, "
        "%.1f MB) in %.1f s (%.0f frames/s, %s, %s on %s); %d of %d lidar profiles kept as heights (edge "
        "policy %s)",
        cache.name,
        c["samples"],
        c["cloud_samples"] - c["samples"],
        c["clear_sky"],
        cache.meta["cached_frames"],
        cache.meta["bytes"] / 1e6,
        seconds,
        how["frames_per_s"],
        workers,
        how["backend"],
        how["device"],
        c["samples"],
        c["profiles"],
        data.edge_policy,
    )


def load_flight_cache(
    flight: FlightConfig, data: DataConfig, backend: Backend | None = None, pool: FramePool | None = None
) -> FlightCache:
    """Open this flight's cache for the current settings: local, else copied from data.cache_copy_dir,
    else built (and then copied there). `backend`: the equaliser (default: data.preprocess_device's);
    `pool`: the worker processes that build it (default: data.preprocess_workers of them, for this flight)."""
    er2.check_files(flight, data)
    if pool is None:
        with FramePool(resolve_workers(data.preprocess_workers)) as own:
            return load_flight_cache(flight, data, backend, own)
    backend = backend or resolve_backend(data.preprocess_device)
    t0 = time.time()
    claim(cache_root(data), CACHE)  # CloudML's own cache folder (made, adopted or marked) before any write
    if ledger.mine(cache_root(data) / MEMO):  # the checksum memo, listed here: hashing runs in a thread
        ledger.add(cache_root(data) / MEMO)
    final = cache_root(data) / f"{flight.name}-{cache_key(flight, data, backend)}"
    cache, source = _try_open(final), "reused"
    if cache is None and data.cache_copy_dir:
        cache, source = _fetch_copy(data.cache_copy_dir, final, flight.name), "copied"
    if cache is None:
        try:
            _build(flight, data, final, backend, pool)
        except OSError as e:  # e.g. a full disk: name the cache, not "the disk"
            raise named(e, final) from None
        cache, source = _open(final), "built"
        _log_built(cache, data, time.time() - t0)
        if data.cache_copy_dir:
            _save_copy(final, data.cache_copy_dir, flight.name)
    cache.source, cache.seconds = source, time.time() - t0
    return cache


def _fetch_copy(copy_dir: str, final: Path, flight: str) -> FlightCache | None:
    """This flight's cache copied from the lasting copy (a folder, or a bucket's prefix) with its checks
    (copy_flight_cache, download_flight_cache); None where there is none, or where it is unusable (said in
    a warning: the cache is then built)."""
    t0, url = time.time(), is_url(copy_dir)
    copy = f"{copy_dir.rstrip('/')}/{final.name}" if url else Path(copy_dir) / final.name
    try:
        if url:
            prefix = bucket.open_prefix(copy_dir)
            state = stored_copy(prefix, final.name)
            if state == "partial":
                raise DataError(f"{copy} is incomplete (no meta.json: an upload that was cut off)")
            if state == "none":
                return None
            download_flight_cache(prefix, final.name, final, f"copy {flight}")
        elif _try_open(copy) is not None:
            copy_flight_cache(copy, final, f"copy {flight}")
        else:
            return None
        cache = _open_copied(final, copy)
    except (DataError, OSError) as e:
        log.warning("flight %s: could not use the cache copy in %s (%s); rebuilding", flight, copy, e)
        return None
    log.info("flight %s: cache copied from %s in %.1f s", flight, copy, time.time() - t0)
    return cache


def _open_copied(final: Path, copy) -> FlightCache:
    try:
        return _open(final)
    except Exception as e:  # noqa: BLE001 - a cache is derived data: whatever is wrong with it, it is rebuilt
        raise DataError(f"the copy {copy} is unusable ({type(e).__name__}: {shown(str(e), 300)})") from None


def _save_copy(final: Path, copy_dir: str, flight: str) -> None:
    """A freshly built cache copied to the lasting copy (claimed first: CloudML's own folder or prefix) for
    later sessions; a copy that fails is a warning (a later session builds the cache again)."""
    t0, option = time.time(), replace(CACHE, option="data.cache_copy_dir")
    copy = f"{copy_dir.rstrip('/')}/{final.name}" if is_url(copy_dir) else Path(copy_dir) / final.name
    try:
        if is_url(copy_dir):
            upload_flight_cache(final, claim(bucket.open_prefix(copy_dir), option), f"save {flight}")
        else:
            claim(Path(copy_dir), option)
            copy_flight_cache(final, copy, f"save {flight}")
        log.info(
            "flight %s: cache copied to %s in %.1f s, for later sessions", flight, copy, time.time() - t0
        )
    except OSError as e:
        log.warning(
            "flight %s: could not copy its cache to %s (%s); a later session will rebuild it", flight, copy, e
        )


def load_caches(data: DataConfig, backend: Backend | None = None) -> list[FlightCache]:
    """Caches of every configured flight, those to build built by one pool of worker processes; every
    missing file is reported at once. `backend`: as load_flight_cache."""
    check_folder_settings(data)
    problems = []
    for flight in data.flights:
        try:
            er2.check_files(flight, data)
        except DataError as e:
            problems.append(str(e))
    if problems:
        raise DataError("\n".join(problems))
    backend = backend or resolve_backend(data.preprocess_device)
    with FramePool(resolve_workers(data.preprocess_workers)) as pool:
        return [load_flight_cache(flight, data, backend, pool) for flight in data.flights]
