import errno
import json
import os
import random

import numpy as np
import pytest
import torch
from conftest import fit_and_finish

from cloudml_lib.core.run import checkpoint as ck
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import clean_leftovers
from cloudml_lib.train import Trainer
from cloudml_lib.train.state import capture_rng, restore_rng


def small_state(step):
    return {"model": {"w": torch.full((3,), float(step))}, "config": {}, "loop": {"step": step}}


def test_commit_writes_state_manifest_and_marker(tmp_path):
    folder = ck.commit(small_state(4), {"step": 4, "epoch": 0}, RunFolder(tmp_path), tmp_path)
    assert folder.name == "step-00000004"
    assert sorted(p.name for p in folder.iterdir()) == ["COMMITTED", "meta.json", "state.pt"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["bytes"] == (folder / "state.pt").stat().st_size
    assert meta["sha256"] == ck.sha256_file(folder / "state.pt") == (folder / "COMMITTED").read_text()
    assert ck.verify(folder) is None
    assert torch.equal(ck.load_state(folder / "state.pt")["model"]["w"], torch.full((3,), 4.0))
    assert not list(tmp_path.glob("*.pt"))  # the local copy is gone


def test_verify_names_each_defect(tmp_path):
    f = ck.commit(small_state(1), {"step": 1}, RunFolder(tmp_path), tmp_path)
    (f / "COMMITTED").unlink()
    assert "not committed" in ck.verify(f)
    f = ck.commit(small_state(2), {"step": 2}, RunFolder(tmp_path), tmp_path)
    (f / "meta.json").write_text("{")
    assert "meta.json" in ck.verify(f)
    f = ck.commit(small_state(3), {"step": 3}, RunFolder(tmp_path), tmp_path)
    (f / "state.pt").unlink()
    assert "missing" in ck.verify(f)


def test_prune_keeps_the_newest_committed_and_drops_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        ck.commit(small_state(step), {"step": step}, RunFolder(tmp_path), tmp_path)
    (tmp_path / "checkpoints" / "step-00000002" / "COMMITTED").unlink()  # an interrupted one
    stale = tmp_path / "checkpoints" / ".step-00000009.tmp-999999"
    stale.mkdir()
    ck.prune(RunFolder(tmp_path), keep_last=2)
    assert [p.name for p in ck.find_checkpoints(RunFolder(tmp_path))] == ["step-00000004", "step-00000003"]
    assert not stale.exists()


def test_a_kill_while_pruning_never_leaves_half_a_checkpoint(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        ck.commit(small_state(step), {"step": step}, RunFolder(tmp_path), tmp_path)
    real_rmtree = ck.shutil.rmtree

    def dies_after_one_file(path, ignore_errors=False):
        if not os.path.isdir(path):
            return
        files = sorted(p.path for p in os.scandir(path) if p.is_file())
        os.unlink(files[0])  # the marker or the state goes first ...
        raise SystemExit("killed")  # ... and the process dies mid-delete

    monkeypatch.setattr(ck.shutil, "rmtree", dies_after_one_file)
    try:
        ck.prune(RunFolder(tmp_path), keep_last=2)
    except SystemExit:
        pass
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    left = ck.find_checkpoints(RunFolder(tmp_path))
    assert [p.name for p in left] == ["step-00000003", "step-00000002"]
    assert all(ck.verify(p) is None for p in left)  # every folder a resume can be pointed at is whole
    ck.prune(RunFolder(tmp_path), keep_last=2)  # the next prune clears the half-deleted leftover
    assert not list((tmp_path / "checkpoints").glob(".trash-*"))


def test_rng_state_round_trips():
    g = torch.Generator().manual_seed(3)
    saved = capture_rng(g)
    a = (random.random(), np.random.rand(), torch.rand(2), torch.rand(1, generator=g))
    restore_rng(saved, g)
    b = (random.random(), np.random.rand(), torch.rand(2), torch.rand(1, generator=g))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def test_checkpoint_is_weights_only_loadable(tiny_config, tmp_path):
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    state = trainer.checkpoints.snapshot()
    trainer.close()
    path = tmp_path / "s.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    assert set(loaded) >= {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "loop",
        "sampler",
        "rng",
        "config",
        "scalers",
        "metrics_bytes",
    }
    assert set(loaded["loop"]) >= {
        "epoch",
        "step",
        "batch",
        "best_val_loss",
        "bad_epochs",
        "history",
        "micro_batch_size",
        "acc",
    }
    assert set(loaded["rng"]) == {"python", "numpy", "torch", "cuda", "generators"}
    assert loaded["sampler"] == {"seed": tiny_config.train.seed, "epoch": 0, "position": 0, "samples": 0}


@pytest.mark.slow
def test_a_failed_write_is_logged_and_training_goes_on(tiny_config, tmp_path, monkeypatch):
    """Disk full on the second checkpoint: logged, the first stays intact, the run completes."""
    tiny_config.checkpoint.every_steps = 2
    real = ck._copy_hashing
    calls = []

    def disk_full(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(ck, "_copy_hashing", disk_full)
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    report = fit_and_finish(trainer)
    assert report["overall"]["n"] > 0 and trainer.checkpoints.writer.failures == 1
    log = (tmp_path / "run" / "train.log").read_text()
    assert "could not be written (OSError: [Errno 28] No space left on device)" in log
    assert "the previous checkpoint is intact" in log
    folders = ck.find_checkpoints(RunFolder(tmp_path / "run"))
    assert folders and all(ck.verify(f) is None for f in folders)
    assert not list((tmp_path / "run" / "checkpoints").glob(".step-*"))


def test_snapshot_is_taken_at_the_step_boundary(tiny_config, tmp_path):
    """The snapshot is a copy: later steps do not change what is being written."""
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    batches = iter(trainer.loader)
    trainer.train_step(next(batches))
    trainer.optimizer_step()
    snap = trainer.checkpoints.snapshot()
    w = snap["model"]["encoder.blocks.0.conv.weight"].clone()
    trainer.train_step(next(batches))
    trainer.optimizer_step()
    trainer.close()
    assert torch.equal(snap["model"]["encoder.blocks.0.conv.weight"], w)
    assert not torch.equal(trainer.model.encoder.blocks[0].conv.weight.detach(), w)
    assert (
        snap["model"]["encoder.blocks.0.conv.weight"].data_ptr()
        != trainer.model.encoder.blocks[0].conv.weight.data_ptr()
    )


def test_a_fault_point_fires_only_where_and_when_it_is_asked(monkeypatch):
    """The tests' fault injection (faults.py): inert without CLOUDML_KILL_AT, another point's name or rank;
    the n-th arrival at the named point sends the signal (here SIGUSR1, caught)."""
    import signal

    from cloudml_lib.base import faults

    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        monkeypatch.setattr(faults, "_counts", {})
        monkeypatch.delenv("CLOUDML_KILL_AT", raising=False)
        for _ in range(3):
            faults.point("step")
        monkeypatch.setenv("CLOUDML_KILL_AT", "step:2:SIGUSR1")
        faults.point("setup")  # another point
        faults.point("step", settle=lambda: received.append("settled"))  # the first arrival: nothing
        assert received == []
        monkeypatch.setenv("CLOUDML_KILL_RANK", "1")
        faults.point("step")  # rank 0 is not the one asked for
        monkeypatch.delenv("CLOUDML_KILL_RANK")
        faults.point("step", settle=lambda: received.append("settled"))  # the 2nd arrival at "step" of rank 0
        assert received == ["settled", signal.SIGUSR1]  # a checkpoint in flight is committed before the kill
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_structure_is_part_of_verification(tmp_path):
    assert "incomplete: no optimizer" in ck.check_structure({"format": ck.FORMAT_VERSION, "model": {}})
    assert "format 7" in ck.check_structure({"format": 7})
    assert "not a checkpoint" in ck.check_structure([1, 2])
    folder = ck.commit(
        small_state(5), {"step": 5}, RunFolder(tmp_path), tmp_path
    )  # verifies, but has no optimizer...
    reason, state, _ = ck.check_folder(folder)
    assert state is None and reason.startswith("format None")


def test_a_full_staging_disk_is_said_in_words(tmp_path, monkeypatch):
    def full(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ck.torch, "save", full)
    try:
        ck.commit(small_state(1), {"step": 1}, RunFolder(tmp_path / "run"), tmp_path)
    except OSError as e:
        assert e.errno == errno.ENOSPC and "no space left on the local disk" in str(e)
    else:
        raise AssertionError("no error")
    assert not ck.find_checkpoints(RunFolder(tmp_path / "run"))


def test_a_folder_pruned_while_being_read_is_walked_past(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for step in (1, 2):
        ck.commit(dict(small_state(step)), {"step": step}, RunFolder(run), tmp_path)
    real, calls = ck.check_folder, []

    def racing(folder, load=True):
        calls.append(folder.name)
        if len(calls) == 1:
            raise FileNotFoundError(folder / "meta.json")  # pruned by another process's save
        return real(folder, load=False)

    monkeypatch.setattr(ck, "check_folder", racing)
    found = ck.find_latest_valid(RunFolder(run))
    assert found.folder.name == "step-00000002" and found.meta["step"] == 2


def test_clean_leftovers_removes_only_what_dead_processes_left(tmp_path, monkeypatch):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    monkeypatch.setattr(ck.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / f".best.pt.tmp-{dead.pid}").write_bytes(b"x")
    (run / f".best.pt.tmp-{os.getpid()}").write_bytes(b"mine")  # a live process's: kept
    (run / "checkpoints" / f".step-00000004.tmp-{dead.pid}").mkdir()
    from cloudml_lib.base.ownership import write_marker
    from cloudml_lib.core.run.checkpoint import STAGING

    (tmp_path / "tmp" / f"cloudml-ckpt-{dead.pid}-abc").mkdir()
    write_marker(tmp_path / "tmp" / f"cloudml-ckpt-{dead.pid}-abc", STAGING)  # staged by CloudML
    (tmp_path / "tmp" / "cloudml-ckpt-abc").mkdir()  # owner unknown: kept
    (tmp_path / "tmp" / f"cloudml-ckpt-{dead.pid}-xyz").mkdir()  # no marker: not ours, whatever its name
    removed = clean_leftovers(RunFolder(run))
    assert len(removed) == 3
    assert (run / f".best.pt.tmp-{os.getpid()}").exists() and (tmp_path / "tmp" / "cloudml-ckpt-abc").exists()
    assert (tmp_path / "tmp" / f"cloudml-ckpt-{dead.pid}-xyz").exists()


def test_the_weights_of_best_pt_are_read_again_after_a_read_that_failed(tmp_path, monkeypatch):
    """run_state compares an evaluation's weights with best.pt's (read once until the file changes): a read
    that failed (a network mount's error) is not kept as the answer, or a finished run would stay 'trained,
    end pending' for the rest of the session."""
    best = tmp_path / "best.pt"
    torch.save({ck.Key.MODEL: {"w": torch.ones(3)}, ck.Key.CONFIG: {}}, best)
    real = ck.load_state
    failures = [OSError(5, "Input/output error")]

    def once(path):
        if failures:
            raise failures.pop()
        return real(path)

    monkeypatch.setattr(ck, "load_state", once)
    assert ck.best_weights_sha256(best) is None
    assert ck.best_weights_sha256(best) == ck.weights_sha256({"w": torch.ones(3)})
    assert ck.best_weights_sha256(tmp_path / "missing.pt") is None
