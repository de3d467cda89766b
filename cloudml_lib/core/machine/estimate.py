"""Peak memory and FLOPs of a training step and of inference, computed from the real model on fake tensors.

The project's own MultimodalRegressionModel and AdamW are built under FakeTensorMode on the CPU device, so
no tensor holds memory; one training step (forward under autocast with the model's own checkpointing and
BatchNorm context, the loss, backward, optimizer.step, twice so that the optimizer's state exists) and one
inference forward run there. A dispatch mode counts every output storage once, rounded up to the CUDA
caching allocator's 512-byte blocks, and frees it when the storage dies: the peak of that count is the peak
of the tensors a real step holds, weights, gradients, optimizer state and the input batch included.
FlopCounterMode counts the same step's floating-point operations. A step takes about a second, whatever the
batch; the peak is linear in the batch (fixed + per sample, fitted from two batch sizes).

What fake tensors do not see, added as a stated overhead (OVERHEAD_BYTES + SLACK) when a budget is asked
for: the CUDA context and the cuDNN/cuBLAS workspaces (0.5-1 GiB), and the caching allocator's slack and
fragmentation (PyTorch holds its own memory tracker to within 10 % of max_memory_allocated on a GPU). The
overhead is stated, not measured: benchmarks/gpu.py records max_memory_allocated and memory_reserved next
to this estimate on a GPU, which is how it is calibrated. Autocast on the CPU device keeps the same ops in
float16 as CUDA's for this network (convolutions, linear layers; BatchNorm and reductions in float32).

The fake-tensor machinery is private PyTorch API: when it fails on some torch, `estimate` returns None with
the reason logged, and the callers fall back to the figures the users reported (REPORTED_PEAK_GIB),
labelled as such.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import asdict, dataclass

import torch

from cloudml_lib.core.machine.memory import GIB, MARGIN, PeakLine, synthetic_inputs, synthetic_step

log = logging.getLogger(__name__)

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
SENSOR_COLUMNS = 640  # the ER-2 IR camera's columns (ER2_DATA.md); data.swath_slice chooses the rows
# Not seen by fake tensors: the cuDNN/cuBLAS workspaces and the part of the CUDA context not yet in use
# when free memory is read (0.5-1 GiB), and the allocator's slack (10 %). Stated, not measured on a GPU yet.
OVERHEAD_BYTES = int(0.75 * GIB)
SLACK = 0.10
# Peak GPU memory at each preset's batch on a T4, 440 x 640, T = 5, as the users reported it in their notes
# (the seeds): shown beside the estimate, used only where the estimate cannot be computed.
REPORTED_PEAK_GIB = {"A": 10.0, "B": 9.0, "C": 8.0}
T4_BYTES = int(14.7 * GIB)  # what a Colab T4 gives one process
T4_FP16_FLOPS = 65e12  # a T4's peak fp16 tensor-core rate (NVIDIA's data sheet)
FIT_BATCHES = (4, 8)  # the two batch sizes the linear fit is drawn through


@dataclass(frozen=True)
class StepShape:
    """What a step's memory depends on: the network's widths, checkpointing, the autocast dtype (None:
    float32), the window and frame size, the cloud head and the optimizer (AdamW, as the trainer's)."""

    channels: tuple[int, ...]
    checkpointing: bool
    amp: str | None
    frames: int
    rows: int
    cols: int
    cloud_head: str = "probe"

    @classmethod
    def of(cls, cfg, amp: str | None = "float16", frame: tuple[int, int] | None = None) -> StepShape:
        """The step of `cfg` (a Config): its widths, checkpointing, window, trained under `amp` ("float16"
        as on a T4), on frames of `frame` (rows, columns) as the network sees them; by default the rows of
        data.swath_slice and the real camera's 640 columns, after data.downsample."""
        d = cfg.data
        if frame is None:
            frame = ((d.swath_slice[1] - d.swath_slice[0]) // d.downsample, SENSOR_COLUMNS // d.downsample)
        return cls(
            tuple(cfg.channels),
            bool(cfg.model.gradient_checkpointing),
            amp,
            d.temporal_frames,
            int(frame[0]),
            int(frame[1]),
            cfg.model.cloud_head,
        )

    def describe(self) -> str:
        width = "/".join(map(str, self.channels))
        return (
            f"{width} channels, {'checkpointing' if self.checkpointing else 'no checkpointing'}, "
            f"{self.amp or 'float32'}, T = {self.frames}, {self.rows} x {self.cols}"
        )


@dataclass(frozen=True)
class Estimate:
    """Peak bytes of the tensors of one training step and of one inference forward (memory.PeakLine: fixed +
    per sample), and the FLOPs of one training step per sample."""

    shape: StepShape
    train: PeakLine
    infer: PeakLine
    flops_per_sample: float

    @property
    def train_fixed(self) -> float:
        return self.train.fixed

    @property
    def train_per_sample(self) -> float:
        return self.train.per_sample

    def train_peak(self, batch: int) -> float:
        return self.train.peak(batch)

    def infer_peak(self, batch: int) -> float:
        return self.infer.peak(batch)

    def need(self, batch: int) -> float:
        """GPU memory a training step at `batch` needs: the tensors' peak, the allocator's slack and the
        stated overhead (context, workspaces)."""
        return self.train_peak(batch) * (1 + SLACK) + OVERHEAD_BYTES

    def largest_batch(self, budget: float, margin: float = MARGIN) -> int:
        """The largest batch whose need, with the probe's 15 % margin, fits `budget` bytes; 0 if none."""
        return self.train.largest_batch(budget, margin, OVERHEAD_BYTES, SLACK)


class _StorageCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Live bytes of every storage an op creates (each once, in 512-byte blocks), and their peak."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def add(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.sizes:
            return
        size = -(-storage.nbytes() // BLOCK) * BLOCK
        self.sizes[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            self.add(t)
        return out


def model_of(shape: StepShape):
    """The network of `shape`, in training mode, checkpointed as the shape says (real or fake tensors: as
    the mode in force when it is called)."""
    from cloudml_lib.core.network.model import MultimodalRegressionModel

    model = MultimodalRegressionModel(channels=list(shape.channels), cloud_head=shape.cloud_head)
    model.set_grad_checkpointing(shape.checkpointing)
    return model


def _autocast(shape: StepShape):
    dtype = getattr(torch, shape.amp) if shape.amp else None
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def train_steps(model, optimizer, shape: StepShape, batch: int, steps: int = 2) -> None:
    """`steps` training steps at `batch` on random inputs: memory.synthetic_step, the one the probe measures
    and the timing times, under the shape's autocast (on the CPU: the count is of bytes, not of a device)."""
    step = synthetic_step(model, optimizer, lambda: _autocast(shape))
    inputs = synthetic_inputs(model, batch, shape.frames, shape.rows, shape.cols)
    for _ in range(steps):
        step(inputs)


def _infer(model, shape: StepShape, batch: int) -> None:
    x = torch.randn(batch, shape.frames, shape.rows, shape.cols)
    with torch.no_grad(), _autocast(shape):
        model(x, torch.randn(batch, model.film[0].in_features))


def measure(shape: StepShape, batch: int, what: str = "train", fake: bool = True) -> int:
    """Peak bytes of two training steps (`what` "train") or of one inference forward ("infer") at `batch`,
    counted on fake tensors (`fake` False: real CPU tensors, the same count; for tests at small sizes)."""
    counter = _StorageCounter()
    with _built(shape, what, fake) as (model, optimizer):
        for t in [*model.parameters(), *model.buffers()]:
            counter.add(t)
        with counter:
            _run(model, optimizer, shape, batch, what)
    return counter.peak


def count_flops(shape: StepShape, batch: int, what: str = "train") -> float:
    """FLOPs of one training step (forward, recomputation under checkpointing, backward) or one inference
    forward at `batch`, on fake tensors. A pass of its own: FlopCounterMode keeps what it tracks alive, so
    it would distort the memory count."""
    from torch.utils.flop_counter import FlopCounterMode

    flops = FlopCounterMode(display=False)
    with _built(shape, what, True) as (model, optimizer), flops:
        _run(model, optimizer, shape, batch, what, steps=1)
    return float(flops.get_total_flops())


@contextlib.contextmanager
def _built(shape: StepShape, what: str, fake: bool):
    """The model (training mode for "train") and its AdamW, on fake tensors unless `fake` is False; the
    random state of the caller is left as it was."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.random.fork_rng(devices=[]), FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = model_of(shape).train(what == "train")
        yield model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _run(model, optimizer, shape: StepShape, batch: int, what: str, steps: int = 2) -> None:
    if what == "train":
        train_steps(model, optimizer, shape, batch, steps)
    else:
        _infer(model, shape, batch)


@functools.lru_cache(maxsize=64)
def _estimate(shape: StepShape) -> Estimate:
    """Counted on fake tensors, or read back where this machine kept the same shape's count (the same torch
    and CloudML code: kept_estimates.py), and kept for the next process."""
    from cloudml_lib.core.machine import kept_estimates

    key = kept_estimates.key_of(asdict(shape))
    kept = kept_estimates.read(key)
    if kept is not None:
        return Estimate(
            shape,
            train=PeakLine(**kept["train"]),
            infer=PeakLine(**kept["infer"]),
            flops_per_sample=kept["flops_per_sample"],
        )
    (b1, b2) = FIT_BATCHES
    t1, t2 = measure(shape, b1), measure(shape, b2)
    i1, i2 = measure(shape, b1, "infer"), measure(shape, b2, "infer")
    f1, f2 = count_flops(shape, b1), count_flops(shape, b2)
    found = Estimate(
        shape,
        train=PeakLine.through(FIT_BATCHES, (t1, t2)),
        infer=PeakLine.through(FIT_BATCHES, (i1, i2)),
        flops_per_sample=(f2 - f1) / (b2 - b1),
    )
    kept_estimates.keep(key, {"train": asdict(found.train), "infer": asdict(found.infer),
                              "flops_per_sample": found.flops_per_sample})  # fmt: skip
    return found


def estimate(shape: StepShape) -> Estimate | None:
    """The estimate of `shape` (cached), or None with the reason logged when this torch cannot run fake
    tensors (private API): callers then use the users' reported figures, labelled as such."""
    try:
        return _estimate(shape)
    except Exception as e:  # private API of another torch: any failure means no estimate, never a crash
        log.warning(
            "memory estimate unavailable on torch %s (%s: %s); the users' reported figures are used",
            torch.__version__,
            type(e).__name__,
            str(e)[:200],
        )
        return None
