"""How long a run will take, said before it starts and checked after (issue 45, items 3 and 10): a step timed
here on the real model (the CPU in these tests), an earlier run's measurement on the same kind of device
used first ("measured in your run X"), the FLOPs as a labelled estimate where nothing can be timed; the
picker says it per epoch and in all, measuring once per choice in a thread ("measuring..."), and the run
records the estimate beside what its epochs took (run.json)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from test_picker import move, tiny_presets  # noqa: F401 (a fixture)

from cloudml_lib import colab
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.colab import expected as expected_mod
from cloudml_lib.commands import presets
from cloudml_lib.core.machine import estimate, timing
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.data.synthetic import make_demo_flights

SHAPE = estimate.StepShape((4, 8, 8), False, None, 3, 32, 40)


def test_a_step_is_timed_on_the_real_model_at_the_runs_own_batch(monkeypatch):
    found = timing.timed(SHAPE, 8, torch.device("cpu"))
    assert found.measured and 0 < found.seconds < 30
    n = int(found.source.split()[3])
    assert timing.TIMED_STEPS <= n <= timing.MAX_TIMED_STEPS
    assert found.source == f"measured here by {n} timed steps at batch 8"
    # steps are timed until a second has passed, and a burst of another process's work on one of them is
    # not the step's time: two warm-up steps left out, then the median of 0.2 s steps with one of 0.9 s
    times = iter([0.5, 0.5, 0.2, 0.2, 0.2, 0.2, 0.9, 5.0])
    monkeypatch.setattr(timing, "_one", lambda *a: next(times))
    steady = timing.timed(SHAPE, 8, torch.device("cpu"))
    assert (steady.seconds, steady.source) == (0.2, "measured here by 5 timed steps at batch 8")
    # warm-up steps are left out; a slow step (a large batch on a CPU) is timed once
    calls = []
    monkeypatch.setattr(timing, "_one", lambda *a: calls.append(1) or 30.0)
    slow = timing.timed(SHAPE, 2, torch.device("cpu"))
    assert slow.seconds == 30.0 and len(calls) == timing.WARMUP_STEPS + 1
    assert slow.source == "measured here by 1 timed step at batch 2"


def test_an_epoch_is_its_steps_and_its_validation_and_an_estimate_says_so():
    step = timing.StepTime(0.5, "measured here", True)
    e = timing.Expected(step, steps_per_epoch=40, val_batches=6, epochs=3)
    assert e.epoch_s == pytest.approx(0.5 * (40 + 2 * timing.FORWARD_SHARE * 6))
    assert e.total_s == pytest.approx(3 * e.epoch_s)
    assert e.words().startswith("Expected time: about 22 s per epoch (40 steps of 0.50 s), 66 s for the run")
    earlier = timing.StepTime(0.5, "measured in your run r", True, with_validation=True)
    assert timing.Expected(earlier, 40, 6, 1).epoch_s == 20  # its epochs' time already holds validation
    guess = timing.Expected(timing.StepTime(2.0, "estimated from FLOPs", False), None, 0, 5)
    assert "(an estimate)" in guess.words() and "once the setup notebook has built the cache" in guess.words()
    assert [timing.duration(s) for s in (0.25, 42, 600, 7200)] == ["0.25 s", "42 s", "10 min", "2.0 h"]


def test_the_runs_end_is_its_samples_read_forward_at_a_share_of_an_epochs_time_per_sample():
    """Issue 65, item 6: the end (cloud probe, scoring, intervals, report) said beside the training's time."""
    step = timing.StepTime(0.5, "measured here", True, with_validation=True)
    e = timing.Expected(step, 40, 6, 3, step_samples=16, end_samples=1000, share=(0.75, "as measured"))
    per = 0.5 * 40 / (40 * 16)  # an epoch's seconds per sample
    assert e.end_s == pytest.approx(timing.end_seconds(per, 1000, 0.75)) == pytest.approx(per * 0.75 * 1000)
    assert e.words().endswith(
        "60 s for the run (measured here); then about 23 s for its end (the cloud probe, scoring, report: "
        "1000 samples read, as measured)."
    )
    assert e.record("CPU")["end_s"] == e.end_s and timing.checked_expected(e.record("CPU")) is not None
    assert (
        timing.Expected(step, 40, 6, 3).end_s is None
        and "for its end" not in timing.Expected(step, 40, 6, 3).words()
    )
    assert timing.per_sample({"step_s": 0.8, "signature": {"batch": 8}}, accumulation=2) == pytest.approx(
        0.05
    )
    assert timing.per_sample({"step_s": 0.8, "signature": {}}) is None and timing.per_sample(None) is None


def test_the_ends_share_comes_from_the_newest_run_that_recorded_its_end_on_this_device(tmp_path):
    def run(name: str, **end):
        (tmp_path / name).mkdir()
        record = timing.end_record(4.0, 6.0, 100, 0.1, "CPU (2 threads)", False)
        (tmp_path / name / "run.json").write_text(json.dumps({"end": {**record, **end}}))

    assert timing.end_share(tmp_path, "CPU (2 threads)") == (
        timing.END_SHARE,
        "as measured for the demo on a CPU",
    )
    run("a", at=1.0e9)
    run("b", at=1.1e9)  # newer: 6 s for 100 samples at 0.1 s each, 0.6
    run("gpu", at=1.2e9, device="Tesla T4", share=0.2)
    run("control", at=1.3e9, scalars_only=True, share=3.0)
    run("damaged", at=1.4e9, share="0.1")
    run("out_of_range", at=1.5e9, share=1e6)
    assert timing.end_share(tmp_path, "CPU (2 threads)") == (pytest.approx(0.6), "as measured in your run b")
    assert timing.end_share(tmp_path, "Tesla T4")[1] == "as measured in your run gpu"
    assert timing.end_share(tmp_path, "CPU (2 threads)", scalars_only=True)[0] == 3.0
    assert timing.end_share(tmp_path, "Tesla T4", scalars_only=True)[0] == timing.END_SHARE_SCALARS
    assert (
        timing.read_end(RunFolder(tmp_path / "damaged")) is None
        and timing.read_end(RunFolder(tmp_path / "out_of_range")) is None
    )


@pytest.mark.slow
def test_the_flops_estimate_uses_the_share_of_peak_a_lent_gpu_measured_and_says_so(monkeypatch):
    gpu = {"device": "NVIDIA H200", "presets": {
        "B": {"channels": [64, 128, 256], "gradient_checkpointing": True, "torch_compile": False,
              "fraction_of_peak_flops": 0.0395},
        "C": {"channels": [32, 64, 128], "gradient_checkpointing": True, "torch_compile": False,
              "fraction_of_peak_flops": 0.0133},
        "A": {"channels": [64, 128, 256], "gradient_checkpointing": True, "torch_compile": True,
              "fraction_of_peak_flops": 0.0949},
    }}  # fmt: skip
    monkeypatch.setattr(timing, "benchmark_results", lambda name: gpu if name == "gpu" else None)
    full = estimate.StepShape((64, 128, 256), True, None, 3, 32, 40)
    found = timing.from_flops(full, 8, 65e12)
    assert not found.measured and found.seconds > 0
    assert "at 4.0% of 65 TFLOP/s, the share preset B's eager step reached on NVIDIA H200" in found.source
    other = timing.from_flops(SHAPE, 8, 65e12)  # a step not measured there: the lowest share measured
    assert (
        "at 1.3% of 65 TFLOP/s, the lowest share an eager preset's step reached on NVIDIA H200"
        in other.source
    )
    gpu["presets"]["B"]["fraction_of_peak_flops"] = "9"  # a damaged figure is left out
    assert "preset C" in timing.from_flops(full, 8, 65e12).source
    monkeypatch.setattr(timing, "benchmark_results", lambda name: None)
    assert (
        f"at {timing.FLOPS_EFFICIENCY:.1%} of 65 TFLOP/s, a stated share"
        in timing.from_flops(SHAPE, 8, 65e12).source
    )
    assert timing.from_flops(SHAPE, 8, 0.0) is None
    # the results file in the repository holds the lent GPU's shares: the real one is read
    monkeypatch.undo()
    share, why = timing.flops_efficiency(full)
    assert 0.001 <= share < 0.25 and "eager step reached on" in why


def test_the_run_records_its_estimate_beside_what_its_epochs_took(tiny_run):
    """run.json's "measured": the device, the step (as the picker compares it), seconds per step and per
    epoch, peak memory; an earlier run with the same step on this device is then the figure used."""
    run_dir = tiny_run[0]
    measured = timing.read_measured(RunFolder(run_dir))
    assert measured is not None and measured["device"] == timing.device_name(torch.device("cpu"))
    assert (
        measured["step_s"] > 0 and measured["epochs_timed"] >= 1 and "peak_rss_gib" in measured["peak_memory"]
    )
    found = timing.from_runs(run_dir.parent, measured["device"], measured["signature"])
    assert found.source == f"measured in your run {run_dir.name}" and found.with_validation
    words = timing.measured_words(run_dir.parent, measured["device"], measured["signature"])  # the CPU's
    assert words.endswith(
        f"GiB of host memory, {1 / measured['step_s']:.1f} steps/s, measured in your run {run_dir.name}"
    )
    assert measured["estimated_need_gib"] is None  # the GPU-memory estimate is a CUDA run's
    assert timing.from_runs(run_dir.parent, "Tesla T4", measured["signature"]) is None  # another device
    other = dict(measured["signature"], batch=measured["signature"]["batch"] + 1)
    assert timing.from_runs(run_dir.parent, measured["device"], other) is None  # another step
    # the end: its expected time from the run's own epochs, said first, and what it took (issue 65, item 6)
    end = timing.read_end(RunFolder(run_dir))
    assert end is not None and end["device"] == measured["device"] and not end["scalars_only"]
    assert end["took_s"] > 0 and end["expected_s"] > 0 and end["samples"] > 0
    assert end["share"] == pytest.approx(end["took_s"] / (timing.per_sample(measured) * end["samples"]))
    log = (run_dir / "train.log").read_text()
    said = (
        f"then the test flights: about {timing.duration(end['expected_s'])} ({end['samples']} samples read at"
    )
    assert log.count(said) == 1, log[-3000:]
    took = f"the end took {timing.duration(end['took_s'])} (expected {timing.duration(end['expected_s'])})"
    assert took in log


def test_the_expected_time_comes_from_the_environment_checked():
    ok = {"step_s": 0.5, "epoch_s": 20.0, "total_s": 60.0, "source": "measured here", "device": "CPU"}
    assert timing.expected_from_env({timing.EXPECTED_ENV: json.dumps(ok)}) == ok
    assert timing.expected_from_env({timing.EXPECTED_ENV: "[1, 2]"}) is None
    assert timing.expected_from_env({timing.EXPECTED_ENV: "[" * 100000}) is None
    assert timing.expected_from_env({}) is None


@pytest.mark.usefixtures("tiny_presets")
@pytest.mark.slow
def test_the_picker_measures_each_choice_once_says_measuring_and_the_run_keeps_the_figure(
    ws, shown, tmp_path, monkeypatch
):
    make_demo_flights(tmp_path / "all", n_flights=3, frames_per_flight=120, frame_shape=(40, 48))
    for f in ("01Mar25", "03Mar25", "05Mar25"):
        move(f, tmp_path / "all", ws.data / "ER2")
    colab.build_cache(ws)
    calls = []

    def counted(*args):
        calls.append(args)
        return timing.timed(*args)

    monkeypatch.setattr(expected_mod, "timed", counted)
    p = colab.Picker(ws)
    assert "No GPU here: this trains on the CPU. Expected time:" in p.note.value
    p.times.wait()
    note = p.note.value
    assert "Expected time: about" in note and "per epoch (" in note and "for the run (measured here" in note
    assert "for its end (the cloud probe, scoring, report: " in note
    p.epochs.value = 5  # the same step: not timed again, the total follows
    p.crossval.value = True
    p.times.wait()
    assert len(calls) == 1 and "for the run (measured here" in p.note.value
    assert (
        "Then cross-validation: one run per flight, each with its scalars-only control: about "
        in p.note.value
    )
    p.sweep.value = True
    assert "at most), into" in p.note.value and "; about" in p.note.value  # the sweep's time too
    p.sweep.value = False
    p.epochs.value = 2
    run_dir = colab.train(ws, p)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["expected"]["source"].startswith("measured here") and info["expected"]["total_s"] > 0
    # what the notebook wrote beside the runs (last_run.json), read back by its reader (issue 65, item 1)
    remembered = RunFiles(ws.root)
    assert remembered.last_run()["run_name"] == run_dir.name and remembered.damaged == []
    assert info["measured"]["step_s"] > 0
    q = colab.Picker(ws)  # the next picker on this device: the run's own measurement, no timing
    q.mode.value = "new"
    q.times.wait()
    assert f"measured in your run {run_dir.name}" in q.note.value and len(calls) == 1
    # its end too, and the cross-validation cell's expected time from both, nothing timed again
    assert f"samples read, as measured in your run {run_dir.name})" in q.note.value
    end, per = (
        timing.read_end(RunFolder(run_dir)),
        timing.per_sample(timing.read_measured(RunFolder(run_dir))),
    )
    folds = q.crossval_expected()
    assert folds is not None and len(calls) == 1
    assert folds > 3 * (2 * per * 10 + timing.end_seconds(per, end["samples"], end["share"]))  # 3 folds


@pytest.mark.slow
def test_an_earlier_runs_peak_memory_is_said_beside_the_presets_estimate(ws, shown, tmp_path):
    """A run of preset C on this device recorded its peak: the preset table says it beside the estimate."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.colab import show

    cfg = load_config(presets.preset_config_path("C"))
    sig = timing.signature(estimate.StepShape.of(cfg, None), cfg.train.batch_size)
    device = timing.device_name(torch.device("cpu"))
    run = ws.runs / "my_c_run"
    run.mkdir(parents=True)
    measured = {"device": device, "signature": sig, "step_s": 2.0, "peak_memory": {"peak_rss_gib": 3.25}}
    (run / "run.json").write_text(json.dumps({"measured": {**measured, "at": 1.0}}))
    assert timing.peak_words(ws.runs, device, sig) == "3.2 GiB of host memory, measured in your run my_c_run"
    assert timing.peak_words(ws.runs, "Tesla T4", sig) is None
    show.show_presets(ws)
    c_row = next(line for line in shown[-1].splitlines() if line.startswith("| C |"))
    assert "(estimated); " in c_row
    assert c_row.endswith("; 3.2 GiB of host memory, measured in your run my_c_run |")
    a_row = next(line for line in shown[-1].splitlines() if line.startswith("| A |"))
    assert "measured in your run" not in a_row  # another step


def recorded_cuda_run(runs, name: str, preset: str, batch: int | None = None) -> dict:
    """A run of `preset` on a CUDA GPU, its run.json's "measured" made of what a GPU really measured for that
    preset: benchmarks/results/gpu.json (an NVIDIA H200 standing for a T4: fp16 + GradScaler, capped at
    14.7 GiB), the same step at the same size. The GPU branch, tested on a machine without one."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.base.resources import measured as packaged

    gpu = packaged("gpu")  # benchmarks/results/gpu.json, as the package holds it
    got = gpu["presets"][preset]
    cfg = load_config(presets.preset_config_path(preset))
    sig = timing.signature(estimate.StepShape.of(cfg, None), batch or got["batch_size"])
    measured = {
        "device": gpu["device"],
        "signature": sig,
        "step_s": 1 / got["steps_per_s"],
        "epoch_s": None,
        "epochs_timed": 1,
        "peak_memory": {k: got[k] for k in ("peak_allocated_gib", "peak_reserved_gib")},
        "estimated_need_gib": got["estimated_need_gib"],
        "at": 1.0,
    }
    (runs / name).mkdir(parents=True)
    (runs / name / "run.json").write_text(json.dumps({"measured": measured}))
    return {"device": gpu["device"], "sig": sig, "got": got}


def test_a_recorded_cuda_run_is_said_beside_the_estimate_in_diagnose_and_the_setup_table(
    tmp_path, monkeypatch
):
    """diagnose --runs and the setup notebook's table: beside each preset's estimate, what the user's newest
    run with that step on this kind of device measured (peak reserved GPU memory, steps/s), "-" elsewhere."""
    runs = tmp_path / "runs"
    rec = recorded_cuda_run(runs, "b_on_my_gpu", "B")
    want = f"{rec['got']['peak_reserved_gib']:.2f} GiB reserved on the GPU, "
    want += f"{rec['got']['steps_per_s']:.1f} steps/s, measured in your run b_on_my_gpu"
    assert timing.measured_words(runs, rec["device"], rec["sig"]) == want
    assert timing.measured_words(runs, "Tesla T4", rec["sig"]) == "-"  # another kind of GPU
    monkeypatch.setattr(presets, "this_device", lambda: rec["device"])
    rows = {row[0]: row for row in presets.memory_rows(None, runs)}
    assert rows["B"][-1] == want and rows["A"][-1] == rows["C"][-1] == "-"  # A, C: other steps
    assert presets.memory_header(runs)[-1] == presets.YOURS and len(presets.memory_header()) == 9
    table = presets.memory_table(None, markdown=True, runs=runs)
    assert want in table and f"the newest run in {runs}" in table
    from cloudml_lib.commands.cli import main

    monkeypatch.setattr("sys.argv", ["cloudml"])
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    assert main(["diagnose", "--json", "--runs", str(runs)]) == 0
    doc = json.loads(printed[-1])
    b = next(r for r in doc["preset_memory"] if r["preset"] == "B")
    assert b[presets.YOURS] == want


def test_the_batch_probes_first_guess_is_calibrated_by_an_earlier_run_on_this_kind_of_gpu(tmp_path):
    """train.batch_size auto on a GPU: an earlier run with the same step (any batch) on this kind of device
    turns the estimate's need into what that GPU held; the probe's line says both guesses, the probe
    decides."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.core.machine.memory import GIB, first_guess

    runs = tmp_path / "runs"
    rec = recorded_cuda_run(runs, "b_at_24", "B", batch=24)  # the measurement at batch 16, said as at 24
    cfg = load_config(presets.preset_config_path("B"))
    est = estimate.estimate(estimate.StepShape.of(cfg, "float16"))
    assert est is not None
    any_batch = dict(rec["sig"], batch=0)
    cal = timing.calibration(runs, rec["device"], any_batch, lambda b: est.need(b) / GIB)
    assert cal is not None and cal.run == "b_at_24" and cal.batch == 24
    assert cal.factor == pytest.approx(rec["got"]["peak_reserved_gib"] / (est.need(24) / GIB))
    budget = 14.7 * GIB
    words = first_guess(est, budget, cal)
    plain, scaled = est.largest_batch(budget), est.largest_batch(budget / cal.factor)
    assert words == f"; the estimate's first guess: {plain}, {scaled} as {cal.words()}"
    assert scaled > plain  # that GPU held less than the estimate's need at 24: room for a larger batch
    assert timing.calibration(runs, "Tesla T4", any_batch, lambda b: 1.0) is None  # another kind of GPU
    other = dict(any_batch, channels=[32, 64, 128])
    assert timing.calibration(runs, rec["device"], other, lambda b: 1.0) is None  # another step
    assert first_guess(est, budget) == f"; the estimate's first guess: {plain}" and first_guess(None, 1) == ""


@pytest.mark.parametrize(
    "field, value",
    [
        ("at", "yesterday"),
        ("peak_memory", [1, 2]),
        ("step_s", 1e-300),
        ("step_s", "fast"),
        ("epoch_s", -5.0),
        ("epochs_timed", 0),
        ("estimated_need_gib", float("inf")),
        ("peak_memory", {"peak_reserved_gib": 1e9, "peak_allocated_gib": 2.0}),
        ("peak_memory", {"peak_reserved_gib": "9 GiB"}),
    ],
)
@pytest.mark.slow
def test_a_hand_edited_measurement_is_left_out_by_name(tmp_path, monkeypatch, field, value, caplog):
    """A hand-edited run.json ("measured.at" a string, "peak_memory" a list, "step_s" 1e-300) gave tracebacks
    in the picker, the preset table and `diagnose --runs`, and absurd figures "measured in your run X": each
    field is checked for type and range before a number from it is shown; a damaged block is named once and
    used nowhere."""
    import logging

    from cloudml_lib.base.config import load_config

    runs = tmp_path / "runs"
    rec = recorded_cuda_run(runs, "edited", "B")
    info = json.loads((runs / "edited" / "run.json").read_text())
    info["measured"][field] = value
    (runs / "edited" / "run.json").write_text(json.dumps(info))
    caplog.set_level(logging.WARNING, logger="cloudml_lib.core.machine.timing")
    assert timing.read_measured(RunFolder(runs / "edited")) is None
    assert timing.measured_words(runs, rec["device"], rec["sig"]) == "-"
    assert timing.from_runs(runs, rec["device"], rec["sig"]) is None
    assert timing.peak_words(runs, rec["device"], rec["sig"]) is None
    assert timing.calibration(runs, rec["device"], rec["sig"], lambda batch: 1.0) is None
    monkeypatch.setattr(presets, "this_device", lambda: rec["device"])
    rows = {row[0]: row for row in presets.memory_rows(None, runs)}
    assert rows["B"][-1] == "-"
    assert load_config(presets.preset_config_path("B"))  # the preset itself is unchanged
    said = [r.getMessage() for r in caplog.records if "run.json" in r.getMessage()]
    assert len(said) == 1 and f"measured.{field}" in said[0] and "left out" in said[0], said
    if field != "at":
        return  # the command once (it takes seconds): the same reader serves every field
    r = run_cli("diagnose", "--runs", runs, timeout=600)
    assert "Traceback" not in r.stdout + r.stderr and "measured in your run edited" not in r.stdout, r.stderr
