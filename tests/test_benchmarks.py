"""benchmarks/RESULTS.md is rendered from the results files, never typed by hand."""

import json
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.__main__ import write_report

REPO = Path(__file__).parent.parent


def test_results_md_is_what_the_results_files_say(tmp_path):
    out = write_report(REPO / "benchmarks" / "results", tmp_path / "RESULTS.md")
    assert out.read_text() == (REPO / "benchmarks" / "RESULTS.md").read_text(), (
        "RESULTS.md is stale: run python -m benchmarks --report-only"
    )


def test_the_report_carries_the_measured_numbers(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results)
    trainers = json.loads((results / "trainers.json").read_text())
    trainers["summary"]["cloudml"]["train_vs_bare"] = 1.23456
    trainers["resume"]["lightning"].update(bit_identical=False, max_abs_diff=0.4321)
    (results / "trainers.json").write_text(json.dumps(trainers))
    (results / "gpu.json").unlink(missing_ok=True)
    text = write_report(results, tmp_path / "R.md").read_text()
    assert "| CloudML Trainer, defaults |" in text and "| 1.235 |" in text
    assert "differ, max abs diff 0.432" in text
    assert "Not measured: no CUDA GPU" in text


def test_each_slow_tests_defect_still_applies_and_its_test_exists():
    """benchmarks/defects.py puts back each of the ten slowest tests' defects: every defect's text is in its
    file once (the code has not moved away from it), every test it runs exists, and the record names the same
    tests, each failed as it must."""
    import ast

    from benchmarks.defects import DEFECTS, RESULTS, check_defects

    assert check_defects() == [] and len(DEFECTS) == 10
    for test, *_ in DEFECTS:
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        if name:
            tree = ast.parse((REPO / path).read_text())
            assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, test
    record = json.loads(RESULTS.read_text())
    assert [r["test"] for r in record["runs"]] == [t for t, *_ in DEFECTS]
    assert all(r["failed"] and r["said"] for r in record["runs"]), record["runs"]


def test_readme_tables_come_from_results_md():
    section = (REPO / "docs" / "explanation" / "benchmarks.md").read_text()
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    results = (REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(rows) >= 15
    assert [r for r in rows if r not in results] == []


@pytest.mark.slow
def test_the_gpu_benchmark_runs_its_items_on_the_cpu(tmp_path):
    """benchmarks/gpu.py --smoke: every item's code path on a tiny CPU run (the GPU run is prepared this way),
    each item in its own time-boxed process, and the results file written after each; it never writes the
    committed results."""
    import subprocess
    import sys

    committed = (REPO / "benchmarks" / "results" / "gpu.json").read_bytes()
    out = tmp_path / "smoke.json"
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu.py",
            "--smoke",
            "--results",
            str(out),
            "--log",
            str(tmp_path / "log"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,  # only against a hang: each item has its own time box, 4x the GPU's on the CPU
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    items = ("presets", "compile", "precision", "memory", "predict", "resume")
    assert [i for i in items if "failed" in doc[i]] == [], {i: doc[i].get("failed") for i in items}
    assert doc["presets"]["A"]["steps_per_s"] > 0 and doc["presets"]["A"]["estimated_peak_gib"] > 0
    compiled = doc["compile"]["compiled"]
    assert len(compiled["epochs"]) == 3 and not compiled["compile_at_end"]["fallback"]
    assert doc["precision"]["fp16_grad_scaler"]["non_finite_losses"] == 0
    assert doc["memory"]["skipped"].startswith("needs CUDA")  # out of memory is a GPU's only
    # bit-identical to an uninterrupted run; two uninterrupted runs differed once in about ten smoke runs on
    # this 2-core CPU (rounding, from epoch 1 on, before any kill), so the resumed run is held to either
    assert doc["resume"]["killed_by_sigkill"] and doc["resume"]["bit_identical_to_either"], doc["resume"]
    # the items a T4 projection needs (gpu_t4.py): the CUDA-only ones say so, the others run
    t4 = ("context", "profile", "speed", "epoch", "predict_2cpu", "graphs")
    assert [i for i in t4 if "failed" in doc[i]] == [], {i: doc[i].get("failed") for i in t4}
    assert doc["context"]["skipped"] == "needs CUDA" and doc["graphs"]["skipped"].startswith("needs CUDA")
    assert doc["profile"]["C"]["wall_s"] > 0 and doc["profile"]["C"]["host_operations"] > 100
    for preset in ("A", "B", "C"):
        assert doc["speed"][preset]["deterministic_over_eager"] > 0, doc["speed"]
    assert doc["epoch"]["cpus"] == doc["predict_2cpu"]["cpus"] and len(doc["epoch"]["cpus"]) <= 2
    assert (
        len(doc["epoch"]["workers_2"]["epochs"]) == 2 and doc["predict_2cpu"]["per_frame"]["frames_per_s"] > 0
    )
    assert (REPO / "benchmarks" / "results" / "gpu.json").read_bytes() == committed


@pytest.mark.slow
def test_the_presets_compile_benchmark_runs_on_a_tiny_model(tmp_path):
    """benchmarks/compile_presets.py --smoke --steps-only: eager and compiled steps, the compile cold and
    warm, on a tiny model; it never writes the committed results (its Trainer epochs: --smoke without
    --steps-only, left out here for CI's time)."""
    import subprocess
    import sys

    committed = REPO / "benchmarks" / "results" / "compile_presets.json"
    before = committed.read_bytes() if committed.exists() else None
    out = tmp_path / "smoke.json"
    r = subprocess.run(
        # steps only: the Trainer's compiled epochs are test_compile.py's (CI time)
        [sys.executable, "benchmarks/compile_presets.py", "--smoke", "--steps-only", "--results", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,  # only against a hang: a cold compile takes minutes on a busy 2-core machine
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    demo = doc["summary"]["demo"]
    assert (
        demo["compile_warm_s"] > 0
        and demo["eager_steps_per_s"] > 0
        and demo["compiled_steps_per_s"] > 0
        and demo["compile_cold_s"] > 0
    )
    assert doc["smoke"] and "demo_compiled_on_cpu" in doc["decisions"]
    assert (committed.read_bytes() if committed.exists() else None) == before


@pytest.mark.slow
def test_the_memory_format_benchmark_runs_on_tiny_models():
    """benchmarks/memory_format.py --smoke: both formats train each model on the CPU and agree to rounding."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "benchmarks/memory_format.py", "--smoke"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,  # only against a hang
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    choice = json.loads(r.stdout.strip().splitlines()[-1])
    assert choice["cpu"]["speedup"] > 0 and isinstance(choice["cpu"]["use"], bool)
    assert r.stdout.count("outputs differ by") == 3


def test_the_suites_processor_time_is_recorded_test_by_test(tmp_path):
    """benchmarks/cpu_use.py (loaded by benchmarks/suite.py): each test's processor time, its own and that of
    the processes it waited for, summed per file by suite.cpu_use; a test that sleeps costs none."""
    import subprocess
    import sys

    from benchmarks.suite import cpu_use

    (tmp_path / "test_work.py").write_text(
        "import subprocess, sys, time\n"
        "def test_busy():\n    t = time.process_time()\n    while time.process_time() - t < 0.3: pass\n"
        "def test_child():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass'], check=True)\n"
        "def test_asleep():\n    time.sleep(0.3)\n"
    )
    folder = tmp_path / "cpu"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "benchmarks.cpu_use",
            "test_work.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "CLOUDML_SUITE_CPU": str(folder), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = {x["test"]: x for x in map(json.loads, (folder / "main.jsonl").read_text().splitlines())}
    busy, child, asleep = (lines[f"test_work.py::test_{n}"] for n in ("busy", "child", "asleep"))
    assert busy["own_s"] >= 0.25 and busy["children_s"] < 0.05
    assert child["children_s"] >= 0.25 and child["own_s"] < 0.2
    assert asleep["own_s"] + asleep["children_s"] < 0.1 and asleep["wall_s"] >= 0.25
    summed = cpu_use(folder)
    assert summed["files_cpu_s"]["test_work.py"] == pytest.approx(
        sum(x["own_s"] + x["children_s"] for x in lines.values()), abs=0.1
    )
    assert list(summed["costliest_cpu_s"])[2] == "test_work.py::test_asleep"
