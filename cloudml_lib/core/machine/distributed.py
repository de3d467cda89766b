"""Several processes, one run: `torchrun --nproc_per_node N -m cloudml_lib train --config FILE`, on one
machine or several (`--nnodes M` with a c10d rendezvous; docs/how-to/cluster.md).

What this module owns:
- `Dist`: this process's rank and the few collectives the trainer needs (sums, agreement, objects
  from rank 0, all ranks' objects). With one process every method is a pass-through, so the trainer
  has no `if distributed:` branches beyond "only rank 0 writes files".
- `init_distributed`: reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); gloo on CPU,
  nccl on CUDA (one GPU per process, cuda:LOCAL_RANK).
- `exit_without_finalizing`: how a process of a torchrun job ends once its command is done (below).
- `apply_ddp`: DistributedDataParallel from outside the model, after BatchNorm is made to use the
  statistics of the global batch (`SyncBatchNorm` on CUDA, `GlobalBatchNorm2d` here on CPU, where
  torch's SyncBatchNorm refuses to run). So N processes normalise over the same samples one process
  would, and the same config trains the same model on 1 or N processes (to float tolerance).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import sys
from contextlib import nullcontext
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as tdist
from torch import nn

from cloudml_lib.data.dataset import part_slice

log = logging.getLogger(__name__)

# Rank 0 may build the flight caches (minutes) while the others wait for it in a collective.
TIMEOUT = timedelta(minutes=60)


class Dist:
    """This process's place in the job; collectives that are no-ops with one process."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, machines: int = 1):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.machines = machines  # torchrun's --nnodes (its GROUP_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a new tensor; `t` is left as it was)."""
        if not self.active:
            return t
        out = t.detach().clone()
        tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
        return out

    def sum_int(self, n: int, device: torch.device) -> int:
        """Sum of a Python int over ranks."""
        return int(self.all_sum(torch.tensor(n, device=device))) if self.active else n

    def any_true(self, *flags: bool, device: torch.device) -> list[bool]:
        """For each flag: is it true on any rank? (one collective for all of them)"""
        if not self.active:
            return [bool(f) for f in flags]
        t = torch.tensor([float(bool(f)) for f in flags], device=device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def from_main(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def main_first(self, fn):
        """`fn` (which may write: a flight's cache, the demo flights) in three turns: rank 0 first; then the
        first process of every other machine (a node-local cache folder is built there, or copied from
        data.cache_copy_dir, once per machine; on a shared folder it finds rank 0's); then every other
        process, which finds its machine's. A failure in any turn stops every process with its message."""
        if not self.active:
            return fn()
        result = None
        for turn in range(3):
            error = None
            if self.turn == turn:
                try:
                    result = fn()
                except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
                    error = e
            messages = self.gather(None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
            if failed:
                from cloudml_lib.base.errors import CloudMLError

                rank, message = failed[0]
                raise CloudMLError(
                    f"rank {rank} stopped during set-up ({message.splitlines()[0]}); see its message"
                )
        return result

    @property
    def turn(self) -> int:
        """This process's turn in main_first: 0 for rank 0, 1 for the first process of another machine
        (torchrun's LOCAL_RANK 0), 2 for the others."""
        return 0 if self.rank == 0 else 1 if self.local_rank == 0 else 2

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def shard(self, n: int) -> slice:
        """This rank's contiguous part of n items."""
        return part_slice(n, self.rank, self.world)

    def close(self) -> None:
        if self.active and tdist.is_initialized():
            tdist.destroy_process_group()


SINGLE = Dist()


def init_distributed(
    device_preference: str = "auto", backend: str | None = None, timeout: timedelta = TIMEOUT
) -> Dist:
    """The process group torchrun asked for (or the single process). Call once per process.
    `backend`: by default nccl when this process gets a GPU, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        from cloudml_lib.base.errors import ConfigError

        raise ConfigError(
            f"WORLD_SIZE={world} is set but RANK or MASTER_ADDR is not: start several processes with "
            "torchrun --nproc_per_node N -m cloudml_lib ..., or unset WORLD_SIZE for one process"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if tdist.is_initialized():
        return Dist(rank, world, local_rank, machines)
    cuda = torch.cuda.is_available() and device_preference != "cpu"
    if cuda:
        if local_rank >= torch.cuda.device_count():
            from cloudml_lib.base.errors import ConfigError

            raise ConfigError(
                f"torchrun started {os.environ.get('LOCAL_WORLD_SIZE', '?')} processes on this machine "
                f"but it has {torch.cuda.device_count()} GPU(s): use --nproc_per_node "
                f"{torch.cuda.device_count()} or fewer"
            )
        torch.cuda.set_device(local_rank)
    else:
        # The cores are shared by the processes of this machine: no oversubscription.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = backend or ("nccl" if cuda else "gloo")
    tdist.init_process_group(backend, timeout=timeout)
    global _JOINED
    _JOINED = True
    if rank != 0:
        logging.getLogger("cloudml_lib").setLevel(logging.WARNING)  # one copy of each progress line: rank 0's
    log.info("Distributed: %d processes (%s), this is rank %d", world, backend, rank)
    return Dist(rank, world, local_rank, machines)


_JOINED = False  # this process started a process group (init_distributed): it ends by exit_without_finalizing


def joined() -> bool:
    """Did this process join a torchrun job's process group?"""
    return _JOINED


def exit_without_finalizing(code: int) -> NoReturn:
    """End a process of a torchrun job whose command is done, with exit status `code`: the exit handlers run
    (train.log closed, temporary folders removed) and stdout and stderr are flushed, then the process ends
    without the interpreter's finalization. There, one of torch's C++ threads that still holds a tensor made
    in Python (gloo's workers let go of a finished collective's buffers after the caller has gone on) takes
    the lock of an interpreter being torn down and aborts the process ("terminate called without an active
    exception", SIGABRT): torchrun then stops the other processes and reports a job that finished as failed
    (pytorch/pytorch#190489, open in torch 2.13: one torchrun sweep in about thirty on a busy 2-core
    machine)."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more can be said there
                pass
        os._exit(code)


_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "Broken pipe",
)


def _peer_failure(e: BaseException | None) -> BaseException | None:
    """The collective's error in `e` or in what `e` interrupted: torchrun's SIGTERM (a KeyboardInterrupt)
    can arrive while this process is still cleaning up after the failed collective."""
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, tdist.DistError) or any(w in str(e) for w in _LOST):
            return e
        e = e.__cause__ or e.__context__
    return None


def explain_peer_failure(e: BaseException, dist: Dist) -> str | None:
    """A collective that failed because another process of the job died, in words (None otherwise)."""
    failure = _peer_failure(e) if dist.active else None
    if failure is None:
        return None
    text = str(failure)
    return (
        f"another process of this {dist.world}-process job stopped, so process {dist.rank} stops too "
        f"({text.splitlines()[0][:200]}). Its own message (or torchrun's summary) says why. Nothing "
        "committed is lost: run the same torchrun command again to resume from the last checkpoint."
    )


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) that autograd can go through: the gradient of a sum over ranks is the sum of
    the ranks' gradients."""

    @staticmethod
    def forward(ctx, t):
        out = t.clone()
        tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        tdist.all_reduce(grad, op=tdist.ReduceOp.SUM)
        return grad


class GlobalBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the global batch, on any backend.

    The per-channel sums and sums of squares are all-reduced with autograd's differentiable
    all_reduce, so the backward pass sums the matching gradients across ranks as well. Buffers
    and state-dict keys are BatchNorm2d's: checkpoints move freely between 1 and N processes.
    """

    def forward(self, x):  # (N, C, H, W)
        if not (self.training and tdist.is_available() and tdist.is_initialized()):
            return super().forward(x)
        xf = x.float()
        count = torch.tensor([float(x.numel() // x.shape[1])], device=x.device)
        stats = _SumAcrossRanks.apply(torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count]))
        c = x.shape[1]
        n = stats[2 * c]
        mean = stats[:c] / n
        var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0.0)  # biased, as BatchNorm normalises with
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1).clamp_min(1.0)), alpha=m)
        shape = (1, c, 1, 1)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def apply_global_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm2d normalises over the global batch (in place; same parameters and buffers)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for _, child in list(model.named_children()):
        if type(child) is nn.BatchNorm2d:
            child.__class__ = GlobalBatchNorm2d  # same object, same tensors: the optimizer still holds them
        else:
            apply_global_batchnorm(child, device)
    return model


def apply_ddp(model: nn.Module, dist: Dist, device: torch.device, unused_parameters: bool) -> nn.Module:
    """The module the loop calls; `model` stays the plain module that is saved."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # No buffer broadcast before each forward: the BatchNorm buffers are updated from the global
    # statistics on every rank alike. (torch 2.13 renamed the option; Colab's 2.11 has the old name.)
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused_parameters, **no_sync)


def no_sync(model: nn.Module, skip: bool):
    """DDP's gradient all-reduce skipped for this backward (`skip`); nothing to skip with one process."""
    return model.no_sync() if skip and hasattr(model, "no_sync") else nullcontext()
