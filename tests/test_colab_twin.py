"""The Colab path, run the way Colab runs it (the "Colab twin"): a fresh virtual environment holding only
what Colab preinstalls, a stub google.colab whose drive.mount links a folder standing in for Google Drive,
the repository copied to MyDrive/CloudML/code on it, and the notebooks' kernel working in a folder outside
the checkout (Colab's /content, moved with CLOUDML_CONTENT), with no environment's bin on its PATH.

- the wheel, installed with its dependencies, runs every command from another folder (--preset, the
  packaged sweep space, absolute data paths, a moved-data error naming --data-dir), its run on shorter
  demo flights written by make-demo-data;
- both notebooks Run all in smoke mode with no cell error, the first cell installing from the Drive copy,
  the smoke self-check passing, TensorBoard started from the kernel's own environment;
- the Drive copy changed: the same kernel is told to restart, a fresh one imports the change, and a module
  deleted from the copy is gone from the installed package; nothing is ever written into the copy;
- all of it on Colab's versions (constraints/colab.txt: Python 3.13, torch 2.11.0, numpy 2.1.3, IPython 7.34,
  ipykernel 6.17.1, ipywidgets 7.7.1): printed when the environment is built, and checked again after each
  test installed CloudML into it, so that neither a newer release nor CloudML's own install drifts silently.

Slow: the environment (~5 GB: PyPI's torch 2.11.0 pulls its CUDA wheels) is built in the background from the
session's start (conftest.py: under a minute on a quiet 2-core machine with uv, a dev dependency; about 2
with pip, which it falls back to), or kept from an earlier session (install_helpers.TwinEnvironment);
these tests run last and took about 3 minutes together (benchmarks/results/suite.json).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from conftest import TWIN_GROUP
from install_helpers import (
    COLAB_PYTHON,
    NOT_ON_COLAB,
    REPO,
    TwinEnvironment,
    colab_versions,
    copy_checkout,
    drifted_from_colab,
    minimal_path,
    pip,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(TWIN_GROUP)]  # one worker: one environment
KERNEL = "cloudml-colab-twin"


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    import conftest

    root = tmp_path_factory.mktemp("twin")
    # Colab's Python where this machine has it (else this one, said below), Colab's versions of the packages:
    # built in the background since the session started (conftest), or kept from an earlier session as built
    environment = conftest.TWIN or TwinEnvironment(root)
    python = environment.python()
    versions = colab_versions(python)
    print(  # shown with -s, and in a failure's captured output
        "Colab twin: "
        + ", ".join(f"{name} {v}" for name, v in versions.items())
        + ("" if versions["python"].startswith(COLAB_PYTHON + ".") else f" (no Python {COLAB_PYTHON} here)")
        + f"; its environment {environment.how}"
    )
    assert not drifted_from_colab(versions), f"the twin is not Colab: {drifted_from_colab(versions)}"
    missing = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])",
            *NOT_ON_COLAB,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert missing.stdout.strip() == "[]", f"the twin holds packages Colab lacks: {missing.stdout}"
    drive, content = root / "gdrive", root / "content"
    code = copy_checkout(drive / "MyDrive" / "CloudML" / "code")
    content.mkdir()
    kernels = root / "jupyter" / "kernels" / KERNEL
    kernels.mkdir(parents=True)
    env = {
        "CLOUDML_SMOKE": "1",
        "CLOUDML_CONTENT": str(content),
        "CLOUDML_TWIN_DRIVE": str(drive),
        "PATH": minimal_path(),
    }
    (kernels / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Colab twin",
                "language": "python",
                "env": env,
            }
        )
    )
    assert shutil.which("tensorboard", path=env["PATH"]) is None, (
        "the kernel's PATH must not hold tensorboard"
    )
    yield SimpleNamespace(
        root=root, python=python, drive=drive, content=content, code=code, jupyter=root / "jupyter"
    )
    environment.reset()  # what the tests installed (CloudML, mapie) removed: the environment as built


@pytest.fixture
def kernel_env(twin, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(twin.jupyter))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the kernel sees the twin's packages only
    monkeypatch.delenv("TENSORBOARD_BINARY", raising=False)
    return twin


def client_for(nb, twin, allow_errors: bool = False):
    from nbclient import NotebookClient

    return NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=900,
        startup_timeout=180,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(twin.content)}},
    )


def run_notebook(name: str, twin, extra: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    """Run all, as Colab's Runtime > Run all; a cell error fails the test with the cell and its output."""
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(REPO / name, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(src) for src in extra]
    try:
        client_for(nb, twin).execute()
    except CellExecutionError as e:
        pytest.fail(f"{name} failed in the Colab twin:\n{str(e)[-6000:]}")
    return nb


def text_of(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(
            o.get("text", "")
            if o.output_type == "stream"
            else "\n".join(o.get("traceback", [])) + o.get("evalue", "")
            if o.output_type == "error"
            else str(o.get("data", {}).get("text/plain", ""))
        )
    return "\n".join(out)


def drive_copy(twin) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(twin.code)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in twin.code.rglob("*")
        if p.is_file()
    }


def cli(twin, *args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CLOUDML_SMOKE")}
    return subprocess.run(
        [str(twin.python), "-m", "cloudml_lib", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# what preprocessing.json's "load" says a colleague does, with plain torch, at frame sizes odd and even
COLLEAGUE_LOADS = """
import json, safetensors.torch, torch
spec = json.load(open("preprocessing.json"))
program = torch.export.load("model.pt2").module()
program.load_state_dict(safetensors.torch.load_file("weights.safetensors"))
t, s = spec["inputs"]["window"]["frames"], len(spec["inputs"]["scalars"]["order"])
sizes = []
for rows, cols in ((17, 23), (55, 101)):
    heights = program(torch.zeros(2, t, rows, cols), torch.zeros(2, s))[0]
    assert heights.shape == (2,) and torch.isfinite(heights).all()
    sizes.append(f"{rows}x{cols}")
print("frame sizes:", " ".join(sizes))
"""


def test_the_installed_wheel_runs_every_command_away_from_the_checkout(twin, wheel):
    pip(twin.python, str(wheel))  # with its dependencies (mapie from the index); icartt is not one
    work, other = twin.root / "elsewhere", twin.root / "third"
    work.mkdir()
    other.mkdir()
    r = cli(twin, "labels", "--preset", "demo", cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "792 labels in 5 flights" in r.stdout and (work / ".cloudml_demo" / "flights_v4").is_dir()
    r = cli(twin, "diagnose", "--preset", "demo", "--json", cwd=work)
    assert r.returncode == 0 and json.loads(r.stdout)["recommendations"], r.stderr[-2000:]
    # the run trains on shorter demo flights (make-demo-data): what the commands do is the point, not the size
    r = cli(twin, "make-demo-data", "--out", "short", "--flights", "3", "--frames", "400", cwd=work)
    assert r.returncode == 0 and "wrote 3 flights" in r.stdout, r.stderr[-2000:]
    r = cli(
        twin, "train", "--preset", "demo", "--data-dir", "short", "--set", "train.epochs=1",
        "--run-dir", "runs/demo", cwd=work,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    stored = (work / "runs" / "demo" / "config.yaml").read_text()
    assert f"dir: {work / 'short'}" in stored  # recorded absolute
    r = cli(twin, "evaluate", "--run-dir", work / "runs" / "demo", "--json", cwd=other)
    assert r.returncode == 0 and json.loads(r.stdout)["overall"]["n"] > 20, r.stderr[-2000:]
    (work / "short").rename(work / "moved")
    r = cli(twin, "evaluate", "--run-dir", work / "runs" / "demo", cwd=other)
    assert r.returncode == 2 and "--data-dir" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = cli(
        twin,
        "evaluate",
        "--run-dir",
        work / "runs" / "demo",
        "--data-dir",
        work / "moved",
        "--json",
        cwd=other,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # export on Colab's torch (2.11 failed at a free frame size), loaded there with plain torch at any size
    r = cli(twin, "export", "--run-dir", work / "runs" / "demo", "--out", other / "export", cwd=other)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    loaded = subprocess.run(
        [str(twin.python), "-c", COLLEAGUE_LOADS],
        cwd=other / "export",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert loaded.returncode == 0 and "frame sizes: 17x23 55x101" in loaded.stdout, loaded.stderr[-2000:]
    r = cli(twin, "sweep", "--preset", "demo", "--trials", "1", "--run-dir", "sweep", cwd=other)
    assert r.returncode == 2 and "pip install 'optuna>=4.0'" in r.stderr, r.stderr[-2000:]  # not on Colab
    assert not (other / "sweep").exists() and not (other / ".cloudml_demo").exists()  # refused before writing
    r = cli(twin, "train", "--config", "configs/demo.yaml", cwd=other)
    assert r.returncode == 2 and "use --preset demo" in r.stderr, r.stderr[-2000:]
    assert not drifted_from_colab(colab_versions(twin.python)), "installing CloudML changed Colab's packages"


def test_both_notebooks_run_all_in_the_colab_twin(kernel_env):
    twin = kernel_env
    before = drive_copy(twin)
    setup = run_notebook("colab_setup.ipynb", twin)
    first = text_of(next(c for c in setup.cells if c.cell_type == "code"))
    drive_code = twin.content / "drive" / "MyDrive" / "CloudML" / "code"
    assert "Installing CloudML" in first and f"of {drive_code}, installed" in first, first
    assert "Smoke test: setup checks passed." in text_of(setup.cells[-1])
    training = run_notebook("colab_training.ipynb", twin)
    first = text_of(next(c for c in training.cells if c.cell_type == "code"))
    assert "Installing" not in first and f"of {drive_code}, installed" in first, first  # already up to date
    last = text_of(training.cells[-1])
    assert "Smoke test passed" in last and "TensorBoard served" in last, last
    assert drive_copy(twin) == before, "the install wrote into the Drive copy"
    assert not (twin.code / "build").exists() and not list(twin.code.glob("*.egg-info"))
    assert not drifted_from_colab(colab_versions(twin.python)), "the install cell changed Colab's packages"


def test_a_changed_drive_copy_is_what_the_next_run_imports(kernel_env):
    twin = kernel_env
    install = next(
        c for c in nbformat.read(REPO / "colab_setup.ipynb", as_version=4).cells if c.cell_type == "code"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(install.source) for _ in range(2)])
    marker = twin.code / "cloudml_lib" / "twin_marker.py"
    client = client_for(nb, twin, allow_errors=True)
    try:
        with client.setup_kernel():
            client.execute_cell(nb.cells[0], 0)  # installs if needed, imports the library
            assert "error" not in {o.output_type for o in nb.cells[0].outputs}, text_of(nb.cells[0])
            marker.write_text('"""Written by the Colab twin test."""\nVALUE = "changed on Drive"\n')
            client.execute_cell(nb.cells[1], 1)  # the same kernel, the copy changed
        said = text_of(nb.cells[1])
        assert "Installing CloudML" in said and "Runtime > Restart session" in said, said
        # a restarted session: its first cell (the rest of the notebook, run by the test above, imports the
        # same installed package)
        check = "import cloudml_lib.twin_marker as m; print('marker:', m.VALUE)"
        fresh = run_first_cell(install, twin, check)
        assert "Installing" not in text_of(fresh.cells[0]), text_of(
            fresh.cells[0]
        )  # the restart's install stands
        assert "marker: changed on Drive" in text_of(fresh.cells[-1])
    finally:
        marker.unlink(missing_ok=True)
    gone = (
        "import importlib.util as u; "
        "print('marker installed:', u.find_spec('cloudml_lib.twin_marker') is not None)"
    )
    again = run_first_cell(install, twin, gone)
    assert "Installing" in text_of(again.cells[0]), text_of(again.cells[0])
    assert "marker installed: False" in text_of(
        again.cells[-1]
    )  # a deleted module is not installed from build/


def run_first_cell(install, twin, check: str) -> nbformat.NotebookNode:
    """A fresh kernel (Runtime > Restart session) running the notebook's first cell, then `check`."""
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(install.source), nbformat.v4.new_code_cell(check)]
    )
    try:
        client_for(nb, twin).execute()
    except CellExecutionError as e:
        pytest.fail(f"the first cell failed in the Colab twin:\n{str(e)[-6000:]}")
    return nb
