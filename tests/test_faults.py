"""Fault injection, end to end through the command line: corrupt and hostile checkpoints, a changed
dataset, leftovers of killed processes, signals during set-up, and data errors before any file is
written. Each test failed before its fix (issue 9)."""

import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import assert_reads_back, fit_and_finish, run_cli, tiny_raw

from cloudml_lib.base import ledger
from cloudml_lib.core.run.checkpoint import (
    COMMITTED,
    META,
    STATE,
    find_checkpoints,
    load_checkpoint,
    read_meta,
    sha256_file,
)
from cloudml_lib.core.run.folder import RunFolder


@pytest.fixture
def cfg_file(tiny_flights, tmp_path):
    root, entries = tiny_flights
    raw = tiny_raw(root, entries, tmp_path / "cache")
    raw["checkpoint"] = {"every_steps": 3, "keep_last": 3}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def status(run):
    r = run_cli("status", str(run), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def rewrite_state(folder: Path, state) -> None:
    """Replace state.pt and make the manifest and marker agree with it (it verifies, then fails later)."""
    buf = io.BytesIO()
    torch.save(state, buf) if not isinstance(state, bytes) else None
    data = buf.getvalue() if not isinstance(state, bytes) else state
    (folder / STATE).write_bytes(data)
    meta = read_meta(folder)
    meta.update(bytes=len(data), sha256=sha256_file(folder / STATE))
    (folder / META).write_text(json.dumps(meta))
    (folder / COMMITTED).write_text(meta["sha256"])


@pytest.mark.slow
def test_a_corrupted_checkpoint_is_set_aside_and_its_step_committed_again(session_runs, tmp_path):
    cfg_file, run = session_runs.cfg, session_runs.copy(session_runs.finished(), tmp_path / "run")
    final = find_checkpoints(RunFolder(run))[0]
    data = bytearray((final / STATE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (final / STATE).write_bytes(bytes(data))
    assert status(run)["finished"] is False  # the corrupt final checkpoint does not count
    r = run_cli("train", "--config", str(cfg_file), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert "checksum mismatch" in r.stdout and "Moved the rejected checkpoint" in r.stdout
    assert list((run / "rejected").glob(f"{final.name}-*"))
    s = status(run)
    assert s["finished"] and not s["rejected"]  # re-committed: no loop
    r = run_cli("train", "--config", str(cfg_file), "--run-dir", str(run))
    assert r.returncode == 0 and "nothing to train" in r.stdout


@pytest.mark.slow
def test_a_checkpoint_without_its_keys_is_rejected_not_a_crash(session_runs, tmp_path):
    cfg_file, run = session_runs.cfg, session_runs.copy(session_runs.killed("step:8"), tmp_path / "run")
    newest = next(p for p in find_checkpoints(RunFolder(run)) if (p / COMMITTED).is_file())
    state = torch.load(newest / STATE, weights_only=True)
    del state["config"]
    rewrite_state(newest, state)
    r = run_cli("train", "--config", str(cfg_file), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "incomplete: no config" in r.stdout and "Traceback" not in r.stderr


class Hostile:
    def __reduce__(self):
        return (os.system, ("echo owned > /dev/null",))


def test_every_file_a_finished_run_writes_reads_back(session_runs):
    """What train writes (and its end: evaluation, provenance), its readers take, in place."""
    read = assert_reads_back(session_runs.finished())
    assert {"config.yaml", "evaluation.json", "run.json", "provenance.json", "metrics.jsonl"} <= set(read)


@pytest.mark.slow
def test_status_verifies_like_resume(session_runs, tmp_path):
    run = session_runs.copy(session_runs.finished(), tmp_path / "run")
    real = status(run)
    fake = run / "checkpoints" / "step-99999999"
    shutil.copytree(find_checkpoints(RunFolder(run))[0], fake)
    meta = read_meta(fake)
    meta.update(step=999, total_steps=78)
    (fake / META).write_text(json.dumps(meta))
    rewrite_state(fake, pickle.dumps({"model": Hostile()}))
    s = status(run)
    assert s["step"] == real["step"] and s["progress"] <= 100.0
    assert (
        s["rejected"][0]["path"].endswith("step-99999999") and "refused to load" in s["rejected"][0]["reason"]
    )


@pytest.mark.slow
def test_a_corrupt_best_model_falls_back_to_the_newest_weights(tiny_config, tmp_path):
    from cloudml_lib.train import Trainer

    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    update = trainer._update_best

    def update_then_corrupt(*args):  # the disk corrupts best.pt after each save
        stop = update(*args)
        (tmp_path / "run" / "best.pt").write_bytes(b"not a checkpoint")
        return stop

    trainer._update_best = update_then_corrupt
    report = fit_and_finish(trainer)
    assert "best.pt cannot be used" in (tmp_path / "run" / "train.log").read_text()
    assert report["overall"]["n"] == report["per_flight"]["05Mar25"]["n"] > 0  # the test flight scored
    assert load_checkpoint(tmp_path / "run" / "best.pt")["epoch"] == 2  # rewritten with the newest weights


@pytest.mark.slow
def test_resuming_onto_changed_data_is_refused(tiny_flights, tmp_path):
    root, entries = tiny_flights
    data = tmp_path / "flights"
    shutil.copytree(root, data)
    raw = tiny_raw(data, entries, tmp_path / "cache")
    raw["checkpoint"] = {"every_steps": 3}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    assert (
        run_cli(
            "train", "--config", str(cfg), "--run-dir", str(run), env={"CLOUDML_KILL_AT": "step:7"}
        ).returncode
        == -signal.SIGKILL
    )
    import h5py

    with h5py.File(data / entries[0]["cpl_file"], "a") as f:  # a reprocessed CPL file: some labels move
        dem = f["layer_descriptor/DEM_Surface_Altitude"]
        dem[:10] = 100.0
    r = run_cli("train", "--config", str(cfg), "--run-dir", str(run))
    assert r.returncode == 2
    assert "the data differs from the data this run was trained on" in r.stderr
    assert f"flight {entries[0]['name']}:" in r.stderr and "Nothing was changed" in r.stderr


@pytest.mark.slow
def test_leftovers_of_killed_processes_are_cleaned_on_the_next_start(cfg_file, tmp_path):
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    r = run_cli(
        "train",
        "--config",
        str(cfg_file),
        "--run-dir",
        str(run),
        env={"CLOUDML_KILL_AT": "step:7", "TMPDIR": str(tmp)},
    )
    assert r.returncode == -signal.SIGKILL
    assert list(tmp.glob("cloudml-ckpt-*")), "the kill should leave a staging folder"
    (run / f".best.pt.tmp-{dead.pid}").write_bytes(b"half")
    (run / "checkpoints" / f".trash-step-00000001-{dead.pid}").mkdir()
    ledger.add(run / "checkpoints" / "step-99999999")  # a write of the run's, listed as commit() lists it
    (run / "checkpoints" / "step-99999999").mkdir()  # and killed before it was committed
    r = run_cli("train", "--config", str(cfg_file), "--run-dir", str(run), env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list(run.glob(".best.pt.tmp-*")) and not list((run / "checkpoints").glob(".trash-*"))
    assert not (run / "checkpoints" / "step-99999999").exists()
    assert not list(tmp.glob("cloudml-ckpt-*"))


def test_a_data_error_creates_no_run_folder(cfg_file, tmp_path):
    run = tmp_path / "run"
    r = run_cli(
        "train",
        "--config",
        str(cfg_file),
        "--run-dir",
        str(run),
        "--set",
        "data.test_flights=[12Feb25]",
    )
    assert r.returncode == 2 and "data.test_flights: 12Feb25 not in data.flights" in r.stderr
    assert not run.exists()


def test_a_batch_larger_than_the_training_set_is_refused(cfg_file, tmp_path):
    r = run_cli(
        "train",
        "--config",
        str(cfg_file),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "train.batch_size=500",
    )
    found = re.search(r"larger than the training set \((\d+) samples\)", r.stderr)
    assert r.returncode == 2 and found and f"Choose train.batch_size <= {found.group(1)}." in r.stderr


def test_sigterm_during_set_up_stops_cleanly(cfg_file, tmp_path):
    r = run_cli(
        "train",
        "--config",
        str(cfg_file),
        "--run-dir",
        str(tmp_path / "run"),
        env={"CLOUDML_KILL_AT": "setup:1:SIGTERM"},
    )
    assert r.returncode == 130, (r.returncode, r.stderr[-1000:])
    assert "interrupted" in r.stderr and "Run the same command again" in r.stderr


def test_repeated_failed_saves_stop_the_run(tiny_config, tmp_path, monkeypatch):
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.core.run import checkpoint
    from cloudml_lib.train import Trainer

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "run" / "checkpoints"))

    monkeypatch.setattr(checkpoint, "commit", read_only)
    tiny_config.checkpoint.every_steps = 1
    with pytest.raises(CloudMLError, match="3 checkpoints in a row could not be written .*Permission denied"):
        fit_and_finish(Trainer(tiny_config, tmp_path / "run").setup())


def test_a_full_disk_anywhere_is_exit_2_with_advice(tiny_raw_config, tmp_path, monkeypatch, capsys):
    import errno

    from cloudml_lib.base.errors import explain_os_error
    from cloudml_lib.commands import cli
    from cloudml_lib.core.run.runfolder import MetricsFile

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(MetricsFile, "append", full)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    assert cli.main(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no space left on the disk holding" in err and "metrics.jsonl" in err and "Free space there" in err
    assert explain_os_error(PermissionError(errno.EROFS, "Read-only file system", "/x")).startswith(
        "cannot write /x: the disk or folder is read-only"
    )
