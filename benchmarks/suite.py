"""What the test suite costs and what it checks: README's test command timed test by test, and the line and
branch coverage of cloudml_lib it reaches.

    python benchmarks/suite.py                 # README's test command, --durations=0: its time, file by file
    python benchmarks/suite.py --quick         # the quick subset (-m "not slow") the same way
    python benchmarks/suite.py --coverage      # README's test command under coverage.py (slower: 1.5-3x)
    python benchmarks/suite.py --from-output ci.out --notes notes.json --cpu DIR --how "..."   # run elsewhere

Each writes its block for the checkout's commit into benchmarks/results/suite.json (other commits' blocks
are kept: the suite before and after a change side by side), the test names it ran into
benchmarks/suite/tests_<commit>.txt, and pytest's whole output into benchmarks/.scratch/suite/pytest.out.
Coverage: coverage.py with branch measurement over cloudml_lib, every
Python process the tests start measured too (coverage's `patch = subprocess`: commands, notebook kernels,
torchrun workers); the Colab twin's own environment is not (it holds no coverage.py). The time of the Colab
twin's environment (built in the background while the other tests run, or kept from an earlier session) is
recorded beside, from what the suite writes to $CLOUDML_SUITE_NOTES. The processor time of each test (its
process's and those it waited for: benchmarks/cpu_use.py) is recorded per file: what two cores share, where
a test's wall time under pytest-xdist is the other worker's load as much as its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "suite.json"
NAMES = REPO / "benchmarks" / "suite"
SCRATCH = REPO / "benchmarks" / ".scratch" / "suite"
# a test's name as --durations prints it (under pytest-xdist's groups, "@group" follows it: left out)
DURATION = re.compile(r"^\s*([0-9.]+)s (call|setup|teardown)\s+([^\s@]+)")
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|error|deselected).*?) in ([0-9.]+)s")


def readme_command() -> str:
    """README's test command (its line ending in "# run the tests"), as .ci/run checks it."""
    line = next(
        x for x in (REPO / "README.md").read_text().splitlines() if x.rstrip().endswith("# run the tests")
    )
    return line.split("&&", 1)[1].rsplit("#", 1)[0].strip()


def pytest_argv(quick: bool) -> tuple[dict, list[str]]:
    """README's pytest call as an environment and an argv (the quick subset: its tests, -m "not slow")."""
    words = shlex.split(readme_command())
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    argv = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    assert argv[:3] == ["python", "-m", "pytest"], argv
    if quick:  # README's quick subset: the tests without the notebooks, slow ones left out
        argv = ["python", "-m", "pytest", "-q", "-n", "2", "tests", "-m", "not slow"]
    return env, argv[3:]


PER_TEST = ("files_s", "slowest_s", "files_cpu_s", "costliest_cpu_s")  # kept in the file, not printed
SLOW_S = 5.0  # a test of this many seconds in a full run is marked slow (the quick subset leaves it out)


def parse(output: str) -> dict:
    """Per-test and per-file seconds (setup, call and teardown together), the summary line and its time."""
    tests: dict[str, float] = {}
    for line in output.splitlines():
        m = DURATION.match(line)
        if m:
            tests[m.group(3)] = tests.get(m.group(3), 0.0) + float(m.group(1))
    files: dict[str, float] = {}
    for name, seconds in tests.items():
        f = name.split("::")[0]
        files[f] = files.get(f, 0.0) + seconds
    summary = [m for m in map(SUMMARY.match, output.splitlines()) if m]
    if not summary:  # pytest never ran its tests (a usage error, a missing plugin): its last words
        tail = "\n".join(output.splitlines()[-15:])
        raise SystemExit(f"pytest printed no summary line; it ended with:\n{tail}")
    last = summary[-1]
    return {
        "summary": last.group(1),
        "pytest_s": float(last.group(2)),
        "files_s": {k: round(v, 1) for k, v in sorted(files.items(), key=lambda kv: -kv[1])},
        # the 30 slowest, and every test of SLOW_S or more (tests/test_readme.py: each is marked slow)
        "slowest_s": {
            k: round(v, 1)
            for k, v in sorted(tests.items(), key=lambda kv: -kv[1])[
                : max(30, sum(v >= SLOW_S for v in tests.values()))
            ]
        },
        "failed": [
            line.split(" ", 1)[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))
        ],
    }


def cpu_use(folder: Path) -> dict:
    """The processor time of the tests (benchmarks/cpu_use.py's lines in `folder`): in all, per file, and
    the 30 costliest tests; each its own process's and the processes' it waited for."""
    lines = [json.loads(x) for f in sorted(folder.glob("*.jsonl")) for x in f.read_text().splitlines() if x]
    if not lines:
        return {}
    cost = {x["test"]: x["own_s"] + x["children_s"] for x in lines}
    files: dict[str, float] = {}
    for name, seconds in cost.items():
        files[name.split("::")[0]] = files.get(name.split("::")[0], 0.0) + seconds
    return {
        "cpu_in_tests_s": round(sum(cost.values()), 1),
        "cpu_in_their_processes_s": round(sum(x["children_s"] for x in lines), 1),
        "files_cpu_s": {k: round(v, 1) for k, v in sorted(files.items(), key=lambda kv: -kv[1])},
        "costliest_cpu_s": {k: round(v, 1) for k, v in sorted(cost.items(), key=lambda kv: -kv[1])[:30]},
    }


def read_notes(path: Path) -> dict:
    """The suite's notes (the twin's environment: how and in how many seconds), with no folder of this machine
    in them (a results file names none)."""
    notes = json.loads(path.read_text())
    return {
        k: re.sub(r"(?<![\w.])/[^\s,;)]+", "a folder", v) if isinstance(v, str) else v
        for k, v in notes.items()
    }


def coverage_totals(report: dict) -> dict:
    t = report["totals"]
    return {
        "lines": [t["covered_lines"], t["num_statements"]],
        "branches": [t["covered_branches"], t["num_branches"]],
        "line_pct": round(100 * t["covered_lines"] / t["num_statements"], 2),
        "branch_pct": round(100 * t["covered_branches"] / t["num_branches"], 2),
        "combined_pct": round(t["percent_covered"], 2),
    }


def commit() -> str:
    """The checkout's commit, "+changes" where its tracked files differ from it (measured, not committed)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    changed = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short=7", "HEAD") + ("+changes" if changed else "")


def run(quick: bool, coverage: bool) -> dict:
    env, args = pytest_argv(quick)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    notes = SCRATCH / "notes.json"
    notes.unlink(missing_ok=True)
    cpu_dir = SCRATCH / "cpu"
    for old in cpu_dir.glob("*.jsonl"):
        old.unlink()
    full = {**os.environ, **env, "CLOUDML_SUITE_NOTES": str(notes), "CLOUDML_SUITE_CPU": str(cpu_dir)}
    cmd = [sys.executable, "-m", "pytest", *args, "--durations=0", "-p", "no:cacheprovider"]
    cmd += ["-p", "benchmarks.cpu_use"]  # each test's processor time
    if coverage:
        rc = SCRATCH / "coveragerc"
        data = SCRATCH / "coverage"
        for old in SCRATCH.glob("coverage*"):
            old.unlink() if old.is_file() else None
        rc.write_text(
            "[run]\nbranch = True\nsource = cloudml_lib\nparallel = True\npatch = subprocess\n"
            f"data_file = {data}\n"
        )
        full["COVERAGE_RCFILE"] = str(rc)
        cmd = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", *cmd[3:]]
    load = os.getloadavg()
    t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    (SCRATCH / "pytest.out").write_text(r.stdout + r.stderr)  # a failure's whole story, kept for reading
    out = parse(r.stdout + r.stderr)
    out.update(exit_status=r.returncode, wall_s=round(time.monotonic() - t0, 1))
    # processor time of the suite and every process it waited for (what two cores share)
    out["cpu_s"] = round(cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)
    out["load_before_after"] = [round(load[0], 2), round(os.getloadavg()[0], 2)]
    if notes.exists():
        out["notes"] = read_notes(notes)
    out.update(cpu_use(cpu_dir))
    if coverage:
        subprocess.run(
            [sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=REPO, check=True
        )
        report = SCRATCH / "coverage.json"
        subprocess.run(
            [sys.executable, "-m", "coverage", "json", f"--rcfile={rc}", "-q", "-o", str(report)],
            cwd=REPO,
            check=True,
        )
        out["coverage"] = coverage_totals(json.loads(report.read_text()))
    out["tests"] = write_names(quick)
    return out


def write_names(quick: bool) -> int:
    """The names of the tests README's command (or the quick subset) collects, into NAMES; their count."""
    env, args = pytest_argv(quick)
    names = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--collect-only", "-p", "no:cacheprovider"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    ).stdout
    listed = sorted(line for line in names.splitlines() if "::" in line)
    NAMES.mkdir(exist_ok=True)
    (NAMES / f"tests_{commit()}{'_quick' if quick else ''}.txt").write_text("\n".join(listed) + "\n")
    return len(listed)


def record(block: dict, key: str) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["machine"] = machine()
    results.setdefault("commits", {}).setdefault(commit(), {})[key] = block
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help='the quick subset: -m "not slow", no notebooks')
    p.add_argument("--coverage", action="store_true", help="under coverage.py: line and branch coverage")
    p.add_argument(
        "--from-output",
        type=Path,
        metavar="FILE",
        help="record instead what a run already printed (e.g. `bash .ci/run` in a fresh clone with "
        "PYTEST_ADDOPTS=--durations=0), under the key fresh_clone; with --notes and --how",
    )
    p.add_argument("--notes", type=Path, help="that run's $CLOUDML_SUITE_NOTES file (the twin's time)")
    p.add_argument("--how", default="", help="that run's machine, load and command, in words")
    p.add_argument(
        "--cpu",
        type=Path,
        metavar="DIR",
        help="that run's $CLOUDML_SUITE_CPU folder (run with PYTEST_ADDOPTS='-p benchmarks.cpu_use')",
    )
    args = p.parse_args()
    if args.from_output:
        block = parse(args.from_output.read_text())
        block["measured"] = args.how
        if args.notes and args.notes.is_file():
            block["notes"] = read_notes(args.notes)
        if args.cpu:
            block.update(cpu_use(args.cpu))
        block["tests"] = write_names(False)
        record(block, "fresh_clone")
        print(json.dumps({k: v for k, v in block.items() if k not in PER_TEST}, indent=1))
        return
    if args.coverage:
        import importlib.util

        if importlib.util.find_spec("coverage") is None:
            p.error("--coverage needs coverage.py: pip install -r benchmarks/requirements.txt")
    key = "coverage" if args.coverage else "quick" if args.quick else "full"
    block = run(args.quick, args.coverage)
    record(block, key)
    print(json.dumps({k: v for k, v in block.items() if k not in PER_TEST}, indent=1))


if __name__ == "__main__":
    main()
