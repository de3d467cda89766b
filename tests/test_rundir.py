import json
import os
import socket
import subprocess
import time

import pytest
import yaml

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.liveness import STALE_S
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.resume import compare_configs
from cloudml_lib.core.run.runlock import RunLock


def write_lock(run, **info):
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lock").write_text(json.dumps(info))


def test_a_live_trainer_on_this_host_keeps_its_lock(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        write_lock(tmp_path, host=socket.gethostname(), pid=proc.pid, heartbeat=time.time())
        with pytest.raises(CloudMLError, match=f"in use by another trainer .*pid {proc.pid}"):
            RunLock(RunFolder(tmp_path)).acquire()
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_trainers_lock_is_taken_over(tmp_path):
    proc = subprocess.Popen(["true"])
    proc.wait()
    write_lock(tmp_path, host=socket.gethostname(), pid=proc.pid, heartbeat=time.time())
    lock = RunLock(RunFolder(tmp_path))
    lock.acquire()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == lock.me["pid"]
    lock.release()
    assert not (tmp_path / ".lock").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="a process's state is read from /proc")
def test_a_trainer_that_ended_but_was_not_yet_reaped_holds_no_lock(tmp_path):
    """A killed trainer is a zombie until the system's first process collects it: its pid still answers a
    signal, but it writes nothing more. A parallel sweep resumed while its killed workers were zombies
    would have failed their trials as "in use by another trainer"."""
    proc = subprocess.Popen(["true"])  # ended, and never waited for while the lock is judged: a zombie
    try:
        deadline = time.time() + 30
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.time() < deadline
            time.sleep(0.01)
        now = time.time()
        write_lock(tmp_path, host=socket.gethostname(), pid=proc.pid, started=now, heartbeat=now)
        lock = RunLock(RunFolder(tmp_path))
        lock.acquire()
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == lock.me["pid"]
        lock.release()
    finally:
        proc.wait()


def test_another_runtimes_lock_counts_while_its_heartbeat_is_fresh(tmp_path):
    write_lock(tmp_path, host="colab-vm-old", pid=123, heartbeat=time.time() - 10)
    with pytest.raises(CloudMLError, match="host colab-vm-old"):
        RunLock(RunFolder(tmp_path)).acquire()
    write_lock(tmp_path, host="colab-vm-old", pid=123, heartbeat=time.time() - STALE_S - 5)
    lock = RunLock(RunFolder(tmp_path))
    lock.acquire()  # the old VM is gone: taken over
    lock.release()


def test_config_differences_are_sorted_into_math_and_harmless():
    saved = {
        "train": {"seed": 1, "epochs": 5, "batch_size": 16},
        "data": {"dir": "a", "temporal_frames": 5},
        "checkpoint": {"every_steps": 100},
    }
    now = {
        "train": {"seed": 2, "epochs": 9, "batch_size": 16},
        "data": {"dir": "b", "temporal_frames": 3},
        "checkpoint": {"every_steps": 50},
    }
    math, harmless = compare_configs(saved, now)
    assert math == ["data.temporal_frames (checkpoint 5, now 3)", "train.seed (checkpoint 1, now 2)"]
    assert harmless == [
        "checkpoint.every_steps (checkpoint 100, now 50)",
        "data.dir (checkpoint 'a', now 'b')",
        "train.epochs (checkpoint 5, now 9)",
    ]


def _acquire_at_once(run_dir, barrier, results):
    from cloudml_lib.base.errors import CloudMLError as Refused
    from cloudml_lib.core.run.runlock import RunLock as Lock

    lock = Lock(RunFolder(run_dir))
    barrier.wait()
    try:
        lock.acquire()
        results.put(1)
        time.sleep(0.3)
        lock.release()
    except Refused:
        results.put(0)


@pytest.mark.slow
def test_two_trainers_starting_at_the_same_moment_never_both_get_the_lock(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for trial in range(15):
        run, barrier, results = tmp_path / f"run{trial}", ctx.Barrier(2), ctx.Queue()
        run.mkdir()
        procs = [ctx.Process(target=_acquire_at_once, args=(run, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        # a child that died before answering (an import error) fails here instead of hanging
        assert sorted([results.get(timeout=30), results.get(timeout=30)]) == [0, 1], f"trial {trial}"


# ------------------------------------------------------------------ the run folder is the user's


def _folder_of_other_things(tmp_path):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    (home / ".bashrc").write_text("")
    return home


@pytest.mark.parametrize("command", ["train", "crossval", "sweep"])
def test_a_folder_of_other_things_is_refused_by_every_command_that_writes_a_run(
    command, tiny_raw_config, tmp_path, capsys
):
    from cloudml_lib.commands.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    home = _folder_of_other_things(tmp_path)
    before = sorted(p.name for p in home.iterdir())
    extra = ["--trials", "1"] if command == "sweep" else []
    assert main([command, "--config", str(cfg), "--run-dir", str(home), *extra]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {home} holds other things (Documents, notes.txt)" in err
    assert "new or empty folder" in err and "or an existing" in err and "Traceback" not in err
    assert sorted(p.name for p in home.iterdir()) == before  # nothing written


def test_an_empty_run_dir_is_refused_not_taken_for_a_default(capsys):
    from cloudml_lib.commands.cli import main

    for argv in (["train", "--preset", "demo", "--run-dir", ""], ["predict", "--run-dir", "x", "--out", " "]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "is empty; name a folder" in capsys.readouterr().err


def test_a_run_file_that_is_a_link_stops_train_before_anything_is_written(tiny_raw_config, tmp_path, capsys):
    from cloudml_lib.commands.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    outside = tmp_path / "outside.jsonl"
    outside.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside)
    assert main(["train", "--config", str(cfg), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'} is a symbolic link (to {outside})" in err and "Traceback" not in err
    assert outside.read_text() == "keep\n" and sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_a_lock_whose_pid_was_given_to_a_later_process_is_not_held():
    """A dead trainer's pid, given again (a restarted VM, a busy machine), made the old-run fixtures' sweep
    "in use by another trainer" by chance. A process that started after the lock was written is not its
    writer."""
    import socket
    import time

    from cloudml_lib.base.liveness import holder_alive, process_started

    here, me = socket.gethostname(), os.getppid()  # the parent: alive, and not this process
    born = process_started(me)
    if born is None:
        pytest.skip("this system does not say when a process started (no /proc)")
    assert abs(born - time.time()) < 10 * 86400
    assert holder_alive({"host": here, "pid": me, "started": born + 1.0})  # written after it started
    assert not holder_alive({"host": here, "pid": me, "started": born - 3600.0})  # before: another's pid
    assert holder_alive({"host": here, "pid": me})  # an older lock without "started": the pid decides


def test_a_reader_change_on_the_original_files_is_told_apart_from_changed_data(tiny_run):
    """A run stopped under the previous release, resumed on its very files, was refused with "the data
    differs ... Resume with the original data": the files are the original; the reader changed."""
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.colab.live import notebook_words
    from cloudml_lib.core.run.resume import check_data_fingerprint, recorded_files

    run_dir = tiny_run[0]
    files = recorded_files(RunFolder(run_dir))
    name = next(iter(files))
    assert files[name] and all(len(h) == 64 for h in files[name].values())
    saved = {name: {"samples": 40, "sha256": "a" * 16}}  # an old checkpoint: no file hashes of its own
    reread = {name: {"samples": 38, "sha256": "b" * 16, "files": dict(files[name])}}
    with pytest.raises(CloudMLError) as e:
        check_data_fingerprint(saved, reread, files)
    said = str(e.value)
    assert f"flight {name}: 40 samples in the checkpoint, 38 now; its files are unchanged" in said
    assert "what changed is how CloudML reads them" in said and "Resume with the original data" not in said
    assert 'choose "Start a new run" in the picker' in notebook_words(said)  # the picker's words
    edited = {name: {**reread[name], "files": {**files[name], "ir": "c" * 64}}}
    with pytest.raises(CloudMLError, match="the data differs from the data this run was trained on"):
        check_data_fingerprint(saved, edited, files)
    check_data_fingerprint(saved, {name: {"samples": 40, "sha256": "a" * 16, "files": {}}}, files)  # same


@pytest.mark.parametrize("pid", [0, -1, 2**31, 2**63])
def test_a_lock_naming_no_possible_process_is_taken_over(tmp_path, pid):
    """0 and -1 name groups of processes (os.kill(0, 0) succeeds: the lock was "in use" for ever), 2**31 and
    above overflowed into a traceback: none is a process, so no trainer holds the lock."""
    write_lock(tmp_path, host=socket.gethostname(), pid=pid, heartbeat=time.time())
    lock = RunLock(RunFolder(tmp_path))
    lock.acquire()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_same_host_lock_of_the_first_process_counts_only_while_its_heartbeat_is_fresh(tmp_path):
    """Pid 1 is always running (init, or a container's command): judged by its heartbeat, as the words say."""
    write_lock(tmp_path, host=socket.gethostname(), pid=1, heartbeat=time.time() - 5, started=0.0)
    with pytest.raises(
        CloudMLError, match=f"taken over automatically {STALE_S:.0f} s after its last heartbeat"
    ):
        RunLock(RunFolder(tmp_path)).acquire()
    write_lock(tmp_path, host=socket.gethostname(), pid=1, heartbeat=time.time() - STALE_S - 5, started=0.0)
    lock = RunLock(RunFolder(tmp_path))
    lock.acquire()
    lock.release()


def test_a_live_same_host_holder_is_waited_for_in_words_that_hold(tmp_path):
    """A live process of this machine keeps the lock whatever its heartbeat's age (an older release never
    wrote one): the refusal says the lock is taken over when the process ends, not after 90 s."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        write_lock(tmp_path, host=socket.gethostname(), pid=proc.pid)  # an older release's lock: no heartbeat
        with pytest.raises(CloudMLError) as e:
            RunLock(RunFolder(tmp_path)).acquire()
        words = str(e.value)
        assert f"pid {proc.pid}, a running process of this machine; last heartbeat never" in words
        assert "taken over once that process has ended" in words and "90 s" not in words
    finally:
        proc.kill()
        proc.wait()


def test_a_run_folder_through_dot_dot_is_checked_where_its_files_land(tiny_flights, tmp_path):
    """`--run-dir runs/never_made/../H` was checked as a new folder (the path unnormalised: never_made does
    not exist), then mkdir(parents=True) made never_made and the run's files landed in runs/H, a user's
    folder. Resolved first: runs/H is checked, refused as another's, and nothing is made or changed."""
    from conftest import run_cli, tiny_raw

    data, entries = tiny_flights
    user = tmp_path / "runs" / "H"
    user.mkdir(parents=True)
    (user / "notes.txt").write_text("mine\n")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(data, entries, tmp_path / "cache")))
    r = run_cli("train", "--config", cfg, "--run-dir", "runs/never_made/../H", cwd=tmp_path, timeout=600)
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in said and str(user) in said, said
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["H"]  # no never_made
    assert (
        sorted(p.name for p in user.iterdir()) == ["notes.txt"]
        and (user / "notes.txt").read_text() == "mine\n"
    )


def test_a_run_folders_objects_of_one_path_are_one_folder(tmp_path):
    """A RunLayout and a RunFolder of one path are one folder (equal, one set entry, sorted by path), so that
    a mix of the two in a set, a dict or sorted() never splits or misorders a run; a path is no layout."""
    from cloudml_lib.base.layout import RunLayout

    a, b = RunLayout(tmp_path / "b"), RunFolder(tmp_path / "b")
    assert a == b and len({a, b}) == 1 and {b: 1}[a] == 1
    assert a != tmp_path / "b" and RunFolder(tmp_path / "a") != b
    assert sorted([b, RunLayout(tmp_path / "a")]) == [RunFolder(tmp_path / "a"), a]
