"""What the notebook's live view says about a command it runs (issue 38): every warning or error the package
logs reaches it with its level (amber, or a red "Problem"), whatever its words; a failed checkpoint is never
called saved; a failure the notebook shows is in train.log too; terminal advice is said in the notebook's
words; cross-validation shows its fold; the curves keep every marker and the legend clear of the lines;
TensorBoard opens on the loss curves."""

from __future__ import annotations

import ast
import errno
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import tiny_raw

from cloudml_lib.base import logs
from cloudml_lib.colab import live
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.science import plots

PACKAGE = Path(__file__).resolve().parents[1] / "cloudml_lib"
LEVELS = {"warning": logging.WARNING, "error": logging.ERROR, "exception": logging.ERROR, "critical": 50}


@pytest.fixture
def console():
    """The console handler the CLI attaches (logs.attach_run_log), writing into a buffer; the package
    logger's handlers are put back afterwards."""
    logger = logging.getLogger(logs.PACKAGE_LOGGER)
    saved = list(logger.handlers)
    out = io.StringIO()
    logs.attach_run_log(None, console=out)
    yield out
    for h in list(logger.handlers):
        logger.removeHandler(h)
    for h in saved:
        logger.addHandler(h)


def logging_calls() -> list[tuple[str, str, str]]:
    """(where, level, message) of every `log.warning(` / `log.error(` ... in the package, including
    `(log.info if ... else log.warning)(...)`: the message as written (a constant, or its source)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            funcs = [node.func.body, node.func.orelse] if isinstance(node.func, ast.IfExp) else [node.func]
            for f in funcs:
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "log":
                    if f.attr in LEVELS:
                        first = node.args[0]
                        text = first.value if isinstance(first, ast.Constant) else ast.unparse(first)
                        found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", f.attr, str(text)))
    return found


# ------------------------------------------------------------------ levels (defect 8)


def test_every_warning_and_error_the_package_logs_reaches_the_notebook_with_its_level(console):
    calls = logging_calls()
    assert len(calls) > 40, calls  # the walk finds the package's warnings (about 60 today)
    assert any("no prediction intervals" in m for _, _, m in calls)  # the ones the issue names
    logger = logging.getLogger("cloudml_lib.somewhere")
    wrong = []
    for where, level, message in calls:
        console.seek(0), console.truncate()
        logger.log(LEVELS[level], message)  # no args: the text is printed as written
        first = console.getvalue().splitlines()[0]
        want = "warning" if LEVELS[level] == logging.WARNING else "problem"
        if live.classify(first) != want:
            wrong.append((where, level, first[:100], live.classify(first)))
    assert wrong == []


def test_an_info_line_is_never_coloured_by_its_words(console):
    logger = logging.getLogger("cloudml_lib.somewhere")
    for text, kind in (
        ("Resumed from step 25 (epoch 2, batch 4/39), saved 3 s ago", "notice"),
        ("torch.compile on the CPU: cannot say yet; it failed before", "notice"),  # words, not a level
        ("Epoch 2/2 | train_loss 0.089 | val_loss 0.173", None),
    ):
        console.seek(0), console.truncate()
        logger.info(text)
        line = console.getvalue().rstrip("\n")
        assert line == text and live.classify(line) == kind, (line, live.classify(line))
        assert "color" not in live.notice_html(line)


def test_warnings_are_amber_and_problems_red_and_say_problem():
    warn = live.notice_html("Warning: 3 missing solar angles: filled with the mean")
    assert warn == '<span style="color:#b45309">&#9888; 3 missing solar angles: filled with the mean</span>'
    problem = live.notice_html("Problem: Checkpoint at step 3 could not be written (OSError: disk full)")
    assert "color:#b91c1c" in problem and "<b>Problem:</b> Checkpoint at step 3" in problem
    assert live.classify("/usr/lib/x/torch/nn.py:12: UserWarning: something old") == "warning"
    assert live.classify("warning: runs/x/train.log cannot be written (No space left on device)") == "warning"


# ------------------------------------------------------------ a forked child and the console's lock

FORKED_CONSOLE = """
import logging, os, signal, threading
from tqdm.auto import tqdm
from cloudml_lib.base import logs

log = logs.attach_run_log(None)
bar = tqdm(total=2, disable=False)  # a progress bar, as a run shows: tqdm's lock exists before any fork

# a child that dies while it holds the console's lock (SIGKILL, the out-of-memory killer)
pid = os.fork()
if pid == 0:
    tqdm.get_lock().acquire()
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
log.info("the parent logs after its child was killed holding the lock")

# a child forked while a thread of the parent holds the lock (a bar refreshing, tqdm's monitor)
held, done = threading.Event(), threading.Event()

def refresh():
    with tqdm.get_lock():
        held.set()
        done.wait(30)

thread = threading.Thread(target=refresh)
thread.start()
held.wait(30)
pid = os.fork()
if pid == 0:
    log.info("the child logs while its parent's thread holds the lock")
    os._exit(0)
_, status = os.waitpid(pid, 0)
done.set()
thread.join()
bar.close()
log.info(f"the child ended with status {os.waitstatus_to_exitcode(status)}")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a forked child needs os.fork")
def test_a_forked_child_never_freezes_its_parents_console_or_its_own():
    """tqdm's console lock is shared with a forked child (a DataLoader worker, the suite's forked runs) by a
    cross-process semaphore: a child killed while it held it froze the parent's next log line for good (CI's
    hang in test_resume, a run killed as its checkpoint committed while a step's line was written), and a
    child forked while a parent's thread held it waited for ever at its first line. A fork now gives the
    child a lock of its own. The process is the point: a failure here hangs it, not the suite."""
    with subprocess.Popen(
        [sys.executable, "-c", FORKED_CONSOLE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a frozen child is stopped with its parent, not left behind
    ) as proc:
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"a log line waited for ever for a lock a forked child held; it printed: {out!r}")
    assert proc.returncode == 0, err
    assert [line for line in out.splitlines() if line.startswith("the ")] == [
        "the parent logs after its child was killed holding the lock",
        "the child logs while its parent's thread holds the lock",
        "the child ended with status 0",
    ], out + err


# ------------------------------------------------------------ a full disk (defect 2), train.log (defect 8)

DISK_FULL_DRIVER = """
import errno, sys
from cloudml_lib.core.run import checkpoint

def full(src, dst):
    raise OSError(errno.ENOSPC, "No space left on device", str(dst))

checkpoint._copy_hashing = full  # every checkpoint write meets a full disk
from cloudml_lib.commands.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_is_a_red_problem_and_never_a_saved_checkpoint(tiny_flights, tmp_path, capsys):
    import ipywidgets  # noqa: F401 - the live view's widgets

    raw = tiny_raw(*tiny_flights, tmp_path / "cache")
    raw["checkpoint"] = {"every_steps": 3}
    cfg, run = tmp_path / "c.yaml", tmp_path / "run"
    cfg.write_text(yaml.safe_dump(raw))
    view = live.LiveView(run)
    cmd = [sys.executable, "-c", DISK_FULL_DRIVER, "train", "--config", str(cfg), "--run-dir", str(run)]
    code = live.run_live(cmd, view, {"CLOUDML_KILL_AT": "step:4:SIGINT"})
    assert code == 130, list(view.lines)[-20:]
    lines = list(view.lines)
    first = next(t for t in lines if "could not be written" in t)
    assert first.startswith("Problem: Checkpoint at step 3 could not be written (OSError: [Errno 28]")
    assert "no checkpoint of this run has been written yet" in first and "intact" not in first
    stop = next(t for t in lines if t.startswith("Problem: Stopped by SIGINT"))
    assert "its checkpoint could not be written" in stop and "checkpoint saved" not in stop
    live.report_end(code, view, "training", run)
    out = capsys.readouterr().out
    shown = view.notices.value + view.label.value + view.placeholder.value + out
    assert "checkpoint saved" not in shown and "progress saved" not in "\n".join(lines)
    assert shown.count("color:#b91c1c") >= 2 and "<b>Problem:</b> Checkpoint at step 3" in view.notices.value
    assert "no checkpoint was saved yet" in view.label.value
    log = (run / "train.log").read_text()
    assert "ERROR Checkpoint at step 3 could not be written" in log


def test_a_first_failed_save_names_no_previous_checkpoint_and_a_later_one_names_its_step(tmp_path):
    from cloudml_lib.core.run.checkpoint import COMMITTED, previous_checkpoint_words

    assert previous_checkpoint_words(RunFolder(tmp_path)).startswith(
        "no checkpoint of this run has been written yet"
    )
    (tmp_path / "checkpoints" / "step-00000006").mkdir(parents=True)  # not committed: does not count
    assert previous_checkpoint_words(RunFolder(tmp_path)).startswith("no checkpoint")
    done = tmp_path / "checkpoints" / "step-00000003"
    done.mkdir()
    (done / COMMITTED).write_text("x")
    assert previous_checkpoint_words(RunFolder(tmp_path)) == (
        "the previous checkpoint is intact (step 3): a resume starts from there."
    )


def test_a_failure_the_command_reports_is_in_train_log_too(tiny_raw_config, tmp_path, monkeypatch, capsys):
    from cloudml_lib.commands import cli
    from cloudml_lib.core.run.runfolder import MetricsFile

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(MetricsFile, "append", full)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    logger = logging.getLogger(logs.PACKAGE_LOGGER)
    saved = list(logger.handlers)
    try:
        assert cli.main(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run")]) == 2
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()
        for h in saved:
            logger.addHandler(h)
    err = capsys.readouterr().err
    said = next(t for t in err.splitlines() if t.startswith("error: "))
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"ERROR {said}" in log and "no space left on the disk holding" in said


# ------------------------------------------------------------------ the notebook's words (defect 11)


def cli_advice() -> list[str]:
    """Every text in the package that gives a terminal's advice the notebook rewrites."""
    advice = re.compile(
        r"same (\w+ )?command|Raise train\.epochs|another --run-dir for a new run|Ctrl-C again"
    )
    out = []
    for path in sorted(p for p in PACKAGE.rglob("*.py") if p.name != "live.py"):  # live.py: the rewriting
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and advice.search(node.value):
                out.append(node.value)
    return out


def test_terminal_advice_is_said_in_the_notebooks_words():
    texts = cli_advice()
    assert len(texts) > 10, texts
    for text in texts:
        said = live.notebook_words(text)
        left = re.findall(
            r"same (?:\w+ )?command(?! with)|train\.epochs|--run-dir for a new run|Ctrl-C", said
        )
        assert not left, (text, said)
    said = live.notebook_words(
        "This run is trained (epoch 2/2); nothing to train. Raise train.epochs to train longer, or use "
        "another --run-dir for a new run."
    )
    assert "Raise Epochs in the picker" in said and '"Start a new run" in the picker' in said
    stop = live.notice_html(
        "Warning: Stopped by SIGINT at step 4; checkpoint saved in r. Run the same command again to resume."
    )
    assert "Run this cell again to resume." in stop
    for (
        line
    ) in (  # a stop the user asked for, as the trainer logs it now (INFO): the notebook's words, neutral
        "SIGINT received: stopping after the current step with a checkpoint (Ctrl-C again to stop at once)",
        "Stopped by SIGINT at step 4; checkpoint saved in r. Run the same command again to resume.",
    ):
        said = live.notice_html(line)
        assert "SIGINT" not in said and "color" not in said and "&#9888;" not in said, said
        assert "Stop (\u25a0) pressed" in said or "Stopped at step 4, as asked (\u25a0)" in said
    # the command line keeps its own words where a flag only it has is meant
    assert "same command with --rebuild-study" in live.notebook_words(
        "run the same command with --rebuild-study"
    )


def test_the_open_log_never_wraps_a_table(tmp_path):
    import ipywidgets  # noqa: F401

    view = live.LiveView(tmp_path / "run")
    view.line("flight   IR file                                  frames  labels kept")
    view.refresh()
    style = re.match(r"<pre style='([^']*)'>", view.log.value).group(1)
    assert "white-space:pre" in style and "word-break:normal" in style and "overflow-x:auto" in style


# ------------------------------------------------------------------ cross-validation's view (defect 10)


def test_the_crossval_view_shows_the_fold_its_curves_and_a_truthful_end(tmp_path, capsys):
    import ipywidgets  # noqa: F401

    cv = tmp_path / "cv"
    view = live.LiveView(None, folds=cv)
    view.line("Cross-validation over 3 flights, each the test flight once: 01Mar25, 12Feb25, 20Feb25")
    view.line("Fold 01Mar25: 01Mar25 is the test flight; training and validating on the other flights")
    (cv / "folds" / "01Mar25").mkdir(parents=True)
    (cv / "folds" / "01Mar25" / "fold.json").write_text("{}")
    view.line("Fold 12Feb25: 12Feb25 is the test flight; training and validating on the other flights")
    view.line('@progress {"step": 5, "total": 8, "epoch": 2, "epochs": 2, "batch": 1, "batches": 4}')
    metrics = cv / "folds" / "12Feb25" / "model" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    epoch = {
        "kind": "epoch",
        "epoch": 1,
        "step": 4,
        "train_loss": 1.0,
        "val_loss": 0.9,
        "r2": 0.2,
        "lr": 1e-3,
    }
    metrics.write_text(json.dumps(epoch) + "\n")
    view.refresh()
    assert "fold 2 of 3 (test flight 12Feb25) &middot; epoch 2 of 2 &middot; step 5 of 8" in view.label.value
    assert view.curves.value[:4] == b"\x89PNG" and view.shown_epochs == 1
    live.report_end(130, view, "cross-validation", None)
    assert "stopped in fold 2 of 3 (test flight 12Feb25); no checkpoint was saved yet" in view.label.value
    assert "1 of 3 folds finished" in view.label.value
    assert "Cross-validation stopped in fold 2 of 3" in capsys.readouterr().out


def test_the_crossval_view_names_a_campaign_fold(tmp_path):
    """data.fold_by campaign: the view reads crossval's own list of campaigns and names the one held out."""
    import ipywidgets  # noqa: F401

    from cloudml_lib.commands.crossval import fold_words

    view = live.LiveView(None, folds=tmp_path / "cv")
    groups = {"GLOVE2025": ["01Mar25", "03Mar25"], "WHYMSIE2024": ["05Mar25"]}
    view.line(f"Cross-validation {fold_words(groups)}")
    view.line(
        "Fold WHYMSIE2024: its flights 05Mar25 are the test flights; training and validating on the others"
    )
    assert view.fold_words() == "fold 2 of 2 (test campaign WHYMSIE2024)"
    flights = live.LiveView(None, folds=tmp_path / "cv2")
    flights.line(f"Cross-validation {fold_words({'01Mar25': ['01Mar25'], '03Mar25': ['03Mar25']})}")
    flights.line("Fold 03Mar25: 03Mar25 is the test flight; training and validating on the other flights")
    assert flights.fold_words() == "fold 2 of 2 (test flight 03Mar25)"


def test_a_finished_command_without_epochs_never_says_no_epoch_finished(tmp_path):
    import ipywidgets  # noqa: F401

    view = live.LiveView(None, folds=tmp_path / "cv")
    live.report_end(0, view, "cross-validation", None)
    assert "No epoch finished" not in view.placeholder.value and view.placeholder.layout.display == "none"
    assert view.label.value == "<b>finished</b>"


@pytest.mark.slow
def test_crossval_through_the_notebook_view_follows_its_folds(tiny_flights, tmp_path, capsys):
    """The real command, stopped in its second fold, then continued to the end."""
    import ipywidgets  # noqa: F401

    raw = tiny_raw(*tiny_flights, tmp_path / "cache")
    raw["train"]["epochs"] = 1
    raw["data"]["test_flights"] = []
    cfg, cv = tmp_path / "c.yaml", tmp_path / "cv"
    cfg.write_text(yaml.safe_dump(raw))
    names = [e["name"] for e in tiny_flights[1]]
    cmd = live.command("crossval", "--config", cfg, "--run-dir", cv, "--no-controls")
    view = live.LiveView(None, folds=cv)
    seen = []
    real_refresh = view.refresh

    def refresh():
        real_refresh()
        seen.append(view.label.value)

    view.refresh = refresh
    code = live.run_live(cmd, view, {"CLOUDML_KILL_AT": "step:10:SIGINT"})
    assert code == 130, list(view.lines)[-20:]
    live.report_end(code, view, "cross-validation", None)
    assert any(f"fold 2 of 3 (test flight {names[1]}) &middot; epoch 1 of 1" in s for s in seen), seen[-5:]
    assert f"stopped in fold 2 of 3 (test flight {names[1]})" in view.label.value
    assert "1 of 3 folds finished" in view.label.value
    view = live.LiveView(None, folds=cv)
    code = live.run_live(cmd, view)
    assert code == 0, list(view.lines)[-20:]
    live.report_end(code, view, "cross-validation", None)
    assert "finished: 3 of 3 folds" in view.label.value
    assert "No epoch finished" not in view.placeholder.value and view.shown_epochs >= 1


# ------------------------------------------------------------------ curves and TensorBoard (defect 13)


def test_the_curves_keep_markers_inside_the_legend_off_the_lines_and_r2_readable():
    history = [
        {"epoch": i, "train_loss": 1.0 / i, "val_loss": 1.3 / i, "r2": r2, "lr": 1e-3}
        for i, r2 in ((1, -43.0), (2, 0.4), (3, 0.7))
    ]
    fig = plots.curves_figure(history)
    fig.canvas.draw()
    loss, r2, lr = fig.axes
    assert loss.get_ylim()[0] == 0 and loss.get_ylim()[1] >= 1.3 * 1.05  # the top marker is not cut
    assert lr.get_ylim()[1] >= 1e-3 * 1.05
    legend = loss.get_legend().get_window_extent()
    assert not legend.overlaps(loss.get_window_extent())  # outside the axes: over no line
    low, high = r2.get_ylim()
    assert -1.1 <= low <= -1.0 and high == 1.0  # -43 does not flatten 0.4 and 0.7
    assert "-43" in r2.get_xlabel()


def test_tensorboard_opens_on_the_loss_curves(monkeypatch):
    pytest.importorskip("IPython")
    from cloudml_lib.colab import show
    from cloudml_lib.core.machine import device

    monkeypatch.delenv("TENSORBOARD_PROXY_URL", raising=False)
    monkeypatch.setattr(device, "is_colab", lambda: False)
    page = show.tensorboard_frame(6006).data
    assert re.search(r'<iframe id="tensorboard-frame-[0-9a-f]+"', page) and "url.port = 6006;" in page
    assert page.startswith(f"<details><summary>{show.TENSORBOARD_SUMMARY}</summary><iframe ")  # folded
    assert 'url.searchParams.set("tagFilter", "loss");' in page and 'url.hash = "timeseries";' in page
    monkeypatch.setenv("TENSORBOARD_PROXY_URL", "/proxy/%PORT%/")
    assert '"/proxy/6006/"' in show.tensorboard_frame(6006).data
    monkeypatch.setattr(device, "is_colab", lambda: True)
    script = show.tensorboard_frame(6006).data
    assert "google.colab.kernel.proxyPort(6006" in script and '"tagFilter", "loss"' in script
    assert "createElement('details')" in script and "fold.appendChild(frame)" in script


def test_the_installed_tensorboard_reads_the_parameter_it_is_opened_with():
    tensorboard = pytest.importorskip("tensorboard")
    from cloudml_lib.colab import show

    with zipfile.ZipFile(Path(tensorboard.__file__).parent / "webfiles.zip") as z:
        page = z.read("index.js").decode("utf-8", "replace")
    for key in show.TENSORBOARD_QUERY:
        assert f'"{key}"' in page, f"TensorBoard {tensorboard.__version__} no longer reads ?{key}="
