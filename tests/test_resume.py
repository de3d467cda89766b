"""Preemption: SIGKILL at any moment, resume, and end bit-identical to a run never interrupted."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_cli, same_folder_at, tiny_raw

from cloudml_lib.core.run.checkpoint import COMMITTED, STATE, find_checkpoints, read_meta, step_of
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import WHOLE_WRITES
from cloudml_lib.core.run.status import run_state

MEASURED_KEYS = {"samples_per_s", "time_s", "time", "memory"}  # the machine, not the math


@pytest.fixture(scope="module")
def setup(tiny_flights, tmp_path_factory):
    """A tiny config that checkpoints every 3 steps over 3 epochs, and its uninterrupted reference run."""
    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("resume")
    raw = tiny_raw(root, entries, tmp / "cache")
    raw["train"].update(epochs=3, log_every_steps=1)
    raw["checkpoint"] = {"every_steps": 3, "keep_last": 2}
    cfg = tmp / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    ref = tmp / "reference"
    r = train(cfg, ref)
    assert r.returncode == 0, r.stderr
    return cfg, ref, tmp


@pytest.fixture(scope="module")
def killed(setup):
    """killed(point, run): a copy at `run` of the reference config's run killed by SIGKILL at `point` (a
    fault point of CLOUDML_KILL_AT), killed once for the module and copied for each test that resumes or
    damages it."""
    cfg, _, tmp = setup
    made = {}

    def copy(point: str, run: Path) -> Path:
        if point not in made:
            made[point] = tmp / f"killed-{point.replace(':', '-')}"
            r = train(cfg, made[point], kill_at=point)
            assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
        return same_folder_at(made[point], run)

    return copy


def train(cfg, run_dir, *extra, kill_at=None, env=None):
    env = dict(env or {}, **({"CLOUDML_KILL_AT": kill_at} if kill_at else {})) or None
    return run_cli("train", "--config", cfg, "--run-dir", run_dir, *extra, env=env)


def newest_committed(run_dir):
    """The newest whole checkpoint: a write the kill interrupted may sit above it, uncommitted."""
    return next(p for p in find_checkpoints(RunFolder(run_dir)) if (p / COMMITTED).is_file())


def final_state(run_dir):
    newest = find_checkpoints(RunFolder(run_dir))[0]
    assert read_meta(newest)["finished"]
    return torch.load(newest / STATE, weights_only=True)


def metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in MEASURED_KEYS} for r in rows]


def tensorboard_scalars(run_dir):
    """{tag: [(step, value), ...]} as TensorBoard shows them (purges applied), measured tags left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
        if not tag.endswith(("samples_per_s", "time_s"))
    }


def assert_same_run(run_dir, ref):
    a, b = final_state(run_dir), final_state(ref)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k, v in b["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(a["optimizer"]["state"][k][name], t), (k, name)
    best_a = torch.load(Path(run_dir) / "best.pt", weights_only=True)["model"]
    best_b = torch.load(Path(ref) / "best.pt", weights_only=True)["model"]
    assert int(best_b["cloud_fitted"]) == 1 and best_b["cloud.weight"].abs().sum() > 0  # the cloud probe too
    assert best_a.keys() == best_b.keys()
    differ = {k: float((best_a[k].double() - best_b[k].double()).abs().max()) for k in best_b}
    assert not any(differ.values()) and all(torch.equal(best_a[k], best_b[k]) for k in best_b), {
        k: d for k, d in differ.items() if d
    }
    assert metrics(run_dir) == metrics(ref)
    evaluations = [json.loads((Path(d) / "evaluation.json").read_text()) for d in (run_dir, ref)]
    assert evaluations[0] == evaluations[1]  # the end of the run, killed or not, writes the same
    # TensorBoard's curves: one value per step, the very values of the run never interrupted
    curves, ref_curves = tensorboard_scalars(run_dir), tensorboard_scalars(ref)
    assert {"train/loss", "val/mae_km", "epoch/lr", "final/mae_km"} <= set(ref_curves)
    assert curves == ref_curves


# Saves every 3 steps, written in the background: step 2 comes before any save; from step 7 on, the step-6
# save has waited for the step-3 one to commit; the commit-* points kill inside the 2nd and 3rd commits.
# probe-fitted: the run trained (its final checkpoint written), its end killed with the cloud probe written
# into best.pt; end-written: killed with every file of the end written but evaluation.json.
@pytest.mark.parametrize(
    "kill_at",
    ["step:2", "step:7", "step:8", "commit-copied:2", "commit-renamed:3", "probe-fitted:1", "end-written:1"],
)
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(setup, killed, tmp_path, kill_at):
    cfg, ref, _ = setup
    run = killed(kill_at, tmp_path / "run")
    assert not (run / "evaluation.json").exists()
    if kill_at.startswith(("probe", "end")):  # trained: its end pending, a state of its own, said alike
        from cloudml_lib.commands.compare import run_row
        from cloudml_lib.core.run.status import format_status, run_status

        pending = "trained, end pending (not evaluated yet)"
        assert run_state(RunFolder(run)).words == pending
        assert run_row(RunFolder(run), "run")["state"].startswith(pending)
        assert format_status(run_status(RunFolder(run))).startswith(f"{run}: {pending}: 3 of 3 epochs")
    resumed = train(cfg, run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert ("Resumed from step" in resumed.stdout) == (kill_at != "step:2")
    if kill_at.startswith("commit-renamed"):
        assert "rejected 1 checkpoint(s)" in resumed.stdout and "not committed" in resumed.stdout
    # an end killed after its probe was fitted keeps that probe (fitted once): no second pass over the flights
    kept = "Cloud / no-cloud output: the one fitted for step 21, kept from"
    assert (kept in resumed.stdout) == kill_at.startswith(("probe", "end")), resumed.stdout[-3000:]
    assert_same_run(run, ref)


@pytest.mark.slow
def test_deterministic_switch_runs_and_changes_nothing_on_the_cpu(setup, tmp_path):
    """train.deterministic sets torch's deterministic algorithms for real (the log says so); on the CPU a
    run is deterministic anyway: killed and resumed with the switch on, it equals the reference bit for
    bit."""
    cfg, ref, _ = setup
    run = tmp_path / "run"
    switched = ("--set", "train.deterministic=true")
    assert train(cfg, run, *switched, kill_at="step:7").returncode == -signal.SIGKILL
    resumed = train(cfg, run, *switched)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = "Deterministic algorithms (train.deterministic): on (on the CPU it changes nothing"
    assert said in resumed.stdout + resumed.stderr
    # the run, in this process, put torch's switches back at its end: a later run or test here is not
    # deterministic behind its log's back (CI's failure of test_hardware after this test on one worker)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert_same_run(run, ref)


@pytest.mark.slow
def test_killed_twice_still_bit_identical(setup, tmp_path):
    cfg, ref, _ = setup
    run = tmp_path / "run"
    first = {"step_s": 0.5, "epoch_s": 3.5, "total_s": 10.5, "source": "measured here", "device": "CPU"}
    expected = {"CLOUDML_EXPECTED": json.dumps(first)}
    # each start killed once its first checkpoint is whole (a kill at a step may come before the background
    # writer commits the checkpoint of a step before it: that start would leave nothing to resume)
    assert train(cfg, run, kill_at="committed:1", env=expected).returncode == -signal.SIGKILL
    assert train(cfg, run, kill_at="committed:1").returncode == -signal.SIGKILL
    assert (
        train(cfg, run, env=dict(expected, CLOUDML_EXPECTED=json.dumps(dict(first, step_s=9.0)))).returncode
        == 0
    )
    # run.json keeps each start's figures: the first expected time stays, every epoch's time is counted
    info = json.loads((run / "run.json").read_text())
    assert [s["start_step"] for s in info["segments"]][0] == 0 and len(info["segments"]) == 3
    assert info["expected"] == first and info["segments"][2]["expected"]["step_s"] == 9.0
    timed = [s["measured"]["epochs_timed"] for s in info["segments"] if s["measured"]]
    assert info["measured"]["epochs_timed"] == sum(timed) >= 3 and len(
        info["measured"]["each_step_s"]
    ) == sum(timed)
    assert_same_run(run, ref)


@pytest.mark.slow
def test_a_probe_fitted_for_another_step_is_fitted_again(setup, tmp_path):
    """best.pt's probe is kept only by the end it was fitted for: one recorded for another step (a run trained
    further since) or not recorded (an earlier release) is fitted again, the same as a first fit."""
    cfg, ref, _ = setup
    for stored in (5, None):
        run = tmp_path / f"run-{stored}"
        shutil.copytree(ref, run)
        best = torch.load(run / "best.pt", weights_only=True)
        best["model"]["cloud.weight"].fill_(0.5)  # a probe that is not this end's
        best.pop("probe_step") if stored is None else best.update(probe_step=stored)
        torch.save(best, run / "best.pt")
        (run / "evaluation.json").unlink()  # the end pending again
        r = train(cfg, run)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "kept from" not in r.stdout and "Cloud / no-cloud output fitted" in r.stdout
        again, first = (torch.load(d / "best.pt", weights_only=True) for d in (run, ref))
        assert again["probe_step"] == first["probe_step"] == 21
        assert all(torch.equal(again["model"][k], first["model"][k]) for k in first["model"])


@pytest.mark.slow
def test_status_of_an_interrupted_run(setup, killed, tmp_path):
    cfg, _, _ = setup
    run = killed("commit-renamed:3", tmp_path / "run")
    r = run_cli("status", run, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert set(s) >= {
        "epoch",
        "step",
        "progress",
        "best_metric",
        "latest_checkpoint",
        "latest_checkpoint_age_s",
        "finished",
        "rejected",
    }
    assert s["step"] == 6 and not s["finished"] and 0 < s["progress"] < 100
    assert s["latest_checkpoint_age_s"] >= 0 and len(s["rejected"]) == 1
    assert "not committed" in s["rejected"][0]["reason"]
    ckpt = torch.load(s["latest_checkpoint"], weights_only=True)
    assert "encoder.blocks.0.conv.weight" in ckpt["model"]
    text = run_cli("status", run).stdout
    assert "stopped (resumable)" in text and "rejected:" in text


def _corrupt_newest_then_resume(setup, killed, tmp_path, damage):
    cfg, ref, _ = setup
    run = killed("step:12", tmp_path / "run")
    newest = newest_committed(run)
    damage(newest / STATE)
    resumed = train(cfg, run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Rejected checkpoint {newest}" in resumed.stdout
    assert_same_run(run, ref)
    return resumed.stdout


@pytest.mark.slow
def test_truncated_newest_checkpoint_is_rejected(setup, killed, tmp_path):
    def truncate(p):
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)

    assert "truncated or resized" in _corrupt_newest_then_resume(setup, killed, tmp_path, truncate)


@pytest.mark.slow
def test_bit_flipped_newest_checkpoint_is_rejected(setup, killed, tmp_path):
    def flip(p):
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x01
        p.write_bytes(bytes(data))

    assert "checksum mismatch" in _corrupt_newest_then_resume(setup, killed, tmp_path, flip)


class _Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['CLOUDML_PWNED']}",))


@pytest.mark.slow
def test_checkpoint_carrying_code_is_refused_not_run(setup, killed, tmp_path, monkeypatch):
    """A crafted state.pt with a valid manifest and marker: loading refuses it, nothing runs."""
    import hashlib

    marker = tmp_path / "pwned"
    monkeypatch.setenv("CLOUDML_PWNED", str(marker))
    cfg, ref, _ = setup
    run = killed("step:12", tmp_path / "run")
    newest = newest_committed(run)
    state = torch.load(newest / STATE, weights_only=True)
    state["extra"] = _Hostile()
    torch.save(state, newest / STATE)
    meta = read_meta(newest)
    data = (newest / STATE).read_bytes()
    meta.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (newest / "meta.json").write_text(json.dumps(meta))
    (newest / COMMITTED).write_text(meta["sha256"])
    resumed = train(cfg, run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "refused to load" in resumed.stdout
    assert not marker.exists()
    assert_same_run(run, ref)


@pytest.mark.slow
def test_resume_from_a_chosen_checkpoint_sets_newer_ones_aside(setup, killed, tmp_path):
    cfg, ref, _ = setup
    run = killed("step:13", tmp_path / "run")
    older = find_checkpoints(RunFolder(run))[-1]
    newer = [p.name for p in find_checkpoints(RunFolder(run)) if step_of(p) > step_of(older)]
    assert newer
    r = train(cfg, run, "--resume", str(older))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"Moved {len(newer)} checkpoints newer than step {step_of(older)}" in r.stdout
    aside = next(run.glob("superseded-*"))
    assert sorted(p.name for p in aside.iterdir()) == sorted(newer)
    assert_same_run(run, ref)


def test_resume_never_refuses_an_existing_run(setup):
    cfg, ref, _ = setup
    before = (ref / "metrics.jsonl").read_bytes()
    r = train(cfg, ref, "--resume", "never")
    assert r.returncode == 2 and "--resume never refuses to touch it" in r.stderr
    assert (ref / "metrics.jsonl").read_bytes() == before


def test_a_finished_run_is_not_trained_again(setup):
    cfg, ref, _ = setup
    before = final_state(ref)["loop"]["step"]
    r = train(cfg, ref)
    assert r.returncode == 0 and "nothing to train" in r.stdout and "This run is finished" in r.stdout
    assert final_state(ref)["loop"]["step"] == before


@pytest.mark.slow
def test_math_changes_are_refused_harmless_ones_taken(setup, killed, tmp_path):
    cfg, _, _ = setup
    run = killed("step:7", tmp_path / "run")
    r = train(cfg, run, "--set", "train.seed=1", "--set", "model.channels=[4,8,16]")
    assert r.returncode == 2
    assert "train.seed (checkpoint 42, now 1)" in r.stderr and "model.channels" in r.stderr
    r = train(cfg, run, "--set", "train.log_every_steps=2", "--set", "checkpoint.every_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "Resuming with changed settings" in r.stdout
        and "train.log_every_steps (checkpoint 1, now 2)" in r.stdout
    )


@pytest.mark.slow
def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(setup, tmp_path):
    cfg, _, _ = setup
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "cloudml_lib",
        "train",
        "--config",
        str(cfg),
        "--run-dir",
        str(run),
        "--set",
        "train.epochs=200",
        "--set",
        "checkpoint.every_steps=1000",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while (
        time.time() < deadline
        and not (run / "metrics.jsonl").exists()
        or len((run / "metrics.jsonl").read_text().splitlines()) < 3
    ):
        time.sleep(0.2)
        assert time.time() < deadline and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-2000:]
    import re

    stopped = re.search(r"Stopped by SIGTERM at step (\d+); checkpoint saved", out)
    assert stopped, out[-2000:]
    newest = find_checkpoints(RunFolder(run))[0]
    meta = read_meta(newest)
    # The stop step is on disk; its save says SIGTERM unless a cadence or epoch-end save of that
    # same step came first (a signal just before an epoch end).
    assert meta["step"] == int(stopped.group(1)) and (newest / COMMITTED).exists()
    assert meta["reason"] in ("SIGTERM", "epoch_end", "every_steps")
    assert not (run / ".lock").exists()


@pytest.mark.slow
def test_a_checkpoint_folder_named_for_another_step_is_trusted_by_its_content(setup, killed, tmp_path):
    """A folder renamed by hand (here: to a step the run never reaches) would be the newest at every start
    and never pruned: the run would resume from it forever. Its content says where it is."""
    cfg, ref, _ = setup
    run = killed("step:12", tmp_path / "run")
    newest = newest_committed(run)
    step = read_meta(newest)["step"]
    wrong = newest.with_name("step-99999999")
    newest.rename(wrong)
    resumed = train(cfg, run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Checkpoint folder {wrong} holds step {step}" in resumed.stdout
    assert f"Resumed from step {step}" in resumed.stdout
    assert not wrong.exists()
    assert_same_run(run, ref)
    again = train(cfg, run)
    assert again.returncode == 0 and "nothing to train" in again.stdout


@pytest.mark.slow
def test_what_another_tool_put_in_a_run_folder_is_left_byte_identical_and_named_once(setup, killed, tmp_path):
    """Ownership is decided per folder, deletion per file: a run folder that is CloudML's can still hold what
    is not (a user's notes; another tool's checkpoint folders, older and newer than the run's, which a resume
    walks past and checkpoint rotation would delete; its figure in plots/). The resume deletes, moves and
    overwrites none of them (the run's ledger, .cloudml-files, does not list them), names each once, and still
    ends on the numbers of the run never interrupted; then `evaluate` refuses to replace a report the user
    wrote where CloudML's would go, naming it, and leaves it as it was."""
    import hashlib

    from cloudml_lib.base.ledger import LEDGER

    cfg, ref, _ = setup
    run = killed("step:8", tmp_path / "run")
    theirs = {
        run / "notes.txt": b"my notes",
        run / "checkpoints" / "step-00000001" / "weights.bin": b"another tool's older checkpoint",
        run / "checkpoints" / "step-99999999" / "model.ckpt": b"another tool's newer checkpoint",
        run / "plots" / "theirs.png": b"not a png of CloudML's",
    }
    for path, data in theirs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def digests():
        return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in theirs if p.exists()}

    before = digests()
    r = train(cfg, run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert digests() == before
    said = r.stdout + r.stderr
    for folder in ("step-00000001", "step-99999999"):
        assert said.count(f"{run / 'checkpoints' / folder} was not written by CloudML") == 1, said[-3000:]
    listed = json.loads((run / LEDGER).read_text())["created"]
    assert "best.pt" in listed and not any("99999999" in p or "theirs" in p or "notes" in p for p in listed)
    shutil.rmtree(run / "checkpoints" / "step-99999999")  # the user takes theirs away: the run's own remain
    before = digests()
    assert_same_run(run, ref)

    mine = (run / "report.md").read_bytes()
    (run / "report.md").unlink()
    ledger_before = (run / LEDGER).read_bytes()
    (run / LEDGER).write_text(json.dumps({"created": [p for p in listed if p != "report.md"]}))
    (run / "report.md").write_text("my own report")
    r = run_cli("evaluate", "--run-dir", run)
    assert r.returncode == 2 and f"{run}: report.md is not listed in the folder's record" in r.stderr, (
        r.stderr
    )
    assert (run / "report.md").read_text() == "my own report" and digests() == before
    (run / LEDGER).write_bytes(ledger_before)
    (run / "report.md").write_bytes(mine)
    assert run_state(RunFolder(run)).kind == "finished", run_state(RunFolder(run))


def test_more_or_fewer_epochs_on_resume_are_said_not_warned_of(tiny_config, logs_reach_caplog, caplog):
    """The picker says more or fewer epochs are fine for a continued run; the run then gave two amber
    warnings. One line, at INFO, for epochs (and patience); another setting taken from the new config is
    still a warning."""
    import logging

    from cloudml_lib.base.config import derive
    from cloudml_lib.core.run.resume import check_resume_config

    saved = tiny_config.to_dict()
    check_resume_config(derive(tiny_config, {"train.epochs": tiny_config.train.epochs + 3}), saved)
    said = [r for r in caplog.records if "Resuming with changed settings" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert "train.epochs (checkpoint" in said[0].getMessage() and "re-planned" in said[0].getMessage()
    caplog.clear()
    check_resume_config(derive(tiny_config, {"train.log_every_steps": 7}), saved)
    said = [r for r in caplog.records if "Resuming with changed settings" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


@pytest.mark.slow
def test_a_backup_put_back_over_a_run_that_went_on_continues_from_where_its_best_pt_was_written(
    session_runs, tmp_path
):
    """A run backed up after epoch 1 (killed at step 8: its best.pt is epoch 1's), then trained to its end
    (its best: epoch 2), then the backup put back over it. The checkpoints after the backup stayed and the end
    scored the backup's best.pt, epoch 1's model, as the run's best, and called the run finished. Now the run
    continues from the newest checkpoint whose record of the best is best.pt's, to the uninterrupted run's
    weights bit for bit, and ends again (its evaluation.json was of another training to the same step): the
    newer checkpoints set aside where the folder's ledger lists them (best.pt alone put back), else named
    and the command refused, nothing changed (a restore that deletes nothing, `cp -a backup/. run/`, puts
    the backup's ledger back too)."""
    cfg, finished = session_runs.cfg, session_runs.finished()
    want = torch.load(finished / "best.pt", weights_only=False)
    assert want["epoch"] == 2  # the case: the best changed after the backup
    backup = session_runs.copy(session_runs.killed("step:8"), tmp_path / "backup")
    run = session_runs.copy(backup, tmp_path / "run")
    train = lambda: run_cli("train", "--config", cfg, "--run-dir", run)  # noqa: E731
    assert train().returncode == 0
    same = lambda: all(  # noqa: E731
        torch.equal(got[k], want["model"][k]) for got in [torch.load(run / "best.pt")["model"]] for k in got
    )
    assert same()
    shutil.copy2(backup / "best.pt", run / "best.pt")  # best.pt alone put back (Drive: an older version)
    r = train()
    said = r.stdout + r.stderr
    assert r.returncode == 0, said[-2000:]
    assert (
        "holds the best model of epoch 1" in said and "the newest checkpoint that agrees with best.pt" in said
    )
    assert json.loads((run / "evaluation.json").read_text())["best_epoch"] == 2 and same()
    assert any(p.name.startswith("superseded-") for p in run.iterdir())
    put_back = same_folder_at(backup, tmp_path / "as_backed_up_there")  # a backup of `run` itself
    shutil.copytree(put_back, run, dirs_exist_ok=True)
    before = {p.name: (p / STATE).read_bytes() for p in find_checkpoints(RunFolder(run))}
    r = train()  # first the files of the later end, all named at once before anything starts
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "not listed in the folder's record" in said, said[-2000:]
    named = [n for n in WHOLE_WRITES if n in said.split(" not listed in")[0].split(f"{run}: ")[-1]]
    end = {
        "evaluation.json",
        "predictions.csv",
        "report.md",
        "plots/scatter.png",
        "tensorboard/events.out.tfevents.final",
    }
    assert end <= set(named), said[-2000:]
    assert "best.pt" not in named and "config.yaml" not in named  # the backup's own, listed
    assert {p.name: (p / STATE).read_bytes() for p in find_checkpoints(RunFolder(run))} == before
    later = tmp_path / "later"  # moved out as the message says
    for name in named:
        (later / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(run / name, later / name)
    r = train()  # then the checkpoints after the one that agrees with best.pt
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "are not listed in the folder's record" in said, said[-2000:]
    assert {p.name: (p / STATE).read_bytes() for p in find_checkpoints(RunFolder(run))} == before
    named = said.split("the checkpoints after it")[1].split(")")[0]
    assert "step-00000014" in named and "step-00000012" not in named, said[-2000:]  # 12 agrees with best.pt
    for name in re.findall(r"step-\d{8}", named):
        shutil.move(run / "checkpoints" / name, later / name)
    r = train()  # and the run ends as if never put back: two refusals, each naming all it must
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert same() and json.loads((run / "evaluation.json").read_text())["best_epoch"] == 2


def test_only_rank_0_cuts_metrics_jsonl_back_to_its_checkpoint_when_a_job_resumes(session_runs, tmp_path):
    """A torchrun job resuming: every process restores the checkpoint, but metrics.jsonl, which rank 0 alone
    writes, is cut back by rank 0 alone. When every rank cut it, rank 1 could cut it after rank 0 had taken
    its fingerprint, and rank 0's next append refused the file as changed by someone else (CI, 91e7201)."""
    from types import SimpleNamespace

    from cloudml_lib.base.config import build_config
    from cloudml_lib.core.machine.distributed import Dist
    from cloudml_lib.core.run.checkpoint import Found, Key, load_checkpoint
    from cloudml_lib.train.state import LoopState, TrainingState

    run = session_runs.copy(session_runs.killed("step:8"), tmp_path / "run")
    newest = find_checkpoints(RunFolder(run))[0]
    saved = load_checkpoint(newest / STATE)
    metrics = RunFolder(run).metrics
    before = metrics.read_bytes()
    assert len(before) > saved[Key.METRICS_BYTES] > 0  # records after the checkpoint: work to redo
    cfg = build_config(session_runs.raw)
    sampler = SimpleNamespace(batches_per_epoch=lambda: 7)
    for rank, want in ((1, before), (0, before[: saved[Key.METRICS_BYTES]])):
        dist = Dist(rank=rank, world=2)
        loop = LoopState(dist, torch.device("cpu"), cfg.train.batch_size)
        state = TrainingState({Key.LOOP: loop}, torch.Generator(), sampler, {}, dist)
        state.restore(Found(newest, saved, []), metrics, cfg)
        assert metrics.read_bytes() == want, f"rank {rank}"
