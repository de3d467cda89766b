"""The preset picker of the training notebook (ipywidgets 7 and 8).

"Run all" after a disconnect must continue the run the user started, with the user's choices, not the
defaults: every start of a run writes its choices to `<CloudML>/last_run.json` (on Drive), and a new
picker comes back with that run's preset, epochs, run name, test flights and boxes, says
"Continuing run X (epoch e of E)" (or, once it is finished, shows its results without training
again), and offers starting a new run as an explicit choice.

A run never changes its data: a run with a checkpoint keeps the flights and test flights its
config.yaml records, whatever data/ holds now. When some are missing (Google Drive not synced yet) the
picker says which and offers to wait or to start a new run; new flights in data/ are offered as a new
run. The widgets always show what will train: Auto is resolved when the picker is built (without a GPU
it says so and picks a short CPU run), and the note under them follows every change. A choice that
cannot train (one flight, every flight a test flight, a continued run's flights missing) is said in red in
the note, and the Train cell refuses it before anything starts.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cloudml_lib.base.config import load_config
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.colab.drive import (
    CPU_EPOCHS,
    FIXED_PRESETS,
    SMALL,
    RunFlights,
    Workspace,
    complete_flights,
    default_heldout,
    frame_rows,
    preset_refusal,
    preset_rows,
    run_config,
    run_flights,
    uses_demo_data,
)
from cloudml_lib.colab.expected import ExpectedTimes
from cloudml_lib.colab.profile import profile
from cloudml_lib.colab.show import plural, show, user_errors
from cloudml_lib.commands import presets
from cloudml_lib.core.machine.timing import Expected, duration
from cloudml_lib.core.network.compile import plan, this_device
from cloudml_lib.core.run.folder import RunFolder

LAST_RUN = "last_run.json"  # in the CloudML folder (on Drive): the choice the newest run started with
PRESET_WORDS = {
    "A": "full model, torch.compile, batch 20",
    "B": "full model, no compile, batch 16",
    "C": "small model, torch.compile, batch 16",
    "demo": "CPU demo configuration",
    SMALL: "the demo configuration on your flights (frames smaller than the camera's)",
}
SWEEP_TRIALS, SWEEP_EPOCHS = 8, 6  # the sweep box's defaults: 8 trials of at most 6 epochs each
PROBLEM_STYLE = "color:#b91c1c"  # a choice that cannot train: red, as a cell's Problem message


@dataclass
class Choice:
    """What a run was started with in the notebook (stored as <CloudML>/last_run.json)."""

    preset: str  # A, B, C or demo (Auto is resolved before a run starts)
    epochs: int
    run_name: str
    heldout: list = field(default_factory=list)
    crossval: bool = False
    whole_flights: bool = True
    sweep_trials: int = 0  # 0: no sweep; else the sweep cell runs this many trials in all
    sweep_epochs: int = SWEEP_EPOCHS  # each trial's epochs at most
    started: float = 0.0

    def save(self, root: Path) -> None:
        from cloudml_lib.base.outputs import write_text

        write_text(Path(root) / LAST_RUN, json.dumps(dict(asdict(self), started=time.time()), indent=1))

    @classmethod
    def load(cls, root: Path) -> Choice | None:
        from cloudml_lib.base.runfiles import RunFiles

        files = RunFiles(Path(root))
        raw = files.last_run()
        if raw is None:
            for d in files.damaged:
                print(f"{d}: the newest run is not offered to continue; choose it again below.")
            return None
        values = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        for k in ("sweep_trials", "sweep_epochs"):  # newer than last_run.json's checked shape: checked here
            v = values.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 10000:
                values.pop(k)
        return cls(**values)


def config_path(preset: str) -> Path:
    """The packaged config of a preset as the picker names it (SMALL: the demo configuration)."""
    return presets.preset_config_path("demo" if preset == SMALL else preset)


def demo_heldout(run_dir: Path) -> list[str]:
    """The test flights a demo run's config.yaml records (validation_flights in an earlier release's)."""
    from cloudml_lib.base.config import renamed_keys
    from cloudml_lib.base.runfiles import RunFiles

    data = ((RunFiles(run_dir).config() if run_dir.is_dir() else None) or {}).get("data") or {}
    held = renamed_keys({"data": data})["data"].get("test_flights")
    return [f for f in held if isinstance(f, str)] if isinstance(held, list) else []


def _status(run_dir: Path) -> dict | None:
    """A run folder's verified status; None when it holds no run or cannot be read."""
    try:
        return RunFolder.of(run_dir).status() if RunFolder.of(run_dir).holds_run() else None
    except CloudMLError:
        return None


def progress(run_dir: Path, choice: Choice | None = None) -> tuple[bool, str]:
    """(unfinished, in words) for a run folder: its verified status, and its cross-validation if asked for."""
    s = _status(run_dir)
    if s is None or s.get("latest_checkpoint") is None:
        return True, "no checkpoint yet: it starts from the beginning"
    if s.get("state") == "trained":  # its end pending: Train runs the end, it trains no more
        return True, f"{s['state_words']}: Train finishes it without training more"
    if s.get("state") == "failed":
        return True, f"{s['state_words']}; Train continues it once that is fixed"
    if not s["finished"]:
        return True, f"epoch {s['epoch']} of {s['epochs']}, step {s['step']} of {s['total_steps']}"
    cv = run_dir.with_name(run_dir.name + "_crossval")
    if choice and choice.crossval and not (cv / "crossval.json").is_file():
        return True, "trained; its cross-validation is not finished"
    return False, f"finished ({plural(s['epochs_completed'], 'epoch')})"


def newest_run(ws: Workspace) -> tuple[Choice, bool, str] | None:
    """The run the notebook started last: (its choice, whether it is unfinished, where it stands)."""
    newest = Choice.load(ws.root)
    if newest is None:
        return None
    if newest.preset not in PRESET_WORDS:
        print(
            f"{ws.root / LAST_RUN}: preset {newest.preset!r} is none of {', '.join(PRESET_WORDS)}; the "
            "newest run is not offered to continue; choose it again below."
        )
        return None
    return (newest, *progress(ws.runs / newest.run_name, newest))


def fresh_name(ws: Workspace, base: str) -> str:
    """`base`, or base_2, base_3, ... when a run of that name exists already."""
    name, k = base, 1
    while (ws.runs / name).exists():
        k += 1
        name = f"{base}_{k}"
    return name


class Picker:
    """Preset, epochs, run name, test flights, cross-validation, whole-flight and sweep boxes; continue
    or new."""

    def __init__(self, ws: Workspace):
        import ipywidgets as widgets

        self.ws, self.demo = ws, uses_demo_data(ws)
        self.times = ExpectedTimes(ws, lambda: self._refresh())  # a choice's step, timed once, in a thread
        self.rows = None if self.demo else frame_rows(ws)  # the fewest sensor rows of the flights' frames
        self.auto, self.auto_why, self.cpu = self._resolve_auto()
        self.found = [] if self.demo else complete_flights(ws)
        self.heldout_default, self.heldout_why = default_heldout(ws)
        self._facts: dict[str, tuple[RunFlights | None, dict | None]] = {}
        self.previous = newest_run(ws)
        if self.previous:  # the run's own test flights (its config.yaml), never the widgets' default
            flights = self.facts(self.previous[0].run_name)[0]
            if flights is not None:
                self.previous = (replace(self.previous[0], heldout=flights.heldout), *self.previous[1:])
        # the user's flights arrived after a demo run: a new run on them is the default (the demo run kept);
        # not news where a run on them exists already (the user went back to the demo since: it goes on)
        self.own_after_demo = bool(
            self.previous and self.previous[0].preset == "demo" and not self.demo and not self._own_runs()
        )
        rows = self._build_widgets()
        self._typed_name, self._loading = False, False
        self.mode.observe(self._on_mode, names="value")
        self.preset.observe(self._on_preset, names="value")
        self.run_name.observe(self._on_name, names="value")
        self.sweep.observe(self._on_sweep, names="value")
        for w in (self.epochs, self.heldout, self.crossval, self.whole_flights, self.sweep_trials):
            w.observe(lambda change: self._refresh(), names="value")
        self.sweep_epochs.observe(lambda change: self._refresh(), names="value")
        go_on = bool(self.previous) and not self.own_after_demo
        self._apply(self.previous[0] if go_on else self._defaults(new=bool(self.previous)), go_on)
        self.mode.value = "continue" if go_on else "new"
        self.mode.layout.display = None if self.previous else "none"
        show(widgets.VBox(rows))
        self._refresh()

    def _build_widgets(self) -> list:
        """The widgets, in the order shown."""
        import ipywidgets as widgets

        style, wide = {"description_width": "initial"}, widgets.Layout(width="auto")
        keep = (
            (("Continue " if self.previous[1] else "Keep ") + self.previous[0].run_name)
            if self.previous
            else ""
        )
        # button_width auto: ipywidgets 8 gives each toggle button 148 px and cuts a longer run name short
        self.mode = widgets.ToggleButtons(
            options=[(keep, "continue"), ("Start a new run", "new")],
            description="Run:",
            style=dict(style, button_width="auto"),
        )
        self.preset = widgets.Dropdown(
            options=self._preset_options(), description="Preset:", style=style, layout=wide
        )
        self.epochs = widgets.BoundedIntText(value=1, min=1, max=10000, description="Epochs:", style=style)
        self.run_name = widgets.Text(description="Run name:", style=style)
        self.heldout = widgets.SelectMultiple(
            options=self.found or ["(demo: 05Mar25)"],
            description="Test flights:",
            style=style,
            rows=min(6, max(2, len(self.found))),
        )
        self.crossval = widgets.Checkbox(
            description="Then cross-validate: every flight the test flight once", indent=False, layout=wide
        )
        self.whole_flights = widgets.Checkbox(
            description="Then predict the test flights frame by frame", indent=False, layout=wide
        )
        self.sweep = widgets.Checkbox(
            description="Then sweep hyperparameters (Optuna trials)", indent=False, layout=wide
        )
        self.sweep_trials = widgets.BoundedIntText(
            value=SWEEP_TRIALS, min=1, max=1000, description="Trials:", style=style
        )
        self.sweep_epochs = widgets.BoundedIntText(
            value=SWEEP_EPOCHS, min=1, max=10000, description="epochs per trial at most:", style=style
        )
        self.sweep_size = widgets.HBox([self.sweep_trials, self.sweep_epochs], layout={"display": "none"})
        self.note = widgets.HTML()
        return [
            self.mode,
            self.preset,
            self.epochs,
            self.run_name,
            self.heldout,
            self.crossval,
            widgets.HTML("<small>Cross-validation trains one run per flight: hours on real data.</small>"),
            self.whole_flights,
            self.sweep,
            self.sweep_size,
            self.note,
        ]

    # ----------------------------------------------------------------------------- choices
    def _resolve_auto(self) -> tuple[str, str, bool]:
        """(Auto's preset, why, whether it is a short CPU run)."""
        if self.demo:
            return (
                "demo",
                "no flights of yours were found, so the demo configuration trains on the demo flights",
                False,
            )
        if preset_refusal("C", self.rows):  # frames too small for every GPU preset: the demo configuration
            return (
                SMALL,
                f"your flights' frames have {self.rows} sensor rows, and presets A, B and C need "
                f"{preset_rows('C')} (the ER-2 camera's); the demo configuration takes frames of "
                f"{preset_rows(SMALL)} rows or more (a narrow model: it trains on a CPU too)",
                False,
            )
        preset, why = presets.choose_preset(presets.system_report())
        if preset == "demo":  # your flights, no GPU: the smallest preset, briefly, with a plain warning
            return (
                "C",
                "no GPU was found: training on the CPU is slow, hours per epoch for your flights even with "
                f"preset C (the smallest model), so Auto trains C for {plural(CPU_EPOCHS, 'epoch')} to try "
                "it out. For a real training, in Colab choose Runtime > Change runtime type > T4 GPU and "
                "run all again",
                True,
            )
        return preset, why, False

    def _preset_options(self, kept: str | None = None) -> list[tuple[str, str]]:
        """The presets offered; `kept`: a continued run's preset, shown even where it is not offered."""
        if self.demo:
            options = [("demo: " + PRESET_WORDS["demo"], "demo")]
        else:
            auto = f"Auto: {self.auto} here" + (" (no GPU: a short CPU run)" if self.cpu else "")
            options = [(self._preset_label(p), p) for p in FIXED_PRESETS] + [(auto, "Auto")]
            if self.auto == SMALL:
                options.insert(len(FIXED_PRESETS), (f"{SMALL}: {PRESET_WORDS[SMALL]}", SMALL))
        if kept and kept not in [v for _, v in options]:
            options.append((f"{kept}: {PRESET_WORDS[kept]}", kept))
        return options

    def _preset_label(self, p: str) -> str:
        """A GPU preset as offered: what it is, and where the flights' frames are too small for it."""
        if preset_refusal(p, self.rows):
            return f"{p}: {PRESET_WORDS[p]} (needs frames of {preset_rows(p)} rows; yours have {self.rows})"
        return f"{p}: {PRESET_WORDS[p]}"

    def _defaults(self, new: bool) -> Choice:
        preset = "demo" if self.demo else "Auto"
        base = profile().run_name("demo" if self.demo else f"preset_{self.auto}")
        name = fresh_name(self.ws, base) if new else base
        return Choice(
            preset=preset,
            epochs=self._preset_epochs(preset),
            run_name=name,
            heldout=list(self.heldout_default),
            crossval=False,
            whole_flights=True,
        )

    def _preset_epochs(self, preset: str) -> int:
        if preset == "Auto" and self.cpu:
            return profile().epochs(CPU_EPOCHS)
        resolved = self.auto if preset == "Auto" else preset
        return profile().epochs(load_config(config_path(resolved)).train.epochs)

    def _apply(self, c: Choice, continuing: bool) -> None:
        """Show choice `c`; a continued run's test flights stay, marked when data/ lacks them."""
        self._loading = True
        self.preset.options = self._preset_options(c.preset if continuing else None)
        values = [v for _, v in self.preset.options]
        self.preset.value = c.preset if c.preset in values else ("demo" if self.demo else "Auto")
        self.epochs.value = c.epochs
        self.run_name.value = c.run_name
        if continuing and c.preset == "demo":  # a demo run: its own test flight, whatever data/ holds
            held = demo_heldout(self.ws.runs / c.run_name)
            self.heldout.options = [(f"{f} (demo)", f) for f in held] or ["(demo: 05Mar25)"]
            self.heldout.value = tuple(held)
            self.heldout.layout.display = None
            self._apply_boxes(c)
            return
        missing = [f for f in c.heldout if f not in self.found] if continuing else []
        options = [(f, f) for f in self.found] + [(f"{f} (not in data/)", f) for f in missing]
        self.heldout.options = (options if missing else list(self.found)) or ["(demo: 05Mar25)"]
        if options:
            chosen = tuple(c.heldout) if continuing else tuple(f for f in c.heldout if f in self.found)
            self.heldout.value = chosen or tuple(f for f in self.heldout_default if f in self.found)
        self.heldout.layout.display = None if options else "none"
        self._apply_boxes(c)

    def _apply_boxes(self, c: Choice) -> None:
        self.crossval.value, self.whole_flights.value = c.crossval, c.whole_flights
        self.sweep.value = bool(c.sweep_trials)
        self.sweep_trials.value = c.sweep_trials or SWEEP_TRIALS
        self.sweep_epochs.value = c.sweep_epochs or SWEEP_EPOCHS
        self.sweep_size.layout.display = None if c.sweep_trials else "none"
        self._typed_name, self._loading = False, False

    def _on_mode(self, change) -> None:
        continuing = change["new"] == "continue" and self.previous is not None
        self._apply(self.previous[0] if continuing else self._defaults(new=True), continuing)
        self._refresh()

    def _on_preset(self, change) -> None:
        if self._loading:
            return
        self.epochs.value = self._preset_epochs(change["new"])
        if not self._typed_name:  # the name follows the preset until the user types one
            resolved = self.auto if change["new"] == "Auto" else change["new"]
            self._loading = True
            self.run_name.value = fresh_name(self.ws, f"preset_{resolved}")
            self._loading = False
        self._refresh()

    def _on_name(self, change) -> None:
        if not self._loading:
            self._typed_name = True
        self._refresh()

    def _on_sweep(self, change) -> None:
        self.sweep_size.layout.display = None if change["new"] else "none"
        self._refresh()

    def choice(self) -> Choice:
        """What the widgets say, Auto resolved; a continued run keeps its preset, name, test flights."""
        boxes = {
            "epochs": int(self.epochs.value),
            "crossval": bool(self.crossval.value),
            "whole_flights": bool(self.whole_flights.value),
            "sweep_trials": int(self.sweep_trials.value) if self.sweep.value else 0,
            "sweep_epochs": int(self.sweep_epochs.value),
        }
        if self.continuing:
            return replace(self.previous[0], started=0.0, **boxes)
        preset = self.auto if self.preset.value == "Auto" else self.preset.value
        name = self.run_name.value.strip() or self._defaults(new=False).run_name
        heldout = [f for f in self.heldout.value if f in self.found]
        return Choice(preset=preset, run_name=name, heldout=heldout, **boxes)

    @property
    def run_dir(self) -> Path:
        return self.ws.runs / self.choice().run_name

    # ----------------------------------------------------------------------------- the run and its data
    def facts(self, name: str) -> tuple[RunFlights | None, dict | None]:
        """(its flights against data/, its status) of run `name` when it has a checkpoint to continue from,
        else (None, None); read once per name (`recheck` reads again)."""
        if name not in self._facts:
            run_dir = self.ws.runs / name
            status = _status(run_dir)
            if status is None or status.get("latest_checkpoint") is None:
                self._facts[name] = (None, None)
            else:
                self._facts[name] = (run_flights(self.ws, run_dir, self.found), status)
        return self._facts[name]

    def recheck(self) -> None:
        """Look at data/ and the runs again, and say so in the note: the Train cell calls it before training
        (Google Drive may have synced since the picker was shown) and after (the run has moved on)."""
        self.found = [] if uses_demo_data(self.ws) else complete_flights(self.ws)
        self._facts.clear()
        self.times.forget()
        if self.previous:
            choice = self.previous[0]
            self.previous = (choice, *progress(self.ws.runs / choice.run_name, choice))
        self._refresh()

    def problem(self) -> str | None:
        """Why the chosen run cannot train, in words (the Train cell refuses it); None when it can."""
        c = self.choice()
        flights, status = self.facts(c.run_name)
        if flights is not None:  # a run to continue: on its own flights
            blocked = flights.removed and not status["finished"]
            return flights.missing_words(finished=False) if blocked else None
        if c.preset == "demo":
            return None
        refusal = preset_refusal(c.preset, self.rows)
        if refusal:
            return refusal + "."
        missing = [f for f in c.heldout if f not in self.found]
        if missing:
            return (
                f"the test flight {', '.join(missing)} is not in {self.ws.data} now. If Google Drive has "
                "not synced yet, wait a minute and run this cell again; otherwise "
                + (
                    "choose other test flights in the picker."
                    if not self.continuing
                    else "choose 'Start a new run' in the picker."
                    if len(self.found) >= 2
                    else f"put it back: a new run needs two flights in {self.ws.data} (one to train on, one "
                    f"to test it on), and {plural(len(self.found), 'complete flight')} is there."
                )
            )
        if len(self.found) < 2:
            have = f"only one complete flight ({self.found[0]})" if self.found else "no complete flight"
            return (
                f"{have} is in {self.ws.data}: training needs two at least, one to train on and one "
                "to test it on. Add a second flight to data/ (the setup notebook checks it), then run "
                "this cell again."
            )
        if not c.heldout:
            return "no test flight is chosen: choose at least one under Test flights in the picker."
        if set(self.found) <= set(c.heldout):
            return (
                "every flight is a test flight: leave at least one for training (unselect one under Test "
                "flights)."
            )
        return None

    # ----------------------------------------------------------------------------- the note
    @property
    def continuing(self) -> bool:
        return self.previous is not None and self.mode.value == "continue"

    def _refresh(self) -> None:
        if self._loading:
            return
        continuing = self.continuing
        for w in (self.preset, self.run_name, self.heldout):
            w.disabled = (
                continuing or (w is self.preset and self.demo) or (w is self.heldout and not self.found)
            )
        self.note.value = self.describe()

    def describe(self) -> str:
        """The note under the widgets: what will train, in words (HTML)."""
        c = self.choice()
        flights = self.facts(c.run_name)[0]
        lines = []
        problem = self.problem()
        if problem:
            text = problem[0].upper() + problem[1:]
            lines.append(f'<span style="{PROBLEM_STYLE}"><b>Problem:</b> {html.escape(text)}</span>')
        if profile().picker_note():
            lines.append(f"<b>Smoke test:</b> {profile().picker_note()}")
        lines += self._demo_news()
        lines += self._run_lines(c)
        if problem:  # nothing trains until it is fixed: no "Trains ..." under the red line
            lines.append("Nothing is trained until this is fixed.")
        elif not self._trains(c):  # a finished run shown as it is: its line above says so
            pass
        else:
            lines.append(self._trains_line(c, flights))
            lines.append(html.escape(self._time_words(c)))
        preset_cfg = load_config(config_path(c.preset))
        lines.append(
            "torch.compile: "
            + plan(preset_cfg.train.torch_compile, preset_cfg.train.torch_compile_mode, this_device())
            + "."
        )
        if not self.continuing and (self.preset.value == "Auto" or self.demo):
            lines.append(f"Auto chose {self.auto} because {self.auto_why}.")
        if not self.demo and not self.continuing and flights is None and c.preset != "demo":
            if sorted(c.heldout) == sorted(self.heldout_default):
                lines.append(f"Test flight by default: {self.heldout_why}.")
            else:
                lines.append(
                    f"Test flights: {', '.join(c.heldout) or 'none'}, your choice (the default: "
                    f"{', '.join(self.heldout_default) or 'none'})."
                )
        if c.crossval:
            lines.append(html.escape(self._crossval_words(c)))
        if c.sweep_trials:
            budget = c.sweep_trials * c.sweep_epochs
            sweep_time = self._expected(c)
            lines.append(
                f"Then a sweep: {plural(c.sweep_trials, 'trial')} of at most "
                f"{plural(c.sweep_epochs, 'epoch')} each ({budget} epochs of training at most; poor trials "
                f"may stop early"
                + (
                    f"; about {duration(sweep_time.epoch_s * budget)} at most"
                    if isinstance(sweep_time, Expected) and sweep_time.epoch_s
                    else ""
                )
                + f"), into <code>{html.escape(str(self.ws.runs / (c.run_name + '_sweep')))}"
                "</code>. Optuna is installed when the sweep starts, if missing."
            )
        return "<br>".join(lines)

    def _own_runs(self) -> list[str]:
        """The runs in runs/ trained on the user's own flights (config.yaml's data.demo false)."""
        from cloudml_lib.base.runfiles import RunFiles

        runs = sorted(p for p in self.ws.runs.iterdir() if p.is_dir()) if self.ws.runs.is_dir() else []
        return [p.name for p in runs if ((RunFiles(p).config() or {}).get("data") or {}).get("demo") is False]

    def _demo_news(self) -> list[str]:
        """The user's own flights arrived after a demo run: said, with what becomes of the demo run."""
        if not self.own_after_demo:
            return []
        demo_run = html.escape(self.previous[0].run_name)
        return [
            f"<b>Your flights are in data/ now</b> ({plural(len(self.found), 'flight')}): a new run on them "
            f"is the default. The demo run {demo_run} is kept"
            + (
                ": it goes on with the demo flights, not yours."
                if self.continuing
                else f" (choose <i>{html.escape(self.mode.options[0][0])}</i> above to go on with it)."
            )
        ]

    def crossval_expected(self) -> float | None:
        """The chosen cross-validation's expected time from the runs measured here (the run just trained:
        its epochs and its end), nothing timed; None without such a run."""
        c = self.choice()
        try:
            cfg = load_config(*run_config(self.ws, c.preset, c.epochs, c.heldout, demo=c.preset == "demo"))
        except CloudMLError:
            return None
        return ExpectedTimes(self.ws, lambda: None).crossval(cfg, c.epochs, measure=False)

    def _crossval_words(self, c: Choice) -> str:
        """The note's line on the cross-validation the box asks for: what it runs and its expected time."""
        line = "Then cross-validation: one run per flight, each with its scalars-only control"
        try:
            cfg = load_config(*run_config(self.ws, c.preset, c.epochs, c.heldout, demo=c.preset == "demo"))
        except CloudMLError:
            return line + "."
        seconds = self.times.crossval(cfg, c.epochs)
        if seconds is None:
            return line + " (its expected time: known with the run's)."
        return line + f": about {duration(seconds)} in all (an estimate from the run's expected time)."

    def _expected(self, c: Choice) -> Expected | str:
        """The expected time of choice `c` as it would train (its config), or words why not yet."""
        try:
            cfg = load_config(*run_config(self.ws, c.preset, c.epochs, c.heldout, demo=c.preset == "demo"))
        except CloudMLError as e:
            return f"Expected time: not known ({e})"
        return self.times.of(cfg, c.epochs)

    def _time_words(self, c: Choice) -> str:
        """The note's line on time: per epoch and in all (what is left of a continued run), on this device."""
        found = self._expected(c)
        cpu = "" if self.times.device.type == "cuda" else "No GPU here: this trains on the CPU. "
        if isinstance(found, str):
            return cpu + found
        status = self.facts(c.run_name)[1]
        done = status["epochs_completed"] if status and self.continuing else 0
        left = replace(found, epochs=max(0, c.epochs - done))  # its end still to come
        what = f"the {plural(left.epochs, 'epoch')} left" if done else "the run"
        return cpu + left.words(what)

    def expected_record(self, c: Choice) -> dict | None:
        """What the run records of its expected time in run.json (None where it is not known yet)."""
        found = self._expected(c)
        return found.record(self.times.device_name) if isinstance(found, Expected) else None

    def _run_lines(self, c: Choice) -> list[str]:
        """Which run: continued (where it stands), kept (finished), existing or new; and its data's news."""
        flights, status = self.facts(c.run_name)
        name = html.escape(c.run_name)
        finished = status is not None and status["finished"]
        if self.continuing and self.previous[1] and not finished:
            out = [
                f"<b>Continuing run {name}</b> ({self.previous[2]}). Its preset and test flights are "
                "fixed; more or fewer epochs are fine. Choose <i>Start a new run</i> for another."
            ]
        elif self.continuing:
            out = [self._finished_line(c, status)]
        elif (self.ws.runs / c.run_name).exists():
            unfinished, words = progress(self.ws.runs / c.run_name, c)
            # the name typed is an existing run's: said beside the pressed "Start a new run", never as if new
            lead = "<i>Start a new run</i> is chosen, but run" if self.previous is not None else "Run"
            out = [
                f"{lead} <b>{name}</b> exists ({words}): Train continues it, on its own flights. Give "
                "another run name for a new run."
                if unfinished
                else f"{lead} <b>{name}</b> exists and is {words}: the cells below show its results; "
                "it is not trained again. Give another run name for a new run."
            ]
        else:
            out = [f"A new run <b>{name}</b>."]
        if flights is not None and flights.removed and finished:
            out.append(html.escape(flights.missing_words(finished=True)))
        if flights is not None and flights.added:
            out.append(html.escape(flights.added_words()))
        return out

    def _trains(self, c: Choice) -> bool:
        """Whether Train would train: not for a finished run whose Epochs box asks for no more epochs, nor
        for one that early stopping ended."""
        status = self.facts(c.run_name)[1]
        if not (status and status["finished"]):
            return True
        done, planned = status["epochs_completed"], status["epochs"]
        return done >= planned and c.epochs > planned

    def _finished_line(self, c: Choice, status: dict | None) -> str:
        """A finished run kept: what the Epochs box does to it now."""
        name = html.escape(c.run_name)
        if status is None:
            return (
                f"<b>Run {name} is {self.previous[2]}</b>: the cells below show its results without "
                "training again. Raise Epochs to train it longer"
                + self._new_run_advice(", or choose <i>Start a new run</i>.")
            )
        done, planned = status["epochs_completed"], status["epochs"]
        if done < planned:  # early stopping ended it: more epochs would not train it again
            return (
                f"<b>Run {name} stopped early at epoch {done} of {planned}</b> (its validation score no "
                "longer improved): the cells below show its results; more epochs do not train it again."
                + self._new_run_advice(" Choose <i>Start a new run</i> for another.")
            )
        if c.epochs > planned:
            return (
                f"<b>Run {name} is finished ({plural(done, 'epoch')})</b>; with Epochs at {c.epochs} it "
                f"trains {plural(c.epochs - planned, 'more epoch')} from its last checkpoint (the learning "
                "rate's decay is planned again over the new length), then the cells below show the new "
                "results."
            )
        return (
            f"<b>Run {name} is finished ({plural(done, 'epoch')})</b>: the cells below show its results "
            f"without training again. Raise Epochs above {planned} to train it longer"
            + self._new_run_advice(", or choose <i>Start a new run</i>.")
        )

    def _new_run_advice(self, words: str) -> str:
        """`words` (advice to start a new run) where a new run could train; else why it could not."""
        if self.demo or len(self.found) >= 2:
            return words
        return ". A new run needs two flights in data/ (one to train on, one to test it on)."

    def _trains_line(self, c: Choice, flights: RunFlights | None) -> str:
        config = presets.PRESET_FILES["demo" if c.preset == SMALL else c.preset]
        held = ", ".join(c.heldout) or "none (choose one)"
        if c.preset == "demo":
            data = "the demo flights"
        elif flights is not None:
            names = ", ".join(flights.names)
            data = f"its {plural(len(flights.names), 'flight')} ({names}), testing on {held}"
        else:
            data = f"your {plural(len(self.found), 'flight')}, testing on {held}"
        return (
            f"Trains preset <b>{c.preset}</b> ({config}: {PRESET_WORDS[c.preset]}) on {html.escape(data)}, "
            f"{plural(c.epochs, 'epoch')}, into <code>{html.escape(str(self.ws.runs / c.run_name))}</code>."
        )


@user_errors
def preset_picker(ws: Workspace) -> Picker:
    return Picker(ws)
