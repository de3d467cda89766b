"""Shared fixtures: small demo flights written once per session, and a tiny config over them."""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from cloudml_lib.base.config import DataConfig, build_config
from cloudml_lib.data.preprocess import FrameSpec, equalise_skimage, prepare
from cloudml_lib.data.synthetic import make_demo_flights

REPO = Path(__file__).resolve().parent.parent
# Under pytest-xdist (README's test command: `-n 2`), each worker is given one core: torch's threads here and
# in every process a test starts (OMP_NUM_THREADS), so that two workers do not contend for both cores.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
MACHINE_THREADS = torch.get_num_threads()  # torch's own choice here (a fixture made on this machine had it)
if WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# inductor (torch.compile on the CPU) trusts the processor's flags for its vector instructions instead of
# compiling and loading six probe programs in each process with a new kernel folder: about 10 s of CPU each
# time (a cold compile of the tiny model: 32 s to 22 s). The kernels themselves are compiled and run as
# before; a machine whose compiler cannot build them fails the compile, and CloudML falls back as it would.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# OpenMP's threads wait asleep, not spinning, between parallel regions (libgomp reads this as torch loads it:
# in pytest-xdist's workers, which start after this is set, and in every process a test starts). The same
# threads and the same sums; what changes is the CPU a waiting thread burns while the other worker holds the
# other core: a test that must run with torch's own threads (test_old_runs.py, 2 on this machine) took
# 169 s of CPU with a loaded second core, 128 s with this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# inductor compiles its C++ kernels in this process, one after the other, instead of starting a pool of
# compiling processes (each importing torch again) in every process that compiles: each worker has one core
# (`-n 2`), so a pool only adds its start. The same kernels (test_compile.py cold: 218 s to 179 s of CPU).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
FRESH_THREADS = (
    torch.get_num_threads()
)  # torch's intra-op threads in a new process (before any test sets them)
TINY_SHAPE = (40, 48)  # raw rows x columns of the test camera
TINY_FRAMES = 240


@pytest.fixture(scope="session")
def tiny_flights(tmp_path_factory):
    """Three demo flights of 240 frames at 40x48: (data dir, data.flights entries)."""
    root = tmp_path_factory.mktemp("flights")
    entries = make_demo_flights(
        root, n_flights=3, seed=1, frames_per_flight=TINY_FRAMES, frame_shape=TINY_SHAPE
    )
    return root, entries


def tiny_raw(data_dir, entries, cache_dir, clahe: bool = False) -> dict:
    """A raw config dict that trains a very small model for two short epochs. `clahe`: the frames' CLAHE at
    its default clip limit; off otherwise (data.clahe_clip_limit 0: min-max and z-score only). On these 32 x
    48 frames CLAHE's 64 tiles of 4 x 6 pixels cost 5 ms a frame, two thirds of every cache build of the
    suite (its quick subset: 360 s of CPU with it, 252 s without), and are no test's point but the
    preprocessing's own (test_preprocess.py, test_inference.py, test_clahe.py and the session's tiny run keep
    it on; the demo, the notebooks and the old releases' runs train with it)."""
    return {
        "data": {
            "dir": str(data_dir),
            "cache_dir": str(cache_dir),
            "flights": copy.deepcopy(entries),
            "test_flights": [entries[2]["name"]],
            "validation_gap_frames": 10,  # the tiny flights are 240 frames long
            "temporal_frames": 3,
            "swath_slice": [4, 36],
            "num_workers": 0,
            "clahe_clip_limit": DataConfig.clahe_clip_limit if clahe else 0.0,
        },
        "model": {"channels": [4, 8, 8], "dropout": 0.0},
        "train": {
            "epochs": 2,
            # the height labels trained on (the last of each training flight validate): 7 batches of 5
            "batch_size": 5,
            "learning_rate": 0.003,
            "warmup_steps": 3,
            "early_stopping_patience": 0,
            "log_every_steps": 2,
            "quick_val_fraction": 0.5,
        },
    }


@pytest.fixture
def tiny_raw_config(tiny_flights, tmp_path):
    root, entries = tiny_flights
    return tiny_raw(root, entries, tmp_path / "cache")


@pytest.fixture
def tiny_config(tiny_raw_config):
    return build_config(tiny_raw_config)


@pytest.fixture
def copied_flights(tiny_flights, tmp_path):
    """A private copy of the tiny flights (tests edit their files) and a function making the tiny config over
    it with data settings changed: (its folder, their entries, config(**data))."""
    root, entries = tiny_flights
    shutil.copytree(root, tmp_path / "flights")

    def config(**data):
        raw = tiny_raw(tmp_path / "flights", entries, tmp_path / "cache")
        raw["data"].update(data)
        return build_config(raw)

    return tmp_path / "flights", entries, config


@pytest.fixture(scope="session")
def _demo_flights_once(tmp_path_factory):
    """The demo's five flights as `--preset demo` writes them, written once for the session: by the first
    worker that asks, under a lock; the other waits and reads them."""
    from filelock import FileLock

    from cloudml_lib.data.demo import DEMO_FLIGHTS
    from cloudml_lib.data.synthetic import DEMO_SEED

    base = tmp_path_factory.getbasetemp()
    root = base.parent if WORKER else base  # pytest-xdist's workers share their parent (this session's)
    folder, done = root / "demo-flights", root / "demo-flights.done"
    with FileLock(str(root / "demo-flights.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            make_demo_flights(folder, n_flights=DEMO_FLIGHTS, seed=DEMO_SEED, option="data.dir")
            done.touch()
    return folder


@pytest.fixture
def demo_flights(_demo_flights_once, tmp_path) -> Path:
    """A copy of the demo's flights (for `--data-dir`): the files `--preset demo` writes, without writing
    them again (12 s of CPU) for each test that only reads them."""
    return Path(shutil.copytree(_demo_flights_once, tmp_path / "flights"))


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The wheel of a clean copy of this checkout (tests/install_helpers.py)."""
    from install_helpers import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


def with_heights(labels):
    """A FlightLabels with only the samples that have a height label (the arrays of the height task)."""
    keep = np.isfinite(labels.cbh_km)
    per_sample = {
        k: v[keep] for k, v in vars(labels).items() if isinstance(v, np.ndarray) and len(v) == len(keep)
    }
    return type(labels)(**{**vars(labels), **per_sample})


def preprocess_frame(raw, data):
    """One raw frame through both stages with the reference backend (scikit-image): (frame, filled, blank)."""
    spec = FrameSpec.of(data)
    x, filled, blank = prepare(raw, spec)
    return (x if blank else equalise_skimage(x, spec.clip_limit)), filled, blank


@pytest.fixture(autouse=True)
def _records_reach_caplog_where_asked(request, monkeypatch):
    """A test that reads caplog sees cloudml_lib's records whatever ran before it: an earlier in-process
    training run or CLI command stops them at the package's own handlers (base/logs.py). pytest 9 lets
    caplog.set_level(logger=) see them anyway, pytest 8 does not: test_timing's hand-edited-run tests failed
    on CI's pytest 8 only."""
    if "caplog" in request.fixturenames:
        monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)


@pytest.fixture
def logs_reach_caplog(monkeypatch, caplog):
    """A training run earlier in the session stops cloudml_lib's records at its own handlers (base/logs.py):
    let them reach caplog again, from INFO up."""
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    caplog.set_level(logging.INFO, logger="cloudml_lib")


@pytest.fixture
def shown(monkeypatch):
    """Everything the notebook cells display, in order (widgets, display objects, Markdown text)."""
    from cloudml_lib.colab import drive, live, picker, show, sweeping, training

    out = []
    for module in (show, drive, live, picker, training, sweeping):
        for name in ("show", "show_markdown"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, out.append)
    return out


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A notebook workspace (the CloudML folder) of the test's own, outside smoke mode."""
    from cloudml_lib import colab

    monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
    monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
    return colab.workspace()


def run_process(
    *args, cwd=None, env: dict | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """`python -m cloudml_lib ARGS` in a process of its own (from the repository, or `cwd`), its output
    captured; no fault injection inherited (CLOUDML_KILL_AT only where `env` sets it). For a test whose point
    is the process: a signal or a kill (CLOUDML_KILL_AT), the interpreter's exit status, what it imports."""
    full = {k: v for k, v in os.environ.items() if k != "CLOUDML_KILL_AT"}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH", "")]))
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cloudml_lib", *map(str, args)],
        cwd=REPO if cwd is None else cwd,
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )


def run_cli(
    *args, cwd=None, env: dict | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """`python -m cloudml_lib ARGS` run in this process (cli.main, as `python -m cloudml_lib` runs it), for a
    test that checks a command's message, exit status and files: what it prints to stdout and stderr is
    captured, its exit status is main's (2 for a refusal, 1 with the traceback on stderr for anything
    unexpected, argparse's own), from the repository or `cwd`, with `env` set for the call alone. Everything
    a command changes in the process is put back afterwards: the working directory, the environment (and
    tempfile's folder, which follows TMPDIR), the signal handlers, cloudml_lib's log handlers. A Ctrl-C
    during the command stops the suite (the command's own handler turned it into exit status 130). A fault
    (CLOUDML_KILL_AT in `env`) runs in a process of its own (run_forked; run_process for the "start" point,
    before anything is imported): its signal or kill is the point.
    `timeout` guards against a hang, as subprocess.run's does: past it, SIGALRM stops the command (a blocking
    read or wait is interrupted) and subprocess.TimeoutExpired is raised."""
    from contextlib import redirect_stderr, redirect_stdout

    from cloudml_lib.commands import cli

    if "CLOUDML_KILL_AT" in (env or {}):  # a fault's signal or kill is the point: a process of its own
        started = str((env or {})["CLOUDML_KILL_AT"]).startswith("start:")  # before anything is imported
        forks = not started and _threads_of(env) == 1
        return (run_forked if forks else run_process)(*args, cwd=cwd, env=env, timeout=timeout)
    argv = [str(a) for a in args]
    saved = _ProcessState.save()
    out, err = io.StringIO(), io.StringIO()
    os.environ.pop("CLOUDML_KILL_AT", None)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # torch's threads as a new process would start them (OMP_NUM_THREADS is read once, at torch's start)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or FRESH_THREADS))
    os.chdir(REPO if cwd is None else cwd)
    interrupts = CTRL_C.count
    try:
        with redirect_stdout(out), redirect_stderr(err), _time_limit(timeout):
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse (a usage error, --help, --version)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except Exception:  # what the interpreter would print, with its exit status
                traceback.print_exc()
                code = 1
    except _Hung:
        raise subprocess.TimeoutExpired(
            ["python", "-m", "cloudml_lib", *argv], timeout, out.getvalue()
        ) from None
    finally:
        saved.restore()
    if CTRL_C.count != interrupts:
        raise KeyboardInterrupt("Ctrl-C while a command ran in the test's process")
    return subprocess.CompletedProcess(
        ["python", "-m", "cloudml_lib", *argv], code, out.getvalue(), err.getvalue()
    )


FORK_GUARD_S = 450  # run_forked's time limit where the test gives none: before pytest's own (600 s)


def _threads_of(env: dict | None) -> int:
    """torch's intra-op threads in a new process given `env` (OMP_NUM_THREADS, else torch's own choice)."""
    return int((env or {}).get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or FRESH_THREADS)


def run_forked(
    *args, cwd=None, env: dict | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """`python -m cloudml_lib ARGS` in a process of its own that starts as a fork of this one: the same
    command, killed or signalled for real (its exit status, its files), without importing torch and CloudML
    again (about 6 s of CPU a process, run_process's). The child starts as a new process would: the
    environment with `env`, the working directory, torch's threads from OMP_NUM_THREADS, Python's own
    signal handlers, CloudML's per-process memories empty, no exit handler of this process; it leaves as the
    interpreter would (its threads joined, its own exit handlers run, its output flushed). stdout and
    stderr go to files the result reads back. Past `timeout` the child is killed and
    subprocess.TimeoutExpired raised, as subprocess.run does. For commands of one thread only (run_cli sends
    the others to run_process): OpenMP cannot start threads in a fork of a process whose own threads it ran
    (the child hangs in its first parallel operator), and pytest's process runs commands with torch's own
    threads where pytest-xdist does not hold each worker to one."""
    import atexit
    import importlib

    from cloudml_lib.commands import cli

    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="cloudml-fork-") as folder:
        out_path, err_path = Path(folder) / "stdout", Path(folder) / "stderr"
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                _die_with(parent)
                atexit._clear()  # this process's exit handlers are pytest's, not the command's
                for fd, path in ((1, out_path), (2, err_path)):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
                sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
                CTRL_C.real_signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as at a start
                CTRL_C.real_signal(signal.SIGTERM, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, CTRL_C.blocked_at_start)
                for module, name in PER_PROCESS:
                    getattr(importlib.import_module(module), name).clear()
                os.environ.pop("CLOUDML_KILL_AT", None)
                os.environ.update({k: str(v) for k, v in (env or {}).items()})
                tempfile.tempdir = None
                torch.set_num_threads(_threads_of(None))
                os.chdir(REPO if cwd is None else cwd)
                try:
                    code = cli.main(argv)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                except BaseException:  # noqa: BLE001 - what the interpreter would print, with its status
                    traceback.print_exc()
                    code = 1
                for t in threading.enumerate():
                    if t is not threading.current_thread() and not t.daemon:
                        t.join()
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 1)
        # a guard against a hang (a fork that deadlocked), never a measure of speed: the suite's kills end
        # in seconds
        timeout = FORK_GUARD_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(["python", "-m", "cloudml_lib", *argv], timeout)
                time.sleep(0.02)
        except BaseException:  # past the limit, or Ctrl-C in pytest: the child does not outlive the test
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        out, err = (p.read_text(errors="replace") for p in (out_path, err_path))
    return subprocess.CompletedProcess(
        ["python", "-m", "cloudml_lib", *argv], os.waitstatus_to_exitcode(status), out, err
    )


def _die_with(parent: int) -> None:
    """The forked child is killed when pytest's worker ends (stopped by pytest-timeout, killed): it holds
    copies of the worker's descriptors, and a child left behind would keep CI's output open after the worker
    was gone. Linux's parent-death signal; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the worker ended before the signal was asked for
            os._exit(1)


class _Hung(BaseException):
    """A command in this process past its time limit (a BaseException: no `except Exception` of the
    command's own takes it)."""


@contextmanager
def _time_limit(seconds: float | None):
    if not seconds:
        yield
        return

    def hung(signum, frame):
        raise _Hung

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# What CloudML remembers for the life of its process (a table or a notice said once, a fault point's count):
# a command run in this process starts with them empty, as in a process of its own, and they are put back
# after it. tests/test_layout.py checks that every module-level set or dict of cloudml_lib is here or in
# NOT_PER_COMMAND, with its reason.
PER_PROCESS = (
    ("cloudml_lib.train.build", "_SHOWN_TABLES"),
    ("cloudml_lib.base.config", "_NOTICED"),
    ("cloudml_lib.base.ledger", "_said"),
    ("cloudml_lib.core.machine.timing", "_told"),
    ("cloudml_lib.base.faults", "_counts"),
    ("cloudml_lib.base.ledger", "_growing"),
    ("cloudml_lib.base.outputs", "_said_aside"),
    ("cloudml_lib.core.run.checkpoint", "_WEIGHTS_OF"),
)
NOT_PER_COMMAND = (
    ("cloudml_lib.base.store", "_held"),  # the folder locks this process holds now: released by their owners
    ("cloudml_lib.base.ownership", "_KINDS"),  # the kinds of folder, registered at import
    ("cloudml_lib.colab.expected", "_RUNNING"),  # the notebook's measuring threads (no command starts one)
)


class _ProcessState:
    """What a command run in this process may change for the ones after it, saved and put back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        import importlib

        self.memories = {}
        for module, name in PER_PROCESS:
            memory = getattr(importlib.import_module(module), name)
            self.memories[(module, name)] = (memory, copy.copy(memory))
            memory.clear()
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)
        self.threads = torch.get_num_threads()
        self.tempdir = None
        self.handlers = {s: signal.getsignal(s) for s in self.SIGNALS}
        logger = logging.getLogger("cloudml_lib")
        self.log = (list(logger.handlers), logger.level, logger.propagate)

    @classmethod
    def save(cls) -> _ProcessState:
        state = cls()
        state.tempdir = tempfile.tempdir
        return state

    def restore(self) -> None:
        from cloudml_lib.base import ledger

        ledger.flush()  # what a process's end does (atexit): its appends' fingerprints into the ledgers
        for memory, before in self.memories.values():
            memory.clear()
            memory.update(before)
        os.chdir(self.cwd)
        torch.set_num_threads(self.threads)
        os.environ.clear()
        os.environ.update(self.environ)
        tempfile.tempdir = self.tempdir
        for s, h in self.handlers.items():
            CTRL_C.real_signal(s, h)  # exactly the handler it found (signal.signal would wrap it)
        logger = logging.getLogger("cloudml_lib")
        handlers, level, propagate = self.log
        for h in logger.handlers:
            if h not in handlers:
                h.close()  # a run's train.log is not held open by the test process
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


class _CtrlC:
    """Counts the Ctrl-Cs (SIGINT) this process receives while a handler other than Python's own holds
    SIGINT: CloudML's (the command line's, a training loop's) turn the first Ctrl-C into a stop at a
    checkpoint or exit status 130, which a test would report as a failure while the suite went on. Every
    SIGINT handler installed in this process is wrapped to count first (signal.signal is wrapped for the
    session, pytest_configure); after each test the handlers are put back to pytest's, and a counted Ctrl-C
    stops the suite."""

    def __init__(self):
        self.count = 0
        self.real_signal = signal.signal
        self.pytest_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self.blocked_at_start: set = set()

    def signal(self, signum, handler):
        if signum == signal.SIGINT and callable(handler) and not getattr(handler, "_counts_ctrl_c", False):
            inner = handler

            def handler(number, frame):
                self.count += 1
                return inner(number, frame)

            handler._counts_ctrl_c = True
            handler.__wrapped__ = inner
        return self.real_signal(signum, handler)


CTRL_C = _CtrlC()


SUITE_TOKEN = "CLOUDML_SUITE_TOKEN"  # in the environment of every process this session starts


def processes_left_behind(token: str) -> list[tuple[int, str]]:
    """(pid, command line) of each process still running whose environment, as it was started, carries this
    session's token: started by the suite (a test's command, a torchrun job, a kernel, anything they started
    in turn, in a session of their own or not), other than this process. Linux's /proc; elsewhere none."""
    needle, found = f"{SUITE_TOKEN}={token}".encode(), []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # ended, not yet reaped
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        found.append((int(entry.name), command.strip()))
    return found


def _stop_what_was_left_behind() -> None:
    """At the session's end: a process the suite started and left running (a worker stopped by pytest-timeout
    leaves its commands behind, their fixtures never torn down) is killed and named, so that it never holds
    CI's output open after pytest has ended (CI then waits for it until its own time limit)."""
    left = processes_left_behind(os.environ.get(SUITE_TOKEN, ""))
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        named = "; ".join(f"{pid}: {command[:160]}" for pid, command in left)
        print(f"\nThe tests left {len(left)} process(es) running, killed now: {named}", file=sys.__stderr__)


def pytest_configure(config):
    if not WORKER:
        import secrets

        # this session's own token (a pytest a test starts gets one of its own, and sweeps only its own)
        os.environ[SUITE_TOKEN] = secrets.token_hex(8)
        # the bytecode of CloudML and the benchmarks, written once before any process starts: where
        # PYTHONDONTWRITEBYTECODE is set (as on this machine), Python writes none itself, and each process
        # the suite starts compiled the package from source again (about 0.3 s of CPU each). Beside the
        # sources, as Python itself writes it (__pycache__: ignored by git, the wheel and the Drive copy)
        import compileall

        for package in ("cloudml_lib", "benchmarks"):
            compileall.compile_dir(REPO / package, quiet=1, workers=1)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # started in the background by a shell (`nohup pytest ... &`), which ignores Ctrl-C there: every
        # process a test starts would inherit that, and the tests of a stop by Ctrl-C would fail; a shell's
        # foreground command gets the default, and so does the suite
        signal.signal(signal.SIGINT, signal.default_int_handler)
        CTRL_C.pytest_handlers[signal.SIGINT] = signal.default_int_handler
    CTRL_C.blocked_at_start = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    signal.signal = CTRL_C.signal
    config.pluginmanager.register(_WholeFilesOnOneWorker(), "cloudml-whole-files-on-one-worker")
    if WORKER and os.environ.get("CLOUDML_XDIST_GROUPS"):
        config.option.loadgroup = True  # the worker names each test's group, as under --dist loadgroup
    if not WORKER and getattr(config.option, "numprocesses", None):
        if config.option.dist == "load":
            # -n alone: each group (a file, the notebooks, the twin's tests) runs on one worker; the workers
            # read their arguments again, so they are told through the environment
            config.option.dist = "loadgroup"
            os.environ["CLOUDML_XDIST_GROUPS"] = "1"
            # in the order of pytest_collection_modifyitems (the longest first), not the most tests first
            config.option.loadscopereorder = False
        # pytest-xdist's controller: it builds the Colab twin's environment (pytest_xdist_node_collection_
        # finished) and tells the worker that runs the twin's tests where, through this file (its folder made
        # only if the twin's tests were selected)
        import secrets

        folder = Path(tempfile.gettempdir()) / f"cloudml-twin-{os.getpid()}-{secrets.token_hex(8)}"
        os.environ["CLOUDML_TWIN_STATE"] = str(folder / "state.json")


def pytest_unconfigure(config):
    signal.signal = CTRL_C.real_signal
    if not WORKER:  # pytest-xdist's workers have ended by now
        _stop_what_was_left_behind()
    if TWIN is not None and TWIN.scratch is not None:  # the process that built it
        notes = os.environ.get("CLOUDML_SUITE_NOTES")  # benchmarks/suite.py records the twin's time beside
        if notes:
            doc = {"colab_twin_environment": TWIN.how, "seconds": TWIN.seconds}
            asked = TWIN.state.parent / "asked.json" if TWIN.state is not None else None
            if asked is not None and asked.is_file() and TWIN.began_at is not None:
                first = json.loads(asked.read_text())  # a worker's: when the twin's first test asked for it
                doc["twin_tests_began_after_s"] = round(first["asked_at"] - TWIN.began_at, 1)
                doc["twin_tests_waited_s"] = first["waited_s"]
            Path(notes).write_text(json.dumps(doc))
        shutil.rmtree(TWIN.scratch, ignore_errors=True)


TWIN = None  # the Colab twin's environment (install_helpers.TwinEnvironment), where its tests were selected
TWIN_MODULE = "test_colab_twin.py"


NOTEBOOKS_GROUP = "notebooks"
# Under pytest-xdist each worker takes whole groups (a test file, the two notebooks), the longest first (by
# the seconds benchmarks/results/suite.json last recorded for each file), so that no worker is left alone
# with a long one at the end; the Colab twin's tests fourth, once its environment (built meanwhile by the
# controller: 2 to 4 minutes in a fresh clone) is about ready, after three long files. Files without a
# recorded time go first (a new file may be long).
TWIN_GROUP, TWIN_PLACE = "colab-twin", 3
SUITE_RESULTS = REPO / "benchmarks" / "results" / "suite.json"


def recorded_group_seconds(quick: bool) -> dict[str, float]:
    """Each group's seconds in the last run benchmarks/suite.py recorded (the quick subset's for a quick run);
    empty where there is none or the file does not read (the order is then the collection's)."""
    try:
        commits = json.loads(SUITE_RESULTS.read_text())["commits"]
        kind = "quick" if quick else "fresh_clone"
        files = [c[kind]["files_s"] for c in commits.values() if kind in c][-1]
        seconds: dict[str, float] = {}
        for name, s in files.items():
            group = NOTEBOOKS_GROUP if name.endswith(".ipynb") else Path(name).stem
            group = TWIN_GROUP if group + ".py" == TWIN_MODULE else group
            seconds[group] = seconds.get(group, 0.0) + float(s)
        return seconds
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return {}


def groups_in_order(groups: list[str], seconds: dict[str, float]) -> list[str]:
    """`groups` (in collection order) longest first by `seconds`, those without a time before them, the
    twin's fourth of those with a time. (Fourth of all, it came right after three files never timed: a few
    tests of a second each, so that its tests asked for its environment 5 s in and waited 142 s for it.)"""
    new = [g for g in groups if g != TWIN_GROUP and g not in seconds]
    known = sorted((g for g in groups if g != TWIN_GROUP and g in seconds), key=lambda g: -seconds[g])
    if TWIN_GROUP in groups:
        known.insert(TWIN_PLACE, TWIN_GROUP)
    return new + known


def xdist_group_of(item) -> str:
    """A test's group under pytest-xdist: its marker's (the twin's), both notebooks', or its file's."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    return NOTEBOOKS_GROUP if item.path.suffix == ".ipynb" else item.path.stem


class _WholeFilesOnOneWorker:
    """Under pytest-xdist, each test file runs on one worker, its tests one after the other, and both
    notebooks together: the notebooks' smoke test shares one workspace (.cloudml_smoke), which the training
    notebook finds as the setup notebook left it; a file's module-scoped fixtures (trained runs, a torchrun
    job's reference) are built once, not again on each worker and after each test of another file in between.
    A plugin of its own (registered in pytest_configure), as this module holds the other
    pytest_collection_modifyitems: pytest takes a conftest's hooks by their pytest_ names only, and calls a
    per-item hook of this file only for items under tests/, never for the notebooks at the top. (A hook under
    another name with specname was never called: the notebooks ran on two workers at once, the training one
    reading the demo flights while the setup one was still writing them.)"""

    @pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
    def pytest_collection_modifyitems(self, items):
        for item in items:
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: a quick run builds no twin
def pytest_collection_modifyitems(session, config, items):
    """The Colab twin's environment starts building in the background now, and its tests go last: the other
    tests run while pip downloads and unpacks Colab's torch. Under pytest-xdist the controller builds it
    (pytest_xdist_node_collection_finished) and the worker given the twin's tests reads where; the groups go
    the longest first, the twin's fourth (groups_in_order)."""
    global TWIN
    if WORKER and config.getvalue("loadgroup"):
        apart = [
            i.nodeid for i in items if i.path.suffix == ".ipynb" and not i.nodeid.endswith(NOTEBOOKS_GROUP)
        ]
        if apart:
            raise pytest.UsageError(
                f"the notebooks would run on two workers at once: {apart} are not grouped"
            )
        groups = list(dict.fromkeys(xdist_group_of(item) for item in items))
        quick = "not slow" in (config.option.markexpr or "")
        rank = {g: n for n, g in enumerate(groups_in_order(groups, recorded_group_seconds(quick)))}
        items.sort(key=lambda item: rank[xdist_group_of(item)])
    twin = [item for item in items if item.path.name == TWIN_MODULE]
    if not twin:
        return
    from install_helpers import TwinBuiltElsewhere, TwinEnvironment

    if WORKER:
        TWIN = TwinBuiltElsewhere(None, Path(os.environ["CLOUDML_TWIN_STATE"]))
        return
    items[:] = [item for item in items if item.path.name != TWIN_MODULE] + twin
    TWIN = TwinEnvironment(Path(tempfile.mkdtemp(prefix="cloudml-twin-")))
    TWIN.start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller, once a worker has collected (and deselected): where the Colab twin's tests
    are among them, its environment starts building here, in the background, while the workers test."""
    global TWIN
    if TWIN is None and any(TWIN_MODULE in nodeid for nodeid in ids):
        from install_helpers import TwinEnvironment

        state = Path(os.environ["CLOUDML_TWIN_STATE"])
        state.parent.mkdir(mode=0o700)  # the outcome's folder, and the build's where it is not kept
        TWIN = TwinEnvironment(state.parent, state)
        TWIN.start()


@pytest.fixture(autouse=True)
def _stop_signals_left_as_found():
    """A test, or CloudML run in this process, must leave Ctrl-C and SIGTERM as it found them: blocked in the
    main thread or ignored, they would stay so in every process started later (a child inherits both), and a
    notebook kernel that ran CloudML would no longer be interrupted. The state is put back, and the test
    fails naming what it left."""
    yield
    if threading.current_thread() is not threading.main_thread():
        return
    stops = {signal.SIGINT, signal.SIGTERM}
    blocked = stops & set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) - CTRL_C.blocked_at_start
    ignored = {s for s in stops if signal.getsignal(s) == signal.SIG_IGN != CTRL_C.pytest_handlers.get(s)}
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    for s in ignored:
        CTRL_C.real_signal(s, CTRL_C.pytest_handlers[s])
    left = [f"{signal.Signals(s).name} blocked" for s in blocked] + [
        f"{signal.Signals(s).name} ignored" for s in ignored
    ]
    assert not left, f"the test left {', '.join(left)} in pytest's process"


def _torch_switches() -> dict:
    return {
        "torch.use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
    }


@pytest.fixture(autouse=True)
def _torch_switches_left_as_found():
    """A test, or a CloudML run in this process, must leave torch's process-wide switches as it found them:
    a deterministic run in-process once left torch.use_deterministic_algorithms on, and a later test of the
    same worker failed on CI (a notebook's kernel would have kept it too). The switches are put back, and the
    test fails naming what it left."""
    found = _torch_switches()
    yield
    left = {k: v for k, v in _torch_switches().items() if v != found[k]}
    if left:
        torch.use_deterministic_algorithms(found["torch.use_deterministic_algorithms"])
        torch.backends.cudnn.deterministic = found["torch.backends.cudnn.deterministic"]
        torch.backends.cudnn.benchmark = found["torch.backends.cudnn.benchmark"]
        torch.set_default_dtype(found["torch.get_default_dtype()"])
        torch.set_grad_enabled(found["torch.is_grad_enabled()"])
    assert not left, f"the test left torch's switches changed in pytest's process: {left}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = CTRL_C.count
    yield
    if threading.current_thread() is threading.main_thread():
        for s, h in CTRL_C.pytest_handlers.items():  # a command the test ran here may have left its own
            CTRL_C.real_signal(s, h)
    if CTRL_C.count != before:
        item.session.shouldstop = "Ctrl-C (a handler of CloudML's had taken it while the test ran)"


def fit_and_finish(trainer) -> dict:
    """A set-up Trainer's run trained and ended (commands/runs.py's route, in this process): its report."""
    from cloudml_lib.science.finish import finish_run

    trainer.fit()
    return finish_run(trainer.folder, trainer.dist)


class SessionRuns:
    """Runs a session trains once, as a user would with `python -m cloudml_lib train`, over the tiny flights
    and one config file (`cfg`: the tiny config, checkpoints every 3 steps, the last 3 kept, its cache in
    the session's folder), and copies for each test that changes them: `finished()` ran to its end;
    `killed(point)` was killed by SIGKILL at a fault point (CLOUDML_KILL_AT, e.g. "step:8"), in a process of
    its own. A test resumes or damages its copy with the same `cfg`: nothing it does differs from a run it
    trained itself."""

    def __init__(self, root: Path, flights: Path, entries: list[dict]):
        import yaml

        self.root, self.flights, self.entries = root, flights, entries
        raw = tiny_raw(flights, entries, root / "cache")
        raw["checkpoint"] = {"every_steps": 3, "keep_last": 3}
        self.raw = raw
        self.cfg = root / "tiny.yaml"
        self.cfg.write_text(yaml.safe_dump(raw))
        self._built: dict[str, Path] = {}

    def _run(self, name: str, **env) -> Path:
        if name not in self._built:
            run = self.root / name.replace(":", "-")
            r = run_cli("train", "--config", self.cfg, "--run-dir", run, env=env or None)
            want = -signal.SIGKILL if env.get("CLOUDML_KILL_AT") else 0
            assert r.returncode == want, (name, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
            self._built[name] = run
        return self._built[name]

    def finished(self) -> Path:
        return self._run("finished")

    def killed(self, point: str) -> Path:
        return self._run(f"killed:{point}", CLOUDML_KILL_AT=point)

    def copy(self, run: Path, dest: Path) -> Path:
        return same_folder_at(run, dest)


@pytest.fixture(scope="session")
def session_runs(tiny_flights, tmp_path_factory) -> SessionRuns:
    root, entries = tiny_flights
    return SessionRuns(tmp_path_factory.mktemp("session_runs"), root, entries)


def same_folder_at(src: Path, dest: Path) -> Path:
    """A copy of the CloudML folder `src` at `dest` that stands for `src` itself, as if its commands had run
    there: its markers and ledgers (which record the folder they were written in, so that a copied marker
    proves nothing) name `dest`'s folders. A test that resumes or damages a run the session made once
    works on this; one about a folder really copied or moved uses shutil.copytree."""
    from cloudml_lib.base.ledger import LEDGER
    from cloudml_lib.base.ownership import MARKER, recorded_here, where

    shutil.copytree(src, dest)
    for name in (MARKER, LEDGER):
        for path in Path(dest).rglob(name):
            doc = json.loads(path.read_text())
            if recorded_here(doc.get("folder"), Path(src) / path.parent.relative_to(dest)):
                path.write_text(json.dumps(dict(doc, folder=where(path.parent))) + "\n")
    return Path(dest)


def assert_reads_back(folder: Path) -> list[str]:
    """Every file under `folder` that a command wrote and another reads back (base/runfiles.READERS) read by
    its reader without damage, and the folder read by `compare` and `status` as the notebooks and the API
    read it, nothing named damaged: what the writers write, the readers take. Returns the files read."""
    from cloudml_lib.base.runfiles import READERS, RunFiles
    from cloudml_lib.commands.compare import compare_runs

    read, damaged = [], []
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.name in READERS:
            files = RunFiles(path.parent)
            getattr(files, READERS[path.name])()
            damaged += files.damaged
            read.append(str(path.relative_to(folder)))
    assert damaged == [], damaged
    rows = compare_runs([folder])  # as the notebooks' Compare and the API read it
    assert [d for r in rows for d in r["damaged"]] == [], rows
    for command in (("compare", folder), ("status", folder)):  # as a user runs them
        r = run_cli(*command)
        assert r.returncode == 0 and "damaged" not in r.stdout + r.stderr, (command, r.stdout, r.stderr)
    return read


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` by its relative path: its SHA-256 (a link: where it points)."""
    import hashlib

    return {
        str(p.relative_to(folder)): os.readlink(p)
        if p.is_symlink()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


@pytest.fixture(scope="session")
def shared_tiny_run(tiny_flights, tmp_path_factory):
    """The tiny run of today's code (one epoch), trained once per session through the Python API from a YAML
    file (cml.fit, as a user's notebook does), over its own copy of the tiny flights: its folder, its
    flights' folder and their entries. Tests read it through `tiny_run` or change a copy (`tiny_run_copy`)."""
    import yaml

    import cloudml_lib as cml

    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("tiny_run")
    data = tmp / "flights"
    shutil.copytree(root, data)
    raw = tiny_raw(data, entries, tmp / "cache", clahe=True)  # the backends' tests score it on other CLAHEs
    raw["train"]["epochs"] = 1
    # a whole flight validates (its 25 heights calibrate the intervals; the tiny time blocks hold too few)
    raw["data"]["validation"] = [entries[1]["name"]]
    (tmp / "tiny_run.yaml").write_text(yaml.safe_dump(raw))
    cml.fit(tmp / "tiny_run.yaml", tmp / "run")
    return tmp / "run", data, entries


@pytest.fixture
def tiny_run(shared_tiny_run):
    """The session's tiny run (shared_tiny_run), read in place: a test that changes a file of the run or of
    its flights fails here, naming them (it should use tiny_run_copy, or copy the flights it changes); lines
    added to its train.log are allowed (predict and evaluate log into the run they read)."""
    run, data, _ = shared_tiny_run
    log, ledger = (run / "train.log").read_bytes(), _ledger_but_the_log(run)
    before = (digest(run), digest(data))
    yield shared_tiny_run
    after = (digest(run), digest(data))
    changed = sorted(
        f"{where}/{name}"
        for where, a, b in (("run", before[0], after[0]), ("flights", before[1], after[1]))
        for name in set(a) | set(b)
        if a.get(name) != b.get(name)
    )
    if (run / "train.log").read_bytes().startswith(log):  # a command that reads a run logs there too
        changed = [name for name in changed if name != "run/train.log"]
        if _ledger_but_the_log(run) == ledger:  # and records the log's new fingerprint in the ledger
            changed = [name for name in changed if name != "run/.cloudml-files"]
    assert not changed, f"the test changed the session's shared tiny run (use tiny_run_copy): {changed}"


def _ledger_but_the_log(run: Path) -> dict:
    """The run's ledger without its record of train.log (a command that reads a run logs there)."""
    doc = json.loads((run / ".cloudml-files").read_text())
    doc.get("contents", {}).pop("train.log", None)
    return doc


@pytest.fixture
def tiny_run_copy(shared_tiny_run, tmp_path):
    """A copy of the session's tiny run in this test's folder, to change (its flights are shared: copy
    those a test changes): the copy's folder, the flights' folder and their entries."""
    run, data, entries = shared_tiny_run
    shutil.copytree(run, tmp_path / "tiny_run")
    return tmp_path / "tiny_run", data, entries
