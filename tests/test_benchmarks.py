"""benchmarks/RESULTS.md is rendered from the results files, never typed by hand."""

import json
import shutil
from pathlib import Path

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


def test_readme_tables_come_from_results_md():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Benchmarks") : readme.index("## Design decisions")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    results = (REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(rows) >= 15
    assert [r for r in rows if r not in results] == []
