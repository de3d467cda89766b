"""A pytest plugin: the processor time each test takes, its own process's and that of every process it
waited for (commands, torchrun jobs, notebook kernels, the Colab twin's), written as one JSON line per test
into $CLOUDML_SUITE_CPU/<worker>.jsonl. Two cores share what the whole suite asks for: the wall time of one
test under pytest-xdist is the other worker's load as much as its own, its processor time is not.

    CLOUDML_SUITE_CPU=DIR python -m pytest -p benchmarks.cpu_use ...   (benchmarks/suite.py does this)

A process a test leaves running, or one its children did not wait for (a compile worker pool), is not
counted: the figures are a floor.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get("CLOUDML_SUITE_CPU")
    own0, waited0 = _cpu()
    t0 = time.perf_counter()
    yield
    if not folder:
        return
    own1, waited1 = _cpu()
    line = {
        "test": item.nodeid.split("@")[0],  # pytest-xdist's "@group" left out
        "own_s": round(own1 - own0, 3),
        "children_s": round(waited1 - waited0, 3),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    os.makedirs(folder, exist_ok=True)
    name = getattr(item.config, "workerinput", {}).get("workerid", "main")  # pytest-xdist's gw0, gw1...
    with open(os.path.join(folder, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
