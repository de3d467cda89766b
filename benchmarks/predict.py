"""Whole flights: each frame encoded once (CloudML) against once for each window it sits in (the previous
release, kept here as the reference), side by side.

    python benchmarks/predict.py            # writes benchmarks/results/predict.json (about 15 minutes, 2-core
    CPU) python benchmarks/predict.py --smoke    # a tiny flight: checks the code path, writes nothing

Two models, each on a synthetic flight in the real file layout (data/synthetic.py), with the preset's
frame crop and T = 5:
  demo   configs/demo.yaml's model (16/32/64) on the demo camera's frames (64 x 96 after the crop)
  full   preset B's model (64/128/256) on frames of the real size (440 x 640 after the crop)
Paths, each run as a whole process of its own (start, reading the IR file, preprocessing by the worker
processes, the model), alternated over rounds so that they meet the same machine load:
  per_window        the previous release: every window of T frames through the whole network
  per_frame         CloudML: every frame encoded once, then each window's head (inference.py)
  per_frame_cl      the same with the model in channels_last memory format
The weights are random (seeded): speed does not depend on them; the paths' heights are compared
(max difference, km). Reported: frames/s of the whole process and of the prediction alone, the ratios,
and the time of a 12,000-frame flight (start + 12,000 frames at the prediction's rate). With CUDA, the
same on the GPU with the real flight size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "predict.json"
SCRATCH = REPO / "benchmarks" / ".scratch" / "predict"
# name: (config, raw frame rows x columns, frames in the flight on a CPU, on a GPU)
MODELS = {"demo": ("demo.yaml", (80, 96), 600, 3000), "full": ("colab_full_stable.yaml", (512, 640), 30, 600)}
PATHS = ("per_window", "per_frame", "per_frame_cl")
FLIGHT_FRAMES = 12_000


def predict_per_window(model, flight, data, scalers, device, batch_size, autocast, backend, pool):
    """The previous release's predict: every window's T frames through the whole network. Returns the height
    (km) and the cloud probability (NaN without a cloud output) of every frame."""
    import numpy as np
    import torch

    from cloudml_lib.data.dataset import model_azimuth, scalar_inputs
    from cloudml_lib.data.preprocess import FrameSpec
    from cloudml_lib.science.predict import BLOCK, _flight_inputs

    inputs = _flight_inputs(flight, data)
    n, t = inputs["t"].size, data.temporal_frames
    scalars = scalar_inputs(
        inputs["sza"], model_azimuth(inputs["saa"], inputs["heading"], data.sun_azimuth), scalers
    )
    pred, prob, half = np.full(n, np.nan), np.full(n, np.nan), t // 2
    stream = pool.blocks(
        Path(data.dir) / flight.ir_file,
        data.keys.ir_signal,
        flight.name,
        np.arange(n),
        FrameSpec.of(data),
        backend,
        ahead=BLOCK,
    )
    buf, buf_lo = None, 0
    try:
        for start in range(0, n, BLOCK):
            stop = min(n, start + BLOCK)
            lo, hi = max(0, min(start - half, n - t)), min(n, max(stop + half, t))
            while buf is None or buf_lo + len(buf) < hi:
                block = next(stream)
                if buf is None:
                    buf = block.frames
                else:
                    buf, buf_lo = np.concatenate([buf[lo - buf_lo :], block.frames]), lo
            frames = buf[lo - buf_lo : hi - buf_lo].astype(np.float32)
            first = np.clip(np.arange(start, stop) - half, 0, n - t)
            windows = frames[(first - lo)[:, None] + np.arange(t)[None, :]]  # (B, T, H, W)
            with torch.no_grad(), autocast():
                for i in range(0, len(windows), batch_size):
                    x = torch.from_numpy(windows[i : i + batch_size]).to(device)
                    s = torch.from_numpy(scalars[start + i : start + i + len(x)].astype(np.float32)).to(
                        device
                    )
                    out = model(x, s).float()
                    height, logit = out.height, out.cloud_logit
                    pred[start + i : start + i + len(x)] = height.cpu().numpy()
                    if logit is not None:
                        prob[start + i : start + i + len(x)] = torch.sigmoid(logit).cpu().numpy()
    finally:
        stream.close()
    return pred * scalers.cbh_std + scalers.cbh_mean, prob


def flight_dir(model_name: str, frames: int) -> Path:
    """One synthetic flight (and a second the generator needs) in the real layout, written once."""
    from cloudml_lib.data.synthetic import make_demo_flights

    folder = SCRATCH / f"{model_name}_{frames}"
    if not (folder / "done").exists():
        make_demo_flights(
            folder, n_flights=2, seed=3, frames_per_flight=frames, frame_shape=MODELS[model_name][1]
        )
        (folder / "done").write_text("")
    return folder


def child(
    model_name: str, path: str, frames: int, device_name: str, out: Path, folder: Path | None = None
) -> None:
    """One whole process: build the model, read and preprocess the flight, predict every frame; timings to
    `out`. `folder`: flights written elsewhere (benchmarks/gpu.py's), instead of this benchmark's own."""
    started = time.perf_counter()
    import numpy as np
    import torch

    from cloudml_lib.base.config import load_config
    from cloudml_lib.base.resources import config_file
    from cloudml_lib.core.machine.device import choose_precision
    from cloudml_lib.core.network.inference import prepare_model
    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.data.dataset import Scalers
    from cloudml_lib.data.preprocess import SKIMAGE, FramePool, resolve_workers
    from cloudml_lib.science.predict import FlightPredictor, flights_to_predict, predict_flight

    folder = folder or flight_dir(model_name, frames)
    cfg = load_config(config_file(MODELS[model_name][0]), [f"data.dir={folder}", "data.flights=[]"])
    name = sorted(p.name for p in folder.iterdir() if p.is_dir())[0]
    flight = flights_to_predict(cfg, [name])[name]
    device = torch.device(device_name)
    torch.manual_seed(0)
    model = build_model(cfg).to(device).eval()
    prepare_model(model, device, channels_last=path == "per_frame_cl")
    dtype = choose_precision(device).dtype
    autocast = (
        (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else __import__("contextlib").nullcontext
    )
    batch = 2 * int(cfg.train.batch_size)
    scalers = Scalers(45.0, 5.0, 1.0, 0.5)  # random weights: any fixed scale times the same work
    if cfg.data.radiometry != "none":  # the model reads the frames' brightness statistics too
        scalers = Scalers(45.0, 5.0, 1.0, 0.5, radiometry_offset=285.0, radiometry_scale=5.0)
    with FramePool(resolve_workers("auto")) as pool:
        ready = time.perf_counter()
        if path == "per_window":
            heights, _ = predict_per_window(
                model, flight, cfg.data, scalers, device, batch, autocast, SKIMAGE, pool
            )
        else:
            predictor = FlightPredictor(model, scalers, device, batch, autocast, SKIMAGE, pool)
            r = predict_flight(predictor, flight, cfg.data)
            heights = np.full(r["counts"]["frames"], np.nan)
            heights[r["frame_index"]] = r["cbh_km"]  # frames with a usable time
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
    np.save(out.with_suffix(".npy"), np.asarray(heights, np.float64))
    out.write_text(json.dumps({"frames": frames, "start_s": ready - started, "predict_s": done - ready}))


def run_child(model_name: str, path: str, frames: int, device: str) -> dict:
    out = SCRATCH / f"timing_{model_name}_{path}_{device}.json"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, __file__, "--child", model_name, path, str(frames), device, str(out)],
        check=True,
        cwd=REPO,
    )
    whole = time.perf_counter() - t0
    r = json.loads(out.read_text())
    import numpy as np

    r["whole_s"], r["heights"] = whole, np.load(out.with_suffix(".npy"))
    return r


def measure(model_name: str, device: str, frames: int, rounds: int) -> dict:
    flight_dir(model_name, frames)  # written before any timing
    runs = {p: [] for p in PATHS}
    for _ in range(rounds):
        for p in PATHS:
            runs[p].append(run_child(model_name, p, frames, device))
    import numpy as np

    out = {"frames": frames, "rounds": rounds}
    for p, rs in runs.items():
        whole, pred, start = (
            statistics.median(r[k] for r in rs) for k in ("whole_s", "predict_s", "start_s")
        )
        out[p] = {
            "whole_process_s": whole,
            "whole_process_frames_per_s": frames / whole,
            "predict_frames_per_s": frames / pred,
            "start_s": start,
            "flight_12000_min": (start + FLIGHT_FRAMES * pred / frames) / 60.0,
            "rounds_whole_s": [round(r["whole_s"], 2) for r in rs],
        }
        ref = runs["per_window"][0]["heights"]
        both = np.isfinite(ref) & np.isfinite(rs[0]["heights"])
        out[p]["max_diff_km_vs_per_window"] = float(np.abs(ref[both] - rs[0]["heights"][both]).max())
    w = out["per_window"]
    for p in PATHS[1:]:
        out[p]["whole_process_speedup"] = w["whole_process_s"] / out[p]["whole_process_s"]
        out[p]["predict_speedup"] = out[p]["predict_frames_per_s"] / w["predict_frames_per_s"]
    out["channels_last_speedup"] = (
        out["per_frame"]["whole_process_s"] / out["per_frame_cl"]["whole_process_s"]
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", nargs=5, metavar=("MODEL", "PATH", "FRAMES", "DEVICE", "OUT"))
    args = p.parse_args()
    if args.child:
        m, path, frames, device, out = args.child
        child(m, path, int(frames), device, Path(out))
        return
    import torch

    if args.smoke:
        print(
            json.dumps(
                {k: v for k, v in measure("demo", "cpu", 40, 1).items() if k != "frames"}, default=str
            )[:600]
        )
        return
    results = {
        "machine": machine(),
        "flight_frames_extrapolated": FLIGHT_FRAMES,
        "cpu": {name: measure(name, "cpu", MODELS[name][2], 3 if name == "demo" else 2) for name in MODELS},
    }
    if torch.cuda.is_available():
        results["cuda"] = {name: measure(name, "cuda", MODELS[name][3], 3) for name in MODELS}
    # what the library follows (inference.prepare_model): channels_last where it was measured to pay
    results["channels_last"] = {
        dev: {
            "speedup": r["full"]["channels_last_speedup"],
            "use": r["full"]["channels_last_speedup"] >= 1.05,
        }
        for dev, r in results.items()
        if dev in ("cpu", "cuda")
    }
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
