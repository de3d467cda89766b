"""The training notebook's steps: train (or continue) the picked run, cross-validate, predict whole
flights. Each step is a subprocess with a live view (live.py). The smoke test's own checks are smoke.py's;
the optional sweep is sweeping.py's.

The picker's choice is remembered on Drive (`<CloudML>/last_run.json`) as soon as a run starts, so
that "Run all" after a disconnect comes back with it (picker.py). A step that depends on a finished
training (cross-validation, whole flights) says so and does nothing while the run is unfinished: a
stop must never start hours of other work.

A run is continued on the flights it started with (its config.yaml's, given to the trainer again), so
new flights in data/ never stop it; they are offered as a new run. A finished run whose flights are gone
from data/ is not trained: its results are shown (the rest of Run all goes on) with what training it
again would need. An unfinished one is refused before anything starts, naming the missing flights.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.colab.drive import RunFlights, Workspace, demo_folder_of, run_config, run_flights
from cloudml_lib.colab.live import LiveView, command, report_end, run_live
from cloudml_lib.colab.picker import Choice, Picker
from cloudml_lib.colab.profile import profile
from cloudml_lib.colab.show import UserError, in_notebook, plural, show, show_markdown, user_errors
from cloudml_lib.core.machine.timing import EXPECTED_ENV, duration
from cloudml_lib.core.run.checkpoint import find_checkpoints
from cloudml_lib.core.run.folder import RunFolder


def continued_flights(ws: Workspace, run_dir: Path) -> RunFlights | None:
    """The flights of a run that has a checkpoint to continue from (None for a new run, one that starts
    from the beginning, or one on the demo flights)."""
    return run_flights(ws, run_dir) if find_checkpoints(RunFolder(run_dir)) else None


def train_command(ws: Workspace, c: Choice) -> list[str]:
    """`python -m cloudml_lib train ...` for choice `c`; a run with a checkpoint gets its own flights and
    test flights again, whatever data/ holds now (the trainer refuses other data)."""
    run_dir = ws.runs / c.run_name
    pinned = continued_flights(ws, run_dir)
    heldout = pinned.heldout if pinned is not None else c.heldout
    config, overrides = run_config(ws, c.preset, c.epochs, heldout, demo=c.preset == "demo")
    if pinned is not None:
        overrides += [
            f"data.flights={json.dumps(pinned.entries)}",
            f"data.test_flights={json.dumps(pinned.heldout)}",
        ]
    own = demo_folder_of(run_dir) if c.preset == "demo" and find_checkpoints(RunFolder(run_dir)) else None
    if own is not None:  # a demo run continues on the demo flights it was trained on
        overrides.append(f"data.dir={own}")
    cmd = command("train", "--config", config, "--run-dir", run_dir)
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def kept(status: dict | None, c: Choice, run_dir: Path) -> bool:
    """A finished run that more epochs would not train (Epochs not raised, or it stopped early) and whose
    results are written: said, and not started again (nothing to train; its data is not read again, so
    data changed since cannot stop "Run all" before its results are shown)."""
    if not (status and status["finished"] and RunFiles(run_dir).evaluation()):
        return False
    done, planned = status["epochs_completed"], status["epochs"]
    if c.epochs > planned and done >= planned:
        return False
    show_markdown(
        f"**Run {c.run_name} is finished** ({plural(done, 'epoch')}): its results are in the cells below; "
        "nothing is trained again."
        + ("" if done < planned else f" Raise Epochs above {planned} in the picker to train it longer.")
    )
    return True


def _remembered(ws: Workspace) -> str | None:
    """The choice the picker remembers now (last_run.json's text), to put back if a start is refused."""
    from cloudml_lib.colab.picker import LAST_RUN

    path = ws.root / LAST_RUN
    return path.read_text() if path.is_file() and not path.is_symlink() else None


def _remember_again(ws: Workspace, text: str | None) -> None:
    """The picker's memory as it was before a start that was refused: the refused run never existed, so the
    next Run all does not offer to "continue" it."""
    from cloudml_lib.base import ledger
    from cloudml_lib.base.outputs import write_text
    from cloudml_lib.colab.picker import LAST_RUN

    if text is None:
        ledger.delete(ws.root / LAST_RUN)
    else:
        write_text(ws.root / LAST_RUN, text)


@user_errors
def train(ws: Workspace, picker: Picker) -> Path:
    """Train (or continue) the picked run with the live view; returns its run directory. In the smoke
    test the run is first killed mid-epoch, as a Colab disconnect would, then continued. A choice that
    cannot train is refused first (picker.problem); a finished run whose flights left data/ is shown,
    not trained."""
    picker.recheck()  # data/ as it is now: Drive may have synced since the picker was shown
    problem = picker.problem()
    if problem:
        raise UserError(problem[0].upper() + problem[1:])
    c = picker.choice()
    run_dir = ws.runs / c.run_name
    flights = continued_flights(ws, run_dir)
    if flights is not None and flights.removed:  # finished (problem() refuses an unfinished one)
        show_markdown(f"**Run {c.run_name} is not trained again.** {flights.missing_words(finished=True)}")
        return run_dir
    remembered = _remembered(ws)
    c.save(ws.root)  # "Run all" after a disconnect comes back with this choice
    if flights is not None and flights.added:
        show_markdown(flights.added_words())
    if not profile().before_training(run_dir, train_command(ws, c)) and kept(
        picker.facts(c.run_name)[1], c, run_dir
    ):
        return run_dir
    cmd = train_command(ws, c)
    config = Path(cmd[cmd.index("--config") + 1]).name
    show_markdown(
        f"**Training** preset {c.preset} (`{config}`), {plural(c.epochs, 'epoch')}, into `{run_dir}`. "
        "The interrupt button (&#9632;) stops it at the next step with a checkpoint."
    )
    view = LiveView(run_dir)
    picker.times.wait(60)  # a step still being timed (seconds): its figure goes with the run
    expected = picker.expected_record(c)  # kept in run.json beside what the epochs take
    code = run_live(cmd, view, {EXPECTED_ENV: json.dumps(expected)} if expected else None)
    if code != 0 and not run_dir.is_dir():  # refused before any run existed: nothing to offer to continue
        _remember_again(ws, remembered)
    picker.recheck()  # the note above says where the run stands now
    report_end(code, view, "training", run_dir)
    return run_dir


@user_errors
def whole_flights(ws: Workspace, picker: Picker, run_dir: Path | None) -> Path | None:
    """With the box ticked: every frame of the test flights through the best model (NetCDF, CSV,
    plots), as `python -m cloudml_lib predict`; shows the along-flight figures, where the files are, and
    whether each flight's inputs lie among those the model was trained on (the domain check)."""
    if not picker.choice().whole_flights:
        print("Whole flights not asked for (tick the box in the picker, then run this cell).")
        return None
    if run_dir is None or not RunFolder.of(run_dir).is_finished():
        print(waits("Whole flights wait", run_dir))
        return None
    flights = run_flights(ws, run_dir)
    gone = [f for f in flights.heldout if f in flights.removed] if flights is not None else []
    if gone:  # the run's results stand; this step needs the flight's files
        print(
            f"Whole flights skipped: the test flight {', '.join(gone)} of run {run_dir.name} is not in "
            f"{ws.data} now. Run this cell again once it is back (if Google Drive has not synced yet, wait a "
            "minute)."
        )
        return None
    out = run_dir / "predictions"
    view = LiveView(None, bar=False)
    report_end(run_live(command("predict", "--run-dir", run_dir), view), view, "prediction", None)
    summary = RunFiles(out).predictions_summary()  # each flight's counts, and its inputs against training's
    for png in sorted(out.glob("*_cbh_along_flight.png")):
        flight = png.name[: -len("_cbh_along_flight.png")]
        said = (summary.get(flight) or {}).get("inputs_vs_training")
        if said and any(said in line for line in view.notice_lines):  # said above already, as a warning
            said = None
        show_markdown(
            f"**{flight}**: `{out / (flight + '_cbh.nc')}` (NetCDF, a CF trajectory) and `{flight}_cbh.csv`"
            + (f"\n\n{said[0].upper() + said[1:]}." if said else "")
        )
        if in_notebook():
            from IPython.display import Image

            show(Image(filename=str(png), width=ALONG_FLIGHT_WIDTH_PX))
    return out


ALONG_FLIGHT_WIDTH_PX = 900  # a whole flight's figure in the notebook (its file: 1210 x 484 px)


@user_errors
def adapt(run_dir: Path | None, flight: str = "", labels=(10, 25, 50)) -> None:
    """How much a few labels of a flight recover (`python -m cloudml_lib adapt`, science/adapt.py): the run's
    network fine-tuned on the flight's first N labels, scored after a gap beside the baselines given the same
    N; `flight` "" is the run's first test flight. Nothing is written."""
    if run_dir is None or not RunFolder.of(run_dir).is_finished():
        print(waits("Adaptation waits", run_dir))
        return
    if not isinstance(flight, str):
        raise UserError(f"flight: {flight!r} is not valid; expected a flight's name such as '01Apr25', or ''")
    args = ["adapt", "--run-dir", run_dir, "--labels", *map(str, labels)] + (
        ["--flight", flight] if flight else []
    )
    view = LiveView(None, bar=False)
    report_end(run_live(command(*args), view), view, "adaptation", None)
    curve = [line.strip() for line in view.lines if _CURVE.search(line)]  # the result, out of the folded log
    if curve:
        show_markdown("**Adaptation** (the log above has the rest):\n\n" + "\n".join(f"- {x}" for x in curve))


# the lines of science/adapt.py's curve_words: where it is scored, what is left out, each N's result
_CURVE = re.compile(r": scored on its \d+ labels|: \d+ left out: |^\s*N = \d+: |: no adaptation curve")


def waits(what: str, run_dir: Path | None) -> str:
    """Why `what` ("Export waits", "Whole flights wait") waits for the run: its training goes on, or its end
    is pending (and why: best.pt replaced or removed after the evaluation, the evaluation damaged), which the
    Train cell runs."""
    try:
        state = RunFolder.of(run_dir).state() if run_dir is not None else None
    except Exception:  # noqa: BLE001 - an unreadable run: the Train cell says what is wrong with it
        state = None
    if state is not None and state.kind == "trained":
        return (
            f"{what} for the run's end: the run is {state.words}. Run the Train cell (or Run all) again: it "
            "ends the run."
        )
    return f"{what} for training to finish: run the Train cell (or Run all) again to continue it."


@user_errors
def export(run_dir: Path | None) -> Path | None:
    """The run's best model as a folder a colleague loads with plain torch (`python -m cloudml_lib export`:
    the program, the weights, how to make the inputs, the model card), in RUN/export; exported again only
    when best.pt is newer than it. Says where the files are and how they are loaded."""
    from cloudml_lib.science.export import EXPORT_FILES, PROGRAM

    if run_dir is None or not RunFolder.of(run_dir).is_finished():
        print(waits("Export waits", run_dir))
        return None
    out, best = run_dir / "export", RunFolder(run_dir).best
    done = best.is_file() and all((out / name).is_file() for name in EXPORT_FILES)  # no best.pt: the
    if done and (out / PROGRAM).stat().st_mtime >= best.stat().st_mtime:  # command says what to do
        print(f"Already exported (the best model has not changed since): {out}")
    else:
        view = LiveView(None, bar=False)
        code = run_live(command("export", "--run-dir", run_dir), view)
        report_end(code, view, "export", None)  # a refusal is said as the user's error, without a traceback
        if code != 0:
            return None
    show_markdown(
        f"**To share the model**, give the folder `{out}` (on your Drive: right-click, *Share*), "
        f"{len(EXPORT_FILES)} files: `{'`, `'.join(EXPORT_FILES)}`. A colleague needs only torch and "
        "safetensors: `program = torch.export.load('model.pt2').module()`, "
        "`program.load_state_dict(safetensors.torch.load_file('weights.safetensors'))`, then "
        "`program(frames, scalars)` gives the height in km; `preprocessing.json` says how to make the inputs "
        "from the ER-2 files, and `MODEL_CARD.md` what the model was trained on and how well it did."
    )
    return out


@user_errors
def crossval(ws: Workspace, picker: Picker, run_dir: Path | None = None) -> Path | None:
    """With the box ticked: every flight the test flight once, with baselines (the same `python -m cloudml_lib
    crossval` command, resumable: run the cell again after a disconnect). Shows crossval.md."""
    c = picker.choice()
    if not c.crossval:
        print("Cross-validation not asked for (tick the box in the picker, then run this cell).")
        return None
    if run_dir is not None and not RunFolder.of(run_dir).is_finished():
        print(waits("Cross-validation waits", run_dir))
        return None
    cmd = train_command(ws, c)
    cv_dir = ws.runs / f"{c.run_name}_crossval"
    cmd[cmd.index("train")] = "crossval"
    cmd[cmd.index("--run-dir") + 1] = str(cv_dir)
    expected = None if cv_dir.is_dir() else picker.crossval_expected()  # a continued one: part is done
    show_markdown(
        f"**Cross-validation** into `{cv_dir}`: one run per flight; run this cell again after a "
        "disconnect and it continues with the unfinished fold."
        + (
            ""
            if expected is None
            else f" Expected time: about {duration(expected)} (from your runs' measured epochs and ends)."
        )
    )
    t0 = time.time()
    view = LiveView(None, folds=cv_dir)  # follows the fold being trained: "fold 2 of 5", its curves
    report_end(run_live(cmd, view), view, "cross-validation", None)
    took = f"The cross-validation took {duration(time.time() - t0)}"
    print(took + (f" (expected {duration(expected)})." if expected is not None else "."))
    show_markdown((cv_dir / "crossval.md").read_text())
    return cv_dir


def check_smoke_run(run_dir: Path | None) -> None:
    """The notebook's last cell: in the headless test (CLOUDML_SMOKE=1), the profile's checks of the run; in
    normal use nothing."""
    profile().after_run(run_dir)
