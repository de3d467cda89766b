"""The code's map stays readable: the layers of pyproject.toml's import-linter contracts hold (lazy imports
included), ruff finds nothing and the code is as ruff formats it (line length 110), no function is over 60
lines, no import cycle, and every module opens with a docstring saying what it owns. (Module line caps were
dropped: a module is split where ownership divides.)"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "cloudml_lib"
MAX_FUNCTION_LINES = 60  # a function's lines, its docstring not counted


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """The package's modules that `path` imports, at the top or inside a function. `from pkg import sub`
    counts as importing the submodule; `from pkg import name` as importing pkg itself."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cloudml_lib"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cloudml_lib"))
    return out & set(MODULES)


def test_the_layers_hold():
    """Every module in exactly one layer (exhaustive), each importing only from the layers below it, science
    and training independent siblings (neither imports the other), the network in core importing nothing of
    the run folder, its model and compilation no data reader (the network importable alone), and figures
    (matplotlib) only above training, the ownership rules written once for a folder and a bucket (no bucket
    client below them): import-linter, as pyproject.toml says."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in r.stdout


def test_the_folders_are_the_layers():
    """The contract's layers are the package's folders, each saying in its docstring what it may import."""

    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert sorted(layer for layer in layer_names() if layer != "__main__") == folders
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert "may import" in doc.lower(), folder


def test_cores_packages_are_its_layers():
    """core's packages are the layers of its own contract (the run folder over the machine over the network),
    each saying what it holds and what it may import; core itself holds no module but its docstring."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (inside,) = [c for c in contracts if c.get("containers") == ["cloudml_lib.core"]]
    folders = sorted(p.parent.name for p in (PACKAGE / "core").glob("*/__init__.py"))
    assert sorted(inside["layers"]) == folders
    assert sorted(p.name for p in (PACKAGE / "core").glob("*.py")) == ["__init__.py"]
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / "core" / folder / "__init__.py").read_text()))
        assert "may import" in doc.lower(), folder


def test_the_demo_generator_contract_covers_every_module_below_the_commands():
    """The contract that keeps the demo generator where commands start names every data module but the
    generator itself, so that a new data module cannot reach it unchecked."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (demo,) = [c for c in contracts if c.get("forbidden_modules") == ["cloudml_lib.data.synthetic"]]
    data = {f"cloudml_lib.data.{p.stem}" for p in (PACKAGE / "data").glob("*.py")} - {
        "cloudml_lib.data.__init__",
        "cloudml_lib.data.synthetic",
    }
    assert data <= set(demo["source_modules"])
    below = {f"cloudml_lib.{layer}" for layer in ("base", "core", "train", "science")}
    assert below <= set(demo["source_modules"])


def layer_names() -> list[str]:
    """The layers of pyproject.toml's first contract, top to bottom; independent siblings ("science | train")
    each in turn."""
    import tomllib

    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return [name.strip() for layer in layers["layers"] for name in layer.split("|")]


def inner_order(init: Path) -> tuple:
    """A layer's own packages bottom-up, as their contract lists them top-down (network, machine, run)."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    container = f"cloudml_lib.{init.parent.parent.name}"
    for contract in contracts:
        if contract.get("containers") == [container]:
            return (-contract["layers"].index(init.parent.name), "")
    return (0, init.parent.name)


def layout_text() -> str:
    """The Layout block of docs/reference/layout.md, drawn from the layers (pyproject.toml, top to bottom),
    each layer package's docstring and those of its own packages (core's)."""
    layers = layer_names()
    out = [
        "cloudml_lib/    __main__.py: python -m cloudml_lib; the layers, each importing only those below it:"
    ]
    for layer in (name for name in layers if name != "__main__"):
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        out.append(f"  {layer}/")
        out += [f"    {line}" if line else "" for line in doc.splitlines()]
        for sub in sorted((PACKAGE / layer).glob("*/__init__.py"), key=inner_order):
            out += ["", f"    {sub.parent.name}/"]
            doc = ast.get_docstring(ast.parse(sub.read_text()))
            out += [f"      {line}" if line else "" for line in doc.splitlines()]
    return "\n".join(line.rstrip() for line in out)


def test_the_readmes_layout_is_drawn_from_the_packages():
    """Every module of the package is named in its layer's docstring, and docs/reference/layout.md's Layout is
    those docstrings
    (regenerate it with `python -c "from tests.test_layout import layout_text; print(layout_text())"`)."""
    text = layout_text()
    for name, path in MODULES.items():
        if path.name != "__init__.py" and path.parent != PACKAGE:
            assert path.name in text, f"{name} is in no layer's docstring"
    assert text in (REPO / "docs" / "reference" / "layout.md").read_text(), (
        "docs/reference/layout.md's Layout differs from the packages' docstrings"
    )


def ruff(*args: str) -> subprocess.CompletedProcess:
    command = [shutil.which("ruff")] if shutil.which("ruff") else [sys.executable, "-m", "ruff"]
    return subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_finds_nothing_and_the_code_is_formatted():
    """The settings are pyproject.toml's [tool.ruff] (line length 110); `ruff format` was applied in one
    commit, listed in .git-blame-ignore-revs."""
    lint = ruff("check", ".")
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-1000:]
    form = ruff("format", "--check", ".")
    assert form.returncode == 0, "not formatted (run `ruff format .`):\n" + form.stdout[-3000:]


def function_lengths(path: Path) -> dict[str, int]:
    """Each function's lines (def to its last line), its docstring left out."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                n -= first.end_lineno - first.lineno + 1
            out[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    return out


def test_no_function_is_over_60_lines():
    lengths = {k: v for p in MODULES.values() for k, v in function_lengths(p).items()}
    assert {k: v for k, v in lengths.items() if v > MAX_FUNCTION_LINES} == {}


MAX_PARAMETERS = 7  # STYLE.md: a bundle, not seven arguments; more only with a reason, stated here
MORE_PARAMETERS = {  # "file function": why it takes more than MAX_PARAMETERS
    "cloudml_lib/data/dataset.py __init__": "CloudDataset's options, each by name with a default",
    "cloudml_lib/train/build.py start": "the trainer's parts, assembled once here from their builders",
    "cloudml_lib/science/clouds.py cloud_report": "the arrays of one evaluation, aligned by sample",
    "cloudml_lib/data/synthetic.py make_demo_flights": "the demo generator's settings, keywords",
    "cloudml_lib/data/synthetic.py _write_flight": "one demo flight's arrays, written as one file set",
    "cloudml_lib/core/network/model.py __init__": "the network's architecture settings, from the config",
    "cloudml_lib/core/network/inference.py predict": "Evaluator holds them for a run; other callers pass few",
    "cloudml_lib/commands/sweep.py sweep": "the sweep command's options, as the command line gives them",
}


def test_no_function_takes_more_than_seven_parameters_without_a_reason():
    """More than seven parameters (self apart) only where MORE_PARAMETERS says why; a reason for a function
    that no longer needs one is taken out."""
    many = set()
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [x.arg for x in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                if len([n for n in names if n not in ("self", "cls")]) > MAX_PARAMETERS:
                    many.add(f"{p.relative_to(REPO)} {node.name}")
    assert many - set(MORE_PARAMETERS) == set() and set(MORE_PARAMETERS) - many == set()


# A run's folder (a run, a fold, a trial, a cross-validation or a sweep) is the RunFolder (core/run/folder.py;
# its places, base/layout.py's RunLayout, below core): the library passes that object, and a bare path for a
# run is taken only where a user or another layer hands one in, each named here with why. The notebooks'
# helpers (colab/) take the paths the notebooks hold.
RUN_PATH_TAKERS = {  # "file function": why it takes a bare path for a run
    "cloudml_lib/commands/api.py load_run": "the Python API: a scientist's path",
    "cloudml_lib/commands/api.py fit": "the Python API: a scientist's path",
    "cloudml_lib/commands/api.py evaluate": "the Python API: a Run or a path",
    "cloudml_lib/commands/api.py predict_flight": "the Python API: a Run or a path",
    "cloudml_lib/commands/api.py adapt": "the Python API: a Run or a path",
    "cloudml_lib/commands/api.py read_report": "the Python API: a Run or a path",
    "cloudml_lib/commands/api.py export": "the Python API: a Run or a path",
    "cloudml_lib/commands/api.py _folder": "the API's one conversion of what it was given into a RunFolder",
    "cloudml_lib/core/run/folder.py of": "RunFolder.of: a path made the object, where one comes in",
    "cloudml_lib/commands/runs.py train_run": "the library's entry to train, as its docs show it",
    "cloudml_lib/commands/crossval.py crossval": "the library's entry to cross-validate, as its docs show it",
    "cloudml_lib/science/evaluate.py load_run_model": "the library's entry to a trained model, in the docs",
    "cloudml_lib/science/evaluate.py evaluate_run": "the library's entry to evaluate, as its docs show it",
    "cloudml_lib/science/predict.py predict_flights": "the library's entry to predict, as its docs show it",
    "cloudml_lib/train/loop.py __init__": "Trainer(cfg, run_dir): the library's trainer, as its docs show it",
    "cloudml_lib/core/run/runfolder.py adopt_run": "a Kind's proof: base/ownership.py knows paths only",
    "cloudml_lib/core/run/runfolder.py adopt_crossval": "a Kind's proof: base/ownership.py knows paths only",
    "cloudml_lib/core/run/runfolder.py owned_by_run": "a Kind's rule: base/ownership.py knows paths only",
    "cloudml_lib/commands/sweep.py adopt_sweep": "a Kind's proof: base/ownership.py knows paths only",
}
RUN_PARAMETERS = (
    "run_dir",
    "run",
    "trial_dir",
    "fold_dir",
    "model_dir",
    "sweep_folder",
    "folder",
    "where",
    "path",
)


def takes_a_run_path(node: ast.FunctionDef, run_kinds_callbacks: set[str]) -> bool:
    """A parameter that is a run's folder given as a path: named for a run (run_dir, run, ...) and annotated
    with a path type, or unannotated; a generic name (folder, where, path) where its annotation names a run
    too (RunFolder | str | Path), a `path` where its function does (load_run); a run kind's own proof or
    rule (Kind(...) below)."""
    if node.name in run_kinds_callbacks:
        return True
    for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
        if a.arg not in RUN_PARAMETERS:
            continue
        text = ast.unparse(a.annotation) if a.annotation is not None else ""
        pathlike = not text or any(t in text for t in ("Path", "str", "PathLike"))
        named_for_a_run = a.arg in ("run_dir", "run", "trial_dir", "fold_dir", "model_dir", "sweep_folder")
        of_a_run = "Run" in text or (a.arg == "path" and node.name.endswith("_run"))
        if pathlike and (named_for_a_run or of_a_run):
            return True
    return False


def test_a_run_is_passed_as_its_folder_object_and_a_path_comes_in_at_few_doors():
    """Outside the notebooks' helpers, at most 20 functions take a bare path for a run, each named with why
    (RUN_PATH_TAKERS); every other function takes the RunFolder (or its RunLayout, below core)."""
    found = set()
    for name, p in MODULES.items():
        if name.startswith("cloudml_lib.colab"):
            continue
        tree = ast.parse(p.read_text())
        callbacks = {  # the proofs and rules of the run kinds (a run, a cross-validation, a sweep)
            arg.id
            for call in ast.walk(tree)
            if isinstance(call, ast.Call)
            and getattr(call.func, "id", None) == "Kind"
            and ast.unparse(call.args[0]) in ("'run'", "'cross-validation'", "SWEEP_KIND")
            for arg in call.args
            if isinstance(arg, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and takes_a_run_path(
                node, callbacks
            ):
                found.add(f"{p.relative_to(REPO)} {node.name}")
    assert found - set(RUN_PATH_TAKERS) == set() and set(RUN_PATH_TAKERS) - found == set()
    assert len(RUN_PATH_TAKERS) <= 20


# Imported where they are used, never at a module's top: every process that starts a command (a sweep's
# trials, torchrun's processes, the notebooks' training runs) imports the commands, and these cost it about
# 0.7 s of CPU more at each start (matplotlib resolving its backend imported pyplot; scipy came with the
# demo's generator), 90 s or so of the suite's CPU over its processes. numpy, torch and h5py (the readers)
# stay at the top.
IMPORTED_WHERE_USED = ("matplotlib", "scipy", "sklearn", "mapie", "xarray", "pandas", "netCDF4", "optuna")


def top_level_imports(tree: ast.Module) -> set[str]:
    """The top-level packages a module imports as it loads (an `if TYPE_CHECKING:` block left out)."""
    nodes = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes += [node, *(node.body + node.orelse if isinstance(node, (ast.If, ast.Try)) else [])]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_a_commands_start_imports_no_plotting_or_fitting_library():
    found = {
        name: sorted(top_level_imports(ast.parse(path.read_text())) & set(IMPORTED_WHERE_USED))
        for name, path in MODULES.items()
    }
    assert {name: libs for name, libs in found.items() if libs} == {}


def test_there_is_no_import_cycle():
    graph = {name: imports_of(p) - {name} for name, p in MODULES.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_says_what_it_owns(name):
    if name.endswith("__main__"):
        pytest.skip("an entry point")
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert doc and len(doc.split()) >= 5, f"{name} has no opening docstring"


def module_memories() -> set[tuple[str, str]]:
    """Every module-level set, dict or list of cloudml_lib built empty (`_said: set[str] = set()`): what a
    process remembers between the commands it runs."""
    empty = ("set()", "{}", "[]", "dict()", "list()")
    out = set()
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            target, value = (
                (node.target, node.value)
                if isinstance(node, ast.AnnAssign)
                else (node.targets[0], node.value)
                if isinstance(node, ast.Assign) and len(node.targets) == 1
                else (None, None)
            )
            if isinstance(target, ast.Name) and value is not None and ast.unparse(value) in empty:
                out.add((name, target.id))
    return out


def test_every_memory_of_a_process_is_known_to_the_in_process_command_runner():
    """conftest.run_cli runs a command in the test's process: what CloudML remembers for a process's life (a
    table said once) is emptied for each command there, as a process of its own starts; a new memory must be
    listed (PER_PROCESS) or said not to be per command (NOT_PER_COMMAND), or an in-process test would see an
    earlier command's."""
    from conftest import NOT_PER_COMMAND, PER_PROCESS

    known = set(PER_PROCESS) | set(NOT_PER_COMMAND)
    assert module_memories() == known


@pytest.mark.slow
def test_the_api_the_run_the_trainer_and_the_readers_have_no_type_errors():
    """mypy over what pyproject.toml's [tool.mypy] names (the Python API, core/run, train, the data readers):
    zero errors. Each fix it asked for was a real gap: a Path | None handed on as a Path, a checkpoint's state
    read where it may be missing, a batch size still "auto" where a number is needed."""
    pytest.importorskip("mypy", reason="mypy is a dev dependency: pip install -e .[dev]")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert r.returncode == 0 and errors == [], r.stdout[-4000:] + r.stderr[-2000:]
