"""Cached loader vs the research code's loader, on generated flights at the real 440 x 640 size.

The research loader reopened the HDF5 file and ran the preprocessing (crop, min-max, CLAHE,
z-score) for every frame of every sample; the cached loader reads a preprocessed window with one
positioned read. Each measurement runs in its own process so its peak RSS is its own.

    python benchmarks/data_path.py            # writes benchmarks/results/data_path.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "data_path"
RAW_SHAPE = (512, 640)  # sensor rows x columns; swath_slice [40, 480] keeps 440 x 640
FRAMES_PER_FLIGHT = 150


def config(n_flights: int):
    from cloudml_lib.base.config import build_config
    from cloudml_lib.data.synthetic import demo_flight_entries

    entries = demo_flight_entries(n_flights)
    return build_config(
        {
            "data": {
                "dir": str(SCRATCH / "flights"),
                "cache_dir": str(SCRATCH / "cache"),
                "flights": entries,
                "test_flights": [entries[-1]["name"]],
                "temporal_frames": 5,
                "swath_slice": [40, 480],
            }
        }
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: Linux carries that over from
    the parent across fork and exec, so a child started by a big parent would report the parent's."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_cached(n_flights: int, passes: int) -> dict:
    """Every sample of every flight, `passes` times, through the training Dataset."""
    from cloudml_lib.data.cache import load_caches
    from cloudml_lib.data.dataset import CloudDataset, fit_scalers

    cfg = config(n_flights)
    caches = load_caches(cfg.data)
    ds = CloudDataset(caches, fit_scalers(caches), augment=False)
    rss_ready = peak_rss_mb()
    t0, n = time.perf_counter(), 0
    for _ in range(passes):
        for i in range(len(ds)):
            ds[i]
            n += 1
    return {
        "samples": n,
        "samples_per_s": n / (time.perf_counter() - t0),
        "peak_rss_mb": peak_rss_mb(),
        "rss_before_reading_mb": rss_ready,
        "dataset_samples": len(ds),
        "cache_mb": sum(c.meta["bytes"] for c in caches) / 1e6,
    }


def measure_research(n_flights: int, limit: int) -> dict:
    """The research way: per sample, reopen the IR file, read T frames, preprocess each."""
    import h5py
    import numpy as np

    from cloudml_lib.data.cache import build_windows
    from cloudml_lib.data.cpl import read_flight_labels
    from cloudml_lib.data.er2 import flight_paths
    from cloudml_lib.data.preprocess import preprocess_frame

    cfg = config(n_flights)
    samples = []
    for flight in cfg.data.flights:
        labels = read_flight_labels(flight, cfg.data)
        windows, _ = build_windows(labels.frame_index, labels.n_frames, 5, "shift")
        samples += [(flight_paths(flight, cfg.data)["ir"], w) for w in windows]
    rss_ready = peak_rss_mb()
    t0, n = time.perf_counter(), 0
    for path, w in samples[:limit]:
        with h5py.File(path, "r") as f:
            frames = np.stack([preprocess_frame(f[cfg.data.keys.ir_signal][int(k)], cfg.data)[0] for k in w])
        assert frames.shape == (5, 440, 640)
        n += 1
    return {
        "samples": n,
        "samples_per_s": n / (time.perf_counter() - t0),
        "peak_rss_mb": peak_rss_mb(),
        "rss_before_reading_mb": rss_ready,
    }


def child(kind: str, n_flights: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--flights", str(n_flights)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["cached", "research"])
    p.add_argument("--flights", type=int, default=2)
    args = p.parse_args()
    if args.child == "cached":
        print(json.dumps(measure_cached(args.flights, passes=3)))
        return
    if args.child == "research":
        print(json.dumps(measure_research(args.flights, limit=40)))
        return

    from cloudml_lib.data.cache import load_caches
    from cloudml_lib.data.synthetic import make_demo_flights

    t0 = time.perf_counter()
    make_demo_flights(
        SCRATCH / "flights", n_flights=4, seed=0, frames_per_flight=FRAMES_PER_FLIGHT, frame_shape=RAW_SHAPE
    )
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_caches(config(4).data)  # build once, outside the timed children
    t_cache = time.perf_counter() - t0

    research = child("research", 2)
    cached2 = child("cached", 2)
    cached4 = child("cached", 4)
    result = {
        "what": "samples/s and peak RSS of the cached loader vs reopening HDF5 + preprocessing per sample",
        "frame": "440 x 640 (swath_slice [40, 480] of 512 x 640), T = 5, float16 cache",
        "machine": machine(),
        "generate_4_flights_s": t_gen,
        "build_cache_4_flights_s": t_cache,
        "research_loader_2_flights": research,
        "cached_loader_2_flights": cached2,
        "cached_loader_4_flights": cached4,
        "throughput_ratio": cached2["samples_per_s"] / research["samples_per_s"],
        "peak_rss_ratio_4_vs_2_flights": cached4["peak_rss_mb"] / cached2["peak_rss_mb"],
        "targets": {"throughput_ratio": ">= 5", "peak_rss_ratio_4_vs_2_flights": "flat (about 1.0)"},
    }
    out = REPO / "benchmarks" / "results" / "data_path.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
