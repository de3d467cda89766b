"""Preprocessing on every core (and the GPU): cache build and whole-flight predict, 1 process against all.

    python benchmarks/preprocess.py           # writes benchmarks/results/preprocess.json (about 15 minutes)
    python benchmarks/preprocess.py --torch-clahe   # only the torch CLAHE item, into that file (a minute)

Generated flights at the real 512 x 640 size (swath_slice [40, 480] keeps 440 x 640), each measurement in
its own process (its peak RSS is its own), side by side in one run:
- cache build: frames/s with data.preprocess_workers 0 (one process, the path before issue 20) and with every
  core, alternated three times (the median round of each); peak RSS of the main process and of the largest
  worker for flights of growing length (flat: frames are streamed in blocks and written with plain writes,
  never held whole);
- predict: the stream of preprocessed frames predict feeds its model (frames/s, 1 process and all cores), and
  predict itself with the demo's network (16/32/64 channels) at the real size, untrained weights (the time
  does not depend on them); where CUDA is available also the torch backend's CLAHE on the GPU and predict
  with preset C's network on the GPU. A 12,000-frame flight's time is extrapolated from each measured rate;
- the torch backend's CLAHE (data/clahe.py) on the CPU (2 threads) against scikit-image's in one process:
  frames/s of the CLAHE alone on the same real-size frames, and their difference (max abs of the [0, 1]
  output; float16 values as cached that differ);
- kornia against scikit-image: the difference of the frames (z-scored units, as cached) on demo and real-size
  frames, and its effect on the demo's held-out error: the demo trained on each backend, and the model trained
  on scikit-image frames evaluated on kornia frames (kornia runs on the CPU here, as it does for such a
  model).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "preprocess"
RAW_SHAPE = (512, 640)
LENGTHS = (200, 400, 800)  # frames per generated flight (RSS as flights grow)
SPEED_FRAMES = 400  # the flight the 1-process / all-cores rates are measured on
PREDICT_FRAMES_CPU = 48  # the network takes ~0.6 s per frame on a 2-core CPU at this size
FLIGHT = 12000  # frames of a long real flight, for the extrapolation
ROUNDS = 3  # alternated repetitions of each side-by-side speed measurement
TORCH_CLAHE_FRAMES = 32  # real-size frames the torch backend's CLAHE is timed and compared on
TORCH_THREADS = 2  # Colab's 2 vCPUs


def config(frames: int, workers, backend_device: str = "cpu", demo_model: bool = True):
    from cloudml_lib.base.config import build_config
    from cloudml_lib.data.synthetic import demo_flight_entries

    entries = demo_flight_entries(2)
    return build_config(
        {
            "data": {
                "dir": str(SCRATCH / f"flights-{frames}"),
                "cache_dir": str(SCRATCH / "cache"),
                "flights": entries[:1],
                "test_flights": [],
                "temporal_frames": 5,
                "swath_slice": [40, 480],
                "preprocess_workers": workers,
                "preprocess_device": backend_device,
            },
            "model": {"channels": [16, 32, 64]} if demo_model else {"memory_optimized": True},
        }
    )


def peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def children_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def measure_cache(frames: int, workers) -> dict:
    from cloudml_lib.data.cache import load_caches

    cfg = config(frames, workers)
    shutil.rmtree(SCRATCH / "cache", ignore_errors=True)
    t0 = time.perf_counter()
    (cache,) = load_caches(cfg.data)
    seconds = time.perf_counter() - t0
    n = cache.meta["cached_frames"]
    return {
        "frames": n,
        "seconds": seconds,
        "frames_per_s": n / seconds,
        "main_peak_rss_mb": peak_rss_mb(),
        "worker_peak_rss_mb": children_peak_rss_mb() if cache.meta["preprocess"]["workers"] else None,
        "workers": cache.meta["preprocess"]["workers"],
    }


def measure_stream(frames: int, workers, device: str) -> dict:
    """What predict's model is fed: every frame of the flight read and preprocessed, in order."""
    from cloudml_lib.data.preprocess import SKIMAGE, Backend, FramePool, FrameSpec, resolve_workers

    cfg = config(frames, workers)
    flight = cfg.data.flights[0]
    backend = SKIMAGE if device == "cpu" else Backend("kornia", "cuda")
    n = 0
    t0 = time.perf_counter()
    with FramePool(resolve_workers(workers)) as pool:
        for block in pool.blocks(
            Path(cfg.data.dir) / flight.ir_file,
            cfg.data.keys.ir_signal,
            flight.name,
            np.arange(frames),
            FrameSpec.of(cfg.data),
            backend,
            ahead=256,
        ):
            n += len(block.index)
    seconds = time.perf_counter() - t0
    return {
        "frames": n,
        "seconds": seconds,
        "frames_per_s": n / seconds,
        "main_peak_rss_mb": peak_rss_mb(),
        "worker_peak_rss_mb": children_peak_rss_mb(),
        "backend": str(backend),
    }


def measure_predict(frames: int, workers, device: str) -> dict:
    """predict_flight over the first `frames` frames of a flight (the rest of predict writes files)."""
    import torch

    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.data.dataset import Scalers
    from cloudml_lib.data.preprocess import SKIMAGE, Backend, FramePool, resolve_workers
    from cloudml_lib.science import predict as pr

    cfg = config(min(n for n in LENGTHS if n >= frames), workers, demo_model=device == "cpu")
    model = build_model(cfg).to(device).eval()
    scalers = Scalers(sza_mean=40.0, sza_std=10.0, cbh_mean=1.0, cbh_std=0.5)
    if cfg.data.radiometry != "none":  # the model reads the frames' brightness statistics too
        scalers = Scalers(40.0, 10.0, 1.0, 0.5, radiometry_offset=285.0, radiometry_scale=5.0)
    backend = SKIMAGE if device == "cpu" else Backend("kornia", "cuda")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.float16)) if device == "cuda" else pr.nullcontext
    inputs = pr._flight_inputs
    pr._flight_inputs = lambda flight, data: {k: v[:frames] for k, v in inputs(flight, data).items()}
    with FramePool(resolve_workers(workers)) as pool:
        t0 = time.perf_counter()
        batch = 16 if device == "cpu" else 64
        predictor = pr.FlightPredictor(model, scalers, torch.device(device), batch, autocast, backend, pool)
        result = pr.predict_flight(predictor, cfg.data.flights[0], cfg.data)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    n = result["counts"]["frames"]
    return {
        "frames": n,
        "seconds": seconds,
        "frames_per_s": n / seconds,
        "main_peak_rss_mb": peak_rss_mb(),
        "torch_threads": torch.get_num_threads(),
        "model": "16/32/64 channels (demo)"
        if device == "cpu"
        else "32/64/128 channels (preset C), float16 autocast",
        "backend": str(backend),
    }


def measure_model(device: str) -> dict:
    """The network alone on random real-size windows: the rate predict cannot exceed."""
    import torch

    from cloudml_lib.core.network.model import build_model

    cfg = config(SPEED_FRAMES, 0, demo_model=device == "cpu")
    model = build_model(cfg).to(device).eval()
    batch = 16 if device == "cpu" else 64
    x, s = torch.randn(batch, 5, 440, 640, device=device), torch.randn(batch, 3, device=device)
    reps = 2 if device == "cpu" else 20
    with (
        torch.no_grad(),
        (
            torch.autocast("cuda", dtype=torch.float16)
            if device == "cuda"
            else torch.autocast("cpu", enabled=False)
        ),
    ):
        model(x, s)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            model(x, s)
        if device == "cuda":
            torch.cuda.synchronize()
    return {"frames_per_s": reps * batch / (time.perf_counter() - t0)}


def child(*args) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *map(str, args)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def side_by_side(kind: str, frames: int, *rest) -> dict:
    """1 process and all cores, alternated ROUNDS times (the machine is shared): each one's median round."""
    runs = {"1_process": [], "all_cores": []}
    for _ in range(ROUNDS):
        runs["1_process"].append(child(kind, frames, 0, *rest))
        runs["all_cores"].append(child(kind, frames, "auto", *rest))
    out = {k: sorted(v, key=lambda r: r["frames_per_s"])[len(v) // 2] for k, v in runs.items()}
    out["rounds_frames_per_s"] = {k: [round(r["frames_per_s"], 1) for r in v] for k, v in runs.items()}
    out["ratio"] = out["all_cores"]["frames_per_s"] / out["1_process"]["frames_per_s"]
    return out


def frame_difference() -> dict:
    """kornia against scikit-image on the same prepared frames, as cached (float16, z-scored units)."""
    import h5py

    from cloudml_lib.base.config import load_config
    from cloudml_lib.data.preprocess import FrameSpec, equalise_skimage, equalise_torch, prepare

    out = {}
    demo = load_config(REPO / "configs" / "demo.yaml", [f"data.dir={SCRATCH / 'demo' / 'flights'}"])
    real = config(SPEED_FRAMES, 0)
    for name, cfg in (("demo_64x96", demo), ("real_440x640", real)):
        flight = cfg.data.flights[0] if cfg.data.flights else None
        path = (
            next((Path(cfg.data.dir)).rglob("*IRAI*.h5"))
            if flight is None
            else Path(cfg.data.dir) / flight.ir_file
        )
        spec = FrameSpec.of(cfg.data)
        with h5py.File(path) as f:
            raw = f[cfg.data.keys.ir_signal][100:164]
        prepared = [prepare(r, spec) for r in raw]
        x, blank = np.stack([p[0] for p in prepared]), np.array([p[2] for p in prepared])
        sk = np.stack([equalise_skimage(v, spec.clip_limit) for v in x]).astype(np.float16).astype(np.float32)
        ko = equalise_torch(x, blank, spec.clip_limit, "cpu").astype(np.float32)
        d = np.abs(sk - ko)
        out[name] = {
            "frames": len(x),
            "max_abs": float(d.max()),
            "mean_abs": float(d.mean()),
            "p99_abs": float(np.percentile(d, 99)),
            "correlation": float(np.corrcoef(sk.ravel(), ko.ravel())[0, 1]),
        }
    return out


def torch_clahe(frames: int = TORCH_CLAHE_FRAMES) -> dict:
    """The torch backend's CLAHE (data/clahe.py) on the CPU with TORCH_THREADS threads against scikit-image's
    in one process, on the same prepared real-size frames: frames/s of the CLAHE alone (the best of
    ROUNDS), the max abs difference of the [0, 1] output, and the float16 values as cached that differ."""
    import h5py
    import torch

    from cloudml_lib.data import clahe
    from cloudml_lib.data.preprocess import FrameSpec, equalise_skimage, equalise_torch, prepare

    folder = SCRATCH / "flights-clahe"
    if not folder.exists():
        from cloudml_lib.data.synthetic import make_demo_flights

        make_demo_flights(folder, n_flights=2, seed=0, frames_per_flight=frames + 20, frame_shape=RAW_SHAPE)
    cfg = config(frames, 0)
    spec = FrameSpec.of(cfg.data)
    with h5py.File(next(folder.rglob("*IRAI*.h5"))) as f:
        raw = f[cfg.data.keys.ir_signal][10 : 10 + frames]
    prepared = [prepare(r, spec) for r in raw]
    x, blank = np.stack([p[0] for p in prepared]), np.array([p[2] for p in prepared])
    torch.set_num_threads(TORCH_THREADS)
    from skimage import exposure

    sk_s, to_s = [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        sk = np.stack([exposure.equalize_adapthist(v, clip_limit=spec.clip_limit) for v in x]).astype(
            np.float32
        )
        sk_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ours = clahe.equalize_adapthist(torch.from_numpy(x), spec.clip_limit).numpy()
        to_s.append(time.perf_counter() - t0)
    cached_sk = np.stack([equalise_skimage(v, spec.clip_limit) for v in x]).astype(np.float16)
    cached_to = equalise_torch(x, blank, spec.clip_limit, "cpu")
    return {
        "frames": len(x),
        "frame": f"{x.shape[1]} x {x.shape[2]}",
        "torch_threads": TORCH_THREADS,
        "skimage_1_process_frames_per_s": len(x) / min(sk_s),
        "torch_cpu_frames_per_s": len(x) / min(to_s),
        "max_abs_difference": float(np.abs(ours - sk).max()),
        "cached_values_differing": int((cached_sk.view(np.uint16) != cached_to.view(np.uint16)).sum()),
        "cached_values": int(cached_sk.size),
    }


def demo_accuracy() -> dict:
    """The demo trained on each backend; the scikit-image model also evaluated on kornia frames."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.runs import train_run as train
    from cloudml_lib.data.preprocess import SKIMAGE, Backend
    from cloudml_lib.science import evaluate
    from cloudml_lib.train import build

    def overrides():
        return [f"data.dir={SCRATCH / 'demo' / 'flights'}", f"data.cache_dir={SCRATCH / 'demo' / 'cache'}"]

    kornia_cpu = Backend("kornia", "cpu")
    real_build, real_eval = build.resolve_backend, evaluate.resolve_backend
    out = {}
    for name, backend in (("skimage", SKIMAGE), ("kornia", kornia_cpu)):
        shutil.rmtree(SCRATCH / "demo" / f"run-{name}", ignore_errors=True)
        build.resolve_backend = lambda setting, trained=None, b=backend: b  # this machine has no GPU
        report = train(
            load_config(REPO / "configs" / "demo.yaml", overrides()),
            SCRATCH / "demo" / f"run-{name}",
            resume="never",
        )
        out[f"trained_{name}"] = {k: report["overall"][k] for k in ("r2", "mae_km", "rmse_km")}
    build.resolve_backend = real_build
    evaluate.resolve_backend = lambda setting, trained=None: kornia_cpu
    report = evaluate.evaluate_run(SCRATCH / "demo" / "run-skimage", write=False)
    evaluate.resolve_backend = real_eval
    out["trained_skimage_evaluated_on_kornia"] = {
        k: report["overall"][k] for k in ("r2", "mae_km", "rmse_km")
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs="+")
    p.add_argument(
        "--torch-clahe", action="store_true", help="only the torch CLAHE item, into the existing results file"
    )
    args = p.parse_args()
    if args.torch_clahe:
        out = REPO / "benchmarks" / "results" / "preprocess.json"
        result = {**json.loads(out.read_text()), "torch_clahe": torch_clahe()}
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result["torch_clahe"], indent=1))
        return
    if args.child:
        kind, rest = args.child[0], [r if r in ("auto", "cpu", "cuda") else int(r) for r in args.child[1:]]
        fn = {
            "cache": lambda: measure_cache(rest[0], rest[1]),
            "stream": lambda: measure_stream(rest[0], rest[1], rest[2]),
            "predict": lambda: measure_predict(rest[0], rest[1], rest[2]),
            "model": lambda: measure_model(rest[0]),
        }[kind]
        print(json.dumps(fn()))
        return
    import torch

    from cloudml_lib.data.preprocess import available_cores
    from cloudml_lib.data.synthetic import make_demo_flights

    cores = available_cores()
    for n in LENGTHS:
        if not (SCRATCH / f"flights-{n}").exists():
            make_demo_flights(
                SCRATCH / f"flights-{n}", n_flights=2, seed=0, frames_per_flight=n, frame_shape=RAW_SHAPE
            )
    if not (SCRATCH / "demo" / "flights").exists():
        make_demo_flights(SCRATCH / "demo" / "flights")
    cache = side_by_side("cache", SPEED_FRAMES)
    cache["rss_by_flight_length"] = {n: child("cache", n, "auto") for n in LENGTHS}
    stream = side_by_side("stream", SPEED_FRAMES, "cpu")
    stream["rss_by_flight_length"] = {n: child("stream", n, "auto", "cpu") for n in LENGTHS}
    predict = {
        "model_only": child("model", "cpu"),
        "1_process": child("predict", PREDICT_FRAMES_CPU, 0, "cpu"),
        "all_cores": child("predict", PREDICT_FRAMES_CPU, "auto", "cpu"),
    }
    predict["ratio"] = predict["all_cores"]["frames_per_s"] / predict["1_process"]["frames_per_s"]
    gpu = None
    if torch.cuda.is_available():
        gpu = {
            "stream_gpu": child("stream", LENGTHS[-1], "auto", "cuda"),
            "model_only": child("model", "cuda"),
            "predict": child("predict", LENGTHS[-1], "auto", "cuda"),
        }
    extrapolated = {
        "cache_1_process_min": FLIGHT / cache["1_process"]["frames_per_s"] / 60,
        "cache_all_cores_min": FLIGHT / cache["all_cores"]["frames_per_s"] / 60,
        "predict_cpu_all_cores_min": FLIGHT / predict["all_cores"]["frames_per_s"] / 60,
        "preprocess_stream_all_cores_min": FLIGHT / stream["all_cores"]["frames_per_s"] / 60,
    }
    if gpu:
        extrapolated["predict_gpu_min"] = FLIGHT / gpu["predict"]["frames_per_s"] / 60
    result = {
        "what": "frames/s of cache build and predict with 1 process and every core (and the GPU where there "
        "is one)",
        "frame": "440 x 640 (swath_slice [40, 480] of 512 x 640), T = 5",
        "machine": machine(),
        "cores": cores,
        "cache_build": cache,
        "predict_stream": stream,
        "predict": predict,
        "gpu": gpu,
        "extrapolated_12000_frames": extrapolated,
        "torch_clahe": torch_clahe(),
        "kornia_vs_skimage": frame_difference(),
        "demo_held_out": demo_accuracy(),
        "targets": {
            "ratio": f">= {0.8 * cores:.1f} (0.8 x {cores} cores) for the CPU path",
            "predict_gpu_min": "< 2 for 12,000 frames (CUDA only)",
            "rss": "flat as flights grow",
        },
    }
    out = REPO / "benchmarks" / "results" / "preprocess.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
