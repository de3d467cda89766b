"""The notebook files themselves: valid, stripped, thin, portable, with the metadata CI relies on.
(Running them is `pytest --nbmake colab_setup.ipynb colab_training.ipynb` with CLOUDML_SMOKE=1.)"""

import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).parent.parent
NOTEBOOKS = ["colab_setup.ipynb", "colab_training.ipynb"]
MACHINE_PATH = re.compile(r"(/root/|/home/|/Users/|/tmp/|[A-Z]:\\\\)")


@pytest.fixture(params=NOTEBOOKS)
def notebook(request):
    return request.param, nbformat.read(REPO / request.param, as_version=4)


def test_valid_nbformat(notebook):
    _, nb = notebook
    nbformat.validate(nb)
    assert nb.nbformat == 4


def test_outputs_are_stripped(notebook):
    _, nb = notebook
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_no_machine_paths(notebook):
    name, _ = notebook
    text = (REPO / name).read_text()
    assert not MACHINE_PATH.search(text), MACHINE_PATH.search(text).group(0)


def test_metadata_the_ci_and_colab_rely_on(notebook):
    _, nb = notebook
    assert nb.metadata.kernelspec.name == "python3"  # the kernel nbmake starts
    assert nb.metadata.execution.timeout >= 600  # nbmake's per-cell timeout
    assert nb.metadata.accelerator == "GPU"  # Colab opens it on a GPU runtime


def test_cells_are_thin_and_titled(notebook):
    name, nb = notebook
    cells = nb.cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    for i, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        lines = [x for x in cell.source.splitlines() if x.strip() and not x.strip().startswith("#")]
        if "ensure_installed" in cell.source:  # the install cell: colab/install.py does the work
            assert len(lines) <= 14
            continue
        assert len(lines) <= 2, f"{name} cell {i} holds logic: {cell.source}"
        assert "colab." in cell.source, f"{name} cell {i} does not call the library"
        assert any(c.cell_type == "markdown" for c in cells[max(0, i - 2) : i]), (
            f"{name} cell {i} has no title"
        )


def install_cell(name: str) -> str:
    cells = [
        c.source for c in nbformat.read(REPO / name, as_version=4).cells if "ensure_installed" in c.source
    ]
    assert len(cells) == 1, f"{name}: expected one install cell, found {len(cells)}"
    return cells[0]


def test_both_notebooks_install_the_library_with_the_same_cell():
    """One install cell, the same in both notebooks (a fix to one cannot miss the other), first in each, and
    running colab/install.py from the Drive copy by its path: nothing is installed before it runs."""
    setup, training = (install_cell(n) for n in NOTEBOOKS)
    assert setup == training
    assert "runpy.run_path" in setup and "cloudml_lib/colab/install.py" in setup
    for name in NOTEBOOKS:
        first_code = next(c for c in nbformat.read(REPO / name, as_version=4).cells if c.cell_type == "code")
        assert first_code.source == setup, f"{name}: the install cell is not the first code cell"


def test_the_training_notebook_has_each_section():
    nb = nbformat.read(REPO / "colab_training.ipynb", as_version=4)
    titles = [c.source.splitlines()[0] for c in nb.cells if c.cell_type == "markdown"]
    for section in (
        "## Presets",
        "## Choose a preset",
        "## Train",
        "## Monitor",
        "## Evaluation",
        "## Whole flights (optional)",
        "## Cross-validation (optional)",
        "## Troubleshooting",
        "## TensorBoard",
        "## Compare runs",
        "## Automated test only",
    ):
        assert section in titles
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for call in (
        "colab.preset_picker(",
        "colab.train(",
        "colab.check_smoke_run(",
        "colab.show_status(",
        "colab.show_evaluation(",
        "colab.whole_flights(",
        "colab.export(",
        "colab.crossval(",
        "colab.show_tensorboard(",
        "colab.show_comparison(",
    ):
        assert call in code
    assert titles[-1] == "## Automated test only"  # the smoke test's check comes last, out of the way


def test_real_flights_are_used_when_found_in_the_data_folder(tmp_path, monkeypatch):
    from cloudml_lib import colab
    from cloudml_lib.data.synthetic import make_demo_flights

    monkeypatch.delenv("CLOUDML_SMOKE", raising=False)
    monkeypatch.setenv("CLOUDML_HOME", str(tmp_path / "CloudML"))
    ws = colab.workspace()
    assert colab.uses_demo_data(ws)
    path, over = colab.run_config(ws, "B", epochs=7)
    assert path.name == "demo.yaml" and f"data.dir={ws.demo}" in over and "train.epochs=7" in over
    # flights in the users' layout (one folder per flight, real names), found without any config change
    make_demo_flights(ws.data / "ER2", n_flights=2, frames_per_flight=30, frame_shape=(32, 40))
    assert not colab.uses_demo_data(ws)
    path, over = colab.run_config(ws, "B", epochs=7)
    assert path.name == "colab_full_stable.yaml" and f"data.dir={ws.data}" in over
    assert f"data.cache_dir={ws.cache / 'flights'}" in over  # not Colab: no separate local disk
