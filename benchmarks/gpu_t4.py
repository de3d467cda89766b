"""The measurements a T4 projection needs, as items of benchmarks/gpu.py (issue 53). Run them in one call:

    python benchmarks/gpu.py --only t4 --results OUT.json    # on a CUDA GPU, about 8 minutes at most
    python benchmarks/gpu.py --only t4 --smoke                # on the CPU at a tiny size: the code paths

Each is time-boxed in a process of its own, like gpu.py's items, standing for a T4 the same way (fp16 +
GradScaler, 14.7 GiB cap):

  context       the memory CUDA, cuDNN and cuBLAS take outside PyTorch's allocator (what a T4 loses to them)
  profile       one step of each preset under torch.profiler: GPU busy against wall time (a step the host
                cannot feed is bound by its ~1,000 operations' dispatch), device time by kind of kernel
  speed         steps/s of each preset: eager, compiled, channels_last, cudnn.benchmark, deterministic
                (train.deterministic's cost), each against eager at the preset's batch
  epoch         whole epochs of the real Trainer (preset C) with Colab's data loading: the process held to
                2 CPUs, data.num_workers 0, against 2 workers
  predict_2cpu  whole-flight predict (benchmarks/predict.py's process) held to 2 CPUs, as on a Colab VM: the
                host's preprocessing against the network
  graphs        compile mode "reduce-overhead" (CUDA graphs) around the checkpointed encoder, which the config
                refuses: does it crash, and how fast is it when it does not
On the CPU (--smoke) the CUDA-only parts say so, and compiled variants are left out of `speed` (the compile's
path is gpu.py's `compile` item); every other path runs.
"""

from __future__ import annotations

import os
import re
import time

T4_ITEMS = ("context", "profile", "speed", "epoch", "predict_2cpu", "graphs")
T4_BOX = {"context": 30, "profile": 90, "speed": 150, "epoch": 120, "predict_2cpu": 60, "graphs": 60}
KINDS = (  # kinds of kernel by name, first match wins (cuDNN, cuBLAS, Triton and ATen names)
    ("convolution", r"conv|implicit|xmma|cutlass|gemm|sm\d\d_|hmma|cudnn|winograd"),
    ("batch norm", r"batch_norm|batchnorm|bn_fw|bn_bw|welford"),
    ("triton (compiled)", r"triton_"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy, cast, layout", r"copy|cast|memcpy|transpose|nchwToNhwc|nhwcToNchw|to_copy"),
    ("pooling", r"pool"),
    ("elementwise, reduction", r"elementwise|vectorized|reduce|threshold|fill|mul|add|sigmoid|relu|softmax"),
)


def _g():
    from benchmarks import gpu

    return gpu


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def two_cpus() -> list[int]:
    """Hold this process (and what it starts) to two CPUs, as a Colab VM has; returns them. PyTorch's own
    threads are set to two as well: it counted the machine's CPUs when it started, and its sixteen threads on
    two CPUs made the loading in the main process (workers 0) eleven times slower than in 2 workers, a
    contention a Colab's own 2-thread process does not have (the first measurement, gpu.json's call 3)."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return cpus


def prepared(preset: str, size, compile_: bool = False, channels_last: bool = False):
    """One training step of `preset` at its batch (2 on the CPU smoke) on a synthetic batch; returns it."""
    import torch

    g = _g()
    cfg = g.config(preset, size)
    device = torch.device(size.device)
    model, opt, autocast, scaler, _ = g.build(cfg, device, compile_)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    b = 2 if size.smoke else cfg.train.batch_size
    batch = g.synthetic_batch(b, cfg.data.temporal_frames, size.frame, device, scalars=g.n_scalars(model))
    return lambda: g.training_step(model, opt, autocast, scaler, batch, cfg.train), b


def rate(step, warm: int, n: int) -> float:
    g = _g()
    for _ in range(warm):
        step()
    g.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    g.sync()
    return n / (time.perf_counter() - t0)


# the items that measure what a CPU does not have: skipped without CUDA, said so (gpu.py does not start a
# process for them there)
NEEDS_CUDA = {"context": "needs CUDA", "graphs": "needs CUDA (CUDA graphs)"}


def item_context(size, put) -> None:
    if not _cuda():
        return put("skipped", NEEDS_CUDA["context"])
    import torch

    free, total = torch.cuda.mem_get_info()
    put("total_gib", total / 2**30)
    put("outside_allocator_after_start_gib", (total - free - torch.cuda.memory_reserved()) / 2**30)
    x = torch.randn(8, 32, 64, 64, device="cuda", dtype=torch.half)
    torch.nn.functional.conv2d(x, torch.randn(32, 32, 3, 3, device="cuda", dtype=torch.half)).sum().item()
    (x.flatten(1) @ x.flatten(1).T).sum().item()  # cuBLAS's workspace and handles
    free, _ = torch.cuda.mem_get_info()
    put("outside_allocator_with_cudnn_cublas_gib", (total - free - torch.cuda.memory_reserved()) / 2**30)


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def item_profile(size, put) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
    for preset in ("A", "B", "C"):
        step, _ = prepared(preset, size)
        rate(step, 2, 0)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step()
            _g().sync()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        device_us = {}
        for e in events:  # the kernels alone: an operator's own device time is its kernels' counted again
            us = getattr(e, "self_device_time_total", 0) or 0
            if us > 0 and e.device_type != DeviceType.CPU:
                device_us[kind_of(e.key)] = device_us.get(kind_of(e.key), 0) + us
        busy = sum(device_us.values()) / 1e6
        put(preset, {
            "wall_s": wall,
            "device_busy_s": busy if _cuda() else None,
            "device_busy_share": busy / wall if _cuda() else None,
            "host_operations": sum(e.count for e in events if e.key.startswith("aten::")),
            "device_s_by_kind": {k: v / 1e6 for k, v in sorted(device_us.items(), key=lambda kv: -kv[1])},
        })  # fmt: skip


def _variant(name: str, preset: str, size) -> float:
    """Steps/s of one variant of a preset (the global switches set for it, and set back)."""
    import torch

    from cloudml_lib.core.machine.determinism import apply_determinism, reset_determinism

    device = torch.device(size.device)
    if name == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = True
    if name == "deterministic":
        apply_determinism(True, device)
    try:
        step, _ = prepared(preset, size, compile_=name == "compiled", channels_last=name == "channels_last")
        return rate(step, size.warmup, size.steps)
    finally:
        torch.backends.cudnn.benchmark = False
        reset_determinism()
        _g().release()


def item_speed(size, put) -> None:
    variants = ["eager", "channels_last", "cudnn_benchmark", "deterministic"] + (
        [] if size.smoke else ["compiled"]
    )
    if size.smoke:
        put("compiled", "left out on the CPU smoke (gpu.py's compile item runs that path)")
    for preset in ("C", "B", "A"):  # C first: the preset whose compile is new
        got = {}
        for name in variants:
            got[f"{name}_steps_per_s"] = _variant(name, preset, size)
            got[f"{name}_over_eager"] = got[f"{name}_steps_per_s"] / got["eager_steps_per_s"]
            put(preset, got)


def item_epoch(size, put) -> None:
    put("cpus", two_cpus())
    put("torch_threads", __import__("torch").get_num_threads())
    g = _g()
    for workers in (0, 2):
        extra = ["train.epochs=2", "checkpoint.every_steps=1000", f"data.num_workers={workers}"]
        extra.append("train.torch_compile=false")  # the loading's cost, not the compile's
        r = g.trainer_run("C", size, f"epoch_w{workers}", extra)
        put(
            f"workers_{workers}",
            {k: r[k] for k in ("epochs", "wall_s", "steps_per_s_after_epoch_1", "batch_size")},
        )


def item_predict_2cpu(size, put) -> None:
    import json

    from benchmarks.predict import FLIGHT_FRAMES, child

    g = _g()
    put("cpus", two_cpus())
    put("torch_threads", __import__("torch").get_num_threads())
    out = g.SCRATCH / "predict_2cpu.json"
    child("demo" if size.smoke else "full", "per_frame", size.flight_frames, size.device, out,
          folder=g.SCRATCH / "flights")  # fmt: skip
    r = json.loads(out.read_text())
    r["frames_per_s"] = r["frames"] / r["predict_s"]
    r["flight_12000_min"] = (r["start_s"] + FLIGHT_FRAMES * r["predict_s"] / r["frames"]) / 60
    put("per_frame", r)


def item_graphs(size, put) -> None:
    if not _cuda():
        return put("skipped", NEEDS_CUDA["graphs"])
    import torch

    g = _g()
    cfg = g.config("C", size)
    device = torch.device(size.device)
    model, opt, autocast, scaler, _ = g.build(cfg, device, False)
    model.encoder.forward = torch.compile(model.encoder.forward, mode="reduce-overhead", dynamic=False)
    batch = g.synthetic_batch(cfg.train.batch_size, cfg.data.temporal_frames, size.frame, device,
                              scalars=g.n_scalars(model))  # fmt: skip
    try:
        put(
            "steps_per_s",
            rate(lambda: g.training_step(model, opt, autocast, scaler, batch, cfg.train), 3, 10),
        )
        put("crashed", False)
    except Exception as e:  # noqa: BLE001 - what happens is the measurement
        put("crashed", True)
        put("error", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


ITEM_FUNCTIONS = {
    "context": item_context,
    "profile": item_profile,
    "speed": item_speed,
    "epoch": item_epoch,
    "predict_2cpu": item_predict_2cpu,
    "graphs": item_graphs,
}
