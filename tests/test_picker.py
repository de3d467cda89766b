"""The training notebook's picker and Train cell as a user meets them (cloudml_lib.colab.picker, training):
a remembered run keeps its flights and held-out flights whatever data/ holds now (a missing flight is named
and the run waits for it; new flights are offered as a new run; a finished run whose flights left data/ is
shown, not trained), a choice that cannot train is refused before anything starts, and the note under the
widgets never goes stale. Headless: widgets are inspected, not rendered."""

import json
import shutil

import pytest
import yaml

from cloudml_lib import (
    colab,
)
from cloudml_lib.colab import drive, live, training
from cloudml_lib.colab import picker as picker_mod
from cloudml_lib.commands import presets
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.status import is_finished
from cloudml_lib.data.synthetic import make_demo_flights

# A preset small enough to train in seconds on the tests' flights (40 x 48 frames); its flights are found in
# data/ as the presets' are.
TINY_PRESET = {
    "data": {
        "temporal_frames": 3,
        "swath_slice": [4, 36],
        "num_workers": 0,
        "skip_incomplete_flights": True,
        "validation_gap_frames": 6,  # the tests' flights are 120 frames long
    },
    "model": {"channels": [4, 8, 8], "dropout": 0.0},
    "train": {
        "epochs": 2,
        "batch_size": 8,
        "learning_rate": 0.003,
        "warmup_steps": 3,
        "early_stopping_patience": 0,
        "log_every_steps": 2,
        "quick_val_fraction": 0.5,
    },
    "checkpoint": {"every_steps": 3},
}


@pytest.fixture
def flights(tmp_path):
    """Four flights of the user's (01, 03, 05, 07Mar25) in a folder outside data/, to move in and out."""
    make_demo_flights(tmp_path / "all", n_flights=4, frames_per_flight=120, frame_shape=(40, 48))
    return tmp_path / "all"


def move(flight: str, src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src / flight), str(dst / flight))


@pytest.fixture
def tiny_presets(tmp_path, monkeypatch):
    """Every preset is the tiny one; Auto picks B (a GPU that fits it), so epochs are the preset's."""
    path = tmp_path / "tiny_preset.yaml"
    path.write_text(yaml.safe_dump(TINY_PRESET))
    monkeypatch.setattr(presets, "preset_config_path", lambda name: path)
    monkeypatch.setattr(presets, "choose_preset", lambda report: ("B", "a test GPU that fits it"))
    return path


def forbidden(*args, **kwargs):
    pytest.fail("no training may start")


def text(shown) -> str:
    return "\n".join(x for x in shown if isinstance(x, str))


@pytest.mark.slow
def test_a_remembered_run_keeps_its_flights_whatever_data_holds(
    ws, shown, flights, tiny_presets, monkeypatch
):
    """Defects 3 and 4 of issue 38: the held-out flight missing (Drive not synced), a new flight added, a
    training flight removed from a finished run."""
    data = ws.data / "ER2"
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, flights, data)
    p = colab.Picker(ws)
    assert p.choice().heldout == ["05Mar25"]  # the newest complete flight (no 12Feb25 here)
    monkeypatch.setenv("CLOUDML_KILL_AT", "step:5")  # a disconnect after the checkpoint at step 3
    run_dir = colab.train(ws, p)
    monkeypatch.delenv("CLOUDML_KILL_AT")
    assert not is_finished(RunFolder(run_dir)) and (run_dir / "checkpoints").is_dir()

    move("05Mar25", data, flights)  # Drive has not synced the held-out flight yet
    p = colab.Picker(ws)
    assert p.continuing and p.choice().heldout == ["05Mar25"]  # never silently another flight
    assert p.heldout.value == ("05Mar25",) and "05Mar25 (not in data/)" in dict(p.heldout.options)
    note = p.note.value
    assert "Problem:" in note
    assert "not complete in data/ now: 05Mar25 is not there (test flights: 05Mar25)" in note
    assert "wait a minute and run this cell again" in note and "Start a new run" in note
    remembered = (ws.root / "last_run.json").read_text()
    monkeypatch.setattr(training, "run_live", forbidden)
    with pytest.raises(colab.UserError, match="05Mar25") as e:
        colab.train(ws, p)
    assert "put them back in data/" in str(e.value) and "Start a new run" in str(e.value)
    assert (ws.root / "last_run.json").read_text() == remembered  # the run is still the one to continue
    p.mode.value = "new"  # the other offer: a new run on the flights present
    assert p.problem() is None and p.choice().run_name != run_dir.name and p.choice().heldout == ["03Mar25"]
    monkeypatch.setattr(training, "run_live", live.run_live)

    move("05Mar25", flights, data)  # synced; and a new flight besides
    move("07Mar25", flights, data)
    shown.clear()
    p = colab.Picker(ws)
    assert p.continuing and p.problem() is None and p.choice().heldout == ["05Mar25"]
    assert "New in data/ since run preset_B started: 07Mar25" in p.note.value
    assert colab.train(ws, p) == run_dir and is_finished(RunFolder(run_dir))  # continued, not refused
    assert "Run preset_B is finished (2 epochs)</b>" in p.note.value  # the note above follows the run
    assert "Resumed from step" in (run_dir / "train.log").read_text()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    assert [f["name"] for f in saved["flights"]] == ["01Mar25", "03Mar25", "05Mar25"]
    assert saved["test_flights"] == ["05Mar25"]
    assert "07Mar25" in text(shown) and "Start a new run" in text(shown)

    shown.clear()  # Run all again on the finished run: its results, no training started
    monkeypatch.setattr(training, "run_live", forbidden)
    assert colab.train(ws, colab.Picker(ws)) == run_dir
    assert "**Run preset_B is finished** (2 epochs): its results are in the cells below" in text(shown)
    monkeypatch.setattr(training, "run_live", live.run_live)

    move("01Mar25", data, flights)  # a training flight of the finished run is gone
    shown.clear()
    p = colab.Picker(ws)
    assert p.problem() is None  # its results can still be shown
    assert "Its results are shown as it was trained" in p.note.value
    monkeypatch.setattr(training, "run_live", forbidden)
    assert colab.train(ws, p) == run_dir  # the rest of Run all goes on with the finished run
    said = text(shown)
    assert "**Run preset_B is not trained again.**" in said and "01Mar25" in said
    assert "Training it longer would need 01Mar25 back in data/" in said


def test_a_continued_run_is_given_its_own_flights_again(ws, flights, tiny_presets, monkeypatch):
    """The command a continued run gets: its recorded flights and held-out flights, not data/'s."""
    for f in ("01Mar25", "03Mar25", "05Mar25", "07Mar25"):
        move(f, flights, ws.data / "ER2")
    run_dir = ws.runs / "mine"
    (run_dir / "checkpoints" / "step-00000003").mkdir(parents=True)
    entries = [{"name": n, "ir_file": f"ER2/{n}/ir.h5"} for n in ("01Mar25", "03Mar25", "05Mar25")]
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump({"data": {"flights": entries, "validation_flights": ["03Mar25"]}})  # an earlier run's
    )
    c = colab.Choice(preset="B", epochs=4, run_name="mine", heldout=["07Mar25"])
    cmd = training.train_command(ws, c)
    sets = [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]
    pinned = [json.loads(x.split("=", 1)[1]) for x in sets if x.startswith("data.flights=")]
    assert pinned == [entries]
    assert sets[-1] == 'data.test_flights=["03Mar25"]'  # the run's, last: it wins
    new = training.train_command(
        ws, colab.Choice(preset="B", epochs=4, run_name="other", heldout=["07Mar25"])
    )
    assert not any(x.startswith("data.flights=") for x in new) and "data.test_flights=[07Mar25]" in new


def test_one_complete_flight_is_refused_before_training(ws, shown, flights, tiny_presets, monkeypatch):
    move("01Mar25", flights, ws.data / "ER2")
    p = colab.Picker(ws)
    assert "Problem:</b> Only one complete flight (01Mar25)" in p.note.value
    assert "Add a second flight to data/" in p.note.value
    monkeypatch.setattr(training, "run_live", forbidden)
    with pytest.raises(colab.UserError, match="Add a second flight"):
        colab.train(ws, p)
    assert not (ws.root / "last_run.json").exists()


def test_held_out_choices_that_leave_nothing_to_train_on_are_refused(ws, shown, flights, tiny_presets):
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, flights, ws.data / "ER2")
    p = colab.Picker(ws)
    assert "Test flight by default:" in p.note.value
    p.heldout.value = ("01Mar25",)  # the default line goes: the note says what is chosen now
    assert (
        "Test flight by default" not in p.note.value and "Test flights: 01Mar25, your choice" in p.note.value
    )
    p.heldout.value = ("01Mar25", "03Mar25", "05Mar25")
    assert "Every flight is a test flight" in p.note.value and "every flight is a test flight" in p.problem()
    p.heldout.value = ()
    assert "no test flight is chosen" in p.problem()


def test_the_finished_note_follows_the_epochs_box(ws, shown, monkeypatch):
    (ws.runs / "demo").mkdir()
    colab.Choice(preset="demo", epochs=12, run_name="demo").save(ws.root)
    status = {"finished": True, "epochs_completed": 12, "epochs": 12, "latest_checkpoint": "x", "epoch": 12}
    monkeypatch.setattr(picker_mod, "_status", lambda run_dir: dict(status))
    monkeypatch.setattr(picker_mod, "progress", lambda run_dir, choice=None: (False, "finished (12 epochs)"))
    p = colab.Picker(ws)
    assert "Run demo is finished (12 epochs)</b>: the cells below show its results without training" in (
        p.note.value
    )
    assert "Trains preset" not in p.note.value and "epochs left" not in p.note.value  # nothing trains
    p.epochs.value = 20
    assert "it trains 8 more epochs from its last checkpoint" in p.note.value
    assert "Trains preset <b>demo</b>" in p.note.value
    assert "without training again" not in p.note.value
    p.epochs.value = 12
    assert "without training again" in p.note.value and "trains 8 more" not in p.note.value
    status["epochs_completed"] = 7  # stopped early: more epochs would not train it again
    p = colab.Picker(ws)
    p.epochs.value = 20
    assert "stopped early at epoch 7 of 12" in p.note.value and "trains 8 more" not in p.note.value


def test_the_continue_button_shows_the_whole_run_name(ws, shown):
    name = "a_rather_long_run_name_for_the_february_flights"
    (ws.runs / name).mkdir()
    colab.Choice(preset="demo", epochs=12, run_name=name).save(ws.root)
    p = colab.Picker(ws)
    assert p.mode.options[0][0] in (f"Continue {name}", f"Keep {name}")
    assert p.mode.style.button_width == "auto"  # ipywidgets 8's fixed 148 px would cut it short


@pytest.mark.slow
def test_auto_without_a_gpu_on_your_flights_is_a_short_cpu_run_said_in_plain_words(
    ws, shown, flights, monkeypatch, capsys
):
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, flights, ws.data / "ER2")
    report = dict(presets.system_report(), gpu=None)
    monkeypatch.setattr(presets, "system_report", lambda *a, **k: report)
    for module in (picker_mod, drive):
        monkeypatch.setattr(module, "frame_rows", lambda ws: 512)  # the camera's frames (the files: 40 rows)
    name, why = presets.choose_preset(report)  # the command line's words: the demo configuration
    assert name == "demo" and "CPU-sized demo configuration is used" not in why and "sized for a CPU" in why
    p = colab.Picker(ws)
    c = p.choice()
    assert c.preset == "C" and c.epochs == picker_mod.CPU_EPOCHS
    assert "Auto chose C because no GPU was found: training on the CPU is slow" in p.note.value
    # the try-out does not compile on the CPU (C compiles on a GPU)
    assert "train.torch_compile=false" in drive.run_config(ws, c.preset, c.epochs, c.heldout, demo=False)[1]
    assert "demo configuration" not in p.note.value
    capsys.readouterr()
    drive.show_diagnostics(ws)  # the setup notebook's advice says the same
    advice = capsys.readouterr().out
    assert "Preset: no GPU was found" in advice and f"preset C for {picker_mod.CPU_EPOCHS} epochs" in advice
    assert "demo configuration" not in advice


def test_flights_too_small_for_the_presets_train_with_the_demo_configuration_said_in_plain_words(
    ws, shown, monkeypatch, capsys
):
    """make-demo-data's default frames (80 x 96): presets A/B/C crop rows 40-480 and refused every flight,
    while the line under the table said 4 were used. Auto takes the demo configuration for such frames, a
    preset that cannot take them says so, and setup's table and its line agree."""
    from pathlib import Path

    from cloudml_lib.base.config import load_config

    make_demo_flights(ws.data / "ER2", n_flights=4, frames_per_flight=120)  # the tool's default size
    monkeypatch.setattr(presets, "choose_preset", lambda report: ("A", "a test GPU that fits it"))
    assert drive.frame_rows(ws) == 80 and not drive.fits_presets(ws)
    p = colab.Picker(ws)
    c = p.choice()
    assert c.preset == drive.SMALL and p.problem() is None
    assert "Auto chose small because your flights' frames have 80 sensor rows" in p.note.value
    labels = {v: label for label, v in p.preset.options}
    assert "(needs frames of 480 rows; yours have 80)" in labels["A"] and drive.SMALL in labels
    p.preset.value = "A"
    assert "preset A is made for the ER-2 camera" in p.problem() and "Choose Auto" in p.problem()
    assert "Problem:" in p.note.value
    p.preset.value = "Auto"
    assert p.problem() is None and "Problem:" not in p.note.value
    cfg = load_config(*drive.run_config(ws, c.preset, c.epochs, c.heldout, demo=False))
    assert cfg.data.swath_slice == [8, 72] and Path(cfg.data.dir) == ws.data and not cfg.data.demo
    assert cfg.data.test_flights == c.heldout
    capsys.readouterr()
    assert drive.verify_data(ws)  # every flight usable with the configuration that will train them
    said = text(shown) + capsys.readouterr().out
    assert "not usable" not in said and "480" not in said
    # one flight without its IR file among them: listed and skipped, as the presets do, and the line under the
    # table names the flights that can be used (it said "None of the flights found can be used")
    next((ws.data / "ER2").rglob("*IRAI*_20250301*")).unlink()
    assert load_config(
        *drive.run_config(ws, c.preset, c.epochs, c.heldout, demo=False)
    ).data.skip_incomplete_flights
    shown.clear()
    assert not drive.verify_data(ws)
    said = text(shown) + capsys.readouterr().out
    assert "missing: no IR file" in said and "None of the flights" not in said
    assert (
        "skipped (data.skip_incomplete_flights: true); 3 flights can be used: 03Mar25, 05Mar25, 07Mar25"
        in said
    )


def test_own_flights_after_a_demo_run_make_a_new_run_the_default_and_the_demo_run_is_kept(
    ws, shown, flights, tiny_presets
):
    """The picker came back as "Continue demo", 12 epochs on the demo flights, with no word of the user's
    new flights, and its disabled held-out list showed the user's flights (07Mar25 highlighted) while the
    demo run holds out 05Mar25."""
    picker_mod.Choice(preset="demo", epochs=12, run_name="demo").save(ws.root)
    (ws.runs / "demo").mkdir(parents=True)
    (ws.runs / "demo" / "config.yaml").write_text(
        yaml.safe_dump({"data": {"demo": True, "validation_flights": ["05Mar25"]}})
    )
    for f in ("01Mar25", "03Mar25", "07Mar25"):
        move(f, flights, ws.data / "ER2")
    p = colab.Picker(ws)
    assert not p.continuing and p.mode.value == "new"
    c = p.choice()
    assert c.preset != "demo" and c.heldout == ["07Mar25"] and c.run_name != "demo"
    assert "Your flights are in data/ now</b> (3 flights): a new run on them is the default" in p.note.value
    assert "The demo run demo is kept (choose <i>Continue demo</i> above" in p.note.value
    p.mode.value = "continue"  # the demo run is still offered, with its own held-out flight
    assert p.continuing and p.choice().preset == "demo"
    assert p.heldout.value == ("05Mar25",) and dict(p.heldout.options) == {"05Mar25 (demo)": "05Mar25"}
    assert "it goes on with the demo flights, not yours" in p.note.value
    # a run on the user's flights exists, and the newest run is the demo's again: no news, the demo goes
    # on (the note said "Your flights are in data/ now" above "Run preset_small exists and is finished")
    (ws.runs / "preset_small").mkdir()
    (ws.runs / "preset_small" / "config.yaml").write_text(yaml.safe_dump({"data": {"demo": False}}))
    q = colab.Picker(ws)
    assert q.continuing and q.choice().preset == "demo"
    assert "Your flights are in data/ now" not in q.note.value


@pytest.mark.slow
def test_lines_that_contradicted_each_other_now_agree(ws, shown, flights, tiny_presets, tiny_run, capsys):
    """One flight: setup said "Setup done" after "Add a second flight", the note advised "Start a new run"
    (then refused) and said "Trains ... on your 1 flight" under the red line; a flight whose nav file alone is
    missing was "not in data/"; a finished run's note read "it is continued, ... it is not trained again"."""
    move("01Mar25", flights, ws.data / "ER2")
    drive.check_setup(ws, None)
    out = capsys.readouterr().out
    assert "Setup is not finished: training needs a second flight" in out and "Setup done" not in out
    p = colab.Picker(ws)
    assert p.problem() and "Problem:" in p.note.value
    assert "Nothing is trained until this is fixed." in p.note.value and "Trains preset" not in p.note.value
    assert p._new_run_advice(", or choose X") == (
        ". A new run needs two flights in data/ (one to train on, one to test it on)."
    )
    # a run's flight whose folder is there without its nav file: incomplete, not "not there"
    move("03Mar25", flights, ws.data / "ER2")
    flights_now = drive.RunFlights(
        "r",
        [{"name": "01Mar25"}, {"name": "03Mar25"}],
        ["03Mar25"],
        ["01Mar25"],
        {"03Mar25": "no nav file"},
    )
    words = flights_now.missing_words(finished=False)
    assert "03Mar25 is there, but incomplete (no nav file)" in words and "not in data/" not in words
    # one flight left: no advice to start a new run, which would need two
    assert "Start a new run" not in words and "A new run needs two flights in data/" in words
    assert "only 01Mar25 is complete there now" in flights_now.missing_words(finished=True)
    for nav in (ws.data / "ER2" / "03Mar25").glob("*nav*"):
        nav.unlink()  # its nav file alone is gone
    found = drive.incomplete_flights(ws)
    assert list(found) == ["03Mar25"] and "nav" in found["03Mar25"], found
    # a finished run of the name typed: shown, not "continued"
    shutil.copytree(tiny_run[0], ws.runs / "done")
    p = colab.Picker(ws)
    p.run_name.value = "done"
    note = p.note.value
    assert "Run <b>done</b> exists and is finished (" in note and "it is continued" not in note
    assert "(finished" not in p.note.value  # "is finished (2 epochs)", not "finished (finished ..."


def test_a_start_refused_before_its_run_existed_is_not_offered_to_continue(
    ws, shown, flights, tiny_presets, monkeypatch
):
    """A Train cell whose command was refused before it made the run folder (exit 2: the message names what
    to fix) left the picker remembering that run, and the next Run all offered to "continue" it. The picker's
    memory goes back to what it was: nothing here, or the run before."""
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, flights, ws.data / "ER2")
    p = colab.Picker(ws)
    refused = []
    monkeypatch.setattr(training, "run_live", lambda cmd, view, env=None: refused.append(cmd) or 2)
    with pytest.raises(colab.UserError):
        colab.train(ws, p)
    assert refused and not (ws.runs / p.choice().run_name).exists()
    assert not (ws.root / "last_run.json").exists() and not colab.Picker(ws).continuing
    picker_mod.Choice(preset="B", epochs=2, run_name="before", heldout=["05Mar25"]).save(ws.root)
    before = (ws.root / "last_run.json").read_text()
    p = colab.Picker(ws)
    p.mode.value = "new"
    with pytest.raises(colab.UserError):
        colab.train(ws, p)
    assert (ws.root / "last_run.json").read_text() == before  # the run before is the one remembered


def test_with_one_flight_the_picker_never_advises_a_new_run_it_would_refuse(ws, shown, flights, tiny_presets):
    """A remembered run whose test flight is gone, one flight left in data/: the advice was "choose 'Start a
    new run'", which the picker then refused (a new run needs two flights)."""
    move("01Mar25", flights, ws.data / "ER2")
    picker_mod.Choice(preset="B", epochs=2, run_name="gone", heldout=["05Mar25"]).save(ws.root)
    p = colab.Picker(ws)
    assert p.continuing
    problem = p.problem()
    assert "05Mar25 is not in" in problem and "Start a new run" not in problem, problem
    assert "a new run needs two flights" in problem and "1 complete flight is there" in problem


def test_a_new_run_named_as_an_existing_one_is_said_so_beside_the_pressed_button(
    ws, shown, flights, tiny_presets
):
    """*Start a new run* was shown pressed above "it is continued": the note now says the name is an
    existing run's, what Train does with it, and how to get a new one."""
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, flights, ws.data / "ER2")
    picker_mod.Choice(preset="B", epochs=2, run_name="before", heldout=["05Mar25"]).save(ws.root)
    (ws.runs / "half").mkdir(parents=True)
    p = colab.Picker(ws)
    p.mode.value = "new"
    p.run_name.value = "half"
    note = p.note.value
    assert "<i>Start a new run</i> is chosen, but run <b>half</b> exists (" in note, note
    assert "Train continues it, on its own flights. Give another run name for a new run." in note
