"""What the notebook cells display (cloudml_lib.colab, plots): the progress bar's fill, the curves'
placeholder and axes, tables in Markdown, the preset picker's messages. Headless: the widgets and
display calls are inspected, not rendered."""
import json
import signal
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from cloudml_lib import colab, plots
from cloudml_lib.data.flights import format_table
from cloudml_lib.evaluate import format_report


@pytest.fixture
def shown(monkeypatch):
    """Everything passed to IPython's display / handle.update, in order."""
    import IPython.display as disp
    out = []

    class Handle:
        def update(self, obj):
            out.append(obj)
    monkeypatch.setattr(disp, "display", lambda obj, display_id=False, **k: out.append(obj) or Handle())
    return out


def write_run(run_dir, total, start, steps, epochs=0):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"total_steps": total, "start_step": start, "started_at": time.time()}))
    rows = [{"kind": "step", "step": s} for s in steps]
    rows += [{"kind": "epoch", "epoch": e + 1, "step": 0, "train_loss": 1.0, "val_loss": 1.0, "r2": 0.1, "lr": 1e-3}
             for e in range(epochs)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_progress_bar_fill_follows_the_real_total(tmp_path, shown, monkeypatch):
    import tqdm.auto
    import tqdm.notebook
    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm)             # the widget, as in a notebook
    live = colab._LiveProgress(tmp_path / "run", time.time())
    live.refresh()
    assert live.bar is None                                                 # no "100% 1/1" before the plan is known
    write_run(tmp_path / "run", total=78, start=25, steps=[30, 35])
    live.refresh()
    _, widget, _ = live.bar.container.children
    assert widget.max == 78 and widget.value == 35                          # the fill is 35/78, not full
    live.end(130)                                                           # a deliberate stop
    assert widget.bar_style != "danger" and "stopped with a checkpoint at step 35" in live.bar.desc
    live2 = colab._LiveProgress(tmp_path / "run", time.time() - 5)
    live2.refresh()
    live2.end(-signal.SIGKILL)                                              # a (simulated) disconnect
    assert live2.bar.container.children[1].bar_style != "danger"
    live3 = colab._LiveProgress(tmp_path / "run", time.time() - 5)
    live3.refresh()
    live3.end(1)                                                            # a real failure: red
    assert live3.bar.container.children[1].bar_style == "danger"


def test_the_curves_placeholder_is_text_and_is_replaced(tmp_path, shown):
    from IPython.display import Image, Markdown
    live = colab._LiveProgress(tmp_path / "run", time.time())
    assert isinstance(shown[0], Markdown) and "Curves appear after the first epoch" in shown[0].data
    live.end(-signal.SIGKILL)
    assert isinstance(shown[-1], Markdown) and "No epoch finished in this run: killed" in shown[-1].data
    write_run(tmp_path / "run", 78, 0, [6], epochs=1)
    live = colab._LiveProgress(tmp_path / "run", time.time() - 5)
    live.refresh()
    assert isinstance(shown[-1], Image) and shown[-1].data[:4] == b"\x89PNG"  # a picture, not a Figure's repr
    assert not plt.get_fignums()                                            # nothing left for the inline backend
    live.end(0)
    assert isinstance(shown[-1], Image)                                     # the curves stay


def test_one_epoch_is_drawn_against_anchored_axes():
    fig = plots.curves_figure([{"epoch": 1, "train_loss": 0.5, "val_loss": 0.4, "r2": 0.6, "lr": 1e-3}])
    loss, r2, lr = fig.axes
    assert loss.get_ylim()[0] == 0 and r2.get_ylim()[1] == 1.0 and lr.get_ylim()[0] == 0
    assert loss.get_xlim() == (0.5, 2.5)


def test_file_names_in_markdown_tables_keep_their_stars():
    table = format_table([["10Feb25", "*_IRAI_L1B_*_20250210.h5", "-", "CRS_20250210_nav.hdf", "1", "2", "x"]],
                         markdown=True)
    assert "| `*_IRAI_L1B_*_20250210.h5` | - | `CRS_20250210_nav.hdf` |" in table


def test_evaluation_table_columns_never_run_together():
    m = {"r2": 0.5, "mae_km": 0.1, "rmse_km": 0.2, "bias_km": -0.01, "std_ratio": 0.9, "n": 12}
    header = format_report({"overall": m, "baseline": m, "per_flight": {"10Feb25": m}}).splitlines()[0]
    for a, b in (("MAE km", "RMSE km"), ("RMSE km", "bias km"), ("bias km", "std ratio"), ("std ratio", "n")):
        assert f"{a}  " in header and header.index(b) > header.index(a) + len(a) + 1


def test_the_picker_says_what_trains_without_real_flights(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
    monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
    ws = colab.workspace()
    picker = colab.Picker(ws)
    out = capsys.readouterr().out
    assert "training uses the demo configuration (demo.yaml, 12 epochs)" in out
    assert picker.epochs.value == 12 and picker.run_name.value == "demo"
    _, run_dir, cfg = colab._command(ws, picker)
    assert cfg.train.epochs == 12 and cfg.data.demo and run_dir.name == "demo"


def test_the_run_name_follows_the_preset_until_typed(tmp_path, monkeypatch):
    from cloudml_lib.data.synthetic import make_demo_flights
    monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
    monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
    ws = colab.workspace()
    make_demo_flights(ws.data, n_flights=2, frames_per_flight=30, frame_shape=(32, 40))
    picker = colab.Picker(ws)
    picker.preset.value = "C"
    assert picker.run_name.value == "preset_C" and picker.epochs.value == 50
    picker.run_name.value = "my_run"
    picker.preset.value = "B"
    assert picker.run_name.value == "my_run"


def test_the_smoke_test_says_the_picker_is_not_used(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLOUDML_SMOKE", "1")
    monkeypatch.chdir(tmp_path)
    colab.Picker(colab.workspace())
    assert "Smoke test: the choices above are not used" in capsys.readouterr().out


def test_the_report_is_shown_as_text_and_images(tmp_path, shown, monkeypatch):
    from IPython.display import Image, Markdown
    monkeypatch.setattr(colab, "_show", lambda text: shown.append(Markdown(text)))    # as in a notebook
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    plots.save_figure(plots.curves_figure([{"epoch": 1, "train_loss": 1, "val_loss": 1, "r2": 0.1, "lr": 1e-3}]),
                      run / "plots" / "curves.png")
    (run / "report.md").write_text("# Run\n\n| a | b |\n|---|---|\n\n## Training curves\n\n"
                                   "![Training curves](plots/curves.png)\n\n## After\ntext\n")
    colab.show_report(run)
    kinds = [type(x).__name__ for x in shown]
    assert kinds == ["Markdown", "Image", "Markdown"] and "| a | b |" in shown[0].data
    assert isinstance(shown[1], Image) and isinstance(shown[2], Markdown)


def test_crossval_from_the_notebook_runs_the_same_command_when_asked(tmp_path, monkeypatch, capsys):
    import subprocess
    monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
    monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
    ws = colab.workspace()
    picker = colab.Picker(ws)
    assert colab.crossval(ws, picker) is None and "not asked for" in capsys.readouterr().out
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--run-dir") + 1])
        out.mkdir(parents=True)
        (out / "crossval.md").write_text("# table")
        return subprocess.CompletedProcess(cmd, 0, "done", "")
    monkeypatch.setattr(colab.subprocess, "run", fake_run)
    picker.crossval.value = True
    cv = colab.crossval(ws, picker)
    assert calls[0][3] == "crossval" and cv == ws.runs / "demo_crossval"
