"""The suite's own machinery (conftest.py): a command run in the test's process behaves as in a process of its
own and leaves the process as it found it, and one Ctrl-C stops the suite even while CloudML's own handler
holds SIGINT (a command's, which turns it into exit status 130, or a training loop's, which stops at the next
step)."""

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from conftest import REPO, run_cli

INNER = """
import os
import time
from pathlib import Path

from conftest import run_cli


def mark():
    Path(os.environ["MARK"]).write_text("waiting")


def test_a_command_in_this_process(monkeypatch):
    from cloudml_lib.commands import cli

    def waits(args):
        mark()
        time.sleep(60)
        return 0

    monkeypatch.setattr(cli, "_status", waits)
    assert run_cli("status", "x").returncode == 0


def test_a_training_loop_in_this_process():
    from cloudml_lib.train.signals import StopRequest

    stop = StopRequest()
    with stop.trapped():  # as Trainer.fit holds SIGINT: the first Ctrl-C stops at the next step
        mark()
        for _ in range(600):
            if stop.asked:
                break
            time.sleep(0.1)


def test_after():
    Path(os.environ["MARK"] + ".after").write_text("ran")
"""


@pytest.mark.slow
@pytest.mark.parametrize("which", ["a_command", "a_training_loop"])
def test_one_ctrl_c_stops_the_suite_while_cloudml_holds_sigint(tmp_path, which):
    (tmp_path / "test_inner.py").write_text(INNER)
    mark = tmp_path / "mark"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]), MARK=str(mark))
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider", "-k",
         f"{which} or after", "test_inner.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not mark.exists() and inner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mark.exists(), inner.communicate(timeout=60)[0][-3000:]
    inner.send_signal(signal.SIGINT)  # what the terminal sends pytest on Ctrl-C
    out = inner.communicate(timeout=120)[0]
    assert inner.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
    assert not (tmp_path / "mark.after").exists(), "the suite went on after one Ctrl-C"


def test_a_command_in_this_process_leaves_the_process_as_it_found_it(tmp_path):
    logger = logging.getLogger("cloudml_lib")

    def state():
        return (
            os.getcwd(), dict(os.environ), tempfile.gettempdir(), torch.get_num_threads(),
            list(logger.handlers), logger.propagate, signal.getsignal(signal.SIGINT),
            signal.getsignal(signal.SIGTERM),
        )  # fmt: skip

    before = state()
    (tmp_path / "vm").mkdir()
    env = {"TMPDIR": str(tmp_path / "vm"), "OMP_NUM_THREADS": "1", "CLOUDML_TEST_MARK": "1"}
    r = run_cli("make-demo-data", "--out", tmp_path / "flights", "--flights", "2", "--frames", "10", env=env)
    assert r.returncode == 0 and "wrote 2 flights" in r.stdout, r.stderr
    assert state() == before


def test_a_command_in_this_process_sees_its_environment_and_a_fresh_process_memory(tmp_path, monkeypatch):
    """TMPDIR (tempfile caches its folder), OMP_NUM_THREADS (torch reads it once), and what CloudML says once
    per process: as a process of its own would."""
    from cloudml_lib.commands import cli

    seen = []

    def notes(args):
        from cloudml_lib.train import build

        seen.append((tempfile.gettempdir(), torch.get_num_threads(), set(build._SHOWN_TABLES)))
        build._SHOWN_TABLES.add("a table said in this command")
        return 0

    monkeypatch.setattr(cli, "_status", notes)
    (tmp_path / "vm").mkdir()
    for _ in range(2):
        assert (
            run_cli("status", "x", env={"TMPDIR": str(tmp_path / "vm"), "OMP_NUM_THREADS": "1"}).returncode
            == 0
        )
    assert seen == [(str(tmp_path / "vm"), 1, set())] * 2


def test_a_killed_command_runs_in_a_fork_that_starts_as_a_new_process(tmp_path, monkeypatch):
    """run_cli with CLOUDML_KILL_AT: a process of its own (killed for real, its exit status the kill's),
    forked from pytest's but started as `python -m cloudml_lib` would be; pytest's exit handlers stay
    pytest's."""
    import atexit
    import json

    from cloudml_lib.base import faults
    from cloudml_lib.commands import cli
    from cloudml_lib.train import build

    def notes(args):
        print(json.dumps({
            "pid": os.getpid(), "tmp": tempfile.gettempdir(), "threads": torch.get_num_threads(),
            "tables": sorted(build._SHOWN_TABLES), "cwd": os.getcwd(),
            "mark": os.environ.get("CLOUDML_TEST_MARK"),
        }), flush=True)  # fmt: skip
        faults.point("step")
        return 0

    monkeypatch.setattr(cli, "_status", notes)
    monkeypatch.setattr(build, "_SHOWN_TABLES", {"a table said in pytest's process"})
    ran = tmp_path / "pytest's exit handler ran"
    handler = ran.touch
    atexit.register(handler)
    try:
        (tmp_path / "vm").mkdir()
        env = {"TMPDIR": str(tmp_path / "vm"), "OMP_NUM_THREADS": "1", "CLOUDML_TEST_MARK": "1"}
        killed = run_cli("status", "x", cwd=tmp_path, env={**env, "CLOUDML_KILL_AT": "step:1"})
        ended = run_cli("status", "x", cwd=tmp_path, env={**env, "CLOUDML_KILL_AT": "step:2"})
    finally:
        atexit.unregister(handler)
    assert killed.returncode == -signal.SIGKILL and ended.returncode == 0, (killed, ended)
    seen = [json.loads(r.stdout) for r in (killed, ended)]
    assert seen[0]["pid"] != os.getpid() != seen[1]["pid"]
    for child in seen:
        assert {k: v for k, v in child.items() if k != "pid"} == {
            "tmp": str(tmp_path / "vm"), "threads": 1, "tables": [], "cwd": str(tmp_path), "mark": "1",
        }  # fmt: skip
    assert not ran.exists() and os.environ.get("CLOUDML_TEST_MARK") is None
    assert build._SHOWN_TABLES == {"a table said in pytest's process"}


def test_a_forked_command_past_its_time_limit_is_killed_with_timeout_expired(monkeypatch):
    from cloudml_lib.commands import cli

    monkeypatch.setattr(cli, "_status", lambda args: time.sleep(30) or 0)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("status", "x", env={"CLOUDML_KILL_AT": "step:1"}, timeout=1)
    assert time.monotonic() - started < 10


def test_a_command_past_its_time_limit_is_stopped_with_timeout_expired(monkeypatch):
    from cloudml_lib.commands import cli

    def hangs(args):
        try:
            time.sleep(30)
        except Exception:  # noqa: BLE001 - a command's own broad handler must not swallow the limit
            pass
        return 0

    monkeypatch.setattr(cli, "_status", hangs)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("status", "x", timeout=1)
    assert time.monotonic() - started < 20


def test_an_unexpected_failure_in_process_is_exit_status_1_with_its_traceback(monkeypatch):
    from cloudml_lib.commands import cli

    def fails(args):
        raise ValueError("an unexpected failure")

    monkeypatch.setattr(cli, "_status", fails)
    r = run_cli("status", "x")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ValueError: an unexpected failure" in r.stderr
    assert run_cli("no-such-command").returncode == 2  # argparse's own exit status
    assert run_cli("--version").returncode == 0


def test_under_xdist_the_longest_files_go_first_and_the_twin_fourth(tmp_path, monkeypatch):
    """The order whole files are handed to the workers: by the seconds the last recorded run took, a file
    never timed first, the Colab twin's tests fourth of the timed ones (its environment is built meanwhile);
    without a record that reads, the collection's order."""
    import json

    import conftest

    groups = ["test_a", conftest.TWIN_GROUP, "test_b", "notebooks", "test_new", "test_c", "test_d", "test_e"]
    seconds = {"test_a": 5.0, "test_b": 50.0, "notebooks": 30.0, "test_c": 1.0, conftest.TWIN_GROUP: 300.0}
    seconds["test_d"] = 2.0
    order = conftest.groups_in_order(groups, seconds)
    assert order == [
        "test_new",
        "test_e",
        "test_b",
        "notebooks",
        "test_a",
        conftest.TWIN_GROUP,
        "test_d",
        "test_c",
    ]
    # the twin after three timed files however many new ones come first (they once put it 5 s into the run)
    assert conftest.groups_in_order(["test_x", "test_y", "test_z", conftest.TWIN_GROUP], {"test_z": 9.0}) == [
        "test_x",
        "test_y",
        "test_z",
        conftest.TWIN_GROUP,
    ]
    record = {
        "commits": {
            "old": {"fresh_clone": {"files_s": {"tests/test_a.py": 1.0}}},
            "new": {
                "fresh_clone": {
                    "files_s": {
                        "tests/test_a.py": 2.0,
                        "colab_setup.ipynb": 3.0,
                        "colab_training.ipynb": 4.0,
                        "tests/test_colab_twin.py": 9.0,
                    }
                },
                "quick": {"files_s": {"tests/test_a.py": 0.5}},
            },
        }
    }
    results = tmp_path / "suite.json"
    results.write_text(json.dumps(record))
    monkeypatch.setattr(conftest, "SUITE_RESULTS", results)
    got = conftest.recorded_group_seconds(False)
    assert got == {"test_a": 2.0, "notebooks": 7.0, conftest.TWIN_GROUP: 9.0}
    assert conftest.recorded_group_seconds(True) == {"test_a": 0.5}
    results.write_text("{not json")
    assert conftest.recorded_group_seconds(False) == {}
    assert conftest.groups_in_order(["test_x", "test_y"], {}) == ["test_x", "test_y"]


def test_a_kept_twin_environment_moved_to_another_folder_is_built_again(tmp_path):
    """A virtual environment's scripts start the python of the folder it was built in: one moved since (its
    tensorboard could not start) is not taken as kept; one where it was built is."""
    from install_helpers import _scripts_start

    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text("")
    (bin_ / "activate").write_text("# no first line naming a python\n")
    (bin_ / "tensorboard").write_text(f"#!{bin_ / 'python'}\nimport sys\n")
    assert _scripts_start(bin_ / "python")
    (bin_ / "jupyter").write_text("#!/where/it/was/built/venv/bin/python3.13\nimport sys\n")
    assert not _scripts_start(bin_ / "python")


def _token_of(pid: int) -> str:
    from conftest import SUITE_TOKEN

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError as e:
        return f"unreadable: {e}"
    mine = [e.decode() for e in entries if e.startswith(SUITE_TOKEN.encode())]
    return mine[0] if mine else f"none of its {len(entries)} entries"


def test_a_process_the_suite_left_running_is_found_by_its_token():
    """conftest's end of session kills what the tests left running (found by the token in its environment,
    however it was started), never a process of another session or one started before."""
    from conftest import SUITE_TOKEN, processes_left_behind

    token = os.environ[SUITE_TOKEN]
    other = subprocess.Popen(["sleep", "60"], env=dict(os.environ, **{SUITE_TOKEN: "another-session"}))
    seen = []  # of each try: (pid, exit status before the kill, command found, its token as /proc shows it)
    try:
        # a process just started can be missed by one look at /proc (CI once found no trace of it there, on
        # a busy machine): it is looked for until found, for 5 s, and a fresh one is started if it ended
        # meanwhile (the test is of the search, not of the process staying alive)
        for _attempt in range(3):
            mine = subprocess.Popen(["sleep", "60"], start_new_session=True)  # not in the suite's group
            try:
                deadline = time.monotonic() + 5
                while True:
                    found = dict(processes_left_behind(token))
                    assert other.pid not in found and os.getpid() not in found, found
                    if found.get(mine.pid) or mine.poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                seen.append((mine.pid, mine.poll(), found.get(mine.pid), _token_of(mine.pid)))
            finally:
                mine.kill()
                mine.wait()
            if seen[-1][1] is None:
                break  # it ran all the while, found or not: the verdict
        assert seen[-1][2] == "sleep 60", f"this session's token is {token}; the tries: {seen}"
    finally:
        other.kill()
        other.wait()
    assert mine.pid not in dict(processes_left_behind(token))  # ended and reaped: not listed
