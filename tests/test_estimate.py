"""The memory estimate (estimate.py) against independent measures, and where it is used: the preset
choice, `diagnose`, the memory table of docs/how-to/memory.md. All on the CPU, in seconds."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cloudml_lib.commands import cli, presets
from cloudml_lib.core.machine import estimate, kept_estimates
from cloudml_lib.core.machine.estimate import StepShape, count_flops, measure
from cloudml_lib.core.machine.memory import GIB, MARGIN

REPO = Path(__file__).resolve().parents[1]
FULL, NARROW = (64, 128, 256), (32, 64, 128)
REAL = dict(frames=5, rows=440, cols=640)

# One real training step in a fresh process: its peak resident memory (VmHWM) above what it held before
# the step. glibc's malloc is told to return every freed block of 64 KiB or more to the system at once
# (without it, freed blocks stay resident and the peak would be that of every block ever used).
RSS_SCRIPT = """
import json, sys
import torch
from cloudml_lib.core.machine.estimate import StepShape, model_of, train_steps

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

shape, batch = StepShape(*json.loads(sys.argv[1])), int(sys.argv[2])
torch.set_num_threads(1)
model = model_of(shape)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
held = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
before = status("VmRSS")
train_steps(model, optimizer, shape, batch)
print(json.dumps({"step": status("VmHWM") - before, "held": held}))
"""


@pytest.mark.parametrize(
    "shape",
    [
        StepShape(NARROW, False, None, 3, 24, 32),
        StepShape(NARROW, True, None, 3, 24, 32),
        StepShape(FULL, True, "bfloat16", 5, 16, 24, "joint"),
    ],
    ids=["plain", "checkpointing", "bf16-joint"],
)
def test_fake_tensors_count_what_real_tensors_hold(shape):
    assert measure(shape, 3) == measure(shape, 3, fake=False)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.parametrize(
    "channels, checkpointing", [(FULL, True), (FULL, False), (NARROW, False)], ids=["A-width", "full", "C"]
)
@pytest.mark.slow
def test_the_estimate_agrees_with_the_peak_memory_of_a_real_step(channels, checkpointing):
    """An independent measure: the peak RSS of a process running the step on real CPU tensors (fp32, 110 x
    160, batch 8). The process adds a few tens of MB of its own (oneDNN's scratch buffers); the tensors'
    peak, which the estimate counts, varies 5x between these three and must be tracked. What else the
    process holds only adds to its peak (once 266.7 MB against a limit of 250 MB on Python 3.13, passing
    alone): the least of up to three processes is the measure, the bounds unchanged."""
    shape = StepShape(channels, checkpointing, None, 5, 110, 160)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    args = [sys.executable, "-c", RSS_SCRIPT, json.dumps(list(vars(shape).values())), "8"]
    runs = []
    for _ in range(3):
        runs.append(
            json.loads(subprocess.run(args, capture_output=True, text=True, env=env, check=True).stdout)
        )
        real = min(runs, key=lambda r: r["step"])
        estimated = measure(shape, 8) - real["held"]
        if real["step"] <= 1.05 * estimated + (48 << 20):
            break
    assert 0.9 * estimated <= real["step"] <= 1.05 * estimated + (48 << 20), (runs, estimated)


def test_the_peak_is_linear_in_the_batch_at_the_real_size():
    e = estimate.estimate(StepShape(FULL, True, "float16", **REAL))
    for batch in (12, 20):
        assert measure(e.shape, batch) == pytest.approx(e.train_peak(batch), rel=1e-3)
    assert e.train_per_sample > 0 and e.train_fixed > 0  # weights and optimizer state are the fixed part


@pytest.mark.slow
def test_checkpointing_and_half_precision_lower_the_peak_as_expected():
    """Checkpointing keeps one frame's activations instead of all T x 3 blocks'; fp16 halves what is kept.
    The same pass counts FLOPs: checkpointing recomputes the frame encoder's forward (about a third more)."""
    peak = lambda ch, ck, amp: estimate.estimate(StepShape(ch, ck, amp, **REAL)).train_per_sample  # noqa: E731
    assert peak(FULL, True, "float16") < peak(FULL, False, "float16") / 3
    assert peak(FULL, True, "float16") < peak(FULL, True, None) * 0.75
    assert peak(NARROW, True, "float16") < peak(FULL, True, "float16") / 1.8
    flops = {ck: count_flops(StepShape(NARROW, ck, "float16", 5, 64, 96), 2) for ck in (True, False)}
    assert 1.2 < flops[True] / flops[False] < 1.45


def test_every_preset_is_estimated_and_c_needs_the_least():
    presets.preset_memory.cache_clear()
    by_name = {p.name: p for p in presets.preset_memory()}
    assert all(p.estimate is not None for p in by_name.values())
    assert by_name["C"].need() < by_name["B"].need() < by_name["A"].need()
    for p in by_name.values():  # the largest batch is the last whose need, with the margin, fits a T4
        n = p.largest_batch(estimate.T4_BYTES)
        assert p.estimate.need(n) * (1 + MARGIN) <= estimate.T4_BYTES < p.estimate.need(n + 1) * (1 + MARGIN)


def test_the_readme_quotes_the_estimate_the_code_computes():
    page = (REPO / "docs" / "how-to" / "memory.md").read_text()
    for name, model, batch, peak, need, _, t4, reported, measured in presets.memory_rows(None):
        row = f"| {name} | {model} | {batch} | {peak} | {need} | {t4} | {reported} | {measured} |"
        assert row in page, f"docs/how-to/memory.md's memory table is stale: {row}"


def test_a_preset_is_chosen_by_the_estimate_of_what_fits():
    def report(free_gib, compile_ok=True):
        gpu = {"name": "Tesla T4", "free_bytes": free_gib * GIB}
        return {"gpu": gpu, "compile": {"available": compile_ok, "reason": "Triton is not installed"}}

    need = {p.name: p.need() * (1 + MARGIN) / GIB for p in presets.preset_memory()}
    assert presets.choose_preset(report(14.6))[0] == "A"
    name, why = presets.choose_preset(report(14.6, compile_ok=False))
    assert name == "B" and "torch.compile is not available (Triton is not installed)" in why
    name, why = presets.choose_preset(report((need["A"] + need["B"]) / 2))
    assert name == "B" and "estimated from the model" in why
    assert presets.choose_preset(report((need["B"] + need["C"]) / 2))[0] == "C"
    name, why = presets.choose_preset(report(need["C"] * 0.7))
    assert name == "C" and "train.batch_size: auto" in why and re.search(r"about batch \d+ fits", why)


def test_without_an_estimate_the_reported_figures_are_used_and_labelled(monkeypatch, caplog):
    def broken(shape):
        raise RuntimeError("fake tensors unsupported")

    monkeypatch.setattr(estimate, "_estimate", broken)
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)  # a CLI test may have cut it
    presets.preset_memory.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cloudml_lib.core.machine.estimate"):
            rows = presets.memory_rows(None)
        assert "memory estimate unavailable" in caplog.text and "fake tensors unsupported" in caplog.text
        assert [r[3] for r in rows] == ["unavailable"] * 3
        gpu = {"name": "Tesla T4", "free_bytes": 14.6 * GIB}
        name, why = presets.choose_preset({"gpu": gpu, "compile": {"available": True, "reason": ""}})
        assert name == "A" and "reported by users" in why
    finally:
        presets.preset_memory.cache_clear()


def test_diagnose_prints_the_memory_table_on_a_machine_without_a_gpu(capsys):
    assert cli.main(["diagnose"]) == 0
    out = capsys.readouterr().out
    assert "estimated peak (GiB)" in out and "largest batch on a T4" in out
    for name, *_ in presets.memory_rows(None):
        assert re.search(rf"^{name}\s+\d+/\d+/\d+", out, re.M)
    assert cli.main(["diagnose", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["preset_memory"]
    assert [r["preset"] for r in rows] == ["A", "B", "C"] and rows[0]["largest batch here"] == "-"


@pytest.fixture
def kept_here(tmp_path, monkeypatch):
    """The kept estimates in a folder of this test's own (the temporary folder's, as TMPDIR sets it), the
    in-process cache emptied before and after."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    estimate._estimate.cache_clear()
    yield kept_estimates.folder()
    estimate._estimate.cache_clear()


SMALL = StepShape((4, 8, 8), False, None, 2, 16, 16)
FIGURES = {"train": {"fixed": 1e6, "per_sample": 2e6}, "infer": {"fixed": 1e5, "per_sample": 3e5},
           "flops_per_sample": 4e9}  # fmt: skip


def test_an_estimate_is_counted_once_per_machine_and_read_back_by_the_next_process(kept_here):
    """The second process (here: the in-process cache emptied) reads the figures the first counted, without
    counting: the file named by its shape, torch and code, with its checksum, in a folder of the user's."""
    first = estimate.estimate(SMALL)
    (path,) = kept_here.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["key"]["torch"] == estimate.torch.__version__ and doc["key"]["shape"]["rows"] == 16
    assert doc["sha256"] and (kept_here.stat().st_mode & 0o777) == 0o700
    estimate._estimate.cache_clear()
    calls = []
    real = estimate.measure
    try:
        estimate.measure = lambda *a, **k: calls.append(a) or real(*a, **k)
        second = estimate.estimate(SMALL)
    finally:
        estimate.measure = real
    assert calls == [] and second == first  # read back, not counted
    other = kept_estimates.key_of(dict(vars(SMALL), checkpointing=True))
    assert kept_estimates.path_of(other) != path  # another shape has a file of its own
    changed_code = dict(kept_estimates.key_of(vars(SMALL)), code="0" * 16)
    assert kept_estimates.path_of(changed_code) != path  # so has the same shape under changed code


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda d: d["train"].update(per_sample=1.0), "SHA-256 does not match"),
        (lambda d: d.update(train={"fixed": -1.0, "per_sample": 1.0}), "out of range"),
        (lambda d: d["key"].update(torch="1.0"), "another shape, torch or code"),
        (lambda d: d.update(flops_per_sample=float("nan")), "out of range"),
        (lambda d: "not json", "not a JSON object"),
    ],
    ids=["edited", "negative", "other-torch", "nan", "not-object"],
)
def test_a_kept_estimate_changed_since_it_was_written_is_said_ignored_and_left_as_it_is(
    kept_here, caplog, change, said
):
    key = kept_estimates.key_of(vars(SMALL))
    kept_estimates.keep(key, FIGURES)
    assert kept_estimates.read(key) == FIGURES
    path = kept_estimates.path_of(key)
    doc = json.loads(path.read_text())
    changed = change(doc)
    if isinstance(changed, str):
        doc = changed
    elif said != "SHA-256 does not match":  # a change that also wrote a matching checksum
        doc["sha256"] = kept_estimates._checksum(doc)
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="cloudml_lib.core.machine.kept_estimates"):
        assert kept_estimates.read(key) is None  # estimate.py then counts afresh
    assert str(path) in caplog.text and said in caplog.text and "left as it is" in caplog.text, caplog.text
    kept_estimates.keep(key, FIGURES)  # what a count afresh keeps
    assert path.read_bytes() == before  # never replaced
    assert [p.name for p in kept_here.iterdir()] == [path.name]  # no file left half-written


def test_a_kept_estimate_folder_that_is_a_link_or_a_file_is_not_used(kept_here, tmp_path):
    key = kept_estimates.key_of(vars(SMALL))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kept_here.symlink_to(elsewhere)
    kept_estimates.keep(key, FIGURES)
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    (elsewhere / kept_estimates.path_of(key).name).write_text("{}")
    assert kept_estimates.read(key) is None  # nor read through it
    kept_here.unlink()
    kept_here.write_text("a user's file\n")
    kept_estimates.keep(key, FIGURES)
    assert kept_estimates.read(key) is None and kept_here.read_text() == "a user's file\n"
