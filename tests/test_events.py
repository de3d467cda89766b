"""TensorBoard events (core/run/events.py): what a run writes, the purge marker a resume starts with,
and a run without the tensorboard package. Kills and resumes: test_resume.py compares the curves of
every killed-and-resumed run with the uninterrupted one."""

import os
from pathlib import Path

import pytest
from test_resume import tensorboard_scalars

from cloudml_lib.commands.runs import train_run
from cloudml_lib.core.run import events as events_module
from cloudml_lib.core.run.folder import RunFolder

pytest.importorskip("tensorboard")


def raw_events(path: Path) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return list(EventFileLoader(str(path)).Load())


@pytest.mark.slow
def test_a_run_writes_curves_text_and_the_scatter(tiny_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train_run(tiny_config, run)
    files = sorted(p.name for p in (run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2 and files[1] == "events.out.tfevents.final"  # training's, and the end's
    curves = tensorboard_scalars(run)
    steps = [s for s, _ in curves["train/loss"]]
    assert steps == sorted(set(steps)) and steps[0] == 2  # log_every_steps: 2
    assert len(curves["val/mae_km"]) == 2 and len(curves["epoch/lr"]) == 2  # one per epoch
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["evaluation/scatter"]
    image = acc.Images("evaluation/scatter")[0]
    assert image.width > 100 and image.height > 100
    assert {"memory/text_summary", "compile/text_summary"} <= set(acc.Tags()["tensors"])
    text = acc.Tensors("compile/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "compile" in text.lower() or "eager" in text.lower()


@pytest.mark.slow
def test_a_resumed_start_purges_the_steps_it_trains_again(tiny_raw_config, tmp_path, monkeypatch):
    """A SIGTERM stop mid-run (a checkpoint there), then the resume: its file opens with the purge marker."""
    from cloudml_lib.base.config import build_config

    tiny_raw_config["checkpoint"] = {"every_steps": 3}
    run = tmp_path / "run"
    monkeypatch.setenv("CLOUDML_KILL_AT", "step:5:SIGTERM")
    with pytest.raises(KeyboardInterrupt):
        train_run(build_config(tiny_raw_config), run)
    monkeypatch.delenv("CLOUDML_KILL_AT")
    first = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(first) == 1  # committed with the stop's checkpoint
    stopped_at = max(e.step for e in raw_events(first[0]))
    assert stopped_at == max(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))
    train_run(build_config(tiny_raw_config), run)
    second = [p for p in (run / "tensorboard").glob("events.out.tfevents.[0-9]*") if p not in first]
    assert len(second) == 1
    opening = [e for e in raw_events(second[0]) if e.HasField("session_log")]
    assert (
        opening
        and opening[0].session_log.status == opening[0].session_log.START
        and opening[0].step == stopped_at + 1
    )
    steps = [s for s, _ in tensorboard_scalars(run)["train/loss"]]
    assert steps == sorted(set(steps)) and stopped_at in steps and stopped_at + 2 in steps


@pytest.mark.slow
def test_without_tensorboard_training_works_and_says_how_to_enable_it(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setattr(events_module, "has_tensorboard", lambda: False)
    run = tmp_path / "run"
    report = train_run(tiny_config, run)
    assert report["overall"]["mae_km"] > 0 and (run / "best.pt").is_file()
    assert not (run / "tensorboard").exists()
    assert (
        "TensorBoard curves are off: the tensorboard package is not installed. To have them, run `pip "
        "install "
        "tensorboard`" in (run / "train.log").read_text()
    )


@pytest.mark.slow
def test_a_fresh_start_removes_events_no_checkpoint_kept(tiny_config, tmp_path):
    """Files of an attempt killed before its first checkpoint belong to no resume point. The attempt was
    CloudML's (its marker, written before anything else, and its ledger listing the event file it wrote); an
    event file another tool put there since is not in the ledger: it is left byte-identical and named once.
    A folder of another project's tensorboard/ is refused outright (tests/test_ownership.py)."""
    from cloudml_lib.base import ledger
    from cloudml_lib.base.ownership import write_marker
    from cloudml_lib.core.run.runfolder import RUN

    stale = tmp_path / "run" / "tensorboard" / "events.out.tfevents.1.host.1.0"
    stale.parent.mkdir(parents=True)
    write_marker(tmp_path / "run", RUN.name)
    ledger.start(tmp_path / "run", [])
    ledger.add(stale)
    stale.write_bytes(b"old")
    theirs = stale.parent / "events.out.tfevents.2.other-tool.7.0"
    theirs.write_bytes(b"another tool's curves")
    train_run(tiny_config, tmp_path / "run")
    assert not stale.exists() and theirs.read_bytes() == b"another tool's curves"
    ours = [
        p for p in stale.parent.glob("events.out.tfevents.*") if not p.name.endswith(".final") and p != theirs
    ]
    assert len(ours) == 1
    log = (tmp_path / "run" / "train.log").read_text()
    said = [line for line in log.splitlines() if str(theirs) in line]
    assert len(said) == 1 and "not written by CloudML" in said[0] and "left as it is" in said[0], said


def test_other_ranks_write_nothing(tmp_path):
    ev = events_module.Events(RunFolder(tmp_path), None, 0, fresh=True)
    ev.scalars(1, {"train/loss": 1.0})
    ev.text(1, "memory", "x")
    assert ev.mark() == {} and not (tmp_path / "tensorboard").exists()
    ev.close()


@pytest.mark.slow
def test_events_that_cannot_be_copied_never_cost_a_checkpoint(tiny_config, tmp_path, monkeypatch):
    import errno

    def disk_full(self, marks):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(events_module.Events, "commit", disk_full)
    run = tmp_path / "run"
    train_run(tiny_config, run)
    assert list((run / "checkpoints").glob("step-*/COMMITTED")) and (run / "best.pt").is_file()
    log = (run / "train.log").read_text()
    assert "TensorBoard events could not be copied" in log and "the checkpoint is written all the same" in log


def test_the_notebook_starts_this_kernels_own_tensorboard_whatever_path_holds(tmp_path, monkeypatch):
    """A kernel run from a virtual environment that is not activated has no `tensorboard` on PATH (issue:
    "Could not find `tensorboard`"): %tensorboard is pointed at the one beside this Python, or at a launcher
    that runs `python -m tensorboard.main` with it."""
    import subprocess
    import sys

    pytest.importorskip("tensorboard")
    from cloudml_lib.colab.show import use_this_pythons_tensorboard

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH at all
    monkeypatch.delenv("TENSORBOARD_BINARY", raising=False)
    lonely = tmp_path / "bin"  # a Python with no tensorboard beside it: this one, started by a script (a
    lonely.mkdir()  # symbolic link to a virtual environment's python loses that environment on Python 3.13)
    (lonely / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (lonely / "python").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(lonely / "python"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    binary = use_this_pythons_tensorboard()
    assert binary.startswith(str(tmp_path)) and os.environ["TENSORBOARD_BINARY"] == binary
    assert use_this_pythons_tensorboard() == binary  # asked again: the launcher it set, no other
    r = subprocess.run([binary, "--version_tb"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip()[:1].isdigit(), r.stderr[-1000:]
    (lonely / "tensorboard").write_text("#!/bin/sh\necho beside\n")
    (lonely / "tensorboard").chmod(0o755)
    monkeypatch.delenv("TENSORBOARD_BINARY")
    assert use_this_pythons_tensorboard() == str(lonely / "tensorboard")


def test_each_starts_file_sorts_after_the_earlier_starts_files_whatever_their_process_ids(tmp_path):
    """TensorBoard reads a folder's files in the order of their names and applies a purge to the files read
    before it. torch names a file by its second and process id: a resume in the same second by a process of a
    lower id (a command run in a notebook's kernel or a test's process after a killed subprocess) was read
    first, and its purge marker dropped nothing while the curves lost steps (test_resume in one process)."""
    killed = events_module.Events(RunFolder(tmp_path / "run"), tmp_path / "a", 0, fresh=True)
    resumed = events_module.Events(RunFolder(tmp_path / "run"), tmp_path / "b", 8, fresh=False)
    resumed.started_ns = killed.started_ns + 1  # began after, in the same second
    second = str(killed.started_ns // 10**9)
    names = [
        f"events.out.tfevents.{int(second) - 1}.vm.50000.3",  # an earlier release's file, a second before
        f"events.out.tfevents.{second}.vm.40000.0",  # an earlier release's file, in the same second
        killed.committed_name(f"events.out.tfevents.{second}.vm.26783.0"),
        resumed.committed_name(f"events.out.tfevents.{second}.vm.16878.196"),
        events_module.FINAL_EVENTS,
    ]
    assert sorted(names) == names
    assert resumed.committed_name(f"events.out.tfevents.{second}.vm.16878.196").endswith(".vm.16878.196")
