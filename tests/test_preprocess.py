"""Preprocessing on every core and the GPU path: worker processes give the serial bytes, stop on Ctrl-C,
SIGTERM and a kill without a half cache or an orphan, and the kornia backend is keyed, recorded and
warned about (issue 20). The kornia path runs for real here, on the CPU."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, preprocess_frame, run_cli, tiny_raw

from cloudml_lib.base.errors import ConfigError, DataError
from cloudml_lib.data import cache as cache_mod
from cloudml_lib.data import cachefiles, preprocess
from cloudml_lib.data.preprocess import SKIMAGE, Backend, FramePool, resolve_backend


@pytest.fixture
def tiny_raw_config(tiny_flights, tmp_path):
    """The tiny config with CLAHE on (conftest's leaves it off): this file's point is the preprocessing."""
    root, entries = tiny_flights
    return tiny_raw(root, entries, tmp_path / "cache", clahe=True)


def build(cfg, workers: int, cache_dir: Path, backend=SKIMAGE):
    cfg.data.cache_dir = str(cache_dir)
    with FramePool(workers) as pool:
        return [cache_mod.load_flight_cache(f, cfg.data, backend, pool) for f in cfg.data.flights]


@pytest.mark.slow
def test_worker_processes_write_the_bytes_of_the_serial_path(tiny_config, tmp_path):
    serial, parallel = (
        build(tiny_config, 0, tmp_path / "serial"),
        build(tiny_config, 2, tmp_path / "parallel"),
    )
    for a, b in zip(serial, parallel):
        assert a.path.name == b.path.name  # same key: the worker count is not a setting of the data
        assert (a.path / "frames.npy").read_bytes() == (b.path / "frames.npy").read_bytes()
        with np.load(a.path / "samples.npz") as x, np.load(b.path / "samples.npz") as y:
            for k in x.files:
                np.testing.assert_array_equal(x[k], y[k])
        assert a.meta["frames_sha256"] == b.meta["frames_sha256"] and a.meta["counts"] == b.meta["counts"]
        assert (a.meta["preprocess"]["workers"], b.meta["preprocess"]["workers"]) == (0, 2)
        assert cachefiles.verify_cache(b) is None  # the sha256 computed while writing is the file's


def test_blocks_come_in_order_with_a_bounded_read_ahead(tiny_config, tmp_path):
    data = tiny_config.data
    flight = data.flights[0]
    path = Path(data.dir) / flight.ir_file
    index = np.r_[0:70, 75:140, 200:230]  # runs with gaps, as a cache needs
    spec = preprocess.FrameSpec.of(data)
    with FramePool(2) as pool:
        seen = []
        for block in pool.blocks(path, data.keys.ir_signal, flight.name, index, spec, SKIMAGE):
            seen.append(block)
            assert (
                pool.submitted - sum(len(b.index) for b in seen) <= 4 * preprocess.BLOCK_FRAMES
            )  # 2 x workers
    np.testing.assert_array_equal(np.concatenate([b.index for b in seen]), index)
    serial = [preprocess_frame(raw, data)[0].astype(np.float16) for raw in _raw(path, index)]
    np.testing.assert_array_equal(np.concatenate([b.frames for b in seen]), np.stack(serial))


def _raw(path: Path, index: np.ndarray) -> np.ndarray:
    import h5py

    with h5py.File(path) as f:
        return f["Product/Signal"][list(index)]


def test_workers_ignore_ctrl_c_and_leave_when_their_parent_is_killed(tiny_config, tmp_path):
    """Ctrl-C in a terminal reaches every process of the group: the workers leave it to the parent. A parent
    killed with SIGKILL cannot stop its workers: they notice and exit on their own."""
    data = tiny_config.data
    flight = data.flights[0]
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys, time
        import numpy as np
        sys.path.insert(0, {str(REPO)!r})
        from cloudml_lib.data.preprocess import FramePool, FrameSpec, SKIMAGE
        pool = FramePool(2)
        assert pool._start()
        pids = [p.pid for p in pool._procs]
        os.kill(pids[0], signal.SIGINT)                    # as a Ctrl-C in a terminal would
        time.sleep(0.5)
        spec = FrameSpec({data.swath_slice[0]}, {data.swath_slice[1]}, 1, 0.01)
        path = {str(Path(data.dir) / flight.ir_file)!r}
        blocks = list(pool.blocks(path, "Product/Signal", "f", np.arange(100), spec, SKIMAGE))
        assert sum(len(b.index) for b in blocks) == 100 and all(p.is_alive() for p in pool._procs)
        print(" ".join(map(str, pids)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2
    assert _gone(pids), f"worker processes {pids} outlived their killed parent"


def _gone(pids, seconds: float = 5.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


_real_read_block = preprocess.read_block


def _killed_for_memory(path, key, flight, index, spec, equalise):
    """A worker task (module level: it is pickled by name) that dies as the kernel's OOM killer would."""
    if index[0] >= 64:
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_read_block(path, key, flight, index, spec, equalise)


def test_a_worker_that_dies_is_a_clear_error_and_leaves_no_half_cache(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess, "read_block", _killed_for_memory)
    tiny_config.data.preprocess_workers = 2
    tiny_config.data.cache_dir = str(tmp_path / "cache")
    with pytest.raises(DataError, match="worker process died.*data.preprocess_workers"):
        cache_mod.load_caches(tiny_config.data, SKIMAGE)
    # neither a cache nor a temporary folder (the input files' SHA-256 memo may stay)
    # no flight's cache folder; the files' SHA-256 memo and the cache folder's own marker and ledger may stay
    assert {p.name for p in (tmp_path / "cache").iterdir()} <= {
        "file_sha256.json",
        ".cloudml",
        ".cloudml-files",
    }


def cli_config(tiny_flights, tmp_path) -> Path:
    root, entries = tiny_flights
    raw = tiny_raw(root, entries, tmp_path / "cache", clahe=True)
    raw["data"]["preprocess_workers"] = 2
    raw["train"]["epochs"] = 1
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def processes_with(text: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace") and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
@pytest.mark.slow
def test_a_stop_during_the_cache_build_leaves_no_half_cache_and_no_orphan(tiny_flights, tmp_path, sig):
    cfg = cli_config(tiny_flights, tmp_path)
    args = ("train", "--config", cfg, "--run-dir", tmp_path / "run")
    env = {"CLOUDML_KILL_AT": f"cache-block:3:{sig}", "TQDM_DISABLE": "1"}
    r = run_cli(*args, env=env, timeout=300)
    assert r.returncode == (-9 if sig == "SIGKILL" else 130), r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]  # the stopped workers are quiet too
    assert _gone_all(str(cfg)), "preprocessing workers outlived the stopped run"
    cache = tmp_path / "cache"
    assert not list(cache.glob("*/meta.json"))  # nothing that looks complete
    leftovers = list(cache.glob("*.tmp-*"))
    assert (len(leftovers) == 1) if sig == "SIGKILL" else not leftovers
    if sig == "SIGKILL":  # the next start removes it and builds
        env.pop("CLOUDML_KILL_AT")
        r = run_cli(*args, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        assert not list(cache.glob("*.tmp-*")) and len(list(cache.glob("*/meta.json"))) == 3


def _gone_all(text: str, seconds: float = 5.0) -> bool:
    deadline = time.time() + seconds
    while processes_with(text):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_kornia_backend_is_close_to_scikit_image_keyed_apart_and_recorded(tiny_config, tmp_path):
    pytest.importorskip("kornia", reason="the GPU path's library: pip install kornia")
    (sk,) = build(tiny_config, 0, tmp_path / "c", SKIMAGE)[:1]
    tiny_config.data.flights = tiny_config.data.flights[:1]
    (ko,) = build(tiny_config, 2, tmp_path / "c", Backend("kornia", "cpu"))
    assert sk.path != ko.path and sk.path.parent == ko.path.parent  # a cache is never reused across backends
    assert (sk.backend, ko.backend) == ("skimage", "kornia")
    a, b = (np.load(c.path / "frames.npy").astype(np.float32) for c in (sk, ko))
    diff = np.abs(a - b)
    assert 0 < diff.mean() < 0.25 and diff.max() < 3.0  # z-scored units: close, not equal
    np.testing.assert_allclose(b.mean(axis=(1, 2)), 0, atol=2e-3)
    np.testing.assert_allclose(b.std(axis=(1, 2)), 1, atol=2e-3)
    from cloudml_lib.core.run.provenance import run_provenance, trained_backend

    assert trained_backend(run_provenance([ko], tiny_config.data)) == "kornia"
    assert trained_backend({"inputs": {}}) == "skimage" and trained_backend(None) is None


def test_the_backend_follows_the_model_and_says_when_it_cannot(monkeypatch, caplog):
    import torch

    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)  # a run's handler stops it
    pytest.importorskip("kornia", reason="the GPU path's library: pip install kornia")
    caplog.set_level(logging.INFO, logger="cloudml_lib")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="data.preprocess_device: cuda.*no CUDA GPU.*auto or cpu"):
            resolve_backend("cuda")
        assert resolve_backend("auto") == SKIMAGE
    assert resolve_backend("auto", trained="kornia").name == "kornia"  # kornia runs on the CPU too
    assert resolve_backend("auto", trained="skimage") == SKIMAGE and "trained on" not in caplog.text
    assert resolve_backend("cpu", trained="kornia") == SKIMAGE
    assert "trained on frames equalised by kornia, but skimage is used now" in caplog.text
    caplog.clear()
    monkeypatch.setattr(preprocess, "has_kornia", lambda: False)
    assert resolve_backend("auto", trained="kornia") == SKIMAGE
    assert "pip install kornia" in caplog.text


def test_the_workers_setting(tiny_config):
    assert preprocess.resolve_workers("auto") == len(os.sched_getaffinity(0))
    assert preprocess.resolve_workers(0) == 0 and preprocess.resolve_workers(3) == 3


def test_meta_records_the_backend_and_speed(tiny_config, tmp_path):
    (c,) = build(tiny_config, 2, tmp_path / "c")[:1]
    info = json.loads((c.path / "meta.json").read_text())["preprocess"]
    assert info["backend"] == "skimage" and info["device"] == "cpu" and info["workers"] == 2
    assert info["frames_per_s"] > 0 and info["seconds"] >= 0


def test_a_machine_that_cannot_start_processes_preprocesses_in_this_one(tiny_config, monkeypatch, caplog):
    import multiprocessing

    class NoFork:  # as under a process limit: fork fails with EAGAIN
        def Pipe(self):
            return multiprocessing.Pipe()

        def Process(self, **kwargs):
            raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(preprocess.multiprocessing, "get_context", lambda method: NoFork())
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)  # a run's handler stops it
    data = tiny_config.data
    flight = data.flights[0]
    index = np.arange(100)
    with FramePool(2) as pool:
        blocks = list(
            pool.blocks(
                Path(data.dir) / flight.ir_file,
                data.keys.ir_signal,
                flight.name,
                index,
                preprocess.FrameSpec.of(data),
                SKIMAGE,
            )
        )
        assert pool.workers == 0
    assert "could not start 2 preprocessing worker processes" in caplog.text
    assert "data.preprocess_workers: 0" in caplog.text
    serial = [
        preprocess_frame(raw, data)[0].astype(np.float16)
        for raw in _raw(Path(data.dir) / flight.ir_file, index)
    ]
    np.testing.assert_array_equal(np.concatenate([b.frames for b in blocks]), np.stack(serial))


def test_a_frozen_worker_is_stopped_and_its_frames_are_preprocessed_here(tiny_config, monkeypatch, caplog):
    """A worker that sends nothing (SIGSTOP: what a hung read or a deadlock looks like) is no wait for ever:
    past the limit the workers are killed, said, and the flight's frames come from this process, the same."""
    monkeypatch.setattr(preprocess, "NO_REPLY_S", 1.0)
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    data = tiny_config.data
    flight = data.flights[0]
    index = np.arange(130)
    where = (Path(data.dir) / flight.ir_file, data.keys.ir_signal, flight.name)
    with FramePool(2) as pool:
        assert len(list(pool.blocks(*where, index[:64], preprocess.FrameSpec.of(data), SKIMAGE))) == 2
        procs = list(pool._procs)  # both have answered (their imports done): only a frozen one is late now
        os.kill(procs[1].pid, signal.SIGSTOP)
        blocks = list(pool.blocks(*where, index, preprocess.FrameSpec.of(data), SKIMAGE))
        assert pool.workers == 0 and not pool._procs
    assert all(not p.is_alive() for p in procs)  # the frozen one too: nothing left behind
    assert f"preprocessing worker process {procs[1].pid} sent no block of frames in 1 s" in caplog.text
    assert "data.preprocess_workers: 0" in caplog.text
    serial = [
        preprocess_frame(raw, data)[0].astype(np.float16)
        for raw in _raw(Path(data.dir) / flight.ir_file, index)
    ]
    np.testing.assert_array_equal(np.concatenate([b.index for b in blocks]), index)
    np.testing.assert_array_equal(np.concatenate([b.frames for b in blocks]), np.stack(serial))


def test_the_progress_bar_counts_each_frame_once_as_the_blocks_arrive(tiny_config, tmp_path, monkeypatch):
    bars = []

    class Bar:
        def __init__(self, total, desc, unit):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            bars.append(self)

        def update(self, k):
            assert not self.closed and k > 0
            self.n += k
            assert self.n <= self.total

        def close(self):
            self.closed = True

    monkeypatch.setattr(cache_mod, "tqdm", Bar)
    caches = build(tiny_config, 2, tmp_path / "c")
    assert [b.desc for b in bars] == [f"cache {c.name}" for c in caches]
    assert all(b.closed and b.n == b.total == c.meta["cached_frames"] for b, c in zip(bars, caches))


def test_leftovers_are_judged_by_host_and_process(tmp_path):
    """A killed build's folder goes; one that another machine (a second Colab VM on the same Drive) is still
    writing stays until it has not changed for the run lock's stale time."""
    import socket

    final = tmp_path / "01Mar25-abc"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    here, old_format = (
        tmp_path / f"01Mar25-abc.tmp-{socket.gethostname()}-{dead}",
        tmp_path / f"01Mar25-abc.tmp-{dead}",
    )
    mine = cachefiles.temporary(final)
    busy, abandoned = tmp_path / "01Mar25-abc.tmp-other-vm-123", tmp_path / "01Mar25-abc.tmp-other-vm-456"
    for folder in (here, old_format, mine, busy, abandoned):
        folder.mkdir()
        (folder / "frames.npy").write_bytes(b"x")
    hour_ago = time.time() - 3600
    for path in (abandoned, abandoned / "frames.npy"):
        os.utime(path, (hour_ago, hour_ago))
    cachefiles.remove_stale_builds(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, busy.name])


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_a_stop_while_a_worker_starts_prints_no_traceback(tiny_flights, tmp_path, sig):
    """Ctrl-C in a terminal (or a SIGTERM to the process group) that lands while a worker process is still
    starting, before it has set its own handlers: the worker must not print a KeyboardInterrupt traceback of
    its own; the command prints its one message and exits 130. The stop is sent by the first worker itself,
    at its very first line, to the whole group; its next lines wait a moment so the parent stops first."""
    cfg = cli_config(tiny_flights, tmp_path)
    script = tmp_path / "start.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, runpy, signal, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from cloudml_lib.data import preprocess
        real = preprocess._worker_main

        def stopped_at_start(*args):
            try:
                os.close(os.open({str(tmp_path / "sent")!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.killpg(0, signal.{sig})
            time.sleep(0.5)
            real(*args)

        preprocess._worker_main = stopped_at_start
        sys.argv = ["cloudml_lib", "train", "--config", {str(cfg)!r}, "--run-dir", {str(tmp_path / "run")!r}]
        runpy.run_module("cloudml_lib", run_name="__main__")
    """)
    )
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # the group the stop goes to is this command's alone
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert (tmp_path / "sent").exists()
    assert r.returncode == 130, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-3000:]
    assert "Process cloudml-preprocess" not in r.stderr, r.stderr[-3000:]  # multiprocessing's traceback head
    assert r.stderr.count("interrupted") == 1, r.stderr[-3000:]
    assert _gone_all(str(cfg)), "preprocessing workers outlived the stopped run"


@pytest.mark.parametrize(
    "attrs, units, packing",
    [
        ({"units": "K", "scale_factor": 0.01, "add_offset": 180.0}, "K", (0.01, 180.0)),  # the demo's, CF
        ({"units": b"Kelvin"}, "K", (1.0, 0.0)),
        ({"units": "counts"}, "counts", (1.0, 0.0)),  # what the demo of CloudML 0.3 states
        ({}, "unstated", (1.0, 0.0)),  # the real files: nothing said, never called kelvin
        ({"units": "DN", "scale_factor": "junk", "add_offset": float("nan")}, "counts", (1.0, 0.0)),
        ({"scale_factor": 0.0}, "unstated", (1.0, 0.0)),  # a scale of 0 would erase every number
    ],
)
def test_the_ir_files_units_are_what_it_states(tmp_path, attrs, units, packing):
    import h5py

    with h5py.File(tmp_path / "ir.h5", "w") as f:
        d = f.create_dataset("Product/Signal", data=np.full((1, 8, 8), 11000, ">u2"))
        d.attrs.update(attrs)
        found = preprocess.radiometry_of(d)
    assert (found.units, found.scale, found.offset) == (units, *packing)
    words = found.words()
    assert ("counts or kelvin unknown" in words) == (units == "unstated")


def test_a_frames_statistics_are_in_the_files_units_and_nan_when_blank():
    spec = preprocess.FrameSpec(1, 7, 1, 0.01)
    raw = np.arange(8 * 10, dtype=np.float32).reshape(8, 10) + 10000.0  # counts
    raw[1, 0] = np.nan  # a bad pixel: left out, not counted as cold
    kelvin = preprocess.frame_statistics(raw, spec, preprocess.Radiometry("K", 0.01, 180.0))
    counts = preprocess.frame_statistics(raw, spec, preprocess.Radiometry("counts"))
    names = list(preprocess.STAT_NAMES)
    swath = raw[1:7][np.isfinite(raw[1:7])]
    assert counts[names.index("p50")] == pytest.approx(np.median(swath))
    assert counts[names.index("mean")] == pytest.approx(swath.mean())
    np.testing.assert_allclose(kelvin[:-1], counts[:-1] * 0.01 + 180.0, rtol=1e-6)  # places on the scale
    assert kelvin[-1] == pytest.approx(counts[-1] * 0.01, rel=1e-5)  # a spread is only scaled
    assert np.isnan(
        preprocess.frame_statistics(np.full((8, 10), np.nan), spec, preprocess.Radiometry("K"))
    ).all()


def test_the_cache_holds_each_samples_statistics_and_the_files_units(tiny_config, tmp_path):
    caches = build(tiny_config, 0, tmp_path / "cache")
    for c in caches:
        assert c.frame_stats.shape == (len(c), len(preprocess.STAT_NAMES))
        assert c.radiometry.units == "K" and c.meta["radiometry"]["statistics"] == list(preprocess.STAT_NAMES)
        p10 = c.frame_stats[:, preprocess.STAT_NAMES.index("p10")]
        np.testing.assert_allclose(p10, c.frame_p10 * 0.01 + 180.0, rtol=1e-5)  # the baseline's p10, in K
        assert 250.0 < float(np.nanmedian(c.frame_stats[:, preprocess.STAT_NAMES.index("p99")])) < 300.0
