"""The training notebook's steps: train (or continue) the picked run, cross-validate, predict whole
flights. Each step is a subprocess with a live view (live.py). The smoke test's own checks are smoke.py's.

The picker's choice is remembered on Drive (`<CloudML>/last_run.json`) as soon as a run starts, so
that "Run all" after a disconnect comes back with it (picker.py). A step that depends on a finished
training (cross-validation, whole flights) says so and does nothing while the run is unfinished: a
stop must never start hours of other work.
"""

from __future__ import annotations

from pathlib import Path

from cloudml_lib.colab.drive import Workspace, run_config, smoke
from cloudml_lib.colab.live import LiveView, command, report_end, run_live
from cloudml_lib.colab.picker import Choice, Picker
from cloudml_lib.colab.show import in_notebook, plural, show, show_markdown, user_errors
from cloudml_lib.rundir import is_finished as finished


def train_command(ws: Workspace, c: Choice) -> list[str]:
    config, overrides = run_config(ws, c.preset, c.epochs, c.heldout)
    cmd = command("train", "--config", config, "--run-dir", ws.runs / c.run_name)
    for o in overrides:
        cmd += ["--set", o]
    return cmd


@user_errors
def train(ws: Workspace, picker: Picker) -> Path:
    """Train (or continue) the picked run with the live view; returns its run directory. In the smoke
    test the run is first killed mid-epoch, as a Colab disconnect would, then continued."""
    c = picker.choice()
    run_dir = ws.runs / c.run_name
    c.save(ws.root)  # "Run all" after a disconnect comes back with this choice
    if smoke():  # the headless test: a disconnect mid-epoch first
        from cloudml_lib.colab.smoke import simulate_disconnect

        simulate_disconnect(run_dir, train_command(ws, c))
    config = Path(train_command(ws, c)[train_command(ws, c).index("--config") + 1]).name
    show_markdown(
        f"**Training** preset {c.preset} (`{config}`), {plural(c.epochs, 'epoch')}, into `{run_dir}`. "
        "The interrupt button (&#9632;) stops it at the next step with a checkpoint."
    )
    view = LiveView(run_dir)
    code = run_live(train_command(ws, c), view)
    report_end(code, view, "training", run_dir)
    return run_dir


@user_errors
def whole_flights(ws: Workspace, picker: Picker, run_dir: Path | None) -> Path | None:
    """With the box ticked: every frame of the held-out flights through the best model (NetCDF, CSV,
    plots), as `python -m cloudml_lib predict`; shows the along-flight figures and where the files are."""
    if not picker.choice().whole_flights:
        print("Whole flights not asked for (tick the box in the picker, then run this cell).")
        return None
    if not finished(run_dir):
        print(
            "Whole flights wait for training to finish: run the Train cell (or Run all) again to continue it."
        )
        return None
    out = run_dir / "predictions"
    view = LiveView(None, bar=False)
    report_end(run_live(command("predict", "--run-dir", run_dir), view), view, "prediction", None)
    for png in sorted(out.glob("*_cbh_along_flight.png")):
        flight = png.name[: -len("_cbh_along_flight.png")]
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
        print(
            "Cross-validation waits for training to finish: run the Train cell (or Run all) again to "
            "continue it."
        )
        return None
    cmd = train_command(ws, c)
    cv_dir = ws.runs / f"{c.run_name}_crossval"
    cmd[cmd.index("train")] = "crossval"
    cmd[cmd.index("--run-dir") + 1] = str(cv_dir)
    show_markdown(
        f"**Cross-validation** into `{cv_dir}`: one run per flight; run this cell again after a "
        "disconnect and it continues with the unfinished fold."
    )
    view = LiveView(None)
    report_end(run_live(cmd, view), view, "cross-validation", None)
    show_markdown((cv_dir / "crossval.md").read_text())
    return cv_dir


def check_smoke_run(run_dir: Path | None) -> None:
    """The notebook's last cell: in the headless test (CLOUDML_SMOKE=1), smoke.py's checks of the run; in
    normal use nothing."""
    if smoke():
        from cloudml_lib.colab.smoke import check_run

        check_run(run_dir)
