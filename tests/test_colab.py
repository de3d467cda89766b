"""What the notebook cells show and do (cloudml_lib.colab): the picker that comes back with the run the
user started, the live view (bar, curves, notices, folded log), steps that wait for a finished run,
user errors without a traceback. Headless: widgets and display calls are inspected, not rendered (the
browser check, tests/test_browser.py, renders them)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import REPO, run_cli, run_process, tiny_raw

from cloudml_lib import colab
from cloudml_lib.colab import drive, live, training
from cloudml_lib.colab import picker as picker_mod
from cloudml_lib.data.flights import format_table
from cloudml_lib.science import plots
from cloudml_lib.science.report import format_report


def own_flights(ws, n=3, shape=(32, 40)):
    """Flights of the user's own in the data folder, in the real layout (found by their names)."""
    from cloudml_lib.data.synthetic import make_demo_flights

    return make_demo_flights(ws.data / "ER2", n_flights=n, frames_per_flight=40, frame_shape=shape)


# ------------------------------------------------------------------ the live view


def test_the_bar_follows_every_step_and_keeps_its_colour_by_how_the_run_ended(tmp_path, shown):
    for code, style in (
        (0, "success"),
        (130, ""),
        (-signal.SIGKILL, ""),
        (-signal.SIGINT, ""),
        (1, "danger"),
    ):
        view = live.LiveView(tmp_path / "run")
        view.line('@progress {"step": 30, "total": 78, "epoch": 2, "epochs": 2, "batch": 4, "batches": 39}')
        view.refresh()
        assert (view.bar.max, view.bar.value) == (78, 30) and "step 30 of 78 (38%)" in view.label.value
        view.end(code, "stopped; the last checkpoint is at step 31 of 78")
        assert view.bar.bar_style == style, (code, view.bar.bar_style)
        assert view.bar.value == (78 if code == 0 else 30)  # a stopped run keeps its fill, blue
    assert all("@progress" not in line for line in view.lines)  # progress lines drive the bar, not the log


def test_curves_bar_and_notices_stay_together_and_the_log_is_folded(tmp_path, shown):
    import ipywidgets as w

    run = tmp_path / "run"
    view = live.LiveView(run)
    box = shown[-1]
    assert isinstance(box, w.VBox)
    top, status, notices, placeholder, curves, folded = box.children
    assert top.children[0] is view.bar and isinstance(folded, w.Accordion) and folded.selected_index is None
    assert "Curves appear after the first epoch" in placeholder.value and curves.layout.display == "none"
    table = "flight   IR file                                  frames  labels kept"
    for text in (
        "Flights:",
        table,
        "Resumed from step 25 (epoch 2, batch 4/39), saved 3 s ago",
        "Epoch 2/2 | train_loss 0.089 | val_loss 0.173 | R2 0.61 | MAE 0.223 km | lr 1.8e-03 | 5.6 s",
        "Stopped by SIGINT at step 41; checkpoint saved in runs/x/checkpoints. Run the same command again.",
    ):
        view.line(text)
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps(
            {
                "kind": "epoch",
                "epoch": 1,
                "step": 39,
                "train_loss": 1.0,
                "val_loss": 0.9,
                "r2": 0.2,
                "lr": 1e-3,
            }
        )
        + "\n"
    )
    view.refresh()
    assert (
        curves.value[:4] == b"\x89PNG"
        and curves.layout.display is None
        and placeholder.layout.display == "none"
    )
    assert "Epoch 2/2" in status.value
    assert (
        "Resumed from step 25" in notices.value and "Stopped at step 41, as asked (\u25a0)" in notices.value
    )
    assert view.log.value.startswith("<pre") and table in view.log.value  # a <pre>: a table never wraps
    assert view.log.layout.overflow == "auto" and "Log (5 lines" in folded.get_title(0)


def test_without_an_epoch_the_placeholder_says_what_happened(tmp_path, shown):
    view = live.LiveView(tmp_path / "run")
    view.end(-signal.SIGKILL, "killed (as by a disconnect); no checkpoint was saved yet")
    assert "No epoch finished in this run: killed (as by a disconnect)" in view.placeholder.value


@pytest.mark.slow
def test_the_training_subprocess_prints_progress_lines_not_a_flood_of_bars(tiny_flights, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(*tiny_flights, tmp_path / "cache")))
    env = {"TQDM_DISABLE": "1", "CLOUDML_PROGRESS": "1", "PYTHONUNBUFFERED": "1"}  # what the notebook sets
    r = run_process("train", "--config", cfg, "--run-dir", tmp_path / "run", env=env)  # read at its start
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "batch/s" not in out and "it/s" not in out and "frame/s" not in out, out[-3000:]
    progress = [
        json.loads(x[len("@progress ") :]) for x in r.stdout.splitlines() if x.startswith("@progress ")
    ]
    assert progress and progress[-1]["total"] == 14 and 1 <= progress[-1]["step"] <= 14


@pytest.mark.slow
def test_a_stop_says_the_step_the_checkpoint_holds(tiny_flights, tmp_path, shown, capsys):
    raw = tiny_raw(*tiny_flights, tmp_path / "cache")
    raw["checkpoint"] = {"every_steps": 3}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    view = live.LiveView(tmp_path / "run")
    code = live.run_live(
        live.command("train", "--config", cfg, "--run-dir", tmp_path / "run"),
        view,
        {"CLOUDML_KILL_AT": "step:8:SIGINT"},
    )
    assert code == 130
    live.report_end(code, view, "training", tmp_path / "run")
    out = capsys.readouterr().out
    step = int(
        re.search(r"Stopped at step (\d+), as asked \(.\); checkpoint saved", view.notices.value).group(1)
    )
    stop_lines = [x for x in view.notices.value.split("<br>") if "as asked" in x or "pressed" in x]
    assert stop_lines and not any("color" in x or "&#9888;" in x for x in stop_lines)  # neutral, not amber
    assert (
        step >= 8 and f"Training stopped; the last checkpoint is at step {step} of 14" in out
    )  # the saved step
    assert view.bar.bar_style == ""


@pytest.mark.slow
def test_the_kernels_interrupt_does_not_reach_the_run_and_a_dead_kernel_stops_it(tiny_flights, tmp_path):
    """Jupyter interrupts the kernel's whole process group: a second SIGINT would stop the run at once,
    without a checkpoint. The run has a session of its own, and stops with a checkpoint when the kernel
    dies."""
    import time

    raw = tiny_raw(*tiny_flights, tmp_path / "cache")
    raw["train"]["epochs"] = 200
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    kernel_code = (
        f"from cloudml_lib.colab import live\n"
        f"view = type('View', (), {{'line': lambda s, t: None, 'refresh': lambda s: None}})()\n"
        f"live.run_live(live.command('train', '--config', {str(cfg)!r}, '--run-dir', {str(run)!r}), view)\n"
    )
    kernel = subprocess.Popen([sys.executable, "-c", kernel_code], cwd=REPO, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "run.json").exists():
        time.sleep(0.5)
    time.sleep(3)
    children = subprocess.run(["pgrep", "-P", str(kernel.pid)], capture_output=True, text=True).stdout.split()
    assert children, "the training subprocess did not start"
    assert os.getpgid(int(children[0])) != os.getpgid(kernel.pid)  # out of reach of the group's SIGINT
    os.killpg(kernel.pid, signal.SIGKILL)  # the kernel dies (restart, crash)
    kernel.wait()
    while time.time() < deadline and (run / ".lock").exists():
        time.sleep(0.5)
    log = (run / "train.log").read_text()
    assert "Stopped by SIGTERM" in log and "checkpoint saved" in log, log[-2000:]
    assert not (run / ".lock").exists()  # the run is free to continue


# ------------------------------------------------------------------ the picker


@pytest.mark.slow
def test_the_picker_comes_back_with_the_run_the_user_started(ws, tiny_flights, tmp_path, shown, monkeypatch):
    raw = tiny_raw(*tiny_flights, tmp_path / "cache")
    raw["checkpoint"] = {"every_steps": 3}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    r = run_cli("train", "--config", cfg, "--run-dir", ws.runs / "my_run", env={"CLOUDML_KILL_AT": "step:10"})
    assert r.returncode == -signal.SIGKILL  # a disconnect in the middle of the run
    colab.Choice(preset="demo", epochs=3, run_name="my_run", crossval=True, whole_flights=False).save(ws.root)
    # the run stands for a demo run, whose flights never leave (its tiny flights lie outside data/)
    monkeypatch.setattr(picker_mod, "run_flights", lambda *a, **k: None)
    p = colab.Picker(ws)  # a new kernel after the disconnect
    assert p.mode.value == "continue" and p.mode.options[0][0] == "Continue my_run"
    c = p.choice()
    assert (c.epochs, c.run_name, c.crossval, c.whole_flights) == (3, "my_run", True, False)
    assert re.search(r"Continuing run my_run</b> \(epoch 2 of 2, step [79] of 14\)", p.note.value), (
        p.note.value
    )
    assert p.run_name.disabled and p.preset.disabled
    p.epochs.value = 1  # the note follows every change
    assert "1 epoch," in p.note.value and "1 epochs" not in p.note.value and "3 epochs" not in p.note.value
    p.mode.value = "new"  # a new run is an explicit choice
    c = p.choice()
    assert c.run_name == "demo" and c.epochs == 12 and not c.crossval and not p.run_name.disabled
    assert "A new run <b>demo</b>" in p.note.value


def test_a_finished_run_is_kept_not_trained_again(ws, shown, monkeypatch, tmp_path):
    (ws.runs / "demo").mkdir()
    colab.Choice(preset="demo", epochs=12, run_name="demo").save(ws.root)
    monkeypatch.setattr(picker_mod, "progress", lambda run_dir, choice=None: (False, "finished (12 epochs)"))
    p = colab.Picker(ws)
    assert p.mode.value == "continue" and p.mode.options[0][0] == "Keep demo"
    assert (
        "Run demo is finished (12 epochs)</b>: the cells below show its results without training again"
        in p.note.value
    )
    p.mode.value = "new"
    assert p.choice().run_name == "demo_2"  # a new run never reuses a finished one's name


def test_the_widgets_show_what_trains_without_a_gpu(ws, shown, monkeypatch):
    from cloudml_lib.commands import presets

    own_flights(ws)
    monkeypatch.setattr(presets, "choose_preset", lambda report: ("demo", "no CUDA GPU was found"))
    monkeypatch.setattr(picker_mod, "frame_rows", lambda ws: 512)  # the camera's frames (the files: 32 rows)
    p = colab.Picker(ws)
    assert (
        p.preset.value == "Auto"
        and dict(p.preset.options)["Auto: C here (no GPU: a short CPU run)"] == "Auto"
    )
    c = p.choice()  # your flights on the CPU: the smallest preset, briefly (50 epochs would take days)
    assert c.preset == "C" and c.epochs == picker_mod.CPU_EPOCHS < 50 and c.run_name == "preset_C"
    assert "Trains preset <b>C</b> (colab_optimized.yaml" in p.note.value
    assert "no GPU was found: training on the CPU is slow" in p.note.value
    assert "demo configuration" not in p.note.value and "preset_Auto" not in p.note.value
    p.preset.value = "B"  # a preset chosen by name: its own epochs
    assert p.choice().epochs == 50


def test_demo_data_shows_the_demo_configuration(ws, shown):
    p = colab.Picker(ws)
    assert p.preset.options == (("demo: CPU demo configuration", "demo"),) and p.preset.disabled
    assert p.choice().epochs == 12 and p.choice().run_name == "demo" and p.heldout.layout.display == "none"
    cmd = training.train_command(ws, p.choice())
    assert cmd[cmd.index("--config") + 1].endswith("demo.yaml") and cmd[cmd.index("--run-dir") + 1] == str(
        ws.runs / "demo"
    )
    assert "train.epochs=12" in cmd


def test_the_crossval_box_is_short_and_its_warning_is_visible(ws, shown):
    p = colab.Picker(ws)
    texts = [getattr(c, "value", "") for c in shown[-1].children]
    assert len(p.crossval.description) < 60 and not p.crossval.indent
    assert any("hours on real data" in t for t in texts if isinstance(t, str))


def test_a_missing_held_out_flight_is_replaced_and_said(ws, shown):
    entries = own_flights(ws)  # 01Mar25, 03Mar25, 05Mar25: no 12Feb25
    held, why = drive.default_heldout(ws)
    assert held == [entries[-1]["name"]] and "12Feb25 is not among the complete flights found" in why
    p = colab.Picker(ws)
    assert p.heldout.value == (entries[-1]["name"],) and not p.heldout.disabled
    assert set(p.heldout.options) == {e["name"] for e in entries}
    p.heldout.value = (entries[0]["name"],)
    config, over = colab.run_config(ws, "B", 5, list(p.heldout.value))
    assert f"data.test_flights=[{entries[0]['name']}]" in over
    from cloudml_lib.base.config import load_config

    assert load_config(config, over).data.test_flights == [entries[0]["name"]]


def test_the_cache_cell_does_not_depend_on_the_held_out_flight(ws, shown):
    own_flights(ws, shape=(488, 64))  # the presets' 440 rows, narrow for speed
    cache = colab.build_cache(ws)  # 12Feb25 is not there: no ConfigError
    assert cache["flights"] == 3


def test_a_user_error_in_a_cell_shows_its_message_without_a_traceback(ws, shown):
    entries = own_flights(ws, shape=(488, 64))
    broken = ws.data / "ER2" / entries[0]["ir_file"]
    broken.write_bytes(b"not an HDF5 file")
    with pytest.raises(colab.UserError) as e:
        colab.build_cache(ws)
    lines = e.value._render_traceback_()
    assert (
        "Problem:" in lines[0]
        and str(broken) in "\n".join(lines)
        and "is the file complete?" in "\n".join(lines)
    )
    assert not any("Traceback" in x or 'File "' in x for x in lines)


# ------------------------------------------------------------------ steps after training


def test_steps_after_training_wait_for_a_finished_run(ws, shown, capsys):
    p = colab.Picker(ws)
    p.crossval.value = True
    assert colab.whole_flights(ws, p, ws.runs / "demo") is None
    assert colab.crossval(ws, p, ws.runs / "demo") is None
    out = capsys.readouterr().out
    assert "Whole flights wait for training to finish" in out and "Cross-validation waits for training" in out


def test_the_smoke_check_says_a_stopped_run_was_not_checked(tmp_path, monkeypatch, capsys):
    from cloudml_lib.colab.profile import choose

    monkeypatch.setenv("CLOUDML_SMOKE", "1")
    choose()  # as the flow's first cell does (workspace())
    colab.check_smoke_run(tmp_path / "run")  # stopped before the end: no AssertionError
    assert "Smoke test not checked: the run was stopped" in capsys.readouterr().out
    monkeypatch.delenv("CLOUDML_SMOKE")
    choose()
    colab.check_smoke_run(tmp_path / "run")
    assert capsys.readouterr().out == ""  # nothing at all in normal use


# ------------------------------------------------------------------ tables and reports


def test_one_epoch_is_drawn_against_anchored_axes():
    fig = plots.curves_figure([{"epoch": 1, "train_loss": 0.5, "val_loss": 0.4, "r2": 0.6, "lr": 1e-3}])
    loss, r2, lr = fig.axes
    assert loss.get_ylim()[0] == 0 and r2.get_ylim()[1] == 1.0 and lr.get_ylim()[0] == 0
    assert loss.get_xlim() == (0.5, 2.5)


def test_file_names_in_markdown_tables_keep_their_stars():
    table = format_table(
        [["10Feb25", "*_IRAI_L1B_*_20250210.h5", "-", "CRS_20250210_nav.hdf", "1", "2", "3", "x"]],
        markdown=True,
    )
    assert "| `*_IRAI_L1B_*_20250210.h5` | - | `CRS_20250210_nav.hdf` |" in table


def test_evaluation_rows_say_whose_numbers_they_are():
    m = {"r2": 0.5, "mae_km": 0.1, "rmse_km": 0.2, "bias_km": -0.01, "std_ratio": 0.9, "n": 12}
    two = {"10Feb25": m, "12Feb25": m}
    lines = format_report(
        {"overall": m, "baseline": m, "per_flight": two, "baseline_per_flight": two}
    ).splitlines()
    assert lines[0].startswith("Test flights scored as CloudML 0.2 did")  # no protocol recorded: the old one
    names = [line.split("  ")[0] for line in lines[2:8]]
    assert names == [  # each test flight first, then the pooled rows, named so
        "model: flight 10Feb25",
        "baseline (training mean): flight 10Feb25",
        "model: flight 12Feb25",
        "baseline (training mean): flight 12Feb25",
        "model: pooled over 2 test flights",
        "baseline (training mean): pooled over 2",
    ]
    assert not any(line.startswith(" ") for line in lines[2:8])  # no row looks nested under another
    header = lines[1]
    for a, b in (("MAE km", "RMSE km"), ("RMSE km", "bias km"), ("bias km", "std ratio"), ("std ratio", "n")):
        assert f"{a}  " in header and header.index(b) > header.index(a) + len(a) + 1


def test_a_finished_run_status_shows_no_batch_position():
    from cloudml_lib.core.run.status import format_status

    s = {
        "run_dir": "runs/demo",
        "latest_checkpoint": "x",
        "finished": True,
        "epochs_completed": 12,
        "epochs": 12,
        "step": 468,
        "total_steps": 468,
        "batch": 0,
        "batches_per_epoch": 39,
        "epoch": 12,
        "progress": 100.0,
        "locked_by": None,
        "best_metric": 0.01,
        "best_r2": 0.98,
        "latest_checkpoint_age_s": 60,
        "rejected": [],
    }
    head = format_status(s).splitlines()[0]
    assert head == "runs/demo: finished: 12 of 12 epochs, step 468/468" and "batch" not in head


@pytest.fixture
def cell_output(monkeypatch) -> list:
    """What a cell of colab/show.py displays, in order, as in a notebook: a Markdown text as ("md", text),
    any other object as it is."""
    from cloudml_lib.colab import show

    out = []
    monkeypatch.setattr(show, "in_notebook", lambda: True)
    monkeypatch.setattr(show, "show", out.append)
    monkeypatch.setattr(show, "show_markdown", lambda text: out.append(("md", text)))
    return out


def test_the_report_cell_points_to_report_md_and_shows_only_what_the_cells_above_do_not(
    tiny_run, cell_output
):
    """The Report cell repeated the evaluation in full (5 screens after its 2): now it names report.md, the
    sections the cells above showed, the training's device in a line, and folds the rest."""
    from cloudml_lib.colab import show

    out, (run, _, _) = cell_output, tiny_run
    show.show_report(run)
    report = (run / "report.md").read_text()
    assert "## Test flights" in report and "## Data provenance" in report
    first = out[0][1]
    assert f"`{run / 'report.md'}`" in first and "Above: Test flights" in first
    assert out[1][0] == "md" and out[1][1].startswith("**Training.** Device: CPU")
    folded = [o[1] for o in out[2:]]  # each a fold of Markdown: a blank line each side, so tables render
    assert folded and all(f.startswith("<details><summary>") and f.endswith("\n\n</details>") for f in folded)
    assert "Data provenance (click to open)</summary>\n\n" in folded[0] and "\n| flight |" in folded[0]
    text = " ".join(o[1] if isinstance(o, tuple) else o.data for o in out)
    assert "| test flight |" not in text and "Image" not in {type(o).__name__ for o in out}  # shown above


def test_the_evaluation_cell_shows_the_verdicts_and_metrics_and_folds_the_rest(tiny_run, cell_output):
    """The page was 9.9 screens of a 1400 x 1000 window with every table of the evaluation open (the browser
    check measures it): the verdicts and the metrics first, the rest a click away."""
    from cloudml_lib.colab import show

    out, (run, _, _) = cell_output, tiny_run
    show.show_evaluation(run)
    (_, head), (_, folded) = out[:2]
    assert "Verdict: " in head and "| model: flight " in head and "Cloud flag: " in head
    assert "*training mean* predicts" not in head and "validation loss" not in head
    assert folded.startswith(f"<details><summary>{show.MORE_WORDS} (click to open)</summary>\n\n")
    assert folded.endswith("\n\n</details>") and "*training mean* predicts" in folded
    assert "prediction intervals" in folded and "| cloud / no-cloud |" in folded
    assert "Cloud flag: " not in folded  # said once, first
    assert type(out[2]).__name__ == "Image"  # the scatter


@pytest.mark.slow  # the export command's own process
def test_the_export_cell_of_a_run_whose_best_model_is_gone_says_what_to_do(tiny_run_copy, capsys):
    """An export folder beside a best.pt deleted since: the cell ran into a FileNotFoundError of its own.
    The run's end is pending (status.run_state: its evaluation scored weights that are gone), and the cell
    says so, naming best.pt and the cell that ends the run."""
    from cloudml_lib.science.export import EXPORT_FILES

    run = tiny_run_copy[0]
    (run / "export").mkdir()
    for name in EXPORT_FILES:
        (run / "export" / name).write_text("an earlier export")
    (run / "best.pt").unlink()
    assert colab.export(run) is None
    said = capsys.readouterr().out
    assert "Export waits for the run's end: the run is trained, end pending (best.pt is missing" in said, said
    assert "Run the Train cell (or Run all) again" in said and "Already exported" not in said


@pytest.mark.slow
def test_the_preset_table_and_picker_say_what_compiling_does_here(ws, shown, monkeypatch):
    from cloudml_lib.colab import show
    from cloudml_lib.core.network.compile import plan

    cpu = torch.device("cpu")
    show.show_presets()
    table = shown[-1]
    assert "torch.compile here" in table
    a_row = next(line for line in table.splitlines() if line.startswith("| A |"))
    assert plan(True, "default", cpu) in a_row and "| B | 64/128/256 | on | off |" in table
    own_flights(ws)
    p = colab.Picker(ws)
    p.preset.value = "A"
    assert f"torch.compile: {plan(True, 'default', cpu)}." in p.note.value
    p.preset.value = "B"
    assert "torch.compile: off." in p.note.value


def test_a_compile_fall_back_is_a_visible_warning_in_the_live_view(tmp_path, shown):
    view = live.LiveView(tmp_path, bar=True)
    view.line(
        "torch.compile: compiled the frame encoder (...): 1 graph(s), no graph break, 0 recompile(s), 2.0 s"
    )
    view.line(
        "Warning: torch.compile failed (InductorError: InvalidCxxCompiler: No working C++ compiler found). "
        "Continuing "
        "in eager mode from the same step; nothing is lost."
    )
    first, second = view.notices.value.split("<br>")
    assert first.startswith("&#9656; torch.compile: compiled")
    assert second.startswith('<span style="color:#b45309">&#9888; torch.compile failed (InductorError')


def test_warnings_in_the_kernel_show_once_with_their_level_word(tmp_path, monkeypatch, capsys):
    """Setup's in-process warnings showed twice (Colab's root logger has a handler) and without "Warning:"."""
    import logging

    seen_by_root = []

    class Root(logging.Handler):
        def emit(self, record):
            seen_by_root.append(record)

    root = Root()
    logging.getLogger().addHandler(root)
    try:
        monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
        monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
        colab.workspace()
        logging.getLogger("cloudml_lib.data.flights").warning("a flight's nav file is odd")
    finally:
        logging.getLogger().removeHandler(root)
    out = capsys.readouterr().out
    assert out.count("a flight's nav file is odd") == 1 and "Warning: a flight's nav file is odd" in out
    assert not seen_by_root


def test_in_a_notebook_the_kernels_warnings_are_amber_and_its_problems_red(monkeypatch, shown, capsys):
    """Setup's data check printed "Warning: flight 09Mar25: ... nav records usable" in the plain log text,
    black among its lines (seen in the browser check): in a notebook, a warning or a problem logged in the
    kernel is shown as every notice is, each in its colour; other lines stay plain text."""
    import logging

    from cloudml_lib.base.logs import attach_run_log

    monkeypatch.setattr(live, "in_notebook", lambda: True)
    attach_run_log(None, screen=live.NotebookLog())
    log = logging.getLogger("cloudml_lib.data.navigation")
    log.info("flight 01Mar25: IR times read as Unix epoch seconds")
    log.warning("flight 09Mar25: 1394 of 1420 nav records usable\n  a second line <kept>")
    log.error("flight 09Mar25: the nav file cannot be read")
    attach_run_log(None)
    assert capsys.readouterr().out == "flight 01Mar25: IR times read as Unix epoch seconds\n"
    warning, problem = (obj.data for obj in shown)
    assert warning.startswith(
        '<div style="white-space:pre-wrap"><span style="color:#b45309">&#9888; flight 09Mar25'
    )
    assert "a second line &lt;kept&gt;" in warning and "Warning:" not in warning  # the sign says it
    assert '<span style="color:#b91c1c">&#10006; <b>Problem:</b> flight 09Mar25: the nav file' in problem


def test_the_setups_cpu_advice_says_what_auto_trains_on_the_flights_found():
    """Without a GPU, the setup's preset line follows the picker's rule: preset C briefly where the frames
    take it, the demo configuration where they are too small for every GPU preset."""
    from cloudml_lib.colab.drive import CPU_ADVICE, CPU_EPOCHS, cpu_advice, preset_rows

    assert cpu_advice(preset_rows("C")) == CPU_ADVICE and f"preset C for {CPU_EPOCHS} epochs" in CPU_ADVICE
    assert cpu_advice(None) == CPU_ADVICE  # no frame shape read: the picker's Auto is C too
    small = cpu_advice(80)
    assert "demo configuration" in small and "80 sensor rows" in small and "preset C for" not in small


def test_a_cells_log_lines_are_folded_after_its_table_and_a_notice_is_shown_once(monkeypatch, capsys):
    """The setup's data and cache cells: the table first, the reading's lines folded after it; a warning
    both cells meet is shown by the first and folded by the second."""
    from cloudml_lib.base.logs import attach_run_log
    from cloudml_lib.colab import live

    log = attach_run_log(None, screen=live.NotebookLog())
    monkeypatch.setattr(live.NotebookLog, "shown_notices", set())
    with live.folded_log("How each flight was read"):
        log.info("flight 01Mar25: 240 frames")
        print("| flight | frames |")
    out = capsys.readouterr().out
    assert out.index("| flight | frames |") < out.index("flight 01Mar25: 240 frames")  # outside a notebook
    shown = []
    monkeypatch.setattr(live, "in_notebook", lambda: True)
    monkeypatch.setattr(live, "show", lambda obj: shown.append(getattr(obj, "data", obj)))
    for _ in range(2):  # the data cell, then the cache cell
        with live.folded_log("How each flight was cached"):
            log.warning("flight 03Mar25: 3 frames are blank")
            log.info("flight 03Mar25: cached")
    notices = [s for s in shown if "3 frames are blank" in s and "<details>" not in s]
    assert len(notices) == 1, shown  # once, in amber
    assert "3 frames are blank (said above, by an earlier cell)" in shown[-1]
    assert "Warning: flight 03Mar25" not in shown[-1]  # plain text in the fold, not a second notice
    assert "<details><summary>" in shown[-1]
    assert "How each flight was cached: 2 lines (click to open)" in shown[-1]
    for h in [h for h in log.handlers if isinstance(h, live.NotebookLog)]:
        log.removeHandler(h)


def test_whole_flights_say_a_flights_inputs_against_training_once(tmp_path, monkeypatch, shown):
    """The domain check's sentence is a warning in predict's log, shown above as a notice: the flight's own
    lines below do not repeat it; a flight whose inputs lie inside says so there (no warning above)."""
    from types import SimpleNamespace

    outside = "flight F1: 28 of its 353 heights (8%) come from frames that lie outside the inputs"
    inside = "flight F2: every frame's inputs lie among the training flights'"
    run_dir = tmp_path / "run"
    out = run_dir / "predictions"
    out.mkdir(parents=True)
    for flight in ("F1", "F2"):
        (out / f"{flight}_cbh_along_flight.png").write_bytes(b"")
    summary = {"F1": {"inputs_vs_training": outside}, "F2": {"inputs_vs_training": inside}}

    def predict(cmd, view, env=None):
        view.line(f"Warning: {outside}")  # as the command prints a warning (base/logs.py)
        return 0

    monkeypatch.setattr(training, "run_live", predict)
    monkeypatch.setattr(training, "run_flights", lambda ws, run: None)
    monkeypatch.setattr(training.RunFolder, "is_finished", lambda self: True)
    monkeypatch.setattr(training.RunFiles, "predictions_summary", lambda self: summary)
    picker = SimpleNamespace(choice=lambda: SimpleNamespace(whole_flights=True))
    assert training.whole_flights(None, picker, run_dir) == out
    said = [x for x in shown if isinstance(x, str)]
    assert sum(outside[1:] in x for x in said) == 0  # said once: the notice above
    assert sum("Flight F2: every frame's inputs lie among the training flights'" in x for x in said) == 1
