"""The training notebook's sweep cell: `python -m cloudml_lib sweep` as a subprocess with a live view that
follows the trial being trained (its bar and curves, "trial k of n") above a table of every trial so far
(its values, how it ended, its score), then the sweep's report (its trials table, optimisation history and
the importance of each parameter).

Free Colab has no terminal, so this cell is the way to sweep there. It is off unless the picker's sweep
box is ticked: Colab does not include Optuna, so it is installed when a sweep starts, with a message, and a
sweep that cannot get it says so and lets the rest of "Run all" go on. Like cross-validation it waits for
the picked run to finish (a stop must never start hours of other work), and like every step here it
resumes: run the cell again after a disconnect and the sweep continues with the trial it was training.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.colab.drive import Workspace, ensure_package, run_config
from cloudml_lib.colab.live import LiveView, command, report_end, run_live
from cloudml_lib.colab.picker import Choice, Picker
from cloudml_lib.colab.show import plural, show, show_markdown, show_page, user_errors
from cloudml_lib.commands.compare import metric_words, numbered_folders
from cloudml_lib.core.run.folder import RunFolder

OPTUNA = "optuna>=4.0"  # as pyproject.toml's extras
TRIAL = re.compile(r"^Trial (\d+) \((\d+) of (\d+)\)")  # sweep.run_trials, as each trial starts
STATE_WORDS = {"running": "training", "complete": "finished", "pruned": "stopped early (pruned)"}


def swept_settings() -> str:
    """The settings the packaged search space tries (the sweep command's default --space)."""
    from cloudml_lib.base.resources import config_file
    from cloudml_lib.base.yamlfile import read_yaml

    params = (read_yaml(config_file("sweeps/demo.yaml")) or {}).get("params") or {}
    return ", ".join(params)


def sweep_dir(ws: Workspace, c: Choice) -> Path:
    return ws.runs / f"{c.run_name}_sweep"


def sweep_command(ws: Workspace, c: Choice) -> list[str]:
    """The sweep over the picked preset and test flights (the packaged search space), each trial at
    most `c.sweep_epochs` epochs."""
    config, overrides = run_config(ws, c.preset, None, c.heldout, demo=c.preset == "demo")
    cmd = command("sweep", "--config", config, "--trials", c.sweep_trials, "--run-dir", sweep_dir(ws, c))
    for o in [*overrides, f"train.epochs={c.sweep_epochs}"]:
        cmd += ["--set", o]
    return cmd


def ensure_optuna() -> bool:
    """Optuna importable by this Python (the sweep's subprocess runs the same one): installed with pip when
    missing, saying so; False, with what pip said and how to try again, when that fails."""
    return ensure_package(
        "optuna",
        OPTUNA,
        "The sweep runs on Optuna, which this runtime does not have (Colab does not include it)",
        "so no sweep runs; nothing else is affected",
    )


def _value(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def trials_html(folder: Path, asked: int) -> str:
    """Every trial so far (trials/<n>/trial.json): its values, how it ended and its score, as HTML."""
    space = (RunFiles(folder).sweep() or {}).get("space") or {}
    metric = space.get("metric") if isinstance(space.get("metric"), str) else "score"
    rows = []
    for t in numbered_folders(folder / "trials"):
        info = RunFiles(t).trial()
        if not info:
            continue
        state = STATE_WORDS.get(info["state"], info["state"])
        if info["state"] == "failed" and info.get("note"):
            state += f": {info['note']}"
        cells = [
            f"{info['number'] + 1} (trials/{info['number']})",
            ", ".join(f"{k} = {_value(v)}" for k, v in info["params"].items()),
            state,
            "-" if info.get("value") is None else f"{info['value']:.4g}",
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in cells) + "</tr>")
    if not rows:
        return "<i>No trial has started yet.</i>"
    head = "".join(
        f"<th>{h}</th>" for h in ("trial (folder)", "values", "state", html.escape(metric_words(metric)))
    )
    return (
        f"<b>Trials</b>: {len(rows)} of {asked} started.<table><tr>{head}</tr>" + "".join(rows) + "</table>"
    )


class SweepView(LiveView):
    """A live view that follows the trial being trained (its bar and curves, "trial k of n"), with the table
    of every trial so far under it."""

    def __init__(self, folder: Path, asked: int):
        import ipywidgets as w

        super().__init__(None)
        self.folder, self.asked, self.trial, self.stale = Path(folder), asked, None, True
        self.table = w.HTML(trials_html(self.folder, asked))
        show(self.table)

    def line(self, text: str) -> None:
        super().line(text)
        started = TRIAL.match(text)
        if started:  # a new trial: a run of its own, with its own bar and curves
            number, k, n = (int(x) for x in started.groups())
            self.trial = f"trial {k} of {n} (trials/{number})"  # counted from 1; the folder from 0
            self.run_dir = self.folder / "trials" / str(number)
            self.metrics_path = RunFolder(self.run_dir).metrics  # where live.py reads the curves
            self.progress, self.metrics_size, self.shown_epochs = {}, -1, 0
            self.curves.layout.display, self.placeholder.layout.display = "none", None
            self.placeholder.value = f"<i>The curves of {self.trial} appear after its first epoch.</i>"
        if text.startswith("Trial "):
            self.stale = True

    def refresh(self) -> None:
        super().refresh()
        if self.trial and (self.progress or self.lines):  # the label was just written again: say the trial
            self.label.value = f"{html.escape(self.trial)} &middot; {self.label.value}"
        if self.stale:
            self.table.value = trials_html(self.folder, self.asked)
            self.stale = False


@user_errors
def sweep(ws: Workspace, picker: Picker, run_dir: Path | None = None) -> Path | None:
    """With the picker's sweep box ticked: `python -m cloudml_lib sweep` over the picked preset and test
    flights, trial by trial in a live view, then the sweep's report. Returns the sweep's folder."""
    c = picker.choice()
    if not c.sweep_trials:
        print("Sweep not asked for (tick 'Then sweep hyperparameters' in the picker, then run this cell).")
        return None
    if run_dir is not None and not RunFolder.of(run_dir).is_finished():
        from cloudml_lib.colab.training import waits

        print(waits("The sweep waits", run_dir))
        return None
    if not ensure_optuna():
        return None
    folder = sweep_dir(ws, c)
    show_markdown(
        f"**Sweep** of {plural(c.sweep_trials, 'trial')}, each at most {plural(c.sweep_epochs, 'epoch')} "
        f"(preset {c.preset}; the settings tried: {swept_settings()}), into "
        f"`{folder}`. Each trial is a run of its own in `trials/<n>`; run this cell again after a "
        "disconnect and the sweep continues with the trial it was training. To add trials later, raise "
        "Trials in the picker and run this cell again."
    )
    view = SweepView(folder, c.sweep_trials)
    report_end(run_live(sweep_command(ws, c), view), view, "sweep", None)
    view.table.value = trials_html(folder, c.sweep_trials)
    show_page(folder)
    return folder
