"""What README.md and its docs pages show is what the code does: README's first two commands are the set-up
and the CI line, the sample of the flight table (docs/explanation/your-data.md) is what `labels --preset demo`
prints today (it went stale once: 301/153 shown, 291/152 printed), and the settings table
(docs/reference/configuration.md) is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DATA_PAGE = REPO / "docs" / "explanation" / "your-data.md"
CONFIG_PAGE = REPO / "docs" / "reference" / "configuration.md"


def test_the_readme_opens_with_the_demo_and_the_test_command():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert block[0].endswith("# run the demo") and "python -m cloudml_lib train" in block[0]
    assert block[1].endswith("# run the tests")
    ci = (REPO / ".ci" / "run").read_text()
    assert (
        "torch==2.13.0" in ci
        and "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README
    )


def test_the_suites_time_in_the_readme_and_the_testing_page_is_the_last_measured():
    """README and docs/how-to/testing.md state the suite's time as benchmarks/results/suite.json last recorded
    it (benchmarks/suite.py): the whole suite in a fresh clone, the quick subset, the Colab twin beside."""
    import json

    suite = json.loads((REPO / "benchmarks" / "results" / "suite.json").read_text())

    def last(kind: str) -> dict:
        return [c[kind] for c in suite["commits"].values() if kind in c][-1]

    full, quick = last("fresh_clone"), last("quick")

    def took(seconds: float) -> str:  # under two minutes in seconds, else in whole minutes
        return f"{round(seconds)} s" if seconds < 120 else f"{round(seconds / 60)} minutes"

    assert not full["failed"] and not quick["failed"]  # figures of green runs
    flat = " ".join(README.split())
    assert f"{full['tests']} tests, {took(full['pytest_s'])} in a fresh clone" in flat
    assert f"runs {quick['tests']} of them in {took(quick['pytest_s'])}" in flat
    page = " ".join((REPO / "docs" / "how-to" / "testing.md").read_text().split())
    q, f = took(quick["pytest_s"]), took(full["pytest_s"])
    assert f"{quick['tests']} tests in {q}, against {f}" in page
    twin = full["files_s"]["tests/test_colab_twin.py"]
    assert f"{took(twin)} for its three tests" in page
    assert f"built meanwhile in {full['notes']['seconds']:.0f} s" in page


def test_every_test_of_5_s_or_more_in_the_last_full_run_is_marked_slow():
    """The quick subset's rule (README, docs/how-to/testing.md): a test that took 5 s or more in the last full
    run benchmarks/suite.py recorded is marked slow, so that `-m "not slow"` leaves it out."""
    import importlib
    import json
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from suite import SLOW_S

    suite = json.loads((REPO / "benchmarks" / "results" / "suite.json").read_text())
    full = [c["fresh_clone"] for c in suite["commits"].values() if "fresh_clone" in c][-1]
    long = [name for name, s in full["slowest_s"].items() if s >= SLOW_S and not name.endswith(".ipynb")]
    assert long  # the record holds them
    unmarked = []
    for name in long:
        path, *inner = name.split("[")[0].split("::")
        obj = importlib.import_module(Path(path).stem)
        marks = []
        for part in ["", *inner]:
            obj = getattr(obj, part, None) if part else obj
            found = getattr(obj, "pytestmark", [])  # a module's may be one mark or a list
            marks += found if isinstance(found, list) else [found]
        if obj is None:  # removed or renamed since the record: the next record has it by its new name
            continue
        if "slow" not in {m.name for m in marks} | param_marks(marks, name):
            unmarked.append(name)
    assert unmarked == [], f"took {SLOW_S:.0f} s or more in the last full run: mark them @pytest.mark.slow"


def param_marks(marks: list, name: str) -> set[str]:
    """The marks of the parameter set a test's `name` names ("test[5]": pytest.param(5, marks=...))."""
    if "[" not in name:
        return set()
    wanted = name.split("[", 1)[1][:-1]
    found = set()
    for m in marks:
        if m.name == "parametrize":
            for p in m.args[1]:
                if isinstance(p, type(pytest.param(0))) and (p.id or "-".join(map(str, p.values))) == wanted:
                    found |= {x.name for x in p.marks}
    return found


@pytest.mark.slow
def test_the_flight_table_in_the_readme_is_what_the_code_prints(demo_flights, capsys):
    from cloudml_lib.commands.cli import main

    assert main(["labels", "--preset", "demo", "--data-dir", str(demo_flights)]) == 0
    printed = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(printed) if line.startswith("flight   IR file"))
    end = next(i for i, line in enumerate(printed) if re.match(r"\d+ labels in \d+ flights", line))
    shown = re.search(r"<!-- labels --preset demo -->\n```\n(.*?)\n```", DATA_PAGE.read_text(), re.S).group(1)
    now = "\n".join(line.rstrip() for line in printed[start : end + 1])
    assert "\n".join(line.rstrip() for line in shown.splitlines()) == now, (
        "docs/explanation/your-data.md's flight table is stale; replace the block after "
        "<!-- labels --preset demo --> with:\n" + now
    )


def test_the_settings_table_in_the_readme_is_generated_from_the_code():
    from cloudml_lib.base.config import settings_table

    shown = re.search(
        r"<!-- settings: cloudml_lib.base.config.settings_table\(\) -->\n(.*?)\n\n",
        CONFIG_PAGE.read_text(),
        re.S,
    ).group(1)
    assert shown == settings_table(), (
        "docs/reference/configuration.md's settings table is stale: paste config.settings_table()"
    )
