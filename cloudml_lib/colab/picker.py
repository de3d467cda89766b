"""The preset picker of the training notebook (ipywidgets 7 and 8).

"Run all" after a disconnect must continue the run the user started, with the user's choices, not the
defaults: every start of a run writes its choices to `<CloudML>/last_run.json` (on Drive), and a new
picker comes back with that run's preset, epochs, run name, held-out flights and boxes, says
"Continuing run X (epoch e of E)" (or, once it is finished, shows its results without training
again), and offers starting a new run as an explicit choice.
The widgets always show what will train: Auto is resolved when the picker is built (and without a GPU
says so), and the note under them follows every change.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cloudml_lib import hardware
from cloudml_lib.colab.drive import Workspace, complete_flights, default_heldout, smoke, uses_demo_data
from cloudml_lib.colab.show import plural, show, user_errors
from cloudml_lib.compile import plan, this_device
from cloudml_lib.config import load_config
from cloudml_lib.errors import CloudMLError
from cloudml_lib.rundir import has_run, run_status

LAST_RUN = "last_run.json"  # in the CloudML folder (on Drive): the choice the newest run started with
PRESET_WORDS = {
    "A": "full model, torch.compile, batch 20",
    "B": "full model, no compile, batch 16",
    "C": "small model, batch 16",
    "demo": "CPU demo configuration",
}


@dataclass
class Choice:
    """What a run was started with in the notebook (stored as <CloudML>/last_run.json)."""

    preset: str  # A, B, C or demo (Auto is resolved before a run starts)
    epochs: int
    run_name: str
    heldout: list = field(default_factory=list)
    crossval: bool = False
    whole_flights: bool = True
    started: float = 0.0

    def save(self, root: Path) -> None:
        from cloudml_lib.outputs import write_text

        write_text(Path(root) / LAST_RUN, json.dumps(dict(asdict(self), started=time.time()), indent=1))

    @classmethod
    def load(cls, root: Path) -> Choice | None:
        from cloudml_lib.runfiles import RunFiles

        files = RunFiles(Path(root))
        raw = files.last_run()
        if raw is None:
            for d in files.damaged:
                print(f"{d}: the newest run is not offered to continue; choose it again below.")
            return None
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def progress(run_dir: Path, choice: Choice | None = None) -> tuple[bool, str]:
    """(unfinished, in words) for a run folder: its verified status, and its cross-validation if asked for."""
    try:
        s = run_status(run_dir) if has_run(run_dir) else None
    except CloudMLError:
        s = None
    if s is None or s.get("latest_checkpoint") is None:
        return True, "no checkpoint yet: it starts from the beginning"
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
    return (newest, *progress(ws.runs / newest.run_name, newest))


def fresh_name(ws: Workspace, base: str) -> str:
    """`base`, or base_2, base_3, ... when a run of that name exists already."""
    name, k = base, 1
    while (ws.runs / name).exists():
        k += 1
        name = f"{base}_{k}"
    return name


class Picker:
    """Preset, epochs, run name, held-out flights, cross-validation and whole-flight boxes; continue or
    new."""

    def __init__(self, ws: Workspace):
        import ipywidgets as widgets

        self.ws, self.demo = ws, uses_demo_data(ws)
        self.auto, self.auto_why = self._resolve_auto()
        self.found = [] if self.demo else complete_flights(ws)
        self.heldout_default, self.heldout_why = default_heldout(ws)
        self.previous = newest_run(ws)
        style, wide = {"description_width": "initial"}, widgets.Layout(width="auto")
        keep = (
            (("Continue " if self.previous[1] else "Keep ") + self.previous[0].run_name)
            if self.previous
            else ""
        )
        self.mode = widgets.ToggleButtons(
            options=[(keep, "continue"), ("Start a new run", "new")], description="Run:", style=style
        )
        self.preset = widgets.Dropdown(
            options=self._preset_options(), description="Preset:", style=style, layout=wide
        )
        self.epochs = widgets.BoundedIntText(value=1, min=1, max=10000, description="Epochs:", style=style)
        self.run_name = widgets.Text(description="Run name:", style=style)
        self.heldout = widgets.SelectMultiple(
            options=self.found or ["(demo: 05Mar25)"],
            description="Held out:",
            style=style,
            rows=min(6, max(2, len(self.found))),
        )
        self.crossval = widgets.Checkbox(
            description="Then cross-validate: every flight held out once", indent=False, layout=wide
        )
        self.whole_flights = widgets.Checkbox(
            description="Then predict the held-out flights frame by frame", indent=False, layout=wide
        )
        self.note = widgets.HTML()
        self._typed_name, self._loading = False, False
        self.mode.observe(self._on_mode, names="value")
        self.preset.observe(self._on_preset, names="value")
        self.run_name.observe(self._on_name, names="value")
        for w in (self.epochs, self.heldout, self.crossval, self.whole_flights):
            w.observe(lambda change: self._refresh(), names="value")
        self._apply(self.previous[0] if self.previous else self._defaults(new=False))
        self.mode.value = "continue" if self.previous else "new"
        self.mode.layout.display = None if self.previous else "none"
        self.heldout.layout.display = None if self.found else "none"
        rows = [
            self.mode,
            self.preset,
            self.epochs,
            self.run_name,
            self.heldout,
            self.crossval,
            widgets.HTML("<small>Cross-validation trains one run per flight: hours on real data.</small>"),
            self.whole_flights,
            self.note,
        ]
        show(widgets.VBox(rows))
        self._refresh()

    # ----------------------------------------------------------------------------- choices
    def _resolve_auto(self) -> tuple[str, str]:
        if self.demo:
            return (
                "demo",
                "no flights of yours were found, so the demo configuration trains on the demo flights",
            )
        preset, why = hardware.choose_preset(hardware.system_report())
        if preset == "demo":  # your flights, no GPU: the smallest preset, with a plain warning
            return "C", (
                "there is no GPU: training your flights on the CPU takes hours per epoch. In Colab choose "
                "Runtime > Change runtime type > T4 GPU and run all again"
            )
        return preset, why

    def _preset_options(self) -> list[tuple[str, str]]:
        if self.demo:
            return [("demo: " + PRESET_WORDS["demo"], "demo")]
        return [(f"{p}: {PRESET_WORDS[p]}", p) for p in ("A", "B", "C")] + [
            (f"Auto: {self.auto} here", "Auto")
        ]

    def _defaults(self, new: bool) -> Choice:
        preset = "demo" if self.demo else "Auto"
        base = "smoke" if smoke() else "demo" if self.demo else f"preset_{self.auto}"
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
        if smoke():
            from cloudml_lib.colab.smoke import EPOCHS

            return EPOCHS
        resolved = self.auto if preset == "Auto" else preset
        return load_config(hardware.preset_config_path(resolved)).train.epochs

    def _apply(self, c: Choice) -> None:
        self._loading = True
        self.preset.value = (
            c.preset
            if c.preset in dict((v, k) for k, v in self.preset.options)
            else ("demo" if self.demo else "Auto")
        )
        self.epochs.value = c.epochs
        self.run_name.value = c.run_name
        if self.found:
            self.heldout.value = tuple(f for f in c.heldout if f in self.found) or tuple(self.heldout_default)
        self.crossval.value, self.whole_flights.value = c.crossval, c.whole_flights
        self._typed_name, self._loading = False, False

    def _on_mode(self, change) -> None:
        self._apply(
            self.previous[0] if change["new"] == "continue" and self.previous else self._defaults(new=True)
        )
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

    def choice(self) -> Choice:
        """What the widgets say, Auto resolved."""
        preset = self.auto if self.preset.value == "Auto" else self.preset.value
        name = self.run_name.value.strip() or self._defaults(new=False).run_name
        heldout = list(self.heldout.value) if self.found else []
        return Choice(
            preset=preset,
            epochs=int(self.epochs.value),
            run_name=name,
            heldout=heldout,
            crossval=bool(self.crossval.value),
            whole_flights=bool(self.whole_flights.value),
        )

    @property
    def run_dir(self) -> Path:
        return self.ws.runs / self.choice().run_name

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
        lines = []
        if smoke():
            lines.append("<b>Smoke test:</b> a tiny demo run of 2 epochs trains, whatever is chosen.")
        if self.continuing and self.previous[1]:
            lines.append(
                f"<b>Continuing run {c.run_name}</b> ({self.previous[2]}). Its preset and held-out "
                "flights are fixed; more or fewer epochs are fine. Choose <i>Start a new run</i> for another."
            )
        elif self.continuing:
            lines.append(
                f"<b>Run {c.run_name} is {self.previous[2]}</b>: the cells below show its results without "
                "training again. Raise Epochs to train it longer, or choose <i>Start a new run</i>."
            )
        elif (self.ws.runs / c.run_name).exists():
            unfinished, words = progress(self.ws.runs / c.run_name, c)
            lines.append(
                f"Run <b>{c.run_name}</b> exists ({words}): it is continued"
                + ("" if unfinished else ", and being finished, it is not trained again")
                + "."
            )
        else:
            lines.append(f"A new run <b>{c.run_name}</b>.")
        config = hardware.PRESET_FILES[c.preset]
        data = (
            "the demo flights"
            if self.demo
            else f"your {plural(len(self.found), 'flight')}, holding out "
            f"{', '.join(c.heldout) or 'none (choose one)'}"
        )
        lines.append(
            f"Trains preset <b>{c.preset}</b> ({config}: {PRESET_WORDS[c.preset]}) on {data}, "
            f"{plural(c.epochs, 'epoch')}, into <code>{self.ws.runs / c.run_name}</code>."
        )
        preset_cfg = load_config(hardware.preset_config_path(c.preset))
        lines.append(
            "torch.compile: "
            + plan(preset_cfg.train.torch_compile, preset_cfg.train.torch_compile_mode, this_device())
            + "."
        )
        if self.preset.value == "Auto" or self.demo:
            lines.append(f"Auto chose {self.auto} because {self.auto_why}.")
        if not self.demo and not self.continuing:
            lines.append(f"Held out by default: {self.heldout_why}.")
        if c.crossval:
            lines.append("Then cross-validation: one run per flight.")
        return "<br>".join(lines)


@user_errors
def preset_picker(ws: Workspace) -> Picker:
    return Picker(ws)
