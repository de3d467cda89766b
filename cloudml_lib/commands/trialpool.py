"""Worker processes that train one job each at a time on one machine: a sweep's trials N at once
(`python -m cloudml_lib sweep ... --parallel N`, sweep.run_parallel).

What this module owns: starting N workers (multiprocessing's spawn: no forked CUDA or thread state), placing
them (with CUDA, worker i on GPU i, round robin with a warning when N exceeds the GPUs; on the CPU, cores // N
torch threads each, at least 1, so that N workers do not oversubscribe the cores), handing out jobs and
taking back results through two queues, and stopping them. A worker dies with the process that started it,
even when that one is SIGKILLed (Linux's PR_SET_PDEATHSIG, and a thread watching the parent elsewhere): a
killed command leaves no trainer behind holding a run folder. Asked to stop (SIGTERM, Ctrl-C), a worker's
training stops at its next step with a checkpoint, as a command's does.

A worker's unexpected error comes back as its exception and is raised by the owner (`Workers.next_result`),
as it would have been in one process; a worker that dies without a word stops the owner too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

from cloudml_lib.base import liveness
from cloudml_lib.base.errors import CloudMLError, ConfigError, shown

log = logging.getLogger(__name__)

IDLE_EVERY_S = 10.0  # how often the owner's `idle` runs while it waits for a result
STOP_WAIT_S = 60.0  # a worker asked to stop saves a checkpoint first; then it is killed
# A worker holding a job that reports no progress (liveness.beat: each training step, each evaluation) for
# QUIET_WARN_S is named in the log (a hung read of Drive, a driver call that never returns, a frozen process);
# after QUIET_STOP_S it is killed, another worker takes its place and its job goes back in the queue: it
# resumes from its checkpoint when a worker is free. Never a silent wait for ever.
QUIET_WARN_S = 600.0
QUIET_STOP_S = 1800.0


@dataclass(frozen=True)
class Place:
    """Where a worker trains: its GPU (None: the CPU) and torch threads; `parent`: the owner's pid. `beat`
    (its last progress, time.time()) and `holding` (the id of the job it runs, -1 none): shared values the
    owner reads (Workers.watch)."""

    parent: int
    gpu: int | None
    threads: int
    beat: object = None
    holding: object = None


def check_parallel(parallel, n_jobs: int, what: str, command: str, dist=None) -> int:
    """--parallel: a whole number >= 1, not under torchrun (`dist`: the caller's process group, else the
    environment's WORLD_SIZE), cut to the `n_jobs` `what` there are (said once). Returns the workers to
    start."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(
            f"--parallel {shown(parallel)}: expected a whole number of {what} to run at once >= 1 (1, the "
            "default, runs them one after another; N runs N at once, one process each)"
        )
    world = dist.world if dist is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if parallel > 1 and world > 1:
        raise ConfigError(
            f"--parallel {parallel} under torchrun ({world} processes): use one or the other. torchrun's "
            f"processes share each of the {what}'s work out their own way; --parallel N starts N processes "
            f"itself, one of the {what} each: python -m cloudml_lib {command} ... --parallel N, without "
            "torchrun"
        )
    if parallel > n_jobs:
        log.info("--parallel %d is more than the %d %s: %d run at once", parallel, n_jobs, what, n_jobs)
    return min(parallel, n_jobs)


def placement(device: str, n: int, what: str) -> tuple[list[Place], str]:
    """Each of n workers' place, and the assignment in words (`what`: trials, folds), for train.device
    `device`."""
    import torch

    from cloudml_lib.core.machine.device import choose_device

    if choose_device(device).type == "cuda":
        count = torch.cuda.device_count()
        if n > count:
            log.warning(
                "%d workers on %d GPU(s): some GPUs train two or more at once (round robin)", n, count
            )
        threads = max(1, (os.cpu_count() or 1) // n)
        words = f"{n} {what} at once, one per process; process i trains on GPU i" + (
            f" modulo {count}" if n > count else ""
        )
        return [Place(os.getpid(), i % count, threads) for i in range(n)], words
    threads = max(1, (os.cpu_count() or 1) // n)
    words = f"{n} {what} at once, one per process; each process uses {threads} CPU thread(s)"
    return [Place(os.getpid(), None, threads) for _ in range(n)], words


class Workers:
    """n worker processes (of `what`: trials, folds), each running `target(place, jobs, results, *args)` (a
    module-level function, for spawn; see `serve`). Use as a context manager: leaving it stops the workers
    still running."""

    def __init__(self, n: int, device: str, what: str, target, args: tuple = ()):
        self.ctx = multiprocessing.get_context("spawn")
        self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.what, self.target, self.args = what[:-1], target, args  # "trial", "fold"
        self.sent: dict[int, tuple] = {}  # job id -> (key, job), until its result comes back
        self.next_id = -1
        places, words = placement(device, n, what)
        log.info("%s", words)
        self.places: list[Place] = []
        self.procs: list = []
        self.warned: list[bool] = []
        for i, place in enumerate(places):
            self._start(i, place)

    def _start(self, i: int, place: Place) -> None:
        """Worker i (a new one in its place after a frozen one), with fresh shared values."""
        place = Place(
            place.parent, place.gpu, place.threads, self.ctx.RawValue("d", 0.0), self.ctx.RawValue("q", -1)
        )
        # not daemonic: a job may start processes of its own (a cache's builders); they end with the worker
        proc = self.ctx.Process(
            target=self.target, args=(place, self.jobs, self.results, *self.args), name=f"worker-{i}"
        )
        proc.start()
        for listed, value in ((self.places, place), (self.procs, proc), (self.warned, False)):
            if i < len(listed):
                listed[i] = value
            else:
                listed.append(value)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def put(self, key, job) -> None:
        """A job for the next free worker; its result comes back with `key`."""
        jid = self.next_id = self.next_id + 1  # never reused: no worker's id is ever another job's
        self.sent[jid] = (key, job)
        self.jobs.put((key, job, jid))

    def watch(self) -> None:
        """A worker quiet for QUIET_WARN_S on a job is named; after QUIET_STOP_S it is killed, replaced, and
        its job put back in the queue (it resumes from its checkpoint)."""
        now = time.time()
        for i, (place, proc) in enumerate(zip(self.places, self.procs)):
            jid = place.holding.value
            if jid not in self.sent or proc.exitcode is not None:
                self.warned[i] = False
                continue
            quiet, (key, job) = now - place.beat.value, self.sent[jid]
            if quiet >= QUIET_STOP_S:
                proc.kill()  # SIGKILL: a frozen (stopped) process takes no SIGTERM
                proc.join(timeout=STOP_WAIT_S)
                log.warning(
                    "Worker %d (process %d) made no progress on %s %s for %s: it was stopped and a new "
                    "worker started; %s %s goes back in the queue and resumes from its checkpoint.",
                    i,
                    proc.pid,
                    self.what,
                    key,
                    _minutes(quiet),
                    self.what,
                    key,
                )
                self._start(i, place)
                del self.sent[jid]
                self.put(key, job)
            elif quiet >= QUIET_WARN_S and not self.warned[i]:
                self.warned[i] = True
                log.warning(
                    "Worker %d (process %d) has made no progress on %s %s for %s (a hung read of Drive, a "
                    "driver call that does not return, a frozen process?); past %s it is stopped and %s %s "
                    "resumed later from its checkpoint.",
                    i,
                    proc.pid,
                    self.what,
                    key,
                    _minutes(quiet),
                    _minutes(QUIET_STOP_S),
                    self.what,
                    key,
                )

    def next_result(self, idle) -> tuple:
        """The next (key, result) a worker sends; `idle()` runs every IDLE_EVERY_S meanwhile. A worker's
        exception is raised here; so is a worker that died without a result."""
        while True:
            try:
                key, result = self.results.get(timeout=IDLE_EVERY_S)
            except queue.Empty:
                idle()
                self.watch()
                dead = [p for p in self.procs if p.exitcode is not None]
                if dead:
                    raise CloudMLError(
                        f"a worker process stopped (exit status {dead[0].exitcode}) without a result: its "
                        "message is above. Run the same command again: what it was training resumes from "
                        "its checkpoint."
                    ) from None
                continue
            if isinstance(result, BaseException):
                raise result
            self.sent = {j: s for j, s in self.sent.items() if s[0] != key}
            return key, result

    def close(self) -> None:
        """No more jobs: each worker ends after its current one."""
        for _ in self.procs:
            self.jobs.put(None)
        for p in self.procs:
            p.join(timeout=STOP_WAIT_S)

    def stop(self) -> None:
        """Workers still running are asked to stop (SIGTERM: a checkpoint at the next step), then killed."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=STOP_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join()


def serve(place: Place, jobs, results, make_run) -> None:
    """A worker's life: placed, then job after job from `jobs` until None, each `run(job)`'s result to
    `results` with its key. `make_run()` builds `run` once, in the worker. A stop ends it quietly (the job
    stays unfinished, to resume); any other error goes to the owner."""
    die_with_parent(place.parent)
    signal.signal(signal.SIGTERM, _stop)
    try:
        _place(place)
        run = make_run()
        liveness.report_progress_to(place.beat)
        while (item := jobs.get()) is not None:
            key, job, jid = item
            liveness.beat()
            place.holding.value = jid
            results.put((key, run(job)))
            place.holding.value = -1
    except KeyboardInterrupt:
        return
    except Exception as e:  # noqa: BLE001 - the owner raises it, as one process would
        results.put((None, _picklable(e)))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _stop(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _place(place: Place) -> None:
    import torch

    from cloudml_lib.base.logs import attach_run_log

    attach_run_log()
    torch.set_num_threads(place.threads)
    if place.gpu is not None:
        torch.cuda.set_device(place.gpu)  # "cuda" is this device for the job's run


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception that cannot cross a queue travels as its words
        return CloudMLError(f"{type(e).__name__}: {e}")


def die_with_parent(parent: int) -> None:
    """This process ends when `parent` does, even killed (SIGKILL leaves it no time to stop us): Linux's
    PR_SET_PDEATHSIG, and elsewhere a thread that watches the parent's pid."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
