"""Sweeps (sweep.py, space.py): the search space refused before any work when wrong, a sweep killed at
any moment continuing to the very study an uninterrupted one ends with, the report and `compare`."""

import json
import signal
from pathlib import Path

import pytest
import yaml
from conftest import REPO, assert_reads_back, run_cli, tiny_raw

from cloudml_lib.base.errors import ConfigError
from cloudml_lib.commands.space import build_space
from cloudml_lib.core.run.folder import RunFolder

optuna = pytest.importorskip("optuna")
SPACE = {
    "pruner": "median",
    "prune_startup_trials": 1,
    "prune_after_epochs": 1,
    "seed": 3,
    "params": {
        "train.learning_rate": {"low": 1.0e-3, "high": 1.0e-2, "log": True},
        "model.dropout": {"low": 0.0, "high": 0.3},
    },
}


@pytest.fixture(scope="module")
def files(tiny_flights, tmp_path_factory):
    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("sweep")
    raw = tiny_raw(root, entries, tmp / "cache")
    raw["checkpoint"] = {"every_steps": 3}
    raw["train"]["epochs"] = 3  # 7 steps each; pruning may stop a trial after epoch 1 or 2
    cfg, space = tmp / "c.yaml", tmp / "space.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    space.write_text(yaml.safe_dump(SPACE))
    return cfg, space, tmp, raw


def sweep_cli(cfg, space, run_dir, trials=3, kill_at=None, tmpdir=None, *extra):
    env = {}
    if kill_at:
        env["CLOUDML_KILL_AT"] = kill_at
    if tmpdir:  # the "local disk" of the machine: another one is a new VM
        Path(tmpdir).mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    args = ("sweep", "--config", cfg, "--space", space, "--trials", trials, "--run-dir", run_dir, *extra)
    return run_cli(*args, env=env, timeout=600)


def study_of(run_dir) -> list[tuple]:
    """What a study holds, without the clock: each trial's number, state, values, result and epoch reports."""
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run_dir / "study.journal"))
    )
    study = optuna.load_study(study_name="cloudml-sweep", storage=storage)
    return [
        (t.number, t.state.name, t.params, t.value, t.intermediate_values, t.user_attrs) for t in study.trials
    ]


@pytest.fixture(scope="module")
def reference(files):
    cfg, space, tmp, _ = files
    run = tmp / "reference"
    r = sweep_cli(cfg, space, run, tmpdir=tmp / "vm0")
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.slow
def test_an_uninterrupted_sweep(reference):
    trials = study_of(reference)
    assert [t[0] for t in trials] == [0, 1, 2]
    assert trials[0][1] == "COMPLETE" and 0 < trials[0][3] < 2  # mae_km of the trial's validation data
    first = json.loads((reference / "trials" / "0" / "evaluation.json").read_text())
    assert trials[0][3] == first["validation"]["pooled"]["mae_km"] != first["overall"]["mae_km"]
    assert all(set(t[2]) == {"train.learning_rate", "model.dropout"} for t in trials)
    assert len({t[2]["train.learning_rate"] for t in trials}) == 3  # three different draws
    assert all(sorted(t[4]) == [1, 2, 3] for t in trials if t[1] == "COMPLETE")  # one report per epoch
    assert [t[1] for t in trials].count("PRUNED") >= 1  # the kill tests replay a pruning too
    assert all(max(t[4]) < 3 for t in trials if t[1] == "PRUNED")  # never after the last epoch
    for n in range(3):
        info = json.loads((reference / "trials" / str(n) / "trial.json").read_text())
        assert info["params"] == trials[n][2] and info["state"] == trials[n][1].lower().replace(
            "fail", "failed"
        )
        assert (reference / "trials" / str(n) / "checkpoints").is_dir()  # an ordinary resumable run


@pytest.mark.slow
def test_every_file_a_sweep_writes_reads_back(reference):
    """What sweep writes (sweep.json, each trial's trial.json and run files), its readers take."""
    read = assert_reads_back(reference)
    assert "sweep.json" in read and {f"trials/{n}/trial.json" for n in range(3)} <= set(read)


@pytest.mark.parametrize(
    "kill_at,new_machine", [("step:26", False), ("step:26", True), ("sweep-told:2", True)]
)
@pytest.mark.slow
def test_a_killed_sweep_continues_to_the_same_study(files, reference, tmp_path, kill_at, new_machine):
    """Killed in trial 1's training (its 5th step) or right after trial 1's result was told, before the copy
    on "Drive" was refreshed; then run again on the same machine or on a new one (no local study)."""
    import shutil

    cfg, space, _, _ = files
    run = tmp_path / "sweep"
    killed = sweep_cli(cfg, space, run, kill_at=kill_at, tmpdir=tmp_path / "vm1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shutil.copytree(run, tmp_path / "as_killed", symlinks=True)
    again = sweep_cli(cfg, space, run, tmpdir=tmp_path / ("vm2" if new_machine else "vm1"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert study_of(run) == study_of(reference)
    if not new_machine and kill_at.startswith("step"):
        # the folder put back as the kill left it, at the same path, on the machine whose own journal went on
        # to the end: that journal is not this folder's any more (it was taken, and trial 1 never finished)
        shutil.rmtree(run)
        shutil.copytree(tmp_path / "as_killed", run, symlinks=True)
        put_back = sweep_cli(cfg, space, run, tmpdir=tmp_path / "vm1")
        assert put_back.returncode == 0, put_back.stderr[-3000:]
        assert "not the copy this machine saved last" in put_back.stderr + put_back.stdout
        assert "Trial 1 was interrupted: it resumes from its checkpoint" in put_back.stdout
        assert study_of(run) == study_of(reference)
        ends = [json.loads((r / "trials/1/trial.json").read_text())["state"] for r in (run, reference)]
        assert ends[0] == ends[1] != "running"
    log1 = (run / "trials" / "1" / "train.log").read_text()
    assert log1.count("parameters, channels") == 2 if kill_at.startswith("step") else 1  # one resumed start
    if kill_at.startswith("step"):
        assert "Trial 1 was interrupted: it resumes from its checkpoint" in again.stdout
        assert "Resumed from step 3" in log1  # not restarted
    assert (run / "trials" / "0" / "train.log").read_text().count("parameters, channels") == 1  # never rerun
    if new_machine:
        assert "Study restored from" in again.stdout


@pytest.mark.slow
def test_more_trials_continue_a_finished_sweep_and_the_same_count_does_nothing(files, reference, tmp_path):
    cfg, space, _, _ = files
    import shutil

    run = tmp_path / "sweep"
    shutil.copytree(reference, run)
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm")
    assert r.returncode == 0 and "Trial" not in r.stdout.replace("best: trial", "")
    r = sweep_cli(cfg, space, run, 4, None, tmp_path / "vm")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [t[0] for t in study_of(run)] == [0, 1, 2, 3] and study_of(run)[:3] == study_of(reference)


COMPARE_HEADER = (
    "| run | scored on | R2 | MAE (km) | RMSE (km) | bias (km) | n | MAE skill vs best baseline "
    "| frames beyond the atmosphere | state | epochs | time (min) | compiled "
    "| "
    "model.dropout | train.learning_rate |"
)


@pytest.mark.slow
def test_report_and_compare(files, tmp_path):
    """Four trials without pruning: the report's table and Optuna's two plots; compare's table."""
    cfg, _, tmp, _ = files
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(dict(SPACE, pruner="none", seed=1)))
    run = tmp_path / "sweep"
    r = sweep_cli(cfg, space, run, 4, None, tmp_path / "vm")
    assert r.returncode == 0, r.stderr[-2000:]
    report = (run / "report.md").read_text()
    # the metrics first, then the swept settings only: no bookkeeping setting counts as "differing"
    assert COMPARE_HEADER in report
    assert report.count("| trials/") == 4 and "4 trial(s), 4 finished, 0 pruned" in report
    for png in ("optimization_history.png", "param_importances.png"):
        assert f"(plots/{png})" in report and (run / "plots" / png).stat().st_size > 5000
    best = min(study_of(run), key=lambda t: t[3])
    assert f"Best: trial {best[0] + 1} (trials/{best[0]}), MAE (km) {best[3]:.4g}" in report
    assert "Objective: MAE (km) (mae_km), lower is better, on the trials' validation data" in report
    assert "Verdict on the best trial: " in report  # judged as a run is: against the training mean
    assert report.count("The best trial's test score, reported once") == 1  # the only test score shown
    assert "on the trials' validation data (never a test flight)" in report
    out = run_cli("compare", run, run / "trials" / "0")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == COMPARE_HEADER and sum(line.startswith("| ") for line in lines) == 6  # header, 5 rows
    # the trials' validation scores beside a run's test score: said to be other data
    assert [line.split(" | ")[1] for line in lines[2:6]] == ["validation"] * 4
    assert "The metrics were measured on different data" in out.stdout
    rows = json.loads(run_cli("compare", run, "--json").stdout)
    assert [r["metrics"]["mae_km"] for r in rows] == pytest.approx([t[3] for t in study_of(run)])
    assert all(r["epochs"] == "3/3" and r["compiled"] == "no" and r["state"] == "finished" for r in rows)


def test_a_new_sweep_cannot_choose_its_best_trial_on_the_test_flights(files, tmp_path):
    cfg, _, _, _ = files
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(dict(SPACE, objective="held_out")))
    r = sweep_cli(cfg, space, tmp_path / "sweep", 1)
    assert r.returncode == 2 and "objective: held_out chose the best trial on the test flights" in r.stderr
    assert not (tmp_path / "sweep" / "trials").exists()


def test_compare_refuses_a_folder_without_runs(tmp_path):
    r = run_cli("compare", tmp_path)
    assert r.returncode == 2 and "holds no run, cross-validation or sweep" in r.stderr


@pytest.mark.parametrize(
    "space,words",
    [
        ({"params": {"train.learnin_rate": {"low": 0.1, "high": 1}}}, "did you mean 'train.learning_rate'"),
        (
            {"params": {"train.learning_rate": {"low": 0.1, "high": 0.01}}},
            "low (0.1) must be below high (0.01)",
        ),
        (
            {"params": {"train.learning_rate": {"low": 0.0, "high": 0.01, "log": True}}},
            "a log range needs low > 0",
        ),
        (
            {"params": {"data.temporal_frames": {"choices": [3, 4]}}},
            "params.data.temporal_frames: the value 4 is not "
            "valid with this config (data.temporal_frames: 4 is even",
        ),
        ({"params": {"model.dropout": {"low": 0.0, "high": 1.5}}}, "the value 1.5 is not valid"),
        (
            {"params": {"train.epochs": {"low": 1.5, "high": 3}}},
            "is an integer, so low and high must be integers",
        ),
        ({"params": {"model.cloud_head": {"low": 1, "high": 2}}}, "is not a number, so it takes choices"),
        ({"params": {"data.dir": {"choices": ["a", "b"]}}}, "cannot be swept"),
        ({"params": {"model.dropout": {"low": 0.0, "high": 0.5, "steps": 0.1}}}, "unknown steps"),
        (
            {"objective": "crossval", "pruner": "median", "params": {"model.dropout": {"choices": [0.0]}}},
            "use pruner: none with objective: crossval",
        ),
        (
            {"metrc": "r2", "params": {"model.dropout": {"choices": [0.0]}}},
            "metrc: unknown key; did you mean 'metric'",
        ),
        (
            {"metric": "loss", "params": {"model.dropout": {"choices": [0.0]}}},
            "choose one of mae_km, rmse_km, r2",
        ),
        ({}, "params: expected a mapping of config keys"),
        (
            {"seed": 2**32, "params": {"model.dropout": {"choices": [0.0]}}},
            "seed: expected a whole number from 0",
        ),
        (
            {"params": {"model.dropout": {"low": 0.0, "high": 0.2, "step": 0.5}}},
            "step: 0.5 is larger than the range 0.0..0.2",
        ),
        (
            {"params": {"model.dropout": {"low": 0.0, "high": 0.25, "step": 0.1}}},
            "high (0.25) is not reached from low (0.0) in steps of 0.1; use high: 0.2",
        ),
        ({"params": {"train.epochs": {"low": 1, "high": 4, "step": 2}}}, "use high: 3"),
    ],
)
def test_a_bad_space_is_refused_naming_the_key(files, space, words):
    with pytest.raises(ConfigError) as e:
        build_space(space, files[3])
    assert words in str(e.value)


def test_an_integer_range_of_any_size_is_checked_without_listing_it(files):
    """train.seed's own range (2**31 values): a list of it would be 17 GB; its ends are checked."""
    space = build_space({"params": {"train.seed": {"low": 0, "high": 2**31 - 1}}}, files[3])
    assert space.params["train.seed"]["high"] == 2**31 - 1


def test_seeds_past_the_samplers_limit_are_refused_before_any_work(files, tmp_path):
    cfg, _, _, _ = files
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(dict(SPACE, seed=2**32 - 2)))
    r = sweep_cli(cfg, space, tmp_path / "sweep", 3)
    assert r.returncode == 2 and f"seed {2**32 - 2} with --trials 3" in r.stderr
    assert f"choose seed <= {2**32 - 3}" in r.stderr and not (tmp_path / "sweep").exists()


def test_a_trial_count_no_sweep_can_reach_is_refused_without_seed_advice(files):
    """--trials 10**20: no seed can help (it advised "choose seed <= 0")."""
    from cloudml_lib.commands.sweep import check_trials

    space = build_space(SPACE, files[3])
    with pytest.raises(ConfigError) as e:
        check_trials(10**20, space)
    assert "--trials 100000000000000000000: more trials than a sweep can run" in str(e.value)
    assert "seed" not in str(e.value).split("(")[0] and "choose seed" not in str(e.value)
    check_trials(2**32 - SPACE.get("seed", 0), space)  # the most there can be: accepted


@pytest.mark.parametrize("listed", [True, False])
def test_a_flight_name_that_is_no_flight_is_refused_before_any_trial(files, tmp_path, listed):
    """With data.flights listed the space's values are checked against the list; with the flights found
    in data.dir (data.flights empty), against the flights found."""
    cfg, _, _, raw = files
    if not listed:
        raw = {**raw, "data": {k: v for k, v in raw["data"].items() if k != "flights"}}
        cfg = tmp_path / "found.yaml"
        cfg.write_text(yaml.safe_dump(raw))
    space = tmp_path / "space.yaml"
    space.write_text(
        yaml.safe_dump({"params": {"data.overweight_flight": {"choices": ["", "nosuchflight"]}}})
    )
    r = sweep_cli(cfg, space, tmp_path / "sweep", 2)
    said = (
        "'nosuchflight' not in data.flights"
        if listed
        else "params.data.overweight_flight: ['nosuchflight'] is not among the flights"
    )
    assert r.returncode == 2 and said in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_a_trial_that_cannot_start_fails_with_its_reason_and_the_sweep_goes_on(files, tmp_path):
    """A batch larger than the training set passes the space check (it needs the data) and is refused at
    the trial's set-up: that trial is failed, with the reason in trial.json, status and the report, and
    the sweep goes on; run again, nothing runs twice."""
    cfg, _, _, _ = files
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"seed": 0, "params": {"train.batch_size": {"choices": [4000, 4]}}}))
    run = tmp_path / "sweep"
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm")
    assert run.is_dir(), r.stderr[-2000:]
    states = [t[1] for t in study_of(run)]
    assert "RUNNING" not in states and "FAIL" in states and "COMPLETE" in states, (states, r.stderr[-2000:])
    assert r.returncode == 0, r.stderr[-2000:]
    failed = next(n for n, state in enumerate(states) if state == "FAIL")
    info = json.loads((run / "trials" / str(failed) / "trial.json").read_text())
    assert info["state"] == "failed" and "train.batch_size 4000" in info["note"]
    assert "larger than the training set" in (run / "report.md").read_text()
    status = run_cli("status", run)
    assert f"trials/{failed}: failed: train.batch_size 4000" in status.stdout
    again = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm")
    assert again.returncode == 0 and "Trial" not in again.stdout.replace("best: trial", "")
    assert [t[1] for t in study_of(run)] == states


@pytest.mark.slow
def test_a_full_disk_stops_the_sweep_and_the_trial_resumes_when_run_again(files, tmp_path, monkeypatch):
    """Checkpoints that cannot be written (a full disk) stop the sweep with the trial left to resume, never
    failed for good: once there is space, the same command trains it on from its last checkpoint."""
    import errno

    from cloudml_lib.core.run import checkpoint

    cfg, space, _, _ = files
    run, real = tmp_path / "sweep", checkpoint.commit

    def full(state, meta, run_dir, local_dir):
        if Path(run_dir).name == "0" and meta["step"] > 3:  # trial 0, after its first checkpoint
            raise OSError(errno.ENOSPC, "No space left on device", str(run_dir))
        return real(state, meta, run_dir, local_dir)

    monkeypatch.setattr(checkpoint, "commit", full)
    r = sweep_cli(cfg, space, run, 2, None, tmp_path / "vm")
    assert r.returncode == 2 and "3 checkpoints in a row could not be written" in r.stderr, r.stderr[-2000:]
    assert [t[1] for t in study_of(run)] == ["RUNNING"]  # not failed: it resumes
    monkeypatch.setattr(checkpoint, "commit", real)  # space freed
    again = sweep_cli(cfg, space, run, 2, None, tmp_path / "vm")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Trial 0 was interrupted: it resumes from its checkpoint" in again.stdout
    states = [t[1] for t in study_of(run)]
    assert states[0] == "COMPLETE" and states[1] in ("COMPLETE", "PRUNED")  # the space's pruner may stop 1
    assert "Resumed from step 3" in (run / "trials" / "0" / "train.log").read_text()


@pytest.mark.slow
def test_a_trial_an_earlier_release_failed_for_a_full_disk_is_trained_again(files, reference, tmp_path):
    """An earlier release failed a trial for good when its checkpoints could not be written (a full disk), and
    running the sweep again did not retrain it. Now the same command trains it again, as a new trial with
    the same values that does not count towards --trials, once; a trial failed for its values stays failed."""
    from conftest import same_folder_at

    from cloudml_lib.base import ledger

    cfg, space, _, _ = files
    run = same_folder_at(reference, tmp_path / "sweep")
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run / "study.journal"))
    )
    study = optuna.load_study(study_name="cloudml-sweep", storage=storage)
    first = study.trials[0]
    full = (
        "3 checkpoints in a row could not be written to trials/3/checkpoints (OSError: [Errno 28] No space "
        "left on device). Training stops so that no more work goes unsaved."
    )
    for note in (full, "train.batch_size 4000 is larger than the training set"):
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.FAIL,
                params=first.params,
                distributions=first.distributions,
                user_attrs={"note": note},
            )
        )
    ledger.add(run / "study.journal", content=run / "study.journal")  # as that release's sweep wrote it
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm")
    assert r.returncode == 0, r.stderr[-2000:]
    said = r.stdout + r.stderr
    assert "Trial 3 failed in an earlier run for a cause that passes ('3 checkpoints in a row" in said, said
    assert "Trial 5 (an earlier trial's values, trained again)" in said
    assert "Trial 4 failed" not in said
    trials = study_of(run)
    assert trials[:3] == study_of(reference)  # the trials that count were done: none trained again
    assert [t[1] for t in trials[3:5]] == ["FAIL", "FAIL"] and trials[5][1] in ("COMPLETE", "PRUNED")
    assert trials[5][2] == first.params and trials[5][5]["retry_of"] == 3
    again = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm")  # trained again once, not at every start
    assert again.returncode == 0 and "failed in an earlier run" not in again.stdout + again.stderr
    assert len(study_of(run)) == 6


def test_a_sweep_whose_every_trial_fails_finishes_and_says_why(files, tmp_path):
    cfg, _, _, _ = files
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"params": {"train.batch_size": {"choices": [4000]}}}))
    run = tmp_path / "sweep"
    r = sweep_cli(cfg, space, run, 2, None, tmp_path / "vm")
    assert (
        r.returncode == 2 and "none of the 2 trial(s) could run; trial 0: train.batch_size 4000" in r.stderr
    )
    assert [t[1] for t in study_of(run)] == ["FAIL", "FAIL"]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_lost_or_damaged_journal_is_refused_and_rebuilt_only_when_asked(files, reference, tmp_path):
    """Deleted, emptied or damaged, study.journal is refused with what to do (nothing changed); with
    --rebuild-study the study is rebuilt from the trial folders, the very study the sweep had."""
    import shutil

    cfg, space, _, _ = files
    run = tmp_path / "sweep"
    shutil.copytree(reference, run)
    journal = run / "study.journal"
    good = journal.read_bytes()
    lines = good.split(b"\n")
    for n, damage in enumerate([None, b"", b"\n".join([lines[0], b"{oops", *lines[1:]])]):
        journal.unlink(missing_ok=True)
        if damage is not None:
            journal.write_bytes(damage)
        r = sweep_cli(cfg, space, run, 3, None, tmp_path / f"vm{n}")  # a new machine: no local journal
        assert r.returncode == 2 and str(journal) in r.stderr and "--rebuild-study" in r.stderr, r.stderr
        assert ["missing", "empty", "line 2 is not an Optuna journal record"][n] in r.stderr
        assert sorted(p.name for p in (run / "trials").iterdir()) == ["0", "1", "2"]  # nothing ran
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm9", "--rebuild-study")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Study rebuilt from 3 trial folder(s)" in r.stdout + r.stderr
    assert study_of(run) == study_of(reference)
    # the damaged journal was CloudML's, changed since: kept as it was, under another name, and said
    assert (run / "study.journal.kept-1").read_bytes() == damage
    assert (
        f"{journal} was changed after CloudML wrote it (damaged, or edited): it is kept"
        in r.stdout + r.stderr
    )


@pytest.mark.slow
def test_stray_trial_folders_and_a_torn_journal_line_never_make_trials(files, reference, tmp_path):
    """--rebuild-study with a stray trials/999999999 looped for ever (a failed trial per missing number),
    trials/60 added 58 phantom trials; a journal whose last line a kill cut was accepted, then broke Optuna's
    reader. The strays are named and left as they are; the cut line is left out, the study is the same."""
    import shutil

    cfg, space, _, _ = files
    run = tmp_path / "sweep"
    shutil.copytree(reference, run)
    for number in ("999999999", "60"):
        (run / "trials" / number).mkdir()
        (run / "trials" / number / "notes.txt").write_text("the user's\n")
    (run / "study.journal").unlink()
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm1", "--rebuild-study")
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert "Study rebuilt from 3 trial folder(s)" in said and "999999999" in said and "60" in said
    assert study_of(run) == study_of(reference)  # no phantom trial
    for number in ("999999999", "60"):
        assert (run / "trials" / number / "notes.txt").read_text() == "the user's\n"
    with open(run / "study.journal", "ab") as f:
        f.write(b'{"op_code": 5, "worker_id": "x", "trial_id": 1')  # a write cut by a kill: no newline
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ends in a line cut by an interruption" in r.stdout + r.stderr
    assert study_of(run) == study_of(reference)
    assert (run / "study.journal.kept-1").read_bytes().endswith(b'"trial_id": 1')  # the cut copy, kept


def test_a_damaged_sweep_json_is_refused_naming_it(files, reference, tmp_path):
    import shutil

    cfg, space, _, _ = files
    run = tmp_path / "sweep"
    shutil.copytree(reference, run)
    (run / "sweep.json").write_text('{"config": [], "space": 1}')
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm")
    assert (
        r.returncode == 2 and f"damaged: {run / 'sweep.json'} (" in r.stderr and "Traceback" not in r.stderr
    )


def test_a_bad_space_is_refused_before_any_work(files, tmp_path):
    cfg, _, _, _ = files
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  train.learning_rate: {low: 1, high: 0.1}\n")
    r = sweep_cli(cfg, space, tmp_path / "sweep")
    assert r.returncode == 2 and "low (1) must be below high (0.1)" in r.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_folder_keeps_its_space_and_is_not_a_run(files, reference, tmp_path):
    cfg, _, _, _ = files
    other = tmp_path / "space.yaml"
    other.write_text(yaml.safe_dump(dict(SPACE, seed=4)))
    r = sweep_cli(cfg, other, reference)
    assert (
        r.returncode == 2 and "space.seed (sweep 3, now 4)" in r.stderr and "Nothing was changed" in r.stderr
    )
    r = sweep_cli(cfg, other, reference / "trials" / "0")
    assert r.returncode == 2 and "is CloudML's run folder, not a sweep folder" in r.stderr


def test_without_optuna_the_sweep_says_how_to_install_it(files, tmp_path, monkeypatch):
    import builtins

    from cloudml_lib.commands import sweep as sweep_module

    real = builtins.__import__

    def no_optuna(name, *a, **k):
        if name == "optuna":
            raise ImportError("No module named 'optuna'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_optuna)
    cfg, space, _, _ = files
    with pytest.raises(ConfigError, match="pip install 'optuna>=4.0'"):
        sweep_module.sweep(cfg, space, 2, RunFolder(tmp_path / "sweep"))
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_space_is_valid_for_the_demo(path):
    from cloudml_lib.base.yamlfile import read_yaml
    from cloudml_lib.commands.space import load_space

    space = load_space(path, read_yaml(REPO / "configs" / "demo.yaml"))
    assert space.params and space.direction in ("minimize", "maximize")


def test_a_run_command_on_a_sweep_folder_points_at_its_trials(files, reference):
    cfg, _, _, _ = files
    r = run_cli("train", "--config", cfg, "--run-dir", reference)
    assert (
        r.returncode == 2 and "is a sweep folder" in r.stderr and str(reference / "trials" / "0") in r.stderr
    )
    r = sweep_cli(cfg, files[1], reference, 0)
    assert r.returncode == 2 and "--trials 0: expected a whole number of trials >= 1" in r.stderr


@pytest.mark.slow
def test_a_crossval_objective_scores_each_trial_by_its_folds(files, tmp_path):
    cfg, _, _, _ = files
    space = tmp_path / "space.yaml"
    space.write_text(
        yaml.safe_dump(
            {"objective": "crossval", "metric": "r2", "params": {"model.dropout": {"choices": [0.0, 0.2]}}}
        )
    )
    run = tmp_path / "sweep"
    r = sweep_cli(cfg, space, run, 2, None, tmp_path / "vm")
    assert r.returncode == 0, r.stderr[-2000:]
    for number, state, _, value, _, _ in study_of(run):
        result = json.loads((run / "trials" / str(number) / "crossval.json").read_text())
        # the mean of the folds' validation scores (nested): never a fold's test flight
        inner = [fold["validation"]["r2"] for fold in result["folds"].values()]
        assert state == "COMPLETE" and value == pytest.approx(sum(inner) / len(inner))
        assert value != pytest.approx(result["summary"]["model"]["r2"]["mean"])
        assert (
            len(list((run / "trials" / str(number) / "folds").iterdir())) == 3
        )  # every flight the test flight once
    rows = json.loads(run_cli("compare", run, "--json").stdout)
    assert [r["epochs"] for r in rows] == ["3 folds", "3 folds"]
    assert (
        "Objective: R2 (r2), higher is better, on the nested folds' validation data (the mean over folds)"
        in (run / "report.md").read_text()
    )


def test_status_of_a_sweep_is_its_trials_table(reference):
    r = run_cli("status", reference)
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "/trials/" in line]
    assert r.returncode == 0 and len(rows) == 3 and "| state |" in r.stdout
    pruned = [line for line in rows if "| pruned |" in line]
    assert pruned and "was worse than the median" in r.stdout  # why each pruned trial stopped, in words
    # a pruned trial shows its last epoch's scores, which are the validation data's: never called a test's
    assert all(line.split("|")[2].strip() == "validation" for line in pruned)


def test_a_sweep_whose_flights_moved_continues(files, reference, tiny_flights, tmp_path):
    """A sweep whose data folder moved (a Drive folder renamed) was refused as "a sweep with other settings":
    a location is no setting. Another setting still is."""
    import shutil

    cfg, space, _, raw = files
    run = tmp_path / "sweep"
    shutil.copytree(reference, run)
    moved = tmp_path / "moved_flights"
    shutil.copytree(tiny_flights[0], moved)
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm", "--set", f"data.dir={moved}")
    said = r.stdout + r.stderr
    assert r.returncode == 0 and "other settings" not in said, said[-3000:]
    assert "data.dir moved since it started" in said, said[-3000:]
    assert study_of(run) == study_of(reference)
    r = sweep_cli(cfg, space, run, 3, None, tmp_path / "vm", "--set", "train.weight_decay=0.5")
    assert r.returncode == 2 and "a sweep with other settings: config.train.weight_decay" in r.stderr, (
        r.stderr
    )
