"""Whose folder it is (base/ownership.py), over the whole family of folders CloudML writes into or cleans: a
run, a cross-validation, a sweep, predictions (--out), demo flights (--out), the preprocessing cache
(data.cache_dir). A folder is CloudML's by the marker it wrote, or, written by an earlier release, by content
that verifies; anything else, run-like names included, is refused and left byte-identical."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import REPO

from cloudml_lib.base import ledger, store
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.ledger import LEDGER
from cloudml_lib.base.ownership import MARKER, check, claim, marker_kind
from cloudml_lib.base.store import Folder
from cloudml_lib.commands.sweep import SWEEP
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import CROSSVAL, RUN

FIXTURES = REPO / "tests" / "fixtures"


def snapshot(folder: Path) -> dict:
    """Every entry under `folder`, with each file's bytes' hash: the folder as the user left it."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def foreign(tmp_path: Path, kind: str) -> Path:
    """A folder of someone else's, with names a CloudML folder of that kind would hold."""
    d = tmp_path / f"theirs-{kind}"
    (d / "papers").mkdir(parents=True)
    (d / "papers" / "draft.txt").write_text("mine")
    names = {
        "home": {"notes.txt": "mine"},
        "run": {
            "tensorboard/events.out.tfevents.1.other": "their curves",
            "checkpoints/step-00000005/model.bin": "another tool's",
            "metrics.jsonl": '{"their": 1}\n',
            "train.log": "their log\n",
            "config.yaml": "train: {epochs: 3}\n",
        },
        "crossval": {"folds/a/notes.txt": "theirs"},
        "sweep": {"trials/0/notes.txt": "theirs", "study.journal": "theirs\n"},
        "predictions": {"summary.json": "[1, 2]", "x_cbh.nc": "not ours", "metrics.jsonl": "{}\n"},
        "demo": {"01Mar25/readme.txt": "theirs", "cloudml_demo_version": "not a number"},
        "cache": {"01Mar25-abc/meta.json": "{}", "file_sha256.json": "[1]"},
    }[kind]
    for name, text in names.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    torch.save({"weights": torch.zeros(3)}, d / "best.pt")  # another project's best.pt, beside its papers
    return d


@pytest.fixture
def cfg_file(tiny_raw_config, tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_raw_config))
    return path


@pytest.mark.parametrize(
    "command, kind",
    [
        ("train", "home"),
        ("train", "run"),
        ("crossval", "crossval"),
        ("crossval", "run"),
        ("sweep", "sweep"),
        ("sweep", "run"),
        ("make-demo-data", "demo"),
        ("make-demo-data", "run"),
        ("train --cache", "cache"),
    ],
)
def test_a_folder_that_is_not_cloudmls_is_refused_and_left_byte_identical(
    command, kind, cfg_file, tmp_path, capsys
):
    from cloudml_lib.commands.cli import main

    theirs = foreign(tmp_path, kind)
    before = snapshot(theirs)
    argv = {
        "train": ["train", "--config", cfg_file, "--run-dir", theirs],
        "crossval": ["crossval", "--config", cfg_file, "--run-dir", theirs, "--no-controls"],
        "sweep": ["sweep", "--config", cfg_file, "--run-dir", theirs, "--trials", "1"],
        "make-demo-data": ["make-demo-data", "--out", theirs, "--flights", "2", "--frames", "20"],
        "train --cache": [
            "train", "--config", cfg_file, "--run-dir", tmp_path / "run", "--set", f"data.cache_dir={theirs}"
        ],
    }[command]  # fmt: skip
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"{theirs} holds other things" in err and "Nothing was written" in err, err
    assert "Traceback" not in err
    assert snapshot(theirs) == before  # not a byte changed, nothing added, nothing removed


def test_predict_out_into_a_folder_that_is_not_cloudmls_is_refused(tiny_run, tmp_path, capsys):
    from cloudml_lib.commands.cli import main

    run_dir = tiny_run[0]
    theirs = foreign(tmp_path, "predictions")
    before = snapshot(theirs)
    assert main(["predict", "--run-dir", str(run_dir), "--out", str(theirs)]) == 2
    assert f"{theirs} holds other things" in capsys.readouterr().err
    assert snapshot(theirs) == before


@pytest.mark.parametrize(
    "folder, kind",
    [
        ("run_d1cecbe/finished", RUN),
        ("run_d1cecbe/stopped", RUN),
        ("run_d1e9854/finished", RUN),
        ("run_d1e9854/stopped", RUN),
        ("run_d1e9854/crossval", CROSSVAL),
        ("run_d1e9854/sweep", SWEEP),
    ],
)
def test_an_earlier_releases_folder_is_adopted_by_its_content_and_marked_first(
    folder, kind, tmp_path, caplog, logs_reach_caplog
):
    mine = tmp_path / "mine"
    shutil.copytree(FIXTURES / folder, mine)
    assert check(mine, kind).startswith("adopted: ")
    before = snapshot(mine)
    claim(mine, kind)
    assert marker_kind(mine) == kind.name
    assert {k: v for k, v in snapshot(mine).items() if k not in (MARKER, LEDGER)} == before  # nothing else
    assert ledger.listed(mine) == set(kind.verified(mine)) and ledger.listed(mine)  # what verifies is its own
    assert "adopted, and marked as CloudML's" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="cloudml_lib"):
        assert check(mine, kind) == "marked"
        claim(mine, kind)
    assert "adopted" not in caplog.text  # said once


def test_a_run_like_folder_whose_content_does_not_verify_is_not_adopted(tmp_path):
    """A run folder's names are not enough: a checkpoint whose checksum does not match, a best.pt without a
    best model's keys, a crossval.json that does not read."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "run_d1e9854" / "stopped", run)
    state = next((run / "checkpoints").glob("step-*")) / "state.pt"
    state.write_bytes(state.read_bytes()[:-10] + b"0123456789")  # another file under the same name
    with pytest.raises(CloudMLError, match="is not a CloudML run folder"):
        check(run, RUN)
    cv = tmp_path / "cv"
    (cv / "folds" / "a" / "model").mkdir(parents=True)
    (cv / "crossval.json").write_text('{"summary": 1}')
    with pytest.raises(CloudMLError, match="is not a CloudML cross-validation folder"):
        check(cv, CROSSVAL)


def test_new_empty_and_hidden_only_folders_are_claimed_and_other_kinds_refused(tmp_path):
    assert check(tmp_path / "new", RUN) == "new"
    hidden = tmp_path / "hidden"
    (hidden / ".ipynb_checkpoints").mkdir(parents=True)
    (hidden / ".DS_Store").write_text("")
    assert check(hidden, RUN) == "empty"
    claim(hidden, RUN)
    assert marker_kind(hidden) == "run"
    with pytest.raises(CloudMLError, match="is CloudML's run folder, not a sweep folder"):
        claim(hidden, SWEEP)
    (tmp_path / "not-ours").mkdir()
    (tmp_path / "not-ours" / MARKER).write_text("something else")  # a file of the same name, not our marker
    with pytest.raises(CloudMLError, match="is not a marker CloudML wrote"):
        check(tmp_path / "not-ours", RUN)


@pytest.mark.parametrize("where", ["dangling", "loop", "proc"])
def test_a_run_dir_that_cannot_be_a_folder_is_explained(where, cfg_file, tmp_path, capsys):
    from cloudml_lib.commands.cli import main

    path = {"dangling": tmp_path / "gone", "loop": tmp_path / "a", "proc": Path("/proc/self/cloudml-run")}[
        where
    ]
    if where == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    if where == "loop":
        path.symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(path)
    assert main(["train", "--config", str(cfg_file), "--run-dir", str(path)]) == 2
    err = capsys.readouterr().err
    shown = str(path) if where != "proc" else os.path.realpath(path)  # /proc/self: where it would land
    assert shown in err and "Traceback" not in err


def test_the_cache_is_never_the_run_folder(cfg_file, tmp_path, capsys):
    from cloudml_lib.commands.cli import main

    run = tmp_path / "run"
    assert (
        main(["train", "--config", str(cfg_file), "--run-dir", str(run), "--set", f"data.cache_dir={run}"])
        == 2
    )
    assert "is the run folder" in capsys.readouterr().err and not run.exists()


@pytest.mark.parametrize("copied", ["best.pt", "marker", "both"])
@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_file_copied_from_a_cloudml_run_proves_nothing(
    copied, command, tiny_run, cfg_file, tmp_path, capsys
):
    """A user's folder holding another tool's tensorboard/ and checkpoints/ plus one copied CloudML best.pt
    (or a copied marker) was adopted: train deleted the other tool's files, truncated metrics.jsonl,
    appended to train.log; evaluate rewrote report.md, evaluation.json, predictions.csv in any folder with a
    best.pt. One file never proves a folder CloudML's: refused, byte-identical."""
    from cloudml_lib.commands.cli import main

    run_dir = tiny_run[0]
    theirs = foreign(tmp_path, "run")
    if copied in ("best.pt", "both"):
        shutil.copy2(run_dir / "best.pt", theirs / "best.pt")
    if copied in ("marker", "both"):
        shutil.copy2(run_dir / MARKER, theirs / MARKER)
    (theirs / "report.md").write_text("my report\n")
    before = snapshot(theirs)
    argv = {
        "train": ["train", "--config", cfg_file, "--run-dir", theirs],
        "evaluate": ["evaluate", "--run-dir", theirs],
    }[command]
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"{theirs} holds other things" in err and "Traceback" not in err, err
    assert snapshot(theirs) == before


def test_a_cloudml_run_folder_moved_elsewhere_is_adopted_by_its_content(tiny_run, tmp_path):
    """The marker records the folder it was written in: a run folder moved (or copied) keeps working, proved
    by its checkpoints, and is marked again where it now is."""
    moved = tmp_path / "moved"
    shutil.copytree(tiny_run[0], moved)
    assert marker_kind(moved) is None  # written for the original folder
    assert check(moved, RUN).startswith("adopted: its checkpoint")
    claim(moved, RUN)
    assert marker_kind(moved) == "run" and check(moved, RUN) == "marked"


def test_status_calls_another_tools_checkpoints_no_cloudml_run(tmp_path, capsys):
    """`status` called any folder holding a checkpoints/ folder "stopped (resumable)"; `compare` and the
    picker read the same state."""
    from cloudml_lib.commands.cli import main
    from cloudml_lib.core.run.status import run_state

    theirs = foreign(tmp_path, "run")
    before = snapshot(theirs)
    assert run_state(RunFolder(theirs)).kind == "none"
    assert main(["status", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert f"{theirs} holds a run's names" in err and "is not a CloudML run" in err and "stopped" not in err
    assert snapshot(theirs) == before


@pytest.mark.parametrize("kind", ["predictions", "crossval", "demo"])
def test_one_copied_results_file_adopts_no_folder(kind, tiny_run, tiny_flights, cfg_file, tmp_path, capsys):
    """A copied summary.json, crossval.json or demo version file made a user's folder CloudML's for
    `predict --out`, `crossval` and `make-demo-data --out`. Each kind now needs two files that verify."""
    import json

    from cloudml_lib.commands.cli import main
    from cloudml_lib.data.synthetic import VERSION_FILE

    theirs = foreign(tmp_path, kind)
    if kind == "predictions":
        made = tmp_path / "made"
        assert main(["predict", "--run-dir", str(tiny_run[0]), "--out", str(made)]) == 0
        shutil.copy2(made / "summary.json", theirs / "summary.json")
        argv = ["predict", "--run-dir", tiny_run[0], "--out", theirs]
    elif kind == "crossval":
        twin = json.loads((FIXTURES / "run_d1e9854" / "expected.json").read_text())["crossval"]
        (theirs / "crossval.json").write_text(json.dumps(twin))  # what that release's crossval wrote
        argv = ["crossval", "--config", cfg_file, "--run-dir", theirs, "--no-controls"]
    else:
        shutil.copy2(tiny_flights[0] / VERSION_FILE, theirs / VERSION_FILE)
        argv = ["make-demo-data", "--out", theirs, "--flights", "2", "--frames", "20"]
    capsys.readouterr()
    before = snapshot(theirs)
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"{theirs} holds other things" in err and "Traceback" not in err, err
    assert snapshot(theirs) == before


def test_a_run_folder_marked_before_ledgers_lists_only_what_verifies_and_a_damaged_ledger_is_made_again(
    tmp_path, caplog
):
    """A run folder an earlier release marked has no ledger: it gets one from what verifies as the run's (the
    files a run writes by name, each checkpoint whose checksum matches), never from everything it holds:
    another tool's checkpoint folder, event file and notes stay out of it, so no clean-up touches them. A
    ledger that is not one (hand-edited) is named and made again by the same rule."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "run_1c3d260" / "stopped", run)
    assert marker_kind(run, proven=False) == RUN.name and not (run / LEDGER).exists()
    assert marker_kind(run) is None  # a marker that names no folder proves nothing by itself
    (run / "checkpoints" / "step-00000001").mkdir()
    (run / "checkpoints" / "step-00000001" / "weights.bin").write_bytes(b"another tool's")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.other.0.0").write_bytes(b"another tool's curves")
    final = run / "tensorboard" / "events.out.tfevents.final"  # the end's values: a name only CloudML writes
    final.write_bytes(b"final values")
    (run / "notes.txt").write_text("mine")
    want = {"config.yaml", "metrics.jsonl", "run.json", "train.log", "provenance.json"}
    want |= {"checkpoints/step-00000008", "tensorboard/events.out.tfevents.final"}
    assert ledger.listed(run) == want
    assert not ledger.mine(run / "checkpoints" / "step-00000001") and not ledger.mine(run / "notes.txt")
    assert ledger.mine(run / "checkpoints" / "step-00000008" / "meta.json")  # inside a listed folder
    assert not ledger.delete(run / "tensorboard") and not final.exists()  # CloudML's file goes, theirs stays
    assert (run / "tensorboard" / "events.out.tfevents.1.other.0.0").read_bytes() == b"another tool's curves"
    want.discard("tensorboard/events.out.tfevents.final")
    (run / LEDGER).write_text('{"created": "everything"}')
    with caplog.at_level("WARNING", logger="cloudml_lib.base.ledger"):
        assert ledger.listed(run) == want
    assert f"{run / LEDGER} is damaged" in caplog.text


def test_a_ledger_made_from_what_verifies_records_each_file_as_found_and_a_later_edit_is_the_users(
    tmp_path, caplog, monkeypatch
):
    """A ledger made again from what verifies (an earlier release's folder, or one whose ledger was lost)
    listed names alone: a report.md or train.log edited after that was CloudML's for good, replaced or
    appended to without a word. Each listed file is now recorded as it was found: edited or cut later, it is
    the user's; a line added at a log's end is not, and CloudML's own next writes (report.md whole, best.pt
    by a checkpoint's protocol, which records no content) go on as before."""
    import json

    from cloudml_lib.base.outputs import append_text, target, write_text
    from cloudml_lib.core.run.checkpoint import save_atomic

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "run_1c3d260" / "finished", run)
    ledger.add(run / "plots")  # the first call makes the ledger (a new name listed: the others' records kept)
    assert {"report.md", "train.log", "best.pt", "evaluation.json", "plots"} <= ledger.listed(run)
    contents = json.loads((run / LEDGER).read_text())["contents"]
    assert (
        contents["train.log"]["size"] == (run / "train.log").stat().st_size and contents["train.log"]["grows"]
    )
    assert (
        contents["report.md"]["size"] == (run / "report.md").stat().st_size
        and "grows" not in contents["report.md"]
    )
    assert all(not r.startswith("checkpoints/") for r in contents)  # folders: their own checksums
    monkeypatch.setattr(ledger, "_growing", {})  # a new process
    save_atomic({"weights": 1}, run / "best.pt")  # CloudML's protocol: replaced, and again
    save_atomic({"weights": 2}, run / "best.pt")
    assert torch.load(run / "best.pt") == {"weights": 2} and ledger.mine(run / "best.pt")
    append_text(run / "train.log", "a line CloudML adds\n")
    with open(run / "train.log", "a") as f:
        f.write("a line of the user's at the end\n")
    monkeypatch.setattr(ledger, "_growing", {})
    assert ledger.mine(run / "train.log")  # longer than its record: a log's
    log = (run / "train.log").read_text()
    (run / "train.log").write_text(log.replace("Epoch", "epoch", 1))  # edited in place, the same size
    monkeypatch.setattr(ledger, "_growing", {})
    with pytest.raises(CloudMLError, match="train.log was changed after CloudML wrote it"):
        append_text(run / "train.log", "more\n")
    notes = (run / "report.md").read_text() + "My reading of these numbers.\n"
    (run / "report.md").write_text(notes)  # the user's lines added at the end of a report
    with caplog.at_level("WARNING"):
        assert write_text(target(run / "report.md"), "# Results, again\n") == run / "report.new.md"
    assert (run / "report.md").read_text() == notes
    assert "report.md was edited after CloudML wrote it: it is kept" in caplog.text
    assert not ledger.delete(run) and (run / "report.md").exists() and (run / "train.log").exists()


def _add_many(folder: str, who: int) -> None:
    for i in range(40):
        ledger.add(Path(folder) / f"fold-{who}" / f"file-{i}.json")


@pytest.mark.slow
def test_processes_writing_into_one_folder_lose_none_of_each_others_entries(tmp_path):
    """Cross-validation folds under torchrun write into one folder at once: each one's entries in its ledger
    survive the others' (an advisory lock on the folder around each read-and-rewrite)."""
    import multiprocessing

    from cloudml_lib.base.ownership import write_marker

    folder = tmp_path / "crossval"
    folder.mkdir()
    write_marker(folder, CROSSVAL.name)
    ledger.start(folder, [])
    workers = [
        multiprocessing.get_context("spawn").Process(target=_add_many, args=(str(folder), w))
        for w in range(3)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert all(w.exitcode == 0 for w in workers)
    assert ledger.listed(folder) == {f"fold-{w}/file-{i}.json" for w in range(3) for i in range(40)}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a forked child needs os.fork")
def test_a_child_forked_while_a_thread_updates_the_ledger_does_not_keep_the_folder_locked(tmp_path):
    """DataLoader or preprocessing workers are forked while another thread (the checkpoint writer, the
    checksum thread) may hold the folder lock of a ledger update: the child drops its copy of the lock, so
    the parent's next update does not wait for the child to exit (it waited for ever before)."""
    import threading
    import time

    home = tmp_path / "run"
    claim(home, RUN)
    held, release = threading.Event(), threading.Event()

    def writer():
        with Folder(home).locked():
            held.set()
            release.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the worker: lives on for a while, as a DataLoader worker does
        time.sleep(8)
        os._exit(0)
    try:
        release.set()
        thread.join(10)
        added = threading.Thread(target=ledger.add, args=(home / "notes.txt",), daemon=True)
        added.start()
        added.join(4)
        assert not added.is_alive(), "the ledger update waited for the forked child to exit"
        assert "notes.txt" in (home / LEDGER).read_text()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a forked child needs os.fork")
def test_a_child_forked_while_a_thread_holds_the_ledgers_thread_lock_updates_its_own_ledgers(tmp_path):
    """A command forked while a thread of its parent is inside a ledger update (the suite's forked runs, a
    worker forked beside the checksum thread): the child's copy of the thread lock would stay held for ever,
    since the thread that holds it does not exist in the child, and its first file would wait for ever. The
    child gets a lock of its own."""
    import signal
    import threading

    parents, childs = tmp_path / "parent", tmp_path / "child"
    claim(parents, RUN)
    claim(childs, RUN)
    held, release = threading.Event(), threading.Event()

    def updating():
        with ledger._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=updating)
    thread.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: a bounded wait (SIGALRM ends it) instead of a hung suite
        signal.alarm(5)
        ledger.add(childs / "notes.txt")
        os._exit(0)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join(10)
    assert os.waitstatus_to_exitcode(status) == 0, "the child waited for its parent's thread lock"
    assert "notes.txt" in (childs / LEDGER).read_text()
    ledger.add(parents / "notes.txt")  # the parent's own lock is untouched
    assert "notes.txt" in (parents / LEDGER).read_text()


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_a_users_files_deep_below_a_run_folder_are_judged_by_its_ledger(tmp_path, depth):
    """A user's TensorBoard runs some folders below a run's tensorboard/: a clean-up of that folder deletes
    what CloudML listed and leaves the user's files byte-identical at any depth (the claimed folder was once
    looked for three levels up only: deeper files counted as in no claimed folder, and were deleted)."""
    from cloudml_lib.base.ownership import write_marker

    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    write_marker(run, RUN.name)
    ledger.start(run, ["tensorboard/events.out.tfevents.1"])
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"cloudml's")
    deep = run / "tensorboard" / Path(*[f"mine{i}" for i in range(depth)])
    deep.mkdir(parents=True)
    (deep / "events.out.tfevents.2").write_bytes(b"the user's")
    assert ledger.home_of(deep / "events.out.tfevents.2") == run
    assert not ledger.delete(run / "tensorboard")
    assert not (run / "tensorboard" / "events.out.tfevents.1").exists()
    assert (deep / "events.out.tfevents.2").read_bytes() == b"the user's"


def test_a_marker_that_names_no_folder_proves_nothing_by_itself(tmp_path):
    """A marker as earlier releases wrote them (no folder), copied into a user's folder of their own
    metrics.jsonl and train.log: the folder is judged by its content, which does not verify, so it is refused
    and left byte-identical (it was trusted: train truncated the metrics and appended to the log)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / MARKER).write_text('{"kind": "run", "by": "CloudML"}')
    (folder / "metrics.jsonl").write_text('{"my": "numbers"}\n')
    (folder / "train.log").write_text("my notes\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert marker_kind(folder) is None and marker_kind(folder, proven=False) == RUN.name
    with pytest.raises(CloudMLError, match="mine"):
        check(folder, RUN)
    assert not ledger.mine(folder / "metrics.jsonl") and not ledger.mine(folder / "train.log")
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != LEDGER} == before


def claimed_run(tmp_path) -> Path:
    from cloudml_lib.base.ownership import write_marker

    run = tmp_path / "run"
    run.mkdir()
    write_marker(run, RUN.name)
    ledger.start(run, [])
    return run


def test_a_file_changed_after_cloudml_wrote_it_is_the_users_and_a_report_goes_beside_it(tmp_path, caplog):
    """The ledger records what CloudML wrote (size and sha256), not only the name: a file changed since is
    never replaced or deleted. A document for people (report.md) stays and the new one goes to report.new.md,
    said once (a user's text in report.md was replaced without a word: the ledger listed the name); another
    file (evaluation.json, damaged or edited) is renamed evaluation.json.kept-1 first, its bytes as they
    were, and said. An edit that keeps the size is found by the checksum."""
    from cloudml_lib.base.outputs import target, write_text

    run = claimed_run(tmp_path)
    write_text(run / "evaluation.json", '{"r2": 0.5}')
    write_text(target(run / "report.md"), "# Results\n")
    write_text(run / "evaluation.json", '{"r2": 0.6}')  # CloudML's own file: replaced as before
    (run / "evaluation.json").write_text('{"r2": 0.9}')  # the same size, another number
    (run / "report.md").write_text("# Results\nMy reading of the numbers.\n")
    with caplog.at_level("WARNING"):
        write_text(run / "evaluation.json", '{"r2": 0.7}')
    assert (run / "evaluation.json.kept-1").read_text() == '{"r2": 0.9}'  # kept, as it was
    assert (run / "evaluation.json").read_text() == '{"r2": 0.7}'
    assert (
        "evaluation.json was changed after CloudML wrote it (damaged, or edited): it is kept" in caplog.text
    )
    with caplog.at_level("WARNING"):
        assert write_text(target(run / "report.md"), "# Results, again\n") == run / "report.new.md"
        write_text(target(run / "report.md"), "# Results, a third time\n")
    assert caplog.text.count("report.md was edited after CloudML wrote it: it is kept as it is") == 1
    assert (run / "report.md").read_text() == "# Results\nMy reading of the numbers.\n"
    assert (run / "report.new.md").read_text() == "# Results, a third time\n"
    assert not ledger.delete(run / "report.md") and not ledger.delete(run)  # a clean-up leaves them
    assert (run / "report.md").exists() and (run / "evaluation.json.kept-1").read_text() == '{"r2": 0.9}'
    assert not (run / "report.new.md").exists() and not (run / "evaluation.json").exists()  # CloudML's


def test_a_file_kept_aside_in_a_listed_folder_stays_the_users(tmp_path):
    """NAME.kept-N holds the bytes a user changed (kept aside before CloudML wrote its own): inside a folder
    CloudML listed (plots/, a bucket's flight cache) it is still never CloudML's, and a clean-up of the
    folder leaves it (the folder's listing made it CloudML's, and the folder went whole)."""
    run = claimed_run(tmp_path)
    ledger.add(run / "plots")
    (run / "plots").mkdir()
    (run / "plots" / "curves.png").write_bytes(b"CloudML's")
    (run / "plots" / "curves.png.kept-1").write_bytes(b"the user's")
    assert ledger.mine(run / "plots" / "curves.png") and not ledger.mine(run / "plots" / "curves.png.kept-1")
    (run / "plots" / "scatter.png.kept-1").mkdir()  # a folder the user put where a file was, kept aside
    (run / "plots" / "scatter.png.kept-1" / "mine.txt").write_bytes(b"the user's")
    assert not ledger.mine(run / "plots" / "scatter.png.kept-1" / "mine.txt")
    assert not ledger.delete(run / "plots")
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["curves.png.kept-1", "scatter.png.kept-1"]
    assert (run / "plots" / "scatter.png.kept-1" / "mine.txt").read_bytes() == b"the user's"


def test_a_write_cut_off_after_an_edited_file_was_kept_aside_leaves_its_name_to_the_user(tmp_path):
    """evaluation.json edited by the user is kept as evaluation.json.kept-1; the write of CloudML's own is
    then cut off (a kill, a full disk): the name is no longer CloudML's, so a file the user puts there later
    is refused by name, not replaced without a word."""
    from cloudml_lib.base.outputs import atomic_path, write_text

    run = claimed_run(tmp_path)
    write_text(run / "evaluation.json", "CloudML's\n")
    (run / "evaluation.json").write_text("edited\n")
    with pytest.raises(KeyboardInterrupt), atomic_path(run / "evaluation.json"):
        raise KeyboardInterrupt  # the process stopped mid-write
    assert (run / "evaluation.json.kept-1").read_text() == "edited\n"
    assert "evaluation.json" not in ledger.listed(run)
    (run / "evaluation.json").write_text("the user's own, put here later\n")
    with pytest.raises(CloudMLError, match="evaluation.json was not written by CloudML"):
        write_text(run / "evaluation.json", "CloudML's again\n")
    assert (run / "evaluation.json").read_text() == "the user's own, put here later\n"


def test_a_kill_between_the_record_and_the_rename_leaves_the_old_file_cloudmls(tmp_path):
    from cloudml_lib.base.outputs import write_text

    run = claimed_run(tmp_path)
    write_text(run / "run.json", '{"step": 1}')
    newer = run / ".run.json.tmp-1"
    newer.write_text('{"step": 2}')
    ledger.add(run / "run.json", content=newer)  # recorded; killed before the rename
    assert ledger.mine(run / "run.json")
    os.replace(newer, run / "run.json")
    assert ledger.mine(run / "run.json")


def test_an_appended_file_is_checked_by_its_fingerprint_not_read_again_at_every_line(tmp_path, monkeypatch):
    """train.log and metrics.jsonl: the fingerprint of what CloudML appended (size and sha256) is kept as the
    lines go and recorded with the ledger; a later process finds the file CloudML's by it. Cut or rewritten
    by the user: refused, naming it. Longer than its record (a process killed after its last record, or a
    user's added line): CloudML's. A truncation to a checkpoint's size is recorded before it is made."""
    from cloudml_lib.base.outputs import append_text

    run = claimed_run(tmp_path)
    log = run / "metrics.jsonl"
    for i in range(3):
        append_text(log, f'{{"step": {i}}}\n')
    reads = []
    real = store.sha256_of
    for module in (ledger, store):
        monkeypatch.setattr(module, "sha256_of", lambda *a: reads.append(a) or real(*a))
    append_text(log, '{"step": 3}\n')
    assert reads == []  # this process's own appends: a stat, no read
    ledger.flush()
    monkeypatch.setattr(ledger, "_growing", {})  # a new process
    assert ledger.mine(log)
    append_text(log, '{"step": 4}\n')  # longer than the record: the last lines came after it
    ledger.flush()
    monkeypatch.setattr(ledger, "_growing", {})
    ledger.truncating(log, len('{"step": 0}\n') * 2)  # recorded; killed before the cut
    monkeypatch.setattr(ledger, "_growing", {})
    assert ledger.mine(log)
    text = log.read_text()
    log.write_text(text.replace('"step": 1', '"step": 9'))  # the user's edit, the same size
    monkeypatch.setattr(ledger, "_growing", {})
    with pytest.raises(CloudMLError, match="metrics.jsonl was changed after CloudML wrote it"):
        append_text(log, '{"step": 5}\n')
    log.write_text(text[:10])  # cut
    with pytest.raises(CloudMLError, match=r"it holds 10 bytes, of the 24 CloudML wrote"):
        append_text(log, '{"step": 5}\n')
    assert log.read_text() == text[:10]


class _SignalInUpdate:
    """A sha256 whose update is followed at once by a signal (torchrun's SIGTERM, raised as KeyboardInterrupt
    by CloudML's handler), or by the checkpoint writer's thread taking its turn: once, when armed."""

    armed = False

    def __init__(self, h=b""):
        self.h = hashlib.sha256(h) if isinstance(h, bytes) else h

    def update(self, data):
        self.h.update(data)
        if _SignalInUpdate.armed:
            _SignalInUpdate.armed = False
            raise KeyboardInterrupt("SIGTERM")

    def copy(self):
        return _SignalInUpdate(self.h.copy())

    def hexdigest(self):
        return self.h.hexdigest()


def test_a_signal_in_the_middle_of_an_append_leaves_the_log_cloudmls(tmp_path, monkeypatch):
    """A job stopped (SIGTERM) as a line went into train.log: the fingerprint is never half of an append (a
    hash of more bytes than its size), which the next launch took for a user's edit and refused the run's
    own log (one full suite run in several, after a peer process was killed)."""
    from cloudml_lib.base.outputs import append_text

    run = claimed_run(tmp_path)
    log = run / "train.log"
    monkeypatch.setattr(ledger, "hashlib", SimpleNamespace(sha256=_SignalInUpdate))  # the ledger's alone
    append_text(log, "first line\n")
    _SignalInUpdate.armed = True
    with pytest.raises(KeyboardInterrupt):
        append_text(log, "the line the signal came in\n")
    ledger.flush()  # at the process's exit
    monkeypatch.setattr(ledger, "_growing", {})  # the next launch
    assert ledger.mine(log)
    append_text(log, "resumed\n")
    assert log.read_text() == "first line\nthe line the signal came in\nresumed\n"


class _FlushOnce:
    """train.log's file, whose next flush first does `before` (a signal's handler writing its own line, or a
    full disk: OSError), once."""

    def __init__(self, f, before):
        self.f, self.before = f, before

    def flush(self):
        before, self.before = self.before, None
        if before is not None:
            before()
        self.f.flush()

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("event", ["a handler's line in between", "a full disk, then space"])
def test_a_log_line_not_counted_as_written_never_makes_the_runs_own_log_the_users(
    tmp_path, monkeypatch, event
):
    """train.log is opened once a run: a SIGTERM whose handler logs its own line while a line is being
    written, or a line that failed on a full disk and went out with the next, left the fingerprint out of
    step with the file, and the next start refused the run's own log as edited by the user. The file no
    longer ends where the appends add up to: the fingerprint is dropped, the ledger keeps its last record
    (a part of the file), which verifies."""
    from cloudml_lib.base.outputs import open_append

    run = claimed_run(tmp_path)
    log = run / "train.log"
    f = open_append(log)
    f.write("step 1\n")
    ledger.flush()

    def handler():
        f._f = f._f.f  # the handler's own line goes straight through
        f.write("SIGTERM received\n")

    def full():
        f._f = f._f.f
        raise OSError(28, "No space left on device")

    f._f = _FlushOnce(f._f, handler if event.startswith("a handler") else full)
    try:
        f.write("step 2\n")
    except OSError:
        pass  # said once by the log's handler; the line stays in the buffer
    f.write("stopping\n")
    f.__exit__(None, None, None)
    ledger.flush()
    monkeypatch.setattr(ledger, "_growing", {})  # the next start
    assert ledger.mine(log), ledger.not_mine(log, "append to")
    assert "step 2" in log.read_text() and "stopping" in log.read_text()


def test_evaluate_keeps_a_report_the_user_edited_and_a_resume_refuses_a_rewritten_log(session_runs, tmp_path):
    """Whole commands: `evaluate` on a run whose report.md a user rewrote writes report.new.md and says so
    (report.md kept byte-identical; it was replaced without a word); `train` on a stopped run whose
    train.log the user rewrote refuses, naming it, and changes nothing (it appended to the user's file)."""
    from conftest import digest, run_cli

    run = session_runs.copy(session_runs.finished(), tmp_path / "run")
    notes = "# My reading of this run\n"
    (run / "report.md").write_text(notes)
    r = run_cli("evaluate", "--run-dir", run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "report.md").read_text() == notes and "## Test flights" in (
        run / "report.new.md"
    ).read_text()
    assert f"{run / 'report.md'} was edited after CloudML wrote it: it is kept" in r.stdout + r.stderr
    stopped = session_runs.copy(session_runs.killed("step:8"), tmp_path / "stopped")
    (stopped / "train.log").write_text("my own log of this run\n")
    before = digest(stopped)
    r = run_cli("train", "--config", session_runs.cfg, "--run-dir", stopped)
    said = r.stdout + r.stderr
    assert r.returncode != 0 and f"{stopped / 'train.log'} was changed after CloudML wrote it" in said, said
    after = digest(stopped)
    assert "Traceback" not in said and after["train.log"] == before["train.log"]
    # what changed is CloudML's bookkeeping: the run lock, and run.json's record of the failure
    assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} <= {
        ".lock",
        "run.json",
        LEDGER,
    }
    assert "train.log was changed after CloudML wrote it" in (stopped / "run.json").read_text()


def test_a_path_through_a_linked_folder_and_dotdot_is_judged_where_the_system_finds_it(tmp_path):
    """`elsewhere/link/../notes.txt` with `link` a link to the run's `plots/`: the system opens the run's own
    notes.txt, a user's file CloudML did not write; judged by its text (os.path.abspath drops `link/..`) it
    lay in no claimed folder, and CloudML would have written over it. The same for its own listed file."""
    from cloudml_lib.base.outputs import write_text

    run = claimed_run(tmp_path)
    (run / "plots").mkdir()
    (run / "notes.txt").write_text("the user's\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "link").symlink_to(run / "plots", target_is_directory=True)
    through = elsewhere / "link" / ".." / "notes.txt"
    assert not ledger.mine(through)
    with pytest.raises(CloudMLError, match="notes.txt"):
        write_text(through, "CloudML's\n")
    assert (run / "notes.txt").read_text() == "the user's\n"
    write_text(run / "report.md", "CloudML's\n")
    assert ledger.mine(elsewhere / "link" / ".." / "report.md")
    write_text(elsewhere / "link" / ".." / "report.md", "CloudML's, again\n")  # its own: written over
    assert (run / "report.md").read_text() == "CloudML's, again\n" and not (elsewhere / "report.md").exists()
    assert ledger.located(through) == str(run / "notes.txt")


def test_a_folder_on_this_machine_is_held_by_the_process_and_a_file_it_cannot_read_is_kept(
    tmp_path, monkeypatch
):
    """A folder's record is changed under this process's thread lock (the checkpoint writer's thread and the
    appends' fingerprints: without it two threads lost entries, and a writer iterated the fingerprints while
    the main thread added one), and a file of it that cannot be read (permissions, an I/O error) is judged
    the user's and kept aside with its words, never a traceback (a bucket's failure is raised instead)."""
    import threading

    from cloudml_lib.base.outputs import write_text

    run = claimed_run(tmp_path)
    seen = []
    with ledger._holding(Folder(run)):
        t = threading.Thread(target=lambda: seen.append(ledger._lock.acquire(blocking=False)))
        t.start()
        t.join()
    assert seen == [False]
    write_text(run / "report.md", "CloudML's\n")
    unreadable = Folder.sha256

    def denied(self, rel, size=None):
        if rel == "report.md":
            raise PermissionError(13, "Permission denied", str(self.at(rel)))
        return unreadable(self, rel, size)

    monkeypatch.setattr(Folder, "sha256", denied)
    assert not ledger.mine(run / "report.md")
    assert ledger.differs(Folder(run), "report.md", {"size": 10, "sha256": ["x"]}) == (
        "it cannot be read (Permission denied)"
    )
    assert Folder(run).local and Folder(run).key("a/b") == os.path.abspath(run / "a" / "b")
