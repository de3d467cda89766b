"""Every structured file the kit reads besides a run's own files (test_runfiles.py covers those), over the
whole family: the run lock, a checkpoint's manifest, the hash memo, a flight cache's meta.json, the folder
marker, a sweep's journal, config files, --set values and --calibration's intervals. Each is fed the
hostile documents of the adversarial pass (nesting 20,000 deep: it found 100,000, which fails the same way,
past Python's recursion limit; 5,000-digit integers, the wrong type at the top) and random JSON
(Hypothesis), and answers with its documented outcome: a value of the right shape, "damaged" (None, {}, a
reason) or a message naming the file. Never another exception.

And no file opened by `train` or `status` can hang them: a FIFO in place of the lock, the metrics, the log
or a run file is refused in a process of its own with a time limit (a regression fails one test, not CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import yaml
from conftest import run_cli, tiny_raw
from hypothesis import given
from hypothesis import strategies as st
from test_runfiles import PROPERTY, json_values

from cloudml_lib.base.config import load_config
from cloudml_lib.base.errors import CloudMLError, ConfigError
from cloudml_lib.base.ownership import MARKER, marker_kind
from cloudml_lib.commands.study import journal_problem
from cloudml_lib.commands.sweep import adopt_sweep
from cloudml_lib.core.run.checkpoint import COMMITTED, META, verify
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runlock import read_lock
from cloudml_lib.data.cache import _try_open
from cloudml_lib.data.hashing import read_memo
from cloudml_lib.science.predict import _calibration

HOSTILE = {
    "deep list": "[" * 20_000,
    "deep object": '{"a": ' * 10_000,
    "5000 digits": "1" * 5000,
    "5000 digits inside": '{"pid": ' + "7" * 5000 + ', "host": "h", "kind": "run", "step": 1}',
    "a list": "[1, 2]",
    "an empty list": "[]",
    "a list of one": "[1]",
    "text": '"run"',
    "null": "null",
    "infinity": "1e999",
    "empty": "",
    "not UTF-8": b"\xff\xfe{}",
    "a lone surrogate": '{"kind": "\\ud800", "host": "\\ud800", "pid": 1}',
}
HOSTILE_IDS = list(HOSTILE)


def _bytes(doc) -> bytes:
    return doc if isinstance(doc, bytes) else doc.encode()


def _folder_readers(tmp_path):
    """name -> (file to write, call returning the reader's outcome, check of a readable outcome)."""
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / COMMITTED).write_text("")
    (ckpt / "state.pt").write_bytes(b"x" * 10)
    cache = tmp_path / "cache" / "01Mar25-abc"
    cache.mkdir(parents=True, exist_ok=True)
    sweep = tmp_path / "sweep"
    sweep.mkdir(exist_ok=True)
    return {
        # a damaged lock is no holder: the run judges it stale (runlock.RunLock)
        "lock": (tmp_path / ".lock", lambda: read_lock(tmp_path / ".lock"), _is_lock),
        # a damaged manifest rejects the checkpoint, with the reason
        "checkpoint meta.json": (ckpt / META, lambda: verify(ckpt), lambda v: isinstance(v, str)),
        # a damaged memo is rebuilt: it only saves time
        "hash memo": (
            tmp_path / "file_sha256.json",
            lambda: read_memo(tmp_path / "file_sha256.json"),
            lambda v: isinstance(v, dict) and all(isinstance(x, str) and len(x) == 64 for x in v.values()),
        ),
        # a damaged flight cache is rebuilt (None: not usable)
        "cache meta.json": (cache / "meta.json", lambda: _try_open(cache), lambda v: v is None),
        # a sweep folder of an earlier release is proved by its study.journal naming its study
        "study.journal": (sweep / "study.journal", lambda: adopt_sweep(sweep), lambda v: v is None),
    }


def _is_lock(v) -> bool:
    return v is None or (isinstance(v["host"], str) and type(v["pid"]) is int)


@pytest.mark.parametrize("doc", HOSTILE.values(), ids=HOSTILE_IDS)
def test_every_reader_turns_a_hostile_document_into_its_damaged_outcome(doc, tmp_path):
    for name, (path, read, ok) in _folder_readers(tmp_path).items():
        path.write_bytes(_bytes(doc))
        assert ok(read()), name
    (tmp_path / "marked").mkdir()
    (tmp_path / "marked" / MARKER).write_bytes(_bytes(doc))
    with pytest.raises(CloudMLError, match="was not written by CloudML|is not a marker CloudML wrote"):
        marker_kind(tmp_path / "marked")
    assert journal_problem(_bytes(doc) + b"\n").startswith("damaged") or not doc


@pytest.mark.parametrize("name", ["lock", "checkpoint meta.json", "hash memo", "cache meta.json"])
@PROPERTY
@given(data=st.data())
def test_every_reader_takes_any_json(name, tmp_path, data):
    path, read, ok = _folder_readers(tmp_path)[name]
    path.write_text(json.dumps(data.draw(json_values)))
    assert ok(read())


@PROPERTY
@given(doc=json_values)
def test_a_marker_of_any_other_content_is_refused_by_name(tmp_path, doc):
    (tmp_path / MARKER).write_text(json.dumps(doc))
    try:
        kind = marker_kind(tmp_path)
    except CloudMLError as e:
        assert str(tmp_path / MARKER) in str(e) and "Nothing was written" in str(e)
    else:
        assert isinstance(kind, str) and doc["kind"] == kind


TEXTUAL = {k: v for k, v in HOSTILE.items() if isinstance(v, str) and v}


@pytest.mark.parametrize("doc", TEXTUAL.values(), ids=list(TEXTUAL))
def test_a_config_file_or_a_set_value_that_is_hostile_is_a_config_error_naming_it(doc, tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text(f"train:\n  learning_rate: {doc}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "learning_rate" in str(e.value) or str(path) in str(e.value)
    path.write_text(doc)
    if doc == "null":  # an empty config: the defaults
        assert load_config(path).train.learning_rate > 0
    else:
        with pytest.raises(ConfigError, match="my.yaml"):
            load_config(path)
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(None, [f"train.learning_rate={doc}"])


INTERVALS = (
    '{"method": "conformal_absolute", "coverage": %s, "n": 0, "source": "x", "pred_km": [], "true_km": []}'
)


@pytest.mark.parametrize(
    "text, why",
    [
        ("[" * 20_000, "nested too deep"),
        (INTERVALS % "0.9", "0 usable heights"),
        (INTERVALS % "2.0", "coverage 2.0 is not between 0.5 and 1"),
        (INTERVALS.replace('"n": 0', '"n": ' + "9" * 5000) % "0.9", "not JSON"),
    ],
    ids=["deep", "empty lists", "coverage 2.0", "5000 digits"],
)
def test_a_calibration_given_with_intervals_that_do_not_read_is_refused_by_name(text, why, tmp_path):
    (tmp_path / "cv").mkdir()
    (tmp_path / "cv" / "intervals.json").write_text(text)
    with pytest.raises(CloudMLError, match=why) as e:
        _calibration(RunFolder(tmp_path / "run"), tmp_path / "cv", "0" * 64)
    assert str(tmp_path / "cv" / "intervals.json") in str(e.value) and "--calibration" in str(e.value)


# ------------------------------------------------------------------------------------ never a hang
FIFO_LIMIT_S = 120  # a command refusing a FIFO takes seconds; one waiting on it would take for ever


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "train.log", "run.json", "evaluation.json"])
@pytest.mark.slow
def test_a_fifo_where_a_run_file_should_be_never_hangs_train_or_status(name, tiny_run, tmp_path):
    run_dir, data, entries = tiny_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    cfg = tmp_path / "more.yaml"
    raw = tiny_raw(data, entries, tmp_path / "cache")
    raw["train"]["epochs"] = 2  # one more epoch: train opens every file of the run again
    cfg.write_text(yaml.safe_dump(raw))
    if (run / name).exists():
        (run / name).unlink()
    os.mkfifo(run / name)
    for argv in (["status", run], ["train", "--config", cfg, "--run-dir", run]):
        try:
            r = run_cli(*argv, timeout=FIFO_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{argv[0]} hung on a FIFO named {name}")
        said = r.stdout + r.stderr
        assert "Traceback" not in said, said
        if argv[0] == "train":
            assert r.returncode == 2 and f"{run / name}" in said and "FIFO" in said, said
    assert (run / name).is_fifo()  # left where it was: not CloudML's to remove


def test_a_flight_file_that_is_a_fifo_never_hangs_predict(tiny_run, tmp_path):
    """`predict` opened the IR file blocking: a FIFO in its place waited for ever (labels and train refused
    it). Refused, named, and left where it was."""
    run_dir, data, entries = tiny_run
    flights = tmp_path / "flights"
    shutil.copytree(data, flights)
    ir = flights / entries[0]["ir_file"]
    ir.unlink()
    os.mkfifo(ir)
    try:
        r = run_cli("predict", "--run-dir", run_dir, "--data-dir", flights, "--flights", entries[0]["name"],
                    "--out", tmp_path / "out", timeout=FIFO_LIMIT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("predict hung on a FIFO in place of an IR file")
    said = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in said, said
    assert f"{ir} is a FIFO" in said and "regular file" in said, said
    assert ir.is_fifo()


@pytest.mark.parametrize("how", ["external_link", "external_group", "broken_link", "virtual"])
def test_a_value_stored_in_another_file_is_refused_by_name(tmp_path, how):
    """An HDF5 external link that could not be opened gave a KeyError traceback; one that could, or a virtual
    dataset, read data from any file (outside the data folder too) without a word."""
    import h5py

    from cloudml_lib.base.errors import DataError
    from cloudml_lib.data.hdf5 import dataset, open_h5

    other = tmp_path / "elsewhere.h5"
    with h5py.File(other, "w") as f:
        f["Signal"] = np.zeros((2, 3, 4), np.uint16)
    path = tmp_path / "ir.h5"
    with h5py.File(path, "w") as f:
        if how == "external_link":
            f["Product/Signal"] = h5py.ExternalLink(str(other), "/Signal")
        elif how == "external_group":
            f["Product"] = h5py.ExternalLink(str(other), "/")
        elif how == "broken_link":
            f["Product/Signal"] = h5py.ExternalLink(str(tmp_path / "gone.h5"), "/Signal")
        else:
            layout = h5py.VirtualLayout(shape=(2, 3, 4), dtype=np.uint16)
            layout[:] = h5py.VirtualSource(str(other), "Signal", shape=(2, 3, 4))
            f.create_group("Product").create_virtual_dataset("Signal", layout)
    with open_h5(path, "F1") as f, pytest.raises(DataError) as e:
        dataset(f, "Product/Signal", "F1", "ir_signal")
    said = str(e.value)
    assert f"flight F1: {path}" in said and "data.keys.ir_signal" in said, said
    assert ("virtual dataset" if how == "virtual" else "external link") in said, said


def test_yaml_nested_past_the_bound_is_refused_before_parsing_and_below_it_read():
    """A hostile depth is refused at once (PyYAML's scan of it took a second per file, quadratic in depth);
    a document nested up to the bound is still read."""
    from cloudml_lib.base.yamlfile import MAX_FLOW_DEPTH, loads

    deep = "[" * MAX_FLOW_DEPTH + "1" + "]" * MAX_FLOW_DEPTH
    value = loads(deep)
    for _ in range(MAX_FLOW_DEPTH - 1):
        value = value[0]
    assert value == [1]
    with pytest.raises(RecursionError, match=f"nested over {MAX_FLOW_DEPTH} deep"):
        loads("[" * (MAX_FLOW_DEPTH + 1), "x.yaml")
