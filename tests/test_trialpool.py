"""--parallel N (trialpool.py): a sweep's trials (or a cross-validation's folds) N at once on the CPU, each as
it would run alone; killed, a sweep leaves no trainer behind and continues from the trials' checkpoints; bad
values refused."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli, tiny_raw

from cloudml_lib.base.errors import ConfigError
from cloudml_lib.commands.trialpool import check_parallel
from cloudml_lib.core.machine.distributed import Dist

optuna = pytest.importorskip("optuna")
SPACE = {  # no pruner: which trials finished first must not change a trial's result
    "seed": 5,
    "params": {
        "train.learning_rate": {"low": 1.0e-3, "high": 1.0e-2, "log": True},
        "model.dropout": {"low": 0.0, "high": 0.3},
    },
}


@pytest.fixture(scope="module")
def files(tiny_flights, tmp_path_factory):
    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("psweep")
    raw = tiny_raw(root, entries, tmp / "cache")
    raw["checkpoint"] = {"every_steps": 3}
    raw["train"]["epochs"] = 3  # 21 steps a trial: time to kill two of them in their training
    cfg, space = tmp / "c.yaml", tmp / "space.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    space.write_text(yaml.safe_dump(SPACE))
    return cfg, space, tmp


def sweep_args(cfg, space, run_dir, trials=4, parallel=2) -> list:
    args = ["sweep", "--config", cfg, "--space", space, "--trials", trials, "--run-dir", run_dir]
    return [*map(str, args), "--parallel", str(parallel)]


def trials_of(run_dir) -> list:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run_dir / "study.journal"))
    )
    return optuna.load_study(study_name="cloudml-sweep", storage=storage).trials


def log_span(trial_dir: Path) -> tuple[float, float]:
    """When a trial's train.log began and ended (seconds)."""
    stamps = [line[:19] for line in (trial_dir / "train.log").read_text().splitlines() if line[:2] == "20"]
    return tuple(time.mktime(time.strptime(s, "%Y-%m-%d %H:%M:%S")) for s in (stamps[0], stamps[-1]))


@pytest.mark.slow
def test_two_trials_at_once_each_as_it_would_run_alone(files, tmp_path):
    cfg, space, _ = files
    run = tmp_path / "sweep"
    r = run_cli(*sweep_args(cfg, space, run), env={"TMPDIR": str(tmp_path)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 trials at once, one per process; each process uses 1 CPU thread(s)" in r.stdout
    trials = trials_of(run)
    assert [t.number for t in trials] == [0, 1, 2, 3] and all(t.state.name == "COMPLETE" for t in trials)
    assert all(math.isfinite(t.value) for t in trials) and len({t.value for t in trials}) == 4
    assert sorted(p.name for p in (run / "trials").iterdir()) == ["0", "1", "2", "3"]
    assert "| trials/3 | validation |" in (run / "report.md").read_text()
    (start0, end0), (start1, end1) = log_span(run / "trials" / "0"), log_span(run / "trials" / "1")
    assert start1 <= end0 and start0 <= end1  # trained at the same time
    for t in trials:
        info = json.loads((run / "trials" / str(t.number) / "trial.json").read_text())
        assert info["state"] == "complete" and info["value"] == t.value
    # the last trial alone, as a run of its values on one thread, gives its value
    last = trials[-1]
    sets = [a for k, v in last.params.items() for a in ("--set", f"{k}={v!r}")]
    alone = run_cli(
        "train", "--config", cfg, "--run-dir", tmp_path / "alone", *sets, env={"OMP_NUM_THREADS": "1"}
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    evaluation = json.loads((tmp_path / "alone" / "evaluation.json").read_text())
    assert evaluation["validation"]["pooled"]["mae_km"] == pytest.approx(last.value, rel=1e-6)


def descendants(pid: int) -> list[int]:
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += [int(child), *descendants(int(child))]
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


def started(trial_dir: Path) -> bool:
    """A committed checkpoint, and the trial still training."""
    return any(trial_dir.glob("checkpoints/*/COMMITTED")) and not (trial_dir / "evaluation.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from /proc")
def test_a_killed_parallel_sweep_leaves_no_trainer_and_resumes_its_trials(files, tmp_path):
    """The command's process SIGKILLed while trials 0 and 1 train (each past its first checkpoint): its
    workers die with it; the same command again resumes both from their checkpoints and finishes."""
    cfg, space, _ = files
    run = tmp_path / "sweep"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("CLOUDML_KILL_AT", None)
    with open(tmp_path / "first.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloudml_lib", *sweep_args(cfg, space, run)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.time() + 300
            while not all(started(run / "trials" / str(n)) for n in (0, 1)):
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "first.out").read_text()
                time.sleep(0.1)
            workers = descendants(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            deadline = time.time() + 10
            while any(alive(p) for p in workers) and time.time() < deadline:
                time.sleep(0.1)
            assert not [p for p in workers if alive(p)], "a worker outlived the killed sweep"
        finally:  # whatever failed, nothing of this sweep is left running
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(workers) >= 2
    again = run_cli(*sweep_args(cfg, space, run), env={"TMPDIR": str(tmp_path)}, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = trials_of(run)
    states = [(t.number, t.state.name, t.user_attrs) for t in trials]
    assert [s[:2] for s in states] == [(n, "COMPLETE") for n in range(4)], f"{states}\n{again.stdout[-3000:]}"
    for n in (0, 1):
        assert f"Trial {n} was interrupted: it resumes from its checkpoint" in again.stdout
        log = (run / "trials" / str(n) / "train.log").read_text()
        assert log.count("parameters, channels") == 2 and "Resumed from step" in log  # not from scratch
    for n in (2, 3):
        assert (run / "trials" / str(n) / "train.log").read_text().count("parameters, channels") == 1


@pytest.mark.slow
def test_a_frozen_worker_is_named_then_replaced_and_its_trial_resumes(files, tmp_path, monkeypatch):
    """One worker stops itself (SIGSTOP at its third step: what a hung read or driver call looks like from
    outside): the owner names it once it is quiet, then kills it, starts another, and the trial resumes from
    its checkpoint; the sweep ends with every trial complete. (The owner runs forked from this process: it
    keeps the short limits set here.)"""
    from cloudml_lib.commands import trialpool

    monkeypatch.setattr(trialpool, "IDLE_EVERY_S", 0.5)
    monkeypatch.setattr(trialpool, "QUIET_WARN_S", 4.0)
    monkeypatch.setattr(trialpool, "QUIET_STOP_S", 20.0)
    cfg, space, _ = files
    run = tmp_path / "sweep"
    env = {
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "CLOUDML_KILL_AT": "step:3:SIGSTOP",
        "CLOUDML_KILL_ONCE": str(tmp_path / "stopped-once"),
    }
    r = run_cli(*sweep_args(cfg, space, run, trials=2), env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "stopped-once").exists()
    said = (run / "train.log").read_text()  # the sweep's log
    # the frozen worker is the one stopped (past QUIET_STOP_S: 20 s, or a little more on a loaded machine); a
    # slow but live one (a worker starting on a loaded machine) may be named too, never stopped
    stops = re.findall(
        r"Worker (\d) \(process (\d+)\) made no progress on trial (\d) for (\d+) s: it was stopped and "
        r"a new worker started; trial \3 goes back in the queue and resumes from its checkpoint\.",
        said,
    )
    assert len(stops) == 1, said[-3000:]
    worker, pid, trial, quiet_s = stops[0]
    assert 20 <= int(quiet_s) < 60, said[-3000:]
    named = rf"Worker {worker} \(process {pid}\) has made no progress on trial {trial} for \d+ s"
    assert re.search(named, said[: said.index("it was stopped")]), said[-3000:]  # named before it was stopped
    assert not alive(int(pid))
    trials = trials_of(run)
    assert [t.number for t in trials] == [0, 1] and all(t.state.name == "COMPLETE" for t in trials)
    log = (run / "trials" / trial / "train.log").read_text()
    assert "Resumed from step 3" in log  # its checkpoint, committed before the stop


@pytest.mark.parametrize(
    "parallel,words",
    [(0, "--parallel 0: expected a whole number"), (2.5, "--parallel 2.5: expected"), (True, "expected")],
)
def test_a_bad_parallel_count_is_refused_naming_the_option(parallel, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        check_parallel(parallel, 4, "trials", "sweep")


def test_parallel_under_torchrun_is_refused_and_more_than_the_trials_is_cut(monkeypatch):
    with pytest.raises(ConfigError, match="--parallel 2 under torchrun .2 processes.: use one or the other"):
        check_parallel(2, 4, "trials", "sweep", Dist(0, 2))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="use one or the other"):
        check_parallel(2, 4, "trials", "sweep")
    assert check_parallel(1, 4, "trials", "sweep") == 1  # torchrun alone, as before
    monkeypatch.delenv("WORLD_SIZE")
    assert check_parallel(8, 3, "trials", "sweep") == 3


def test_the_cli_refuses_a_parallel_count_that_is_no_whole_number(tmp_path, capsys):
    from cloudml_lib.commands.cli import main

    for bad in ("two", "0", "-1"):
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "sweep",
                    "--config",
                    "x",
                    "--trials",
                    "2",
                    "--run-dir",
                    str(tmp_path / "s"),
                    "--parallel",
                    bad,
                ]
            )
        assert e.value.code == 2
        assert f"argument --parallel: {bad!r} is not a whole number >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_crossval_trains_two_folds_at_once_to_the_results_of_one_after_another(files, tmp_path):
    cfg, _, tmp = files
    raw = yaml.safe_load(cfg.read_text())
    raw["train"]["epochs"] = 1
    one_epoch = tmp_path / "c.yaml"
    one_epoch.write_text(yaml.safe_dump(raw))
    runs, said = {}, {}
    for parallel, env in ((2, {}), (1, {"OMP_NUM_THREADS": "1"})):  # one thread each, as the workers have
        run = tmp_path / f"cv{parallel}"
        args = ("crossval", "--config", one_epoch, "--run-dir", run, "--no-controls", "--parallel", parallel)
        r = run_cli(*args, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[parallel], said[parallel] = json.loads((run / "crossval.json").read_text())["folds"], r.stdout
    assert "2 folds at once, one per process; each process uses 1 CPU thread(s)" in said[2]
    assert "folds at once" not in said[1]
    assert sorted(runs[2]) == sorted(runs[1]) and len(runs[2]) == 3
    for name in runs[1]:
        assert runs[2][name]["model"] == pytest.approx(runs[1][name]["model"], rel=1e-6)
