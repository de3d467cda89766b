"""Shared fixtures: small demo flights written once per session, and a tiny config over them."""

from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cloudml_lib.base.config import build_config
from cloudml_lib.data.preprocess import FrameSpec, equalise_skimage, prepare
from cloudml_lib.data.synthetic import make_demo_flights

REPO = Path(__file__).resolve().parent.parent
TINY_SHAPE = (40, 48)  # raw rows x columns of the test camera
TINY_FRAMES = 240


@pytest.fixture(scope="session")
def tiny_flights(tmp_path_factory):
    """Three demo flights of 240 frames at 40x48: (data dir, data.flights entries)."""
    root = tmp_path_factory.mktemp("flights")
    entries = make_demo_flights(
        root, n_flights=3, seed=1, frames_per_flight=TINY_FRAMES, frame_shape=TINY_SHAPE
    )
    return root, entries


def tiny_raw(data_dir, entries, cache_dir) -> dict:
    """A raw config dict that trains a very small model for two short epochs."""
    return {
        "data": {
            "dir": str(data_dir),
            "cache_dir": str(cache_dir),
            "flights": copy.deepcopy(entries),
            "test_flights": [entries[2]["name"]],
            "validation_gap_frames": 10,  # the tiny flights are 240 frames long
            "temporal_frames": 3,
            "swath_slice": [4, 36],
            "num_workers": 0,
        },
        "model": {"channels": [4, 8, 8], "dropout": 0.0},
        "train": {
            "epochs": 2,
            # the height labels trained on (the last of each training flight validate): 7 batches of 5
            "batch_size": 5,
            "learning_rate": 0.003,
            "warmup_steps": 3,
            "early_stopping_patience": 0,
            "log_every_steps": 2,
            "quick_val_fraction": 0.5,
        },
    }


@pytest.fixture
def tiny_raw_config(tiny_flights, tmp_path):
    root, entries = tiny_flights
    return tiny_raw(root, entries, tmp_path / "cache")


@pytest.fixture
def tiny_config(tiny_raw_config):
    return build_config(tiny_raw_config)


@pytest.fixture
def copied_flights(tiny_flights, tmp_path):
    """A private copy of the tiny flights (tests edit their files) and a function making the tiny config over
    it with data settings changed: (its folder, their entries, config(**data))."""
    root, entries = tiny_flights
    shutil.copytree(root, tmp_path / "flights")

    def config(**data):
        raw = tiny_raw(tmp_path / "flights", entries, tmp_path / "cache")
        raw["data"].update(data)
        return build_config(raw)

    return tmp_path / "flights", entries, config


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The wheel of a clean copy of this checkout (tests/install_helpers.py)."""
    from install_helpers import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


def with_heights(labels):
    """A FlightLabels with only the samples that have a height label (the arrays of the height task)."""
    keep = np.isfinite(labels.cbh_km)
    per_sample = {
        k: v[keep] for k, v in vars(labels).items() if isinstance(v, np.ndarray) and len(v) == len(keep)
    }
    return type(labels)(**{**vars(labels), **per_sample})


def preprocess_frame(raw, data):
    """One raw frame through both stages with the reference backend (scikit-image): (frame, filled, blank)."""
    spec = FrameSpec.of(data)
    x, filled, blank = prepare(raw, spec)
    return (x if blank else equalise_skimage(x, spec.clip_limit)), filled, blank


@pytest.fixture(autouse=True)
def _records_reach_caplog_where_asked(request, monkeypatch):
    """A test that reads caplog sees cloudml_lib's records whatever ran before it: an earlier in-process
    training run or CLI command stops them at the package's own handlers (base/logs.py). pytest 9 lets
    caplog.set_level(logger=) see them anyway, pytest 8 does not: test_timing's hand-edited-run tests failed
    on CI's pytest 8 only."""
    if "caplog" in request.fixturenames:
        monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)


@pytest.fixture
def logs_reach_caplog(monkeypatch, caplog):
    """A training run earlier in the session stops cloudml_lib's records at its own handlers (base/logs.py):
    let them reach caplog again, from INFO up."""
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)
    caplog.set_level(logging.INFO, logger="cloudml_lib")


@pytest.fixture
def shown(monkeypatch):
    """Everything the notebook cells display, in order (widgets, display objects, Markdown text)."""
    from cloudml_lib.colab import drive, live, picker, show, sweeping, training

    out = []
    for module in (show, drive, live, picker, training, sweeping):
        for name in ("show", "show_markdown"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, out.append)
    return out


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A notebook workspace (the CloudML folder) of the test's own, outside smoke mode."""
    from cloudml_lib import colab

    monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
    monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
    return colab.workspace()


def run_cli(
    *args, cwd=None, env: dict | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """`python -m cloudml_lib ARGS` in a process of its own (from the repository, or `cwd`), its output
    captured; no fault injection inherited (CLOUDML_KILL_AT only where `env` sets it)."""
    full = {k: v for k, v in os.environ.items() if k != "CLOUDML_KILL_AT"}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH", "")]))
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cloudml_lib", *map(str, args)],
        cwd=REPO if cwd is None else cwd,
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )


def fit_and_finish(trainer) -> dict:
    """A set-up Trainer's run trained and ended (commands/runs.py's route, in this process): its report."""
    from cloudml_lib.science.finish import finish_run

    trainer.fit()
    return finish_run(trainer.folder, trainer.dist)


@pytest.fixture(scope="module")
def tiny_run(tiny_flights, tmp_path_factory):
    """A tiny run of today's code (one epoch), trained once per test module over its own copy of the tiny
    flights: its folder, its flights' folder and their entries."""
    from cloudml_lib.train import Trainer

    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("tiny_run")
    data = tmp / "flights"
    shutil.copytree(root, data)
    raw = tiny_raw(data, entries, tmp / "cache")
    raw["train"]["epochs"] = 1
    # a whole flight validates (its 25 heights calibrate the intervals; the tiny time blocks hold too few)
    raw["data"]["validation"] = [entries[1]["name"]]
    fit_and_finish(Trainer(build_config(raw), tmp / "run").setup())
    return tmp / "run", data, entries
