"""The training notebook's steps: train (or continue) the picked run, cross-validate, predict whole
flights, and the smoke test's own checks. Each step is a subprocess with a live view (live.py).

The picker's choice is remembered on Drive (`<CloudML>/last_run.json`) as soon as a run starts, so
that "Run all" after a disconnect comes back with it (picker.py). A step that depends on a finished
training (cross-validation, whole flights) says so and does nothing while the run is unfinished: a
stop must never start hours of other work.
"""
from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path

from cloudml_lib.checkpoint import find_checkpoints, load_checkpoint, read_meta, verify
from cloudml_lib.colab.live import LiveView, command, read_records, report_end, run_live
from cloudml_lib.colab.picker import SMOKE_EPOCHS, Choice, Picker
from cloudml_lib.colab.show import in_notebook, plural, show, show_markdown, user_errors
from cloudml_lib.colab.drive import Workspace, run_config, smoke
from cloudml_lib.rundir import has_run, run_status

SMOKE_DISCONNECT_STEP = 25


def train_command(ws: Workspace, c: Choice) -> list[str]:
    config, overrides = run_config(ws, c.preset, c.epochs, c.heldout)
    cmd = command("train", "--config", config, "--run-dir", ws.runs / c.run_name)
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def finished(run_dir: Path | None) -> bool:
    try:
        return run_dir is not None and has_run(run_dir) and bool(run_status(run_dir)["finished"])
    except Exception:  # noqa: BLE001 - an unreadable run is simply not finished
        return False


@user_errors
def train(ws: Workspace, picker: Picker) -> Path:
    """Train (or continue) the picked run with the live view; returns its run directory. In the smoke
    test the run is first killed mid-epoch, as a Colab disconnect would, then continued."""
    c = picker.choice()
    run_dir = ws.runs / c.run_name
    c.save(ws.root)                                   # "Run all" after a disconnect comes back with this choice
    if smoke():
        _simulated_disconnect(ws, c)
    config = Path(train_command(ws, c)[train_command(ws, c).index("--config") + 1]).name
    show_markdown(f"**Training** preset {c.preset} (`{config}`), {plural(c.epochs, 'epoch')}, into `{run_dir}`. "
                  "The interrupt button (&#9632;) stops it at the next step with a checkpoint.")
    view = LiveView(run_dir)
    code = run_live(train_command(ws, c), view)
    report_end(code, view, "training", run_dir)
    return run_dir


def _simulated_disconnect(ws: Workspace, c: Choice) -> None:
    run_dir = ws.runs / c.run_name
    shutil.rmtree(run_dir, ignore_errors=True)
    show_markdown(f"**Smoke test:** a simulated disconnect, killing the run at step {SMOKE_DISCONNECT_STEP}.")
    view = LiveView(run_dir)
    code = run_live(train_command(ws, c), view, {"CLOUDML_KILL_AT": f"step:{SMOKE_DISCONNECT_STEP}"})
    assert code == -signal.SIGKILL, f"the simulated disconnect did not happen (exit status {code})"
    report_end(code, view, "training", run_dir)


@user_errors
def whole_flights(ws: Workspace, picker: Picker, run_dir: Path | None) -> Path | None:
    """With the box ticked: every frame of the held-out flights through the best model (NetCDF, CSV,
    plots), as `python -m cloudml_lib predict`; shows the along-flight figures and where the files are."""
    if not picker.choice().whole_flights:
        print("Whole flights not asked for (tick the box in the picker, then run this cell).")
        return None
    if not finished(run_dir):
        print("Whole flights wait for training to finish: run the Train cell (or Run all) again to continue it.")
        return None
    out = run_dir / "predictions"
    view = LiveView(None, bar=False)
    report_end(run_live(command("predict", "--run-dir", run_dir), view), view, "prediction", None)
    for png in sorted(out.glob("*_cbh_along_flight.png")):
        flight = png.name[:-len("_cbh_along_flight.png")]
        show_markdown(f"**{flight}**: `{out / (flight + '_cbh.nc')}` (NetCDF, CF-1.8) and `{flight}_cbh.csv`")
        if in_notebook():
            from IPython.display import Image
            show(Image(filename=str(png)))
    return out


@user_errors
def crossval(ws: Workspace, picker: Picker, run_dir: Path | None = None) -> Path | None:
    """With the box ticked: every flight held out once, with baselines (the same `python -m cloudml_lib
    crossval` command, resumable: run the cell again after a disconnect). Shows crossval.md."""
    c = picker.choice()
    if not c.crossval:
        print("Cross-validation not asked for (tick the box in the picker, then run this cell).")
        return None
    if run_dir is not None and not finished(run_dir):
        print("Cross-validation waits for training to finish: run the Train cell (or Run all) again to continue it.")
        return None
    cmd = train_command(ws, c)
    cv_dir = ws.runs / f"{c.run_name}_crossval"
    cmd[cmd.index("train")] = "crossval"
    cmd[cmd.index("--run-dir") + 1] = str(cv_dir)
    show_markdown(f"**Cross-validation** into `{cv_dir}`: one run per flight; run this cell again after a "
                  "disconnect and it continues with the unfinished fold.")
    view = LiveView(None)
    report_end(run_live(cmd, view), view, "cross-validation", None)
    show_markdown((cv_dir / "crossval.md").read_text())
    return cv_dir


def check_smoke_run(run_dir: Path | None) -> None:
    """Smoke test: trained, checkpointed, resumed after the disconnect, evaluated. Shows nothing in normal use."""
    if not smoke():
        return
    if not finished(run_dir):
        print("Smoke test not checked: the run was stopped before it finished (run all again to finish it).")
        return
    log = (run_dir / "train.log").read_text()
    assert "Resumed from step" in log, "the second start did not resume"
    newest = find_checkpoints(run_dir)[0]
    assert verify(newest) is None and read_meta(newest)["finished"], f"no finished, verified checkpoint: {newest}"
    epochs = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, SMOKE_EPOCHS + 1)), epochs
    report = json.loads((run_dir / "evaluation.json").read_text())
    assert report["overall"]["n"] > 100 and math.isfinite(report["overall"]["r2"]), report["overall"]
    assert load_checkpoint(run_dir / "best.pt")["model"]
    assert "## Held-out flights" in (run_dir / "report.md").read_text(), "no report.md"
    assert list((run_dir / "predictions").glob("*_cbh.nc")), "no whole-flight prediction"
    board = check_tensorboard_served(run_dir)
    print(f"Smoke test passed: trained {SMOKE_EPOCHS} epochs, checkpointed, resumed after a disconnect at step "
          f"{SMOKE_DISCONNECT_STEP}, evaluated (held-out R2 {report['overall']['r2']:.2f}), whole flight predicted"
          f"{board}.")


def check_tensorboard_served(run_dir: Path, wait_s: float = 60.0) -> str:
    """Smoke test: the TensorBoard the notebook started serves this run's curves (one value per step); then
    it is stopped, as the headless kernel's end would leave it running."""
    import os
    import time
    import urllib.parse
    import urllib.request

    from cloudml_lib.train.events import has_tensorboard
    if not has_tensorboard():
        return ""
    from tensorboard import manager
    mine = [i for i in manager.get_all() if Path(i.logdir).resolve() == run_dir.parent.resolve()]
    assert mine, f"no TensorBoard was started for {run_dir.parent}"
    name = f"{run_dir.name}/tensorboard"
    url = f"http://localhost:{mine[0].port}/data/plugin/scalars/scalars?" + urllib.parse.urlencode(
        {"run": name, "tag": "train/loss"})
    try:
        deadline, steps = time.time() + wait_s, []
        while time.time() < deadline and not steps:
            try:
                steps = [row[1] for row in json.loads(urllib.request.urlopen(url, timeout=5).read())]
            except OSError:                                   # not loaded yet (400 until the run is found)
                time.sleep(1.0)
        assert steps, f"TensorBoard at port {mine[0].port} did not serve {name}'s train/loss within {wait_s:.0f} s"
        assert steps == sorted(set(steps)), f"TensorBoard shows repeated steps after the resume: {steps}"
    finally:
        for info in mine:
            try:
                os.kill(info.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return f", TensorBoard served {len(steps)} loss values, one per step"
