import json
import logging
import os

import numpy as np
import pytest
from conftest import preprocess_frame

from cloudml_lib.base.config import DataConfig, build_config
from cloudml_lib.data import cache as cache_mod
from cloudml_lib.data.cache import build_windows, load_caches, load_flight_cache
from cloudml_lib.data.cachefiles import verify_cache


def test_windows_edge_policies():
    frames = np.array([0, 1, 5, 9])
    shift, kept = build_windows(frames, 10, 3, "shift")
    assert shift.tolist() == [[0, 1, 2], [0, 1, 2], [4, 5, 6], [7, 8, 9]] and kept.all()
    pad, _ = build_windows(frames, 10, 3, "pad")
    assert pad.tolist() == [[0, 0, 1], [0, 1, 2], [4, 5, 6], [8, 9, 9]]
    drop, kept = build_windows(frames, 10, 3, "drop")
    assert drop.tolist() == [[0, 1, 2], [4, 5, 6]] and kept.tolist() == [False, True, True, False]
    even, _ = build_windows(np.array([5]), 10, 4, "shift")
    assert even.tolist() == [[3, 4, 5, 6]]


def test_preprocess_crops_normalises_and_fills_nan(tiny_config):
    raw = np.random.default_rng(0).normal(290, 3, (40, 48)).astype(np.float32)
    raw[10, 10] = np.nan
    frame, n_bad, blank = preprocess_frame(raw, tiny_config.data)
    assert frame.shape == (32, 48) and n_bad == 1 and not blank
    assert np.isfinite(frame).all()
    assert abs(frame.mean()) < 1e-4 and abs(frame.std() - 1) < 1e-3
    tiny_config.data.downsample = 2
    assert preprocess_frame(raw, tiny_config.data)[0].shape == (16, 24)


def test_cache_holds_the_preprocessed_windows(tiny_config):
    tiny_config.data.clahe_clip_limit = DataConfig.clahe_clip_limit  # the whole reading: CLAHE on (conftest)
    cache = load_flight_cache(tiny_config.data.flights[0], tiny_config.data)
    meta = json.loads((cache.path / "meta.json").read_text())
    assert (
        meta["counts"]["cloud_samples"]
        == len(cache)
        > meta["counts"]["samples"]
        == cache.has_height.sum()
        > 0
    )
    assert set(np.unique(cache.cloud)) == {0, 1} and (cache.cloud[cache.has_height] == 1).all()
    assert np.isfinite(cache.frame_p10).all()
    assert cache.windows.shape == (len(cache), 3)
    assert cache.frame_shape == (32, 48)
    # the window's middle frame is the labelled frame (shift policy moves only edge windows)
    i = len(cache) // 2
    store = np.load(cache.path / "frames.npy", mmap_mode="r")
    assert store.dtype == np.float16
    np.testing.assert_array_equal(cache.frames.read(cache.windows[i]), store[cache.windows[i]])
    import h5py

    with h5py.File(tiny_config.data.dir + "/" + tiny_config.data.flights[0].ir_file) as f:
        raw = f["Product/Signal"][int(cache.frame_index[i])]
    expected = preprocess_frame(raw, tiny_config.data)[0].astype(np.float16)
    np.testing.assert_array_equal(cache.frames.read(cache.windows[i][1:2])[0], expected)


def test_frame_store_reads_any_rows_in_order(tiny_config):
    cache = load_flight_cache(tiny_config.data.flights[0], tiny_config.data)
    full = np.load(cache.path / "frames.npy")
    rows = np.array([3, 4, 5, 5, 0, 7])
    np.testing.assert_array_equal(cache.frames.read(rows), full[rows])


def test_unchanged_cache_is_reused_and_changed_settings_rebuild(tiny_config, monkeypatch):
    flight = tiny_config.data.flights[0]
    first = load_flight_cache(flight, tiny_config.data)
    calls = []
    monkeypatch.setattr(cache_mod, "_build", lambda *a: calls.append(a) or pytest.fail("rebuilt"))
    again = load_flight_cache(flight, tiny_config.data)
    assert again.path == first.path and not calls
    monkeypatch.undo()
    tiny_config.data.clahe_clip_limit = 0.02
    changed = load_flight_cache(flight, tiny_config.data)
    assert changed.path != first.path


def test_incomplete_cache_is_rebuilt(tiny_config):
    flight = tiny_config.data.flights[0]
    cache = load_flight_cache(flight, tiny_config.data)
    with open(cache.path / "frames.npy", "r+b") as f:
        f.truncate(os.path.getsize(cache.path / "frames.npy") - 100)
    rebuilt = load_flight_cache(flight, tiny_config.data)
    full = np.load(rebuilt.path / "frames.npy")
    assert full.shape[0] == rebuilt.meta["cached_frames"]


def test_all_missing_flights_are_reported_at_once(tiny_raw_config, tmp_path):
    raw = tiny_raw_config
    raw["data"]["flights"][0]["ir_file"] = "gone1.h5"
    raw["data"]["flights"][1]["nav_file"] = "gone2.hdf"
    cfg = build_config(raw)
    with pytest.raises(Exception) as e:
        load_caches(cfg.data)
    assert "gone1.h5" in str(e.value) and "gone2.hdf" in str(e.value)


def test_reading_samples_does_not_grow_memory(tiny_config):
    """Positioned reads: reading every sample leaves no mapping behind to grow RSS."""
    cache = load_flight_cache(tiny_config.data.flights[0], tiny_config.data)
    for w in cache.windows:
        cache.frames.read(w)
    maps = open(f"/proc/{os.getpid()}/maps").read() if os.path.exists(f"/proc/{os.getpid()}/maps") else ""
    assert str(cache.path / "frames.npy") not in maps


def test_a_cache_that_would_not_fit_on_disk_is_refused_before_writing(tiny_config, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        Exception, match=r"its cache needs 0\.\d+ GB but only 0\.00 GB are free .*data.downsample: 2"
    ):
        load_flight_cache(tiny_config.data.flights[0], tiny_config.data)
    assert not list(cache_mod.cache_root(tiny_config.data).glob("*.tmp-*"))


def test_cache_copy_is_written_and_copied_back_instead_of_rebuilt(tiny_config, tmp_path, monkeypatch):
    """Colab: the cache is built on the VM's disk, kept on Drive, and copied back in a new session."""
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = str(tmp_path / "drive_cache")
    built = load_flight_cache(flight, data)
    assert built.source == "built"
    copy = tmp_path / "drive_cache" / built.path.name
    assert (copy / "meta.json").is_file()
    assert (copy / "frames.npy").read_bytes() == (built.path / "frames.npy").read_bytes()
    expected = np.load(built.path / "frames.npy")
    import shutil

    shutil.rmtree(built.path)  # a new Colab VM: the local disk is empty
    monkeypatch.setattr(cache_mod, "_build", lambda *a: pytest.fail("rebuilt although a valid copy exists"))
    copied = load_flight_cache(flight, data)
    assert copied.source == "copied" and copied.path == built.path
    np.testing.assert_array_equal(np.load(copied.path / "frames.npy"), expected)
    assert load_flight_cache(flight, data).source == "reused"


def _flip_a_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # same size, one byte changed
    path.write_bytes(bytes(raw))


def _heights_a_km_higher(path):
    """A samples.npz that reads well: every height shifted by 1 km (what no size or format check sees)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["cbh_km"] = arrays["cbh_km"] + 1.0
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize(
    "name, tamper", [("frames.npy", _flip_a_byte), ("samples.npz", _heights_a_km_higher)]
)
def test_a_corrupted_cache_copy_is_rebuilt_not_used(tiny_config, tmp_path, name, tamper):
    data, flight = tiny_config.data, tiny_config.data.flights[0]
    data.cache_copy_dir = str(tmp_path / "drive_cache")
    built = load_flight_cache(flight, data)
    expected = (built.path / name).read_bytes()
    copy = tmp_path / "drive_cache" / built.path.name / name
    tamper(copy)
    import shutil

    shutil.rmtree(built.path)
    again = load_flight_cache(flight, data)
    assert again.source == "built"
    assert (again.path / name).read_bytes() == expected == copy.read_bytes()  # the copy is repaired too
    assert not list(built.path.parent.glob("*.tmp-*")), "a temporary copy was left behind"


def test_a_cache_whose_samples_changed_is_rebuilt(tiny_config, caplog, monkeypatch):
    """samples.npz holds the labels the network learns: one changed since its build is never trained on."""
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    flight = tiny_config.data.flights[0]
    cache = load_flight_cache(flight, tiny_config.data)
    heights = cache.cbh_km.copy()
    _heights_a_km_higher(cache.path / "samples.npz")
    assert verify_cache(cache) == (
        f"flight {flight.name}: the preprocessing cache {cache.path} is corrupt: samples.npz no longer "
        "matches the checksum recorded when it was built (bit rot on the disk, or a damaged copy)"
    )
    again = load_flight_cache(flight, tiny_config.data)
    assert again.source == "built" and "samples.npz no longer matches the checksum" in caplog.text
    np.testing.assert_array_equal(again.cbh_km, heights)


def _blank_some_frames(tmp_path, which, value):
    """Demo flights whose first flight has frames `which` set to `value` (NaN, or one count: no contrast)."""
    import h5py

    from cloudml_lib.data.synthetic import make_demo_flights

    entries = make_demo_flights(tmp_path / "f", n_flights=2, frames_per_flight=120, frame_shape=(40, 48))
    path = tmp_path / "f" / entries[0]["ir_file"]
    with h5py.File(path, "a") as f:  # as float, with the chosen frames blank
        counts = f["Product/Signal"][()].astype("f4")
        counts[which] = value
        del f["Product/Signal"]
        f["Product/Signal"] = counts
    return build_config(
        {
            "data": {
                "dir": str(tmp_path / "f"),
                "cache_dir": str(tmp_path / "c"),
                "flights": entries,
                "test_flights": [entries[1]["name"]],
                "swath_slice": [4, 36],
                "temporal_frames": 3,
            }
        }
    )


@pytest.mark.parametrize("value", [np.nan, 11000.0], ids=["all NaN", "no contrast"])
def test_a_flight_of_mostly_blank_frames_is_refused(tmp_path, value):
    from cloudml_lib.base.errors import DataError

    cfg = _blank_some_frames(tmp_path, slice(None, None, 3), value)  # a third of the frames
    with pytest.raises(
        DataError,
        match=r"flight 01Mar25: \d+ of the \d+ frames .* blank \(entirely NaN/inf, or every "
        r"pixel equal\).*more than 5%",
    ):
        load_flight_cache(cfg.data.flights[0], cfg.data)
    # no flight's cache folder, finished or not; the input files' SHA-256 memo (read while the frames were)
    # and the cache folder's own marker and ledger (.cloudml, .cloudml-files) may stay
    assert set(p.name for p in (tmp_path / "c").glob("*")) <= {
        "file_sha256.json",
        ".cloudml",
        ".cloudml-files",
    }


def test_a_label_on_a_blank_frame_is_dropped_and_counted(tmp_path):
    cfg = _blank_some_frames(tmp_path, [], np.nan)
    clean = load_flight_cache(cfg.data.flights[0], cfg.data)
    labelled = int(clean.frame_index[len(clean) // 2])
    cfg = _blank_some_frames(tmp_path / "again", [labelled], 11000.0)  # one labelled frame without contrast
    cache = load_flight_cache(cfg.data.flights[0], cfg.data)
    assert labelled not in cache.frame_index and len(cache) == len(clean) - 1
    assert cache.meta["counts"]["blank_frame"] == 1 and cache.meta["counts"]["empty_frames"] == 1


def _tree(folder):
    """Every file below `folder` with its bytes: a user's files compared before and after."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_users_folders_in_the_cache_folder_are_never_replaced_or_deleted(tiny_config, caplog):
    """The cache folder's ledger lists what CloudML built there: a folder of the user's where a flight's cache
    goes is refused by name (nothing written into it), and one named like a killed build's leftover is left
    byte-identical and named once, while the caches CloudML built are rebuilt and replaced as before."""
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.base.ledger import LEDGER

    flight = tiny_config.data.flights[0]
    cache = load_flight_cache(flight, tiny_config.data)  # the cache folder claimed, its ledger started
    root = cache.path.parent
    assert cache.path.name in (root / LEDGER).read_text()
    mine = root / f"{cache.path.name}.tmp-elsewhere-4242"  # a killed build's name, but the user's folder
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    for p in (mine / "notes.txt", mine):  # untouched for a day: a build from another host that died
        os.utime(p, (p.stat().st_atime - 86400, p.stat().st_mtime - 86400))
    before = _tree(mine)
    with open(cache.path / "frames.npy", "r+b") as f:  # damaged: CloudML rebuilds its own cache
        f.truncate(os.path.getsize(cache.path / "frames.npy") - 100)
    rebuilt = load_flight_cache(flight, tiny_config.data)
    assert np.load(rebuilt.path / "frames.npy").shape[0] == rebuilt.meta["cached_frames"]
    assert _tree(mine) == before
    assert f"{mine} was not written by CloudML" in caplog.text
    other = tiny_config.data.flights[1]
    final = (
        root
        / f"{other.name}-{cache_mod.cache_key(other, tiny_config.data, cache_mod.resolve_backend('cpu'))}"
    )
    final.mkdir()  # the user's folder exactly where the second flight's cache goes
    (final / "meta.json").write_text("the user's")
    users = _tree(final)
    with pytest.raises(CloudMLError, match="was not written by CloudML"):
        load_flight_cache(other, tiny_config.data)
    assert _tree(final) == users
    assert not list(root.glob(f"{final.name}.tmp-*"))  # the build left nothing behind


def test_the_checksum_memo_stays_cloudmls_after_the_cache_folders_ledger_is_made_again(tmp_path, caplog):
    """A cache folder whose ledger was lost gets one made again from what it holds, by name (a run folder's
    files are recorded as found; a cache's have checksums of their own): the memo of input files' sha256
    (file_sha256.json), which CloudML replaces whole at every new input file, stays CloudML's (recorded as
    found, it was taken for a user's edit at its next write, and never written again)."""
    from cloudml_lib.base import ledger
    from cloudml_lib.base.ownership import claim
    from cloudml_lib.data.cachefiles import CACHE
    from cloudml_lib.data.hashing import MEMO, file_sha256

    folder = claim(tmp_path / "cache", CACHE)
    inputs = [tmp_path / f"input-{i}.bin" for i in range(3)]
    for i, p in enumerate(inputs):
        p.write_bytes(bytes([i]) * 1000)
    file_sha256(inputs[0], folder)
    (folder / ledger.LEDGER).unlink(missing_ok=True)  # lost: made again from what verifies at the next write
    with caplog.at_level("WARNING"):
        file_sha256(inputs[1], folder)
        file_sha256(inputs[2], folder)
    assert "changed after CloudML wrote it" not in caplog.text
    assert len(json.loads((folder / MEMO).read_text())) == 3 and ledger.mine(folder / MEMO)
