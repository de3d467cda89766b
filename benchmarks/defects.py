"""Does a test made faster still catch its defect? Each of the ten slowest tests of 0a8a03d (issue 64: the
suite before it was made fast, benchmarks/results/suite.json's coverage block of that commit) is run once
against a scratch copy of the checkout with the defect it was written for put back; it must fail, and fail
saying what is wrong.

    python benchmarks/defects.py              # all ten, two at a time (about 10 minutes on 2 cores)
    python benchmarks/defects.py --only 3,7   # some of them (their numbers in DEFECTS, from 1)

Each defect is a one-line change to one file (DEFECTS: the file, the text replaced, the text put in its
place), made in a git worktree of HEAD in a temporary folder (never in the checkout), which is removed
afterwards. The test runs there as the suite runs it (CLOUDML_SMOKE=1, one thread per test), its package the
worktree's own (PYTHONPATH). The Colab twin's tests build its environment unless $CLOUDML_TWIN_CACHE holds
one. Results: benchmarks/results/defects.json (the commit, each test, its defect, whether it failed, the
first line of what it said, seconds), rendered in RESULTS.md. A defect whose text is no longer in the file
stops the run before anything is changed, naming it: the code moved, and the defect must be written again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "defects.json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MACHINE_PATH = re.compile(r"/(?:tmp|var|root|home|work)/\S*/")
RAISED = re.compile(r"^[A-Za-z_.]*(Error|Exception): \S")

# (the test, what the defect does, the file, the text replaced, the replacement); the tests in the order of
# their time at 0a8a03d, slowest first
DEFECTS = [
    (
        "tests/test_benchmarks.py::test_the_gpu_benchmark_runs_its_items_on_the_cpu",
        "the GPU benchmark writes the committed results file, whatever --results asks",
        "benchmarks/gpu.py",
        'results = args.results or (SCRATCH / "smoke.json" if args.smoke else RESULTS)',
        "results = RESULTS",
    ),
    (
        "tests/test_colab_twin.py::test_both_notebooks_run_all_in_the_colab_twin",
        "the notebooks' install builds in the Drive copy itself instead of a copy on the VM's disk",
        "cloudml_lib/colab/install.py",
        '            "--no-input",\n            str(work),',
        '            "--no-input",\n            str(code),',
    ),
    (
        "tests/test_demo.py::test_demo_learns_height_from_the_frames",
        "the network never sees the frames (multiplied by 0 before the encoder)",
        "cloudml_lib/core/network/model.py",
        "return self.output(self.features(frames, scalars))",
        "return self.output(self.features(frames * 0, scalars))",
    ),
    (
        "tests/test_colab_twin.py::test_the_installed_wheel_runs_every_command_away_from_the_checkout",
        "the presets (YAML) are left out of the installed package",
        "setup.py",
        'DATA = ("*.yaml", "*.json")',
        'DATA = ("*.json",)',
    ),
    (
        "colab_training.ipynb",
        "the Train cell after a disconnect starts the run again (--resume never) instead of continuing it",
        "cloudml_lib/colab/training.py",
        "    cmd = train_command(ws, c)\n    config =",
        '    cmd = train_command(ws, c) + ["--resume", "never"]\n    config =',
    ),
    (
        "tests/test_compile.py::test_a_compiled_run_killed_mid_epoch_and_resumed_is_bit_identical",
        "the compiled kernels are never kept in the run folder (a new machine compiles from nothing)",
        "cloudml_lib/core/network/compile_cache.py",
        "        return _copy_missing(self.local, self.lasting)",
        "        return 0",
    ),
    (
        "tests/test_sweep.py::test_report_and_compare",
        "the sweep's report draws no optimisation history",
        "cloudml_lib/commands/compare.py",
        'reason = _optuna_figure("history", study, folder.plots / "optimization_history.png", space.metric)',
        'reason = "not drawn"',
    ),
    (
        "tests/test_sweep.py::test_a_crossval_objective_scores_each_trial_by_its_folds",
        "a cross-validation trial is scored on its folds' test flights (CloudML 0.2's objective)",
        "cloudml_lib/commands/sweep.py",
        '    if result.get("protocol") == LEGACY_VALIDATION:\n',
        "    if True:\n",
    ),
    (
        "tests/test_compile.py::test_a_real_compile_failure_falls_back_to_eager_and_matches_an_eager_run",
        "a failed compile stops the run instead of continuing in eager mode",
        "cloudml_lib/train/loop.py",
        "            else:\n                self._eager_after_compile_failure(failure)",
        "            else:\n                raise RuntimeError(failure)",
    ),
    (
        "tests/test_distributed.py::test_the_slurm_recipe_stops_at_the_time_limit_requeues_and_resumes_to_the_"
        "same_weights",
        "the SLURM recipe (docs/how-to/cluster.md) no longer requeues the job at the time limit",
        "docs/how-to/cluster.md",
        '    scontrol requeue "$SLURM_JOB_ID"',
        '    : # scontrol requeue "$SLURM_JOB_ID"',
    ),
]


def check_defects() -> list[str]:
    """What stops the run: a defect whose text is not in its file exactly once (the code moved)."""
    wrong = []
    for i, (test, _, path, old, _) in enumerate(DEFECTS, 1):
        found = (REPO / path).read_text().count(old)
        if found != 1:
            wrong.append(f"defect {i} ({test}): its text is in {path} {found} times, not once")
    return wrong


def pytest_args(test: str) -> list[str]:
    """A notebook runs under nbmake, after the setup notebook it follows (they share a workspace)."""
    if test.endswith(".ipynb"):
        return ["--nbmake", "colab_setup.ipynb", test]
    return [test]


def first_words(output: str) -> str:
    """What the failing test said, in its most telling line: a command's "Problem:", else the error raised
    (the last of a traceback), else an assertion's own message, else the failed comparison."""
    text = MACHINE_PATH.sub(".../", ANSI.sub("", output))  # no path of this machine in the record
    problem = re.search(r"Problem: .+", text)
    if problem:
        return problem.group(0)[:300]
    lines = [line[4:].strip() for line in text.splitlines() if line.startswith("E   ") and line[4:].strip()]
    said = "AssertionError: assert "
    lines = [x.removeprefix("AssertionError: ") if x.startswith(said) else x for x in lines]
    raised = [x for x in lines if RAISED.match(x) and not x.startswith(("AssertionError", "nbclient"))]
    if raised:
        return raised[-1][:300]
    message = [x for x in lines if x.startswith("AssertionError: ") and x[16:17].isalpha()]
    if message:
        return message[0][:300]
    compared = [i for i, x in enumerate(lines) if x.startswith("assert ")]
    if compared:
        return " / ".join(lines[compared[0] : compared[0] + 2])[:300]
    return lines[0][:300] if lines else ""


def run_one(number: int) -> dict:
    test, what, path, old, new = DEFECTS[number - 1]
    with tempfile.TemporaryDirectory(prefix="cloudml-defect-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), "HEAD"], cwd=REPO, check=True)
        try:
            target = tree / path
            target.write_text(target.read_text().replace(old, new, 1))
            env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", CLOUDML_SMOKE="1")
            env.pop("PYTEST_ADDOPTS", None)
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short"]
                + pytest_args(test),
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - t0
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    out = done.stdout + done.stderr
    failed = done.returncode == 1 and f"FAILED {test}" in out
    result = {"test": test, "defect": what, "file": path, "failed": failed, "exit_status": done.returncode}
    result.update(said=first_words(out), seconds=round(seconds, 1))
    verdict = "failed, as it must" if failed else "DID NOT FAIL"
    print(f"{number}: {verdict} ({seconds:.0f} s): {test}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated numbers of DEFECTS (from 1)")
    p.add_argument("--jobs", type=int, default=2, help="tests at a time (default 2: one per core)")
    args = p.parse_args()
    words = args.only.split(",") if args.only else [str(n) for n in range(1, len(DEFECTS) + 1)]
    bad = [w for w in words if not (w.strip().isdigit() and 1 <= int(w) <= len(DEFECTS))]
    if bad:
        p.error(f"--only: {', '.join(map(repr, bad))} not among the numbers 1 to {len(DEFECTS)}")
    numbers = [int(w) for w in words]
    wrong = check_defects()
    if wrong:
        print("\n".join(wrong), file=sys.stderr)
        return 2
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    status = ["git", "status", "--porcelain"]
    changed = subprocess.run(status, cwd=REPO, capture_output=True, text=True).stdout
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = dict(zip(numbers, pool.map(run_one, numbers)))
    if args.only and RESULTS.is_file():  # the others as recorded before
        before = {r["test"]: r for r in json.loads(RESULTS.read_text())["runs"]}
        runs = {n: runs.get(n) or before.get(DEFECTS[n - 1][0]) for n in range(1, len(DEFECTS) + 1)}
    runs = [r for _, r in sorted(runs.items()) if r]
    doc = {
        "machine": machine(),
        "commit": commit + ("+changes" if changed.strip() else ""),
        "what": "the ten slowest tests of 0a8a03d, each against HEAD with the defect it was written for put "
        "back (benchmarks/defects.py); failed: the test failed, as it must",
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0 if all(r["failed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
