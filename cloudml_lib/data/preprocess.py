"""Frame preprocessing at the hardware's speed: raw IR frames -> the network's input, on every core and,
optionally, on the GPU.

One frame goes through two stages: `prepare` (crop the swath, fill non-finite pixels with the frame's
median, block-average, min-max to [0, 1]) and `equalise` (CLAHE, then z-score). Beside them, the raw frame's
radiometry is kept as numbers (`frame_statistics`: percentiles, mean and spread of its swath in the units the
IR file states, `Radiometry`): the per-frame reading keeps no temperature, and a cloud's temperature is what
every infrared cloud-height retrieval starts from (the network's data.radiometry inputs, the baselines).
Three backends equalise, giving two readings of a frame:
- skimage (scikit-image's `equalize_adapthist`, on the CPU): the reference; every cache used it;
- torch (clahe.py: scikit-image's algorithm in batched torch, our own): on the GPU, where there is a CUDA GPU
  (data.preprocess_device auto or cuda). Its CLAHE output is scikit-image's bit for bit (measured: max abs
  difference 0, tests/test_clahe.py) and the z-score is the same numpy code, so its frames are the same
  reading as scikit-image's: the decision is that the two are one reading, "skimage" (`reading`). A cache
  built by either has the same key and serves a model trained on either (0 differing float16 values of the
  tiny demo caches, tests/test_clahe.py); meta.json still records which backend and device built it;
- kornia (`kornia.enhance.equalize_clahe`): the GPU path before torch, the other reading (its frames differ:
  benchmarks/RESULTS.md). No setting chooses it any more; it is kept, as an optional package, only for the
  models trained on it (their runs and caches recorded "kornia": predict, evaluate and a resume under auto use
  it again, and warn where kornia is missing). Its reading is part of the cache key.
The reading a model was trained on is the one predict and evaluate use when they can.

`FramePool` streams blocks of frames, in order, from worker processes that each open the IR file, read
their block and prepare (and, for skimage, equalise) it: the bytes are those of the serial path, at most
a bounded number of blocks is in flight (memory stays flat whatever a flight's length), and the next blocks
are prepared while the caller works on the current one. The workers ignore Ctrl-C (the parent stops them)
and leave on their own when the parent dies (SIGKILL included): no orphans. A worker starts with Ctrl-C and
SIGTERM held until it has set its own handlers, so a stop that comes while it starts never prints a
KeyboardInterrupt traceback of the worker: the parent says it once.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cloudml_lib.base.config import STAT_NAMES as STAT_NAMES  # base/config.py's, named here too
from cloudml_lib.base.config import STAT_PERCENTILES as STAT_PERCENTILES
from cloudml_lib.base.config import DataConfig
from cloudml_lib.base.errors import ConfigError, DataError, install_command, shown
from cloudml_lib.data import hdf5

log = logging.getLogger(__name__)

BLOCK_FRAMES = 32  # frames one worker task reads and preprocesses (~0.6 s at the real size on one core)
READ_RUN = 32  # consecutive frames read from HDF5 at once
KORNIA_CLIP_SCALE = (
    256.0  # kornia's clip limit is per histogram bin (OpenCV's), scikit-image's a share of the tile
)
KORNIA_GRID = (8, 8)  # scikit-image's default kernel is 1/8 of each side: 8 x 8 tiles
WORKER_NICENESS = 10
# How long the main process waits for a worker's next block (~0.6 s of work; far more on a loaded machine or
# a slow Drive read) before it takes the worker for frozen (a hung read, a deadlock, SIGSTOP): the workers are
# stopped and the rest of the flight is preprocessed in the main process, said. Never a wait for ever.
NO_REPLY_S = 300.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class FrameSpec(NamedTuple):
    """What preprocessing needs from the config; small and picklable for the workers."""

    row0: int
    row1: int
    downsample: int
    clip_limit: float

    @classmethod
    def of(cls, data: DataConfig) -> FrameSpec:
        return cls(
            int(data.swath_slice[0]),
            int(data.swath_slice[1]),
            int(data.downsample),
            float(data.clahe_clip_limit),
        )


# The radiometric statistics of a frame (frame_statistics), STAT_NAMES in base/config.py's order; a
# statistic's name is its key wherever it is stored


class Radiometry(NamedTuple):
    """What an IR file's numbers are, as the file states it: `units` (its `units` attribute; "counts" where it
    says counts, "unstated" where it says nothing), and the linear unpacking it declares (CF's
    `scale_factor` and `add_offset`: value = scale x stored + offset; 1 and 0 where none)."""

    units: str
    scale: float = 1.0
    offset: float = 0.0

    def words(self) -> str:
        """ "K (the IR file's units, unpacked by its scale_factor 0.01 and add_offset 180)"."""
        if self.units == UNSTATED:
            return "the IR file's own numbers (it states no units: counts or kelvin unknown)"
        packed = (
            f", unpacked by its scale_factor {self.scale:g} and add_offset {self.offset:g}"
            if (self.scale, self.offset) != (1.0, 0.0)
            else ""
        )
        return f"{self.units} (as the IR file states{packed})"


UNSTATED = "unstated"


def radiometry_of(signal) -> Radiometry:
    """The Radiometry an IR dataset (h5py) states in its attributes; a unit spelled as kelvin is "K"."""
    attrs = signal.attrs

    def text(key):
        v = attrs.get(key)
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        if isinstance(v, np.ndarray) and v.size == 1:
            v = v.reshape(-1)[0]
            v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        return v

    def number(key, default):
        v = text(key)
        try:
            v = float(v)
        except (TypeError, ValueError):
            return default
        return v if np.isfinite(v) and (key != "scale_factor" or v != 0.0) else default

    units = text("units")
    units = str(units).strip() if isinstance(units, (str, np.str_)) and str(units).strip() else UNSTATED
    if units.lower() in ("k", "kelvin", "degk", "deg_k"):
        units = "K"
    elif units.lower() in ("count", "counts", "dn"):
        units = "counts"
    return Radiometry(units, number("scale_factor", 1.0), number("add_offset", 0.0))


def file_radiometry(path: Path, key: str, flight: str) -> Radiometry:
    """The Radiometry an IR file's frames dataset (`key`) states."""
    with hdf5.open_h5(Path(path), flight) as f:
        return radiometry_of(hdf5.dataset(f, key, flight, "data.keys.ir_signal"))


def frame_statistics(raw: np.ndarray, spec: FrameSpec, radiometry: Radiometry) -> np.ndarray:
    """(len(STAT_NAMES),) float32: the STAT_PERCENTILES, mean and standard deviation of a raw frame's finite
    values in the swath, unpacked to the file's stated units (Radiometry); NaN for a blank frame."""
    x = np.asarray(raw[spec.row0 : spec.row1], dtype=np.float64)
    x = x[np.isfinite(x)] * radiometry.scale + radiometry.offset
    if not x.size:
        return np.full(len(STAT_NAMES), np.nan, np.float32)
    return np.concatenate([np.percentile(x, STAT_PERCENTILES), [x.mean(), x.std()]]).astype(np.float32)


class Block(NamedTuple):
    """Consecutive items of a `FramePool.blocks` stream."""

    index: np.ndarray  # (n,) raw frame indices
    frames: np.ndarray  # (n, H, W) float16, as cached; zeros for a blank frame
    filled: np.ndarray  # (n,) non-finite pixels filled per frame
    blank: np.ndarray  # (n,) bool
    p10: np.ndarray  # (n,) float32, frame_p10 of the raw frame
    stats: np.ndarray  # (n, len(STAT_NAMES)) float32, frame_statistics of the raw frame
    radiometry: Radiometry  # what the file's numbers are


@dataclass(frozen=True)
class Backend:
    name: str  # skimage | torch | kornia
    device: str  # cpu | cuda

    def __str__(self) -> str:
        return f"{self.name} on {self.device}"

    @property
    def reading(self) -> str:
        return reading(self.name)


SKIMAGE = Backend("skimage", "cpu")


def reading(backend: str) -> str:
    """The frames a backend makes, as a model sees them: "skimage" for scikit-image and torch (clahe.py, the
    same frames bit for bit), "kornia" for kornia's."""
    return "skimage" if backend in ("skimage", "torch") else backend


def output_shape(spec: FrameSpec, columns: int) -> tuple[int, int]:
    return (spec.row1 - spec.row0) // spec.downsample, columns // spec.downsample


def prepare(raw: np.ndarray, spec: FrameSpec) -> tuple[np.ndarray, int, bool]:
    """(x, filled, blank): the cropped, filled, block-averaged frame min-maxed to [0, 1] (float32); a blank
    frame (no finite pixel, or no contrast at all) comes out as zeros."""
    x = np.asarray(raw[spec.row0 : spec.row1], dtype=np.float32)
    bad = ~np.isfinite(x)
    n_bad = int(bad.sum())
    k = spec.downsample
    if n_bad:
        if n_bad == x.size:
            return np.zeros((x.shape[0] // k, x.shape[1] // k), np.float32), 0, True
        x = np.where(bad, np.float32(np.median(x[~bad])), x)
    if k > 1:
        h, w = (x.shape[0] // k) * k, (x.shape[1] // k) * k
        x = x[:h, :w].reshape(h // k, k, w // k, k).mean(axis=(1, 3))
    lo, hi = float(x.min()), float(x.max())
    if not hi > lo:
        return np.zeros(x.shape, np.float32), 0, True
    return (x - lo) / (hi - lo), n_bad, False


def zscore(x: np.ndarray) -> np.ndarray:
    return ((x - x.mean()) / (x.std() + 1e-6)).astype(np.float32)


def equalise_skimage(x: np.ndarray, clip_limit: float) -> np.ndarray:
    from skimage import exposure

    if clip_limit > 0:
        x = exposure.equalize_adapthist(x, clip_limit=clip_limit).astype(np.float32)
    return zscore(x)


def frame_p10(raw: np.ndarray, data: DataConfig | FrameSpec) -> float:
    """The 10th percentile of a raw frame's finite values in the swath (the file's units): cold cloud pixels
    pull it down. The brightness-temperature baseline of cloud / no-cloud thresholds it; NaN for a blank
    frame."""
    spec = data if isinstance(data, FrameSpec) else FrameSpec.of(data)
    x = np.asarray(raw[spec.row0 : spec.row1], dtype=np.float32)
    x = x[np.isfinite(x)]
    return float(np.percentile(x, 10)) if x.size else float("nan")


def equalise_torch(x: np.ndarray, blank: np.ndarray, clip_limit: float, device: str) -> np.ndarray:
    """scikit-image's CLAHE in torch (clahe.py) on `device`, then the z-score of each frame by the same numpy
    code as the skimage backend, of (n, H, W) [0, 1] frames -> float16 (n, H, W): skimage's frames."""
    import torch

    from cloudml_lib.data import clahe

    x = np.ascontiguousarray(x, np.float32)
    if clip_limit > 0:
        x = clahe.equalize_adapthist(torch.from_numpy(x).to(device), clip_limit).cpu().numpy()
    out = np.zeros(x.shape, np.float16)
    for i in np.flatnonzero(~np.asarray(blank, bool)):
        out[i] = zscore(x[i])  # numpy's float32 sums, not torch's: the stored float16 values stay skimage's
    return out


def equalise_kornia(x: np.ndarray, blank: np.ndarray, clip_limit: float, device: str) -> np.ndarray:
    """kornia's CLAHE and the z-score of (n, H, W) [0, 1] frames on `device` -> float16 (n, H, W)."""
    import kornia
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device)[:, None]  # (n, 1, H, W)
    if clip_limit > 0:
        t = kornia.enhance.equalize_clahe(t, clip_limit=clip_limit * KORNIA_CLIP_SCALE, grid_size=KORNIA_GRID)
    mean = t.mean(dim=(2, 3), keepdim=True)
    std = t.std(dim=(2, 3), keepdim=True, correction=0)
    t = ((t - mean) / (std + 1e-6))[:, 0]
    t[torch.from_numpy(np.asarray(blank, bool)).to(device)] = 0.0
    return t.to(torch.float16).cpu().numpy()


def read_block(path: str, key: str, flight: str, index: np.ndarray, spec: FrameSpec, equalise: bool) -> Block:
    """Read the raw frames `index` (sorted) of one IR file and preprocess them; without `equalise` the frames
    are only prepared ([0, 1] float32, for the torch and kornia backends). A worker task, and the serial
    path."""
    n = len(index)
    filled, blank, p10 = np.zeros(n, np.int64), np.zeros(n, bool), np.zeros(n, np.float32)
    stats = np.zeros((n, len(STAT_NAMES)), np.float32)
    frames = None
    with hdf5.open_h5(Path(path), flight) as f:
        signal_ = hdf5.dataset(f, key, flight, "data.keys.ir_signal")
        radiometry = radiometry_of(signal_)
        i = 0
        while i < n:
            j = i + 1  # a run of consecutive frames, read at once
            while j < n and j - i < READ_RUN and index[j] == index[j - 1] + 1:
                j += 1
            run = signal_[int(index[i]) : int(index[j - 1]) + 1]
            for r in range(j - i):
                x, filled[i + r], blank[i + r] = prepare(run[r], spec)
                p10[i + r] = frame_p10(run[r], spec)
                stats[i + r] = frame_statistics(run[r], spec, radiometry)
                if frames is None:
                    frames = np.empty((n,) + x.shape, np.float16 if equalise else np.float32)
                frames[i + r] = x if blank[i + r] or not equalise else equalise_skimage(x, spec.clip_limit)
            i = j
    return Block(np.asarray(index), frames, filled, blank, p10, stats, radiometry)


def _worker_start(parent: int) -> None:
    """In each worker: Ctrl-C is the parent's to handle (it stops the workers), and a worker whose parent
    is gone (killed, even by SIGKILL) exits within a second instead of waiting on its queue forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stopped by the parent: quietly, not the CLI's handler
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held since the fork (_held_while_forking)
    # below the main process: on a CPU that also runs the network (predict), its threads come first and
    # the workers fill the idle moments; with nothing else to run (a cache build) this changes nothing
    os.nice(WORKER_NICENESS)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="cloudml-parent-watch").start()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_workers(setting) -> int:
    """data.preprocess_workers: auto -> every core this process may use; 0 -> in this process."""
    return available_cores() if setting == "auto" else int(setting)


class FramePool:
    """Worker processes that read and preprocess blocks of frames, started on first use and stopped by
    `close()` (or the `with` block). workers 0: everything in this process, one block after another.

    Each worker has its own pipe, and block k goes to worker k % n, so the results come back in order
    without a queue. No helper thread sits between: a stop kills the workers and nothing is left to wait
    on (a ProcessPoolExecutor's feeder thread can hang its shutdown once its workers are killed)."""

    def __init__(self, workers: int = 0):
        self.workers = int(workers)
        self.submitted = 0  # frames handed to the workers so far (tests watch the read-ahead)
        self._procs: list = []
        self._pipes: list = []

    def __enter__(self) -> FramePool:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(kill=kind is not None)

    def blocks(
        self,
        path: Path,
        key: str,
        flight: str,
        index: np.ndarray,
        spec: FrameSpec,
        backend: Backend,
        ahead: int = 0,
    ) -> Iterator[Block]:
        """The frames `index` (sorted) of one IR file, preprocessed, in blocks, in order. `ahead`: frames to
        keep in preparation beyond the block being consumed (predict: one model block)."""
        chunks = [index[i : i + BLOCK_FRAMES] for i in range(0, len(index), BLOCK_FRAMES)]
        equalise = backend.name == "skimage"
        stream = self._stream((str(path), key, flight), chunks, spec, equalise, ahead)
        try:
            for block in stream:
                if not equalise:
                    on_device = equalise_kornia if backend.name == "kornia" else equalise_torch
                    block = block._replace(
                        frames=on_device(block.frames, block.blank, spec.clip_limit, backend.device)
                    )
                yield block
        finally:
            stream.close()

    def _stream(
        self, where: tuple, chunks: list, spec: FrameSpec, equalise: bool, ahead: int
    ) -> Iterator[Block]:
        if self.workers < 1 or len(chunks) < 2 or not self._start():
            for chunk in chunks:
                self.submitted += len(chunk)
                yield read_block(*where, chunk, spec, equalise)
            return
        n = len(self._procs)
        depth = max(2 * n, math.ceil(ahead / BLOCK_FRAMES) + n)  # blocks in flight, all workers together
        sent, frozen = 0, None
        try:
            for k in range(len(chunks)):
                while sent < len(chunks) and sent - k < depth:
                    try:
                        self._pipes[sent % n].send((*where, chunks[sent], spec, equalise))
                    except OSError:  # its worker is gone (the pipe is reset)
                        raise self._died(sent % n, where[2]) from None
                    self.submitted += len(chunks[sent])
                    sent += 1
                block = self._receive(k % n, where[2])
                if block is None:  # a frozen worker (stopped now, said): the rest in this process
                    frozen = k
                    break
                yield block
        except BaseException:
            self.close(kill=True)  # Ctrl-C, SIGTERM, an error, or the consumer stopping early
            raise
        for chunk in chunks[frozen:] if frozen is not None else []:
            yield read_block(*where, chunk, spec, equalise)

    def _receive(self, i: int, flight: str) -> Block | None:
        """Block i's result; None (the workers stopped, said) where its worker sent nothing in NO_REPLY_S."""
        pipe, proc = self._pipes[i], self._procs[i]
        if not mp_connection.wait([pipe, proc.sentinel], timeout=NO_REPLY_S):
            log.warning(
                "flight %s: preprocessing worker process %d sent no block of frames in %.0f s (a hung read "
                "of the file, or the process frozen); the workers are stopped and the rest of this flight is "
                "preprocessed in this process (slower; nothing is lost). Set data.preprocess_workers: 0 to "
                "preprocess in this process from the start.",
                flight,
                proc.pid,
                NO_REPLY_S,
            )
            for p in self._procs:
                p.kill()  # SIGKILL: a stopped process takes no SIGTERM until it is continued
            self.close(kill=True)
            self.workers = 0
            return None
        try:
            if not pipe.poll():
                raise EOFError
            kind, value = pipe.recv()
        except (EOFError, OSError):  # the worker is gone without an answer (its pipe ended or reset)
            raise self._died(i, flight) from None
        if kind == "error":
            raise value
        return value

    def _died(self, i: int, flight: str) -> DataError:
        proc = self._procs[i]
        proc.join(timeout=1)
        self.close(kill=True)
        return DataError(
            f"flight {flight}: a preprocessing worker process died (exit {proc.exitcode}; out of host "
            "memory?). Set data.preprocess_workers to fewer processes (0: none, in the main process), "
            "then run the same command again; nothing finished is lost."
        )

    def _start(self) -> bool:
        """Workers running (started now if needed); False (and from then on no workers, said) where processes
        cannot be started."""
        if self._procs:
            return True
        # fork, not spawn: spawn runs the caller's main script again in every worker (a script without
        # `if __name__ == "__main__":` would repeat its work there). Fork is safe here: the workers run
        # numpy, h5py and scikit-image on files they open themselves, never torch or CUDA, and the pool
        # starts from the thread that uses h5py. Python 3.12 warns about fork in any threaded process.
        ctx = multiprocessing.get_context("fork")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
                for _ in range(self.workers):
                    mine, theirs = ctx.Pipe()
                    # the child closes its copies of the main process's ends, or a closed pipe would never end
                    proc = ctx.Process(
                        target=_worker_main,
                        args=(os.getpid(), theirs, [*self._pipes, mine]),
                        daemon=True,
                        name="cloudml-preprocess",
                    )
                    with _held_while_forking():
                        proc.start()
                    theirs.close()
                    self._procs.append(proc)
                    self._pipes.append(mine)
        except OSError as e:  # e.g. a process or memory limit of the machine
            log.warning(
                "could not start %d preprocessing worker processes (%s); preprocessing in this process "
                "instead (slower). Set data.preprocess_workers: 0 to skip trying.",
                self.workers,
                e,
            )
            self.close(kill=True)
            self.workers = 0
            return False
        return True

    def close(self, kill: bool = False) -> None:
        """Stop the workers: after their current block (they read the end of their pipe), or at once
        (`kill`)."""
        procs, pipes, self._procs, self._pipes = self._procs, self._pipes, [], []
        for proc in procs:  # before the pipes close, or a worker mid-send meets a broken pipe
            if kill and proc.is_alive():
                proc.terminate()
        for pipe in pipes:
            pipe.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


@contextmanager
def _held_while_forking():
    """A stop (Ctrl-C, SIGTERM) that comes while this process forks a worker is taken after the fork, by both.
    The worker inherits the signals blocked, and takes them only once _worker_start has replaced the
    handlers it inherited (the CLI's, which raise KeyboardInterrupt: multiprocessing would print that as a
    traceback of the worker). This process only notes them meanwhile: raised during the fork, in logging's
    at-fork hooks, a KeyboardInterrupt would be printed as "Exception ignored" and lost; noted, the signal is
    sent again when the fork is done, to the handler it was meant for."""
    noted = []
    swap = [s for s in STOP_SIGNALS if signal.getsignal(s) is not None]
    if threading.current_thread() is not threading.main_thread():
        swap = []  # only the main thread may set handlers: from another, the blocking alone
    previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in swap}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(noted):
            os.kill(os.getpid(), s)


def _worker_main(parent: int, pipe, inherited: list) -> None:
    """A worker: blocks to preprocess from its pipe, results (or the error) back, until the pipe closes."""
    for other in inherited:
        other.close()
    _worker_start(parent)
    while True:
        try:
            task = pipe.recv()
        except (EOFError, OSError):
            return
        try:
            try:
                result = ("ok", read_block(*task))
            except Exception as e:  # a bad file or frame: raised in the main process, naming it
                result = ("error", e if _picklable(e) else DataError(f"{type(e).__name__}: {e}"))
            pipe.send(result)
        except OSError:  # the main process closed the pipe: it is stopping
            return


def _picklable(e: BaseException) -> bool:
    try:
        pickle.dumps(e)
    except Exception:
        return False
    return True


def resolve_backend(setting: str, trained: str | None = None) -> Backend:
    """The backend for data.preprocess_device (auto | cpu | cuda). `trained`: the backend the model in use was
    trained on (predict, evaluate, a resumed run); auto then keeps its reading, and another is warned about.
    skimage and torch are one reading (`reading`): auto and cuda use torch on the GPU where there is one."""
    import torch

    cuda = torch.cuda.is_available()
    if setting == "cuda" and not cuda:
        raise ConfigError(
            "data.preprocess_device: cuda, but this machine has no CUDA GPU that torch can use; "
            "set it to auto or cpu"
        )
    if setting == "cpu":
        chosen = SKIMAGE
    elif setting != "cuda" and trained == "kornia":  # an older model's reading, where kornia is installed
        chosen = Backend("kornia", "cuda" if cuda else "cpu") if has_kornia() else SKIMAGE
    else:
        chosen = Backend("torch", "cuda") if cuda else SKIMAGE
    if trained and chosen.reading != reading(trained):
        _warn_other_reading(trained, chosen, setting)
    return chosen


def _warn_other_reading(trained: str, chosen: Backend, setting: str) -> None:
    missing = trained == "kornia" and not has_kornia()
    log.warning(
        "the model was trained on frames equalised by %s, but %s is used now (data.preprocess_device: "
        "%s%s). The frames differ slightly, and a model can lose most of its accuracy on the other "
        "backend's frames (the demo's did: benchmarks/RESULTS.md). Use data.preprocess_device: auto%s to "
        "match the training.",
        trained,
        chosen.name,
        setting,
        ", and kornia is not installed" if missing else "",
        f" (and {install_command('kornia')})" if missing else "",
    )


@functools.cache
def has_kornia() -> bool:
    """kornia imports (an install that is there but broken counts as absent, with a notice saying why and
    how to repair it)."""
    if importlib.util.find_spec("kornia") is None:
        return False
    try:
        import kornia.enhance  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install fails in many ways; scikit-image always works
        log.warning(
            "kornia is installed but does not import (%s: %s): preprocessing uses scikit-image on the CPU "
            "cores instead. To repair kornia: %s",
            type(e).__name__,
            shown(str(e)),
            install_command("--force-reinstall kornia"),
        )
        return False
    return True
