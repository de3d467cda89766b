"""The stated Python API (cloudml_lib/commands/api.py, importable from the package top): what a scientist's
own notebook calls. A tiny run trained through it, loaded, reported, predicted into an xarray Dataset equal
to the NetCDF file `predict` writes, and the user's mistakes named."""

import inspect
import json
import shutil
import subprocess
import sys

import pytest
import xarray as xr
from conftest import REPO

import cloudml_lib as cml
from cloudml_lib.science.predict import predict_flights

API = ("Run", "load_run", "fit", "evaluate", "predict_flight", "adapt", "read_report", "export")


def test_the_api_is_at_the_package_top_documented_and_import_stays_light():
    assert set(API) <= set(cml.__all__) and set(API) <= set(dir(cml))
    import cloudml_lib.train  # noqa: F401  (a subpackage's name would hide an API function of that name)

    for name in API:
        assert not inspect.ismodule(getattr(cml, name)), name
        doc = inspect.getdoc(getattr(cml, name))
        assert doc and len(doc.splitlines()) >= 3, name
    for name in ("load_run", "fit", "evaluate", "predict_flight", "read_report", "export"):
        assert "Returns\n-------" in inspect.getdoc(getattr(cml, name)), f"{name}: numpydoc Returns"
    r = subprocess.run(
        [sys.executable, "-c", "import sys, cloudml_lib; print('torch' in sys.modules)"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == "False", r.stderr  # the CLI and `import cloudml_lib` start without torch
    with pytest.raises(AttributeError, match="no attribute 'predict_flights'"):
        cml.predict_flights  # noqa: B018  (internal: not re-exported)


@pytest.fixture(scope="module")
def api_run(shared_tiny_run, tmp_path_factory):
    """The session's tiny run, trained through cml.fit from a YAML file (one epoch; a whole flight
    validates: conftest.shared_tiny_run), copied for this module (cml.evaluate writes into it)."""
    run, _, entries = shared_tiny_run
    tmp = tmp_path_factory.mktemp("api")
    shutil.copytree(run, tmp / "run")
    return cml.load_run(tmp / "run"), entries, tmp


def test_a_run_trained_through_the_api_is_finished_and_reported_as_data(api_run):
    run, entries, _ = api_run
    assert isinstance(run, cml.Run) and run.state == "finished"
    report = run.report()
    assert report == json.loads((run.path / "evaluation.json").read_text())
    assert set(report["per_flight"]) == {entries[2]["name"]} and -10 < report["overall"]["r2"] <= 1
    assert report["verdict"]  # in words, whoever wins
    history = run.history()
    assert [h["epoch"] for h in history] == [1] and history[0]["mae_km"] >= 0
    again = cml.load_run(str(run.path))
    assert again == run and cml.read_report(again) == report
    assert cml.evaluate(run)["overall"] == pytest.approx(report["overall"])  # the same model, scored again


@pytest.mark.slow
def test_predict_flight_gives_the_netcdf_files_dataset_and_writes_nothing(api_run, tmp_path):
    run, entries, _ = api_run
    name = entries[2]["name"]
    before = sorted(p.relative_to(run.path) for p in run.path.rglob("*"))
    ds = run.predict(name)
    assert sorted(p.relative_to(run.path) for p in run.path.rglob("*")) == before
    (nc,) = predict_flights(run.path, [name], out_dir=tmp_path / "out")
    with xr.open_dataset(nc, engine="h5netcdf") as written:
        xr.testing.assert_identical(undated(ds), undated(written.load()))
    assert ds.cloud_base_height.attrs["units"] == "km"
    assert ds.attrs["flight_role"].startswith("a test flight of this run")
    assert ds.sizes["time"] > 100 and float(ds.cloud_base_height.max()) < 20
    default = cml.predict_flight(run)  # the run's first test flight
    xr.testing.assert_identical(undated(default), undated(ds))


def undated(ds):
    """A product without the moment it was made (ACDD's date_created and history): two writes a second apart
    differ there and nowhere else."""
    assert ds.attrs["history"].startswith(ds.attrs["date_created"])
    out = ds.copy()
    out.attrs = {k: v for k, v in ds.attrs.items() if k not in ("date_created", "history")}
    return out


def test_the_api_names_the_users_mistakes(api_run, tmp_path):
    run, _, tmp = api_run
    with pytest.raises(cml.CloudMLError, match="no such folder"):
        cml.load_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(cml.CloudMLError, match="holds no run"):
        cml.load_run(tmp_path / "empty")
    with pytest.raises(cml.CloudMLError, match="no-such-flight"):
        run.predict("no-such-flight")
    with pytest.raises(ValueError, match="cloud_flag='nope': expected 'model' or 'bt_threshold'"):
        run.predict(cloud_flag="nope")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "config.yaml").write_text((run.path / "config.yaml").read_text())
    with pytest.raises(cml.CloudMLError, match="has no valid evaluation.json"):
        cml.read_report(stopped)


@pytest.mark.parametrize(
    "call, said",
    [
        (lambda run, d: cml.load_run(123), "path=123: expected a folder's path"),
        (lambda run, d: cml.fit({"train": {}}, d), "config={'train': {}}: expected a folder's path"),
        (lambda run, d: cml.fit("configs/demo.yaml", None), "run_dir=None: expected a folder's path"),
        (lambda run, d: cml.fit("configs/demo.yaml", d, resume=1), "resume=1: expected 'auto', 'never'"),
        (lambda run, d: cml.evaluate(run, data_dir=5), "data_dir=5: expected a folder's path"),
        (lambda run, d: cml.predict_flight(run, flight=3), "flight=3: expected a flight's name"),
        (lambda run, d: cml.adapt(run, labels="10"), "labels='10': expected a list of whole numbers"),
        (lambda run, d: cml.export(run, out=1), "out=1: expected a folder's path"),
        (lambda run, d: cml.read_report(2.5), "run=2.5: expected a folder's path"),
    ],
)
def test_a_wrong_type_is_a_type_error_naming_the_argument_before_anything_is_written(
    api_run, tmp_path, call, said
):
    run, _, _ = api_run
    before = sorted(p.relative_to(run.path) for p in run.path.rglob("*"))
    with pytest.raises(TypeError) as e:
        call(run, tmp_path / "new_run")
    assert isinstance(e.value, cml.CloudMLError) and said in str(e.value) and "--" not in str(e.value)
    assert (
        not (tmp_path / "new_run").exists()
        and sorted(p.relative_to(run.path) for p in run.path.rglob("*")) == before
    )


def test_a_config_changed_after_loading_is_checked_again_by_fit(tmp_path):
    cfg = cml.load_config(REPO / "configs" / "demo.yaml")
    cfg.train.epochs = "2"
    with pytest.raises(cml.CloudMLError, match="train.epochs: expected an integer, got '2'"):
        cml.fit(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written, no train.log


def api_reference() -> str:
    """docs/reference/python-api.md's reference part, drawn from the API's signatures and docstrings."""
    parts = []
    for name in API:
        obj = getattr(cml, name)
        if inspect.isclass(obj):
            members = [m for m in vars(obj) if not m.startswith("_")]
            head = f"### `cml.{name}`\n\nAttributes and methods: {', '.join(f'`{m}`' for m in members)}."
        else:
            head = f"### `cml.{name}{inspect.signature(obj)}`"
        parts.append(f"{head}\n\n```text\n{inspect.getdoc(obj)}\n```")
    return "\n\n".join(parts)


PAGE = REPO / "docs" / "reference" / "python-api.md"
MARK = "<!-- generated: tests/test_api.py api_reference() -->\n"


def test_the_api_page_is_the_apis_docstrings():
    text = PAGE.read_text()
    assert MARK in text, f"{PAGE.name} lost its generated block's marker"
    shown = text.split(MARK, 1)[1].strip()
    assert shown == api_reference(), (
        "docs/reference/python-api.md is stale: replace what follows its marker with tests/test_api.py's "
        "api_reference()"
    )


def python_blocks(page) -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def test_the_api_pages_examples_run():
    """The page's first example is README's (run on the demo by test_demo.py); the config one runs here."""
    first, config = python_blocks(PAGE)
    assert first == python_blocks(REPO / "README.md")[0]
    r = subprocess.run([sys.executable, "-c", config], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("3 ") and "did you mean 'train.epochs'" in r.stdout
