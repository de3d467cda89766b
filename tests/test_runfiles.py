"""Run folders read as untrusted (runfiles.py): every run file, fed random, wrong-shaped and hostile
documents, is read without an exception and named as damaged; `compare` and `status` then show everything
else and exit 2 with the file named, never a traceback. Property tests (Hypothesis, derandomized, bounded
examples)."""

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudml_lib.base.runfiles import READERS, RunFiles, numbered_folders
from cloudml_lib.commands import cli

FIXTURE = Path(__file__).parent / "fixtures" / "run_d1cecbe"
PROPERTY = settings(
    max_examples=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TRIAL = {"number": 0, "params": {"model.dropout": 0.1}, "state": "failed", "value": None, "note": "why"}
SUMMARY = {"model": {"r2": {"mean": 0.2, "std": 0.1}, "mae_km": {"mean": 0.3, "std": 0.05}}}
SUMMARY["skill_vs_best_baseline"] = {"mean": 0.1, "std": 0.2}  # as commands/crossval.py writes it
VALID_EXTRA = {
    "trial.json": TRIAL,
    "sweep.json": {"config": {"train": {"epochs": 2}}, "space": {"params": {}}, "trials": 3},
    "crossval.json": {"summary": SUMMARY, "folds": {}, "warnings": [], "verdicts": []},
    "last_run.json": {"preset": "demo", "epochs": 2, "run_name": "r", "heldout": ["a"], "crossval": False},
    "summary.json": {"f1": {"predicted": 5, "frames": 6, "blank": 1, "no_time": 0, "filled_pixels": 0}},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


def make_run(folder: Path) -> Path:
    """A run folder with every file a run writes, from the committed fixture of an earlier release."""
    shutil.copytree(FIXTURE / "stopped", folder)
    for name in ("evaluation.json", "intervals.json"):
        shutil.copy(FIXTURE / "finished" / name, folder / name)
    return folder


def valid_text(name: str, run: Path) -> str:
    if name in VALID_EXTRA:
        return json.dumps(VALID_EXTRA[name])
    if name == "fold.json":
        metrics = json.loads((run / "evaluation.json").read_text())["overall"]
        return json.dumps({"model": metrics, "mean": metrics, "warnings": []})
    return (run / name).read_text()


def mutate(doc, data) -> object:
    """`doc` with one value somewhere in it (or the whole) replaced by a random one."""
    if isinstance(doc, (dict, list)) and doc and data.draw(st.booleans()):
        keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
        key = keys[data.draw(st.integers(0, len(keys) - 1))]
        copy = dict(doc) if isinstance(doc, dict) else list(doc)
        copy[key] = mutate(doc[key], data)
        return copy
    return data.draw(json_values)


def document(name: str, run: Path, data) -> bytes:
    """A wrong document for file `name`: random JSON, the valid file with one value changed, or bytes."""
    kind = data.draw(st.sampled_from(["random", "mutated", "bytes", "truncated"]))
    valid = valid_text(name, run)
    if kind == "random":
        return json.dumps(data.draw(json_values)).encode()
    if kind == "bytes":
        return data.draw(st.binary(max_size=64))
    if kind == "truncated":
        return valid.encode()[: data.draw(st.integers(0, max(0, len(valid) - 1)))]
    if name == "metrics.jsonl":
        lines = valid.splitlines()
        i = data.draw(st.integers(0, len(lines) - 2))
        lines[i] = json.dumps(mutate(json.loads(lines[i]), data))
        return ("\n".join(lines) + "\n").encode()
    parsed = yaml.safe_load(valid) if name == "config.yaml" else json.loads(valid)
    return (
        yaml.safe_dump(mutate(parsed, data)) if name == "config.yaml" else json.dumps(mutate(parsed, data))
    ).encode()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runfiles") / "run")


def test_a_runs_own_files_read_without_damage(run):
    files = RunFiles(run)
    assert files.config()["train"]["epochs"] >= 1
    assert files.evaluation()["overall"]["n"] > 0 and files.run_info()["total_steps"] > 0
    assert files.intervals()["method"] and files.provenance()["flights"]
    assert [r for r in files.metrics() if r["kind"] == "epoch"]
    assert files.damaged == []


@pytest.mark.parametrize("name", sorted(READERS))
@PROPERTY
@given(data=st.data())
def test_every_reader_takes_any_document_and_names_the_damage(run, tmp_path, name, data):
    blob = document(name, run, data)
    folder = tmp_path / "any"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(blob)
    files = RunFiles(folder)
    value = getattr(files, READERS[name])()  # never raises
    for d in files.damaged:
        assert d.startswith(f"damaged: {folder / name} (") and len(d) < 600
    if files.damaged and name != "metrics.jsonl":  # metrics.jsonl keeps its good lines
        assert value in (None, {}, [])
    if name != "metrics.jsonl" and not blob.strip():
        assert files.damaged  # an emptied file is damage, not an empty result


def test_values_that_json_allows_and_a_run_never_writes_are_damage(tmp_path):
    cases = {
        "intervals.json": '{"method": "conformal_absolute", "coverage": 0.9, "n": 2, "source": "x", '
        '"pred_km": [1.0, NaN], "true_km": [1.0, 2.0]}',
        "evaluation.json": '{"overall": {"r2": "high"}, "per_flight": {}, "baseline": {}}',
        "trial.json": '{"number": 1, "params": {}, "state": "exploded"}',
        "run.json": "[1, 2, 3]",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    files = RunFiles(tmp_path)
    assert (
        files.intervals() is None
        and files.evaluation() == {}
        and files.trial() == {}
        and files.run_info() == {}
    )
    said = "\n".join(files.damaged)
    assert "intervals.json (pred_km[1] is nan, expected a finite number)" in said
    assert "trial.json (state is 'exploded', expected one of running, complete, pruned, failed)" in said
    assert "run.json (the file is a list, expected an object)" in said


def test_a_yaml_alias_bomb_in_a_config_is_refused_without_walking_it(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp_path / "config.yaml").write_text("train:\n" + "\n".join("  " + line for line in lines) + "\n")
    t0 = time.perf_counter()
    files = RunFiles(tmp_path)
    assert files.config() is None
    assert time.perf_counter() - t0 < 30  # 9**9 values were never expanded (a guard, not a benchmark)
    assert len(files.damaged) == 1 and len(files.damaged[0]) < 600 and "config.yaml" in files.damaged[0]


def test_a_date_in_a_config_is_text_and_a_symlink_is_not_followed(tmp_path):
    (tmp_path / "config.yaml").write_text("data:\n  flights: [2023-03-02]\ntrain:\n  epochs: 2\n")
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(TRIAL))
    (tmp_path / "trial.json").symlink_to(outside)
    files = RunFiles(tmp_path)
    assert files.config() == {"data": {"flights": ["2023-03-02"]}, "train": {"epochs": 2}}
    assert files.trial() == {} and "trial.json (a symbolic link" in files.damaged[0]


def test_a_cut_last_line_of_metrics_is_a_kill_and_a_bad_line_before_it_is_damage(run, tmp_path):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:10])
    files = RunFiles(tmp_path)
    assert len(files.metrics()) == len(lines) and files.damaged == []
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], "[1, 2]", "{oops", *lines[1:]]) + "\n")
    assert len(files.metrics()) == len(lines)
    assert "line 2 is a list, expected an object; line 3 is not JSON" in files.damaged[0]


def test_only_plain_numbers_name_trial_folders(tmp_path):
    for name in ("0", "2", "10", "²", "1a", "-1", "٣"):
        (tmp_path / name).mkdir()
    assert [p.name for p in numbered_folders(tmp_path)] == ["0", "2", "10"]


def run_main(argv, capsys) -> tuple[int, str, str]:
    """A command run in-process, as `python -m cloudml_lib` would (argparse's exit caught)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A run, a sweep with one trial and a cross-validation with one fold, every file valid."""
    root = tmp_path_factory.mktemp("folders")
    run = make_run(root / "run")
    sweep = root / "sweep"
    make_run(sweep / "trials" / "0")
    (sweep / "trials" / "0" / "trial.json").write_text(valid_text("trial.json", run))
    (sweep / "sweep.json").write_text(valid_text("sweep.json", run))
    cv = root / "cv"
    make_run(cv / "folds" / "f1" / "model")
    (cv / "folds" / "f1" / "fold.json").write_text(valid_text("fold.json", run))
    (cv / "crossval.json").write_text(valid_text("crossval.json", run))
    return {"run": run, "sweep": sweep, "cv": cv}


# (folder, file in it): every file compare or status reads
DAMAGEABLE = [
    ("run", "config.yaml"),
    ("run", "evaluation.json"),
    ("run", "run.json"),
    ("run", "metrics.jsonl"),
    ("sweep", "trials/0/trial.json"),
    ("sweep", "trials/0/config.yaml"),
    ("cv", "crossval.json"),
    ("cv", "folds/f1/model/evaluation.json"),
]


@pytest.mark.parametrize("where,name", DAMAGEABLE, ids=[f"{w}-{n}" for w, n in DAMAGEABLE])
@PROPERTY
@given(data=st.data())
@pytest.mark.slow
def test_compare_and_status_show_what_they_can_and_name_the_damaged_file(folders, capsys, where, name, data):
    folder = folders[where]
    path = folder / name
    valid = path.read_bytes()
    try:
        path.write_bytes(document(Path(name).name, folders["run"], data))
        for command in ("compare", "status"):
            code, out, err = run_main([command, str(folder)], capsys)
            assert code in (0, 2), (command, code, err)
            assert "Traceback" not in out + err
            if code == 2:
                assert err.startswith("error: ") and len(err) < 2000
                if "damaged:" in err:
                    assert str(path) in out + err and out.strip()  # what could be read is still shown
    finally:
        path.write_bytes(valid)


def test_a_damaged_file_is_named_and_the_rest_of_the_table_stays(folders, capsys):
    path = folders["run"] / "evaluation.json"
    valid = path.read_text()
    path.write_text('{"overall": {"r2": NaN}}')
    try:
        code, out, err = run_main(["compare", str(folders["run"]), str(folders["cv"])], capsys)
    finally:
        path.write_text(valid)
    assert code == 2 and f"damaged: {path} (" in out and f"{path}" in err
    cv_row = next(line for line in out.splitlines() if line.startswith(f"| {folders['cv']}"))
    assert "0.2" in cv_row  # the cross-validation's mean R2 is still shown


def test_an_empty_sweep_says_so(tmp_path, capsys):
    (tmp_path / "sweep.json").write_text(json.dumps(VALID_EXTRA["sweep.json"]))
    code, out, _ = run_main(["compare", str(tmp_path)], capsys)
    assert code == 0 and "no trial started yet" in out


def test_finite_numbers_only_where_a_run_writes_them():
    from cloudml_lib.base.runfiles import NUM, OPT_NUM

    assert NUM.problem(math.inf, "x") and NUM.problem(True, "x") and OPT_NUM.problem(None, "x") is None


def test_the_baselines_a_report_may_name_are_the_science_layers():
    """runfiles' HEIGHT_BASELINES (the base layer cannot import science) is baselines.BASELINES, in order:
    a baseline added there and not here would make every new report read as damaged."""
    from cloudml_lib.base.runfiles import HEIGHT_BASELINES
    from cloudml_lib.science.baselines import BASELINES

    assert HEIGHT_BASELINES == BASELINES
