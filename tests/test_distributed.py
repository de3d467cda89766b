"""torchrun with 2 processes (gloo on CPU): the same model as one process with the same global batch,
a killed or stopped process and the relaunch that resumes, cross-validation folds in parallel."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, run_cli, tiny_raw

from cloudml_lib.core.machine.distributed import SINGLE, Dist, explain_peer_failure
from cloudml_lib.core.run.checkpoint import STATE, Key, find_checkpoints, read_meta
from cloudml_lib.core.run.folder import RunFolder

# Its gradient is zero in exact arithmetic (the softmax over frames ignores a shift shared by all
# frames), so Adam turns rounding noise into steps of about the learning rate in any two runs that
# sum in a different order. It cannot change a prediction.
SHIFT_ONLY = "temporal.2.bias"


def launch(args: list[str], nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    if nproc == 1:
        return run_cli(*args, env=env, timeout=300)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CLOUDML_KILL")}
    full_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "cloudml_lib",
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300)


def train_args(cfg: Path, run: Path) -> list[str]:
    return ["train", "--config", str(cfg), "--run-dir", str(run)]


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def ddp_config(tiny_flights, tmp_path_factory) -> Path:
    """The tiny config the module's jobs train (checkpoints every 3 steps)."""
    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("ddp")
    raw = tiny_raw(root, entries, tmp / "cache")  # dropout 0: see the README's torchrun section
    raw["checkpoint"] = {"every_steps": 3}
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


@pytest.fixture(scope="module")
def runs(ddp_config):
    """The same config trained by 1 process and by 2 (global batch 5 either way: 3 and 2 samples)."""
    cfg = ddp_config
    one, two = cfg.parent / "one", cfg.parent / "two"
    for run, nproc in ((one, 1), (two, 2)):
        r = launch(train_args(cfg, run), nproc)
        assert r.returncode == 0, r.stderr[-3000:]
    return cfg, one, two


@pytest.mark.slow
def test_two_processes_train_the_same_model_as_one(runs):
    _, one, two = runs
    a, b = weights(one / "best.pt"), weights(two / "best.pt")
    assert a.keys() == b.keys()  # checkpoints move between 1 and N processes
    for k in a:
        if k != SHIFT_ONLY:
            assert torch.allclose(a[k].double(), b[k].double(), atol=1e-4), k
    pa = np.loadtxt(one / "predictions.csv", delimiter=",", skiprows=1, usecols=3)
    pb = np.loadtxt(two / "predictions.csv", delimiter=",", skiprows=1, usecols=3)
    assert len(pa) == len(pb) > 10 and np.abs(pa - pb).max() <= 1.5e-4  # written to 0.1 m
    # the inputs trained on (predict's domain check), fitted by rank 0 alone: those of the whole training part
    domains = [torch.load(run / "best.pt", weights_only=True)[Key.DOMAIN] for run in (one, two)]
    assert domains[0]["n"] > 10 and domains[0] == domains[1]
    assert json.loads((two / "run.json").read_text())["processes"] == 2
    log = (two / "train.log").read_text()
    assert "batch 5 over 2 processes (BatchNorm over the whole batch)" in log
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2]  # written once, by rank 0
    for key in ("train_loss", "val_loss"):
        a_ep = [
            r[key]
            for r in map(json.loads, (one / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "epoch"
        ]
        assert [r[key] for r in records if r["kind"] == "epoch"] == pytest.approx(a_ep, rel=1e-4)
    assert len(list((two / "tensorboard").glob("events.out.tfevents.[0-9]*"))) == 1  # rank 0's only


@pytest.mark.slow
def test_a_job_stopped_by_sigterm_then_killed_resumes_each_time_to_bit_identical_weights(runs, tmp_path):
    """One job stopped twice, each relaunch resuming where the last stopped: SIGTERM to process 1 stops both
    at the same step with a checkpoint; SIGKILL to process 1 ends the job (process 0 says why, nothing is
    evaluated); the last launch ends with the weights of the uninterrupted 2-process run, bit for bit."""
    cfg, _, two = runs
    run = tmp_path / "run"
    r = launch(train_args(cfg, run), env={"CLOUDML_KILL_AT": "step:4:SIGTERM", "CLOUDML_KILL_RANK": "1"})
    assert r.returncode != 0
    newest = find_checkpoints(RunFolder(run))[0]
    assert read_meta(newest)["reason"] == "SIGTERM" and read_meta(newest)["step"] == 5
    assert "Stopped by SIGTERM at step 5" in (run / "train.log").read_text()
    # the 3rd step of this launch (a fault point counts the steps of its process): step 8 of the run
    r = launch(train_args(cfg, run), env={"CLOUDML_KILL_AT": "step:3", "CLOUDML_KILL_RANK": "1"})
    assert r.returncode != 0  # the job ended (no hang: launch has a timeout)
    assert "Resumed from step 5" in (run / "train.log").read_text()
    assert "rank      : 1" in r.stderr and "SIGKILL" in r.stderr
    assert "another process of this 2-process job stopped, so process 0 stops too" in r.stderr
    assert not (run / "evaluation.json").exists()
    r = launch(train_args(cfg, run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Resumed from step 7" in (run / "train.log").read_text()  # the end of epoch 1
    a, b = weights(two / "best.pt"), weights(run / "best.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # as if never interrupted
    final = torch.load(find_checkpoints(RunFolder(run))[0] / STATE, weights_only=True)
    assert len(final["rng_ranks"]) == 2 and final["processes"] == 2


def test_torchruns_sigterm_during_the_clean_up_after_a_lost_peer_still_names_the_peer():
    """torchrun stops the other processes with SIGTERM when one dies; arriving while process 0 unwinds from
    the failed collective, it must not hide why (it did, one run in four on a loaded machine)."""
    dist = Dist(0, 2, 0)
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46736")
        finally:
            raise KeyboardInterrupt("SIGTERM")  # as cli._stop_on_sigterm raises it
    except KeyboardInterrupt as e:
        message = explain_peer_failure(e, dist)
    assert message.startswith("another process of this 2-process job stopped, so process 0 stops too")
    assert "Connection closed by peer" in message
    assert explain_peer_failure(KeyboardInterrupt("SIGTERM"), dist) is None  # a stop asked for: not a failure
    assert explain_peer_failure(RuntimeError("Connection closed by peer"), SINGLE) is None


@pytest.mark.slow
def test_a_global_batch_smaller_than_the_process_count_is_refused(ddp_config, tmp_path):
    cfg = ddp_config
    r = launch(train_args(cfg, tmp_path / "run") + ["--set", "train.batch_size=1"])
    assert r.returncode != 0
    assert (
        "train.batch_size 1 is the global batch, shared by the 2 processes: it must be at least 2" in r.stderr
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_crossval_trains_one_fold_per_process(runs, tmp_path):
    cfg, _, _ = runs
    args = ["crossval", "--config", str(cfg), "--no-controls", "--set", "train.epochs=1", "--run-dir"]
    seq, par = tmp_path / "seq", tmp_path / "par"
    r = launch(args + [str(par)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Process 0 of 2: folds 01Mar25, 05Mar25" in r.stdout
    assert (par / "folds" / "03Mar25" / "model" / "best.pt").is_file()  # trained by process 1
    r = launch(args + [str(seq)], nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = (json.loads((d / "crossval.json").read_text())["folds"] for d in (par, seq))
    assert got.keys() == want.keys()
    for name in want:  # each process had 1 thread instead of 2: float rounding only
        assert got[name]["model"]["mae_km"] == pytest.approx(want[name]["model"]["mae_km"], rel=1e-5)
        assert got[name]["trees"] == want[name]["trees"]


ENDS_A_JOB = """
import atexit, runpy, sys, threading, time
import torch
import cloudml_lib.commands.cli as cli
import cloudml_lib.core.machine.distributed as distributed

a = torch.randn(600, 600)


def busy():  # a thread of torch's, still at work when the command is done (as gloo's workers can be)
    while True:
        torch.mm(a, a)


def command():
    atexit.register(lambda: open(sys.argv[1], "w").write("closed"))
    sys.stdout.write("the command's last words, not yet flushed")
    if sys.argv[2] == "raises":
        raise RuntimeError("an error nobody foresaw")
    return 3


threading.Thread(target=busy, daemon=True).start()
time.sleep(0.2)
distributed._JOINED = True  # as init_distributed leaves a process of a torchrun job
cli.main = command
runpy.run_module("cloudml_lib", run_name="__main__")
"""


@pytest.mark.parametrize("end", ["returns", "raises"])
def test_a_process_of_a_job_ends_with_its_status_where_torchs_threads_would_abort_it(tmp_path, end):
    """The end of `python -m cloudml_lib` in a torchrun job: a thread still inside torch when the interpreter
    finalizes aborts the process (SIGABRT, "terminate called"; gloo's workers did it at the end of about one
    torchrun sweep in thirty). The command's status comes back instead (an unexpected error's: its traceback
    and 1), after its exit handlers and output."""
    handler = tmp_path / "handler"
    r = subprocess.run(
        [sys.executable, "-c", ENDS_A_JOB, str(handler), end], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == (3 if end == "returns" else 1), r.stderr[-2000:]
    assert "terminate called" not in r.stderr
    if end == "raises":
        assert r.stderr.strip().splitlines()[-1] == "RuntimeError: an error nobody foresaw"
        assert r.stderr.startswith("Traceback (most recent call last):")
    assert r.stdout == "the command's last words, not yet flushed"
    assert handler.read_text() == "closed"


def test_a_world_size_without_torchrun_is_explained(ddp_config, tmp_path):
    cfg = ddp_config
    r = launch(train_args(cfg, tmp_path / "run"), nproc=1, env={"WORLD_SIZE": "2"})
    assert r.returncode == 2 and "WORLD_SIZE=2 is set but RANK or MASTER_ADDR is not" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_sweep_runs_each_trial_with_all_processes_and_rank_0_writes(runs, tmp_path):
    """Two trials under torchrun: the values one process draws and nearly its results; one study, one
    event file per trial (rank 0's)."""
    optuna = pytest.importorskip("optuna")
    cfg, _, _ = runs
    space = tmp_path / "space.yaml"
    space.write_text(
        yaml.safe_dump({"seed": 5, "params": {"train.learning_rate": {"low": 1e-3, "high": 1e-2}}})
    )
    results = {}
    for nproc in (1, 2):
        run = tmp_path / f"sweep{nproc}"
        r = launch(
            ["sweep", "--config", str(cfg), "--space", str(space), "--trials", "2", "--run-dir", str(run)],
            nproc,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(run / "study.journal"))
        )
        results[nproc] = optuna.load_study(study_name="cloudml-sweep", storage=storage).trials
    one, two = results[1], results[2]
    assert [t.state.name for t in two] == ["COMPLETE", "COMPLETE"]
    assert [t.params for t in two] == [t.params for t in one]
    assert [t.value for t in two] == pytest.approx([t.value for t in one], rel=1e-3)
    for n in (0, 1):
        trial = tmp_path / "sweep2" / "trials" / str(n)
        assert json.loads((trial / "run.json").read_text())["processes"] == 2
        assert len(list((trial / "tensorboard").glob("events.out.tfevents.[0-9]*"))) == 1
    assert not list((tmp_path / "sweep2").glob(".lock*"))


# ---- several machines: two torchrun "nodes" on localhost, each with its own cache folder ----------------


def _turns(rank: int, world: int, init: str, out: str) -> None:
    """One process of a 4-process job on two "machines" (local ranks 0, 1, 0, 1): main_first's turns."""
    import time

    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    dist = Dist(rank, world, rank % 2)

    def build():
        with open(out, "a") as f:
            f.write(f"start {rank} {time.monotonic()}\n")
        time.sleep(0.3)
        with open(out, "a") as f:
            f.write(f"end {rank} {time.monotonic()}\n")
        return rank

    assert dist.main_first(build) == rank
    tdist.destroy_process_group()


@pytest.mark.slow
def test_each_machine_builds_once_after_rank_0_then_its_other_processes_open_it(tmp_path):
    """Rank 0 first; then the first process of the other machine (its own disk); then everyone else."""
    out = tmp_path / "turns.txt"
    init = f"file://{tmp_path / 'rendezvous'}"
    torch.multiprocessing.spawn(_turns, args=(4, init, str(out)), nprocs=4)
    times = {}
    for line in out.read_text().splitlines():
        what, rank, t = line.split()
        times[what, int(rank)] = float(t)
    assert times["end", 0] <= times["start", 2]  # rank 0, then machine 2's first process (rank 2)
    assert max(times["end", 0], times["end", 2]) <= min(times["start", 1], times["start", 3])


def launch_nodes(args: list[str], disks: Path, nodes: int = 2, env: dict | None = None) -> list:
    """`torchrun --nnodes 2 --nproc_per_node 1` twice on this machine, one c10d rendezvous; each "machine"
    has its own $TMPDIR (a node-local disk). Returns each node's CompletedProcess."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for node in range(nodes):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("CLOUDML_KILL")}
        full_env.update(env or {}, TMPDIR=str(disks / f"node{node}"))
        (disks / f"node{node}").mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", "1"]
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", "nodes"]
        cmd += ["--node_rank", str(node), "-m", "cloudml_lib", *args]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.decode(), err.decode()))
    return done


def node_local_config(cfg: Path, tmp: Path) -> Path:
    """The runs' config with data.cache_dir on each machine's own disk ($TMPDIR, expanded on each)."""
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["cache_dir"] = "$TMPDIR/cloudml-cache"
    out = tmp / "nodes.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out


@pytest.fixture(scope="module")
def two_machines(runs, tmp_path_factory):
    """The runs' config trained by two "machines" of one process each, caches on each one's own disk."""
    cfg, _, _ = runs
    tmp = tmp_path_factory.mktemp("nodes")
    config, run, disks = node_local_config(cfg, tmp), tmp / "run", tmp / "disks"
    done = launch_nodes(train_args(config, run), disks)
    assert all(r.returncode == 0 for r in done), [r.stderr[-3000:] for r in done]
    return config, run, disks


@pytest.mark.slow
def test_two_machines_train_the_same_model_as_one_each_building_its_own_caches(runs, two_machines):
    _, one, _ = runs
    _, run, disks = two_machines
    for node in (0, 1):  # each machine built the three flights' caches on its own disk
        assert len(list((disks / f"node{node}" / "cloudml-cache").glob("0*Mar25-*"))) == 3
    a, b = weights(one / "best.pt"), weights(run / "best.pt")
    for k in a:
        if k != SHIFT_ONLY:
            assert torch.allclose(a[k].double(), b[k].double(), atol=1e-4), k
    info = json.loads((run / "run.json").read_text())
    assert info["processes"] == 2 and info["machines"] == 2
    assert "batch 5 over 2 processes on 2 machines" in (run / "train.log").read_text()


# ---- the SLURM recipe of docs/how-to/cluster.md, run as written with stand-ins for srun and scontrol -------

FAKE_SRUN = """#!{python}
# srun's stand-in: the command once per "machine" of the job, each with its own $TMPDIR; signals passed on
import os, signal, subprocess, sys, time
args = sys.argv[1:]
while args[0].startswith("--"):
    args.pop(0)
tasks = []
for node in range(int(os.environ["SLURM_JOB_NUM_NODES"])):
    disk = os.path.join(os.environ["FAKE_SLURM"], "node%d" % node)
    os.makedirs(disk, exist_ok=True)
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0", TMPDIR=disk)
    tasks.append(subprocess.Popen(args, env=env))
def forward(signum, frame):
    for t in tasks:
        if t.poll() is None:
            t.send_signal(signum)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
while any(t.poll() is None for t in tasks):
    time.sleep(0.2)
sys.exit(max(abs(t.returncode) for t in tasks))
"""

FAKE_SCONTROL = """#!/bin/bash
# scontrol's stand-in: every machine of the job is this one; a requeue is written down
case "$1" in
    show) for _ in $(seq "$SLURM_JOB_NUM_NODES"); do echo localhost; done ;;
    requeue) echo "$2" >> "$FAKE_SLURM/requeued" ;;
    *) echo "scontrol stand-in: $*" >&2; exit 1 ;;
esac
"""


def batch_script() -> str:
    text = (REPO / "docs" / "how-to" / "cluster.md").read_text()
    start = text.index("```bash\n#!/bin/bash\n") + len("```bash\n")
    return text[start : text.index("```", start)]


def stand_ins(folder: Path) -> Path:
    """A folder for PATH: srun, scontrol and python (this interpreter)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (
        ("srun", FAKE_SRUN.format(python=sys.executable)),
        ("scontrol", FAKE_SCONTROL),
        ("python", f'#!/bin/bash\nexec "{sys.executable}" "$@"\n'),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def stopped_process(marker: str) -> int | None:
    """The pid of a process stopped (state T) whose environment holds `marker`, or None."""
    for proc in Path("/proc").iterdir():
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "T" and marker.encode() in (proc / "environ").read_bytes():
                return int(proc.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def free_port_job_id() -> int:
    """A job id whose rendezvous port (29500 + id % 1000, as the script says) is free here."""
    import socket

    for port in range(29500 + os.getpid() % 500, 30500):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
        return 7000 + port - 29500
    pytest.skip("no free port in 29500-30499")


def sbatch(script: Path, home: Path, fake: Path, job: int, extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLOUDML_KILL", "SLURM_"))}
    env.update(
        PATH=f"{fake / 'bin'}{os.pathsep}{env['PATH']}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])),
        HOME=str(home),
        FAKE_SLURM=str(fake),
        SLURM_JOB_ID=str(job),
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_ON_NODE="1",
    )
    env.update(extra or {})
    return subprocess.Popen(
        ["bash", str(script)], cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_the_slurm_recipe_stops_at_the_time_limit_requeues_and_resumes_to_the_same_weights(
    two_machines, tmp_path
):
    config, uninterrupted, _ = two_machines
    home, fake = tmp_path / "home", tmp_path / "slurm"
    home.mkdir()
    (home / "my_flights.yaml").write_text(config.read_text())  # the script's CONFIG, in its folder
    stand_ins(fake)
    script = home / "cloudml.sbatch"
    script.write_text(batch_script())
    run, job = home / "runs" / "cbh1", free_port_job_id()
    # rank 0 halts after its 4th step (after the first checkpoint), so that the limit comes mid-run
    job_run = sbatch(script, home, fake, job, {"CLOUDML_KILL_AT": "step:4:SIGSTOP", "CLOUDML_KILL_RANK": "0"})
    deadline = time.monotonic() + 240
    while (halted := stopped_process(f"FAKE_SLURM={fake}")) is None:
        assert job_run.poll() is None and time.monotonic() < deadline, job_run.communicate()[0][-3000:]
        time.sleep(0.2)
    os.kill(job_run.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 sends 120 s before the limit
    time.sleep(2)  # the script passes SIGTERM on: srun, torchrun, the processes (rank 0's waits for it)
    os.kill(halted, signal.SIGCONT)
    out = job_run.communicate(timeout=300)[0]
    assert "time limit near: the run stops at a checkpoint" in out
    assert "training exited with 0" not in out and f"{run}: stopped (resumable)" in out, out[-3000:]
    assert (fake / "requeued").read_text().split() == [str(job)]  # the script put the job back
    assert read_meta(find_checkpoints(RunFolder(run))[0])["reason"] == "SIGTERM"
    # SLURM starts the requeued job: the same script, SLURM_RESTART_COUNT=1
    out = sbatch(script, home, fake, job, {"SLURM_RESTART_COUNT": "1"}).communicate(timeout=300)[0]
    assert "training exited with 0" in out and f"{run}: finished" in out, out[-3000:]
    assert (fake / "requeued").read_text().split() == [str(job)]  # not requeued again
    assert "Resumed from step" in (run / "train.log").read_text()
    a, b = weights(uninterrupted / "best.pt"), weights(run / "best.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # as if never interrupted
