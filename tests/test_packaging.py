"""The package as installed: the wheel holds every module and data file of the checkout, declares every
package the code imports, and the Colab install script (colab/install.py) fingerprints the Drive copy,
installs only when it changed, and says when the session must be restarted."""

from __future__ import annotations

import ast
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
from install_helpers import REPO, expected_wheel_files, wheel_files, wheel_requirements

INSTALL = REPO / "cloudml_lib" / "colab" / "install.py"
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "skimage": "scikit-image", "sklearn": "scikit-learn"}
# imported only where present, each with its install command when missing (or only in a notebook / on Colab)
# cfgrib: ERA5 in GRIB (the "grib" extra), cdsapi: fetch-era5's client (the "era5" extra); each named with
# its install command where it is needed
OPTIONAL = {"optuna", "kornia", "tensorboard", "ipywidgets", "IPython", "google", "cfgrib", "cdsapi"}


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_data_file_of_the_checkout(wheel):
    """Nothing to list by hand: a new sub-package, module, preset or sweep space is in the wheel, and nothing
    that is not in the checkout (a stale build/) is."""
    have, want = wheel_files(wheel), expected_wheel_files()
    assert want - have == set(), f"missing from the wheel: {sorted(want - have)}"
    assert have - want == set(), f"in the wheel but not in the checkout: {sorted(have - want)}"
    for must in (
        "cloudml_lib/train/loop.py",
        "cloudml_lib/configs/sweeps/demo.yaml",
        "cloudml_lib/configs/demo.yaml",
        "cloudml_lib/colab/install.py",
        "cloudml_lib/measured/compile.json",
    ):
        assert must in have


def _third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for path in (REPO / "cloudml_lib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else []
            )
            found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in stdlib and n != "cloudml_lib"}


def test_every_package_the_code_imports_is_a_declared_dependency(wheel):
    """mapie was imported but not declared: the Colab install trained every epoch, then stopped."""
    required = {
        re.split(r"[ <>=!;\[]", r)[0].lower() for r in wheel_requirements(wheel) if "extra ==" not in r
    }
    for name in sorted(_third_party_imports() - OPTIONAL):
        assert DISTRIBUTIONS.get(name, name).lower() in required, f"cloudml_lib imports {name}, not declared"
    assert "netcdf4" not in required and {"xarray", "h5netcdf", "mapie"} <= required
    assert "icartt" not in required  # GPL-3.0: CloudML (BSD-3-Clause) reads ICARTT itself (data/ict.py)
    torch = next(r for r in wheel_requirements(wheel) if r.startswith("torch"))
    assert (
        torch.replace(" ", "") == "torch>=2.3"
    )  # never a floor that makes Colab (2.8-2.11) replace its torch
    assert not any(r.startswith("ipywidgets") for r in wheel_requirements(wheel) if "extra ==" not in r)


def test_the_install_script_uses_the_standard_library_only():
    """It runs from the Drive copy before anything is installed: an import of the package would fail there."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for node in ast.walk(ast.parse(INSTALL.read_text())):
        if isinstance(node, ast.Import):
            assert {a.name.split(".")[0] for a in node.names} <= stdlib, ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module.split(".")[0] in stdlib, ast.dump(node)


def test_the_install_script_fingerprints_what_setup_py_packages():
    """The folders it copies and fingerprints are the ones setup.py builds from."""
    install = runpy.run_path(str(INSTALL))
    setup_text = (REPO / "setup.py").read_text()
    for folder in re.findall(r'"cloudml_lib\.\w+": "([\w/]+)"', setup_text):
        assert folder in install["SOURCES"], folder
    assert {"cloudml_lib", "pyproject.toml", "setup.py"} <= set(install["SOURCES"])


# ------------------------------------------------------------------------------ colab/install.py, in parts


@pytest.fixture
def bootstrap(tmp_path, monkeypatch):
    """install.py loaded as the notebook loads it, with a Drive copy of the checkout under CLOUDML_CONTENT."""
    from install_helpers import copy_checkout

    content = tmp_path / "content"
    code = content / "drive" / "MyDrive" / "CloudML" / "code"
    copy_checkout(code)
    monkeypatch.setenv("CLOUDML_CONTENT", str(content))
    return runpy.run_path(str(INSTALL)), code


def test_the_fingerprint_follows_the_sources_and_nothing_else(bootstrap):
    install, code = bootstrap
    first = install["fingerprint"](code)
    (code / "cloudml_lib" / "__pycache__").mkdir(exist_ok=True)
    (code / "cloudml_lib" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    (code / "README.md").write_text("edited")
    (code / "notes.txt").write_text("a user's file beside the code")
    assert install["fingerprint"](code) == first
    (code / "cloudml_lib" / "colab" / "extra.py").write_text("X = 1\n")
    second = install["fingerprint"](code)
    assert second != first
    (code / "configs" / "demo.yaml").write_text(
        (code / "configs" / "demo.yaml").read_text() + "\n# changed\n"
    )
    assert install["fingerprint"](code) not in (first, second)
    assert install["version_of"](code) == __import__("cloudml_lib").__version__


def test_an_installed_copy_with_the_same_fingerprint_is_not_installed_again(bootstrap, monkeypatch):
    install, code = bootstrap
    ensure = install["ensure_installed"]
    record = {"fingerprint": install["fingerprint"](code), "version": "0.2.0"}
    ensure.__globals__["installed_record"] = lambda: record
    ensure.__globals__["imported_record"] = lambda: None
    ensure.__globals__["build_and_install"] = lambda *a: pytest.fail("installed although nothing changed")
    assert f"copy {record['fingerprint'][:10]}" in ensure()


def test_the_install_cell_says_when_this_torch_cannot_use_the_gpu(bootstrap, capsys):
    """`pip install -U torch` on Colab: the first cell's output says so (core/machine/device.py's words,
    asked of the installed package in a process of its own, only where an NVIDIA driver is installed)."""
    install, code = bootstrap
    ensure = install["ensure_installed"]
    ensure.__globals__["installed_record"] = lambda: {"fingerprint": install["fingerprint"](code)}
    ensure.__globals__["imported_record"] = lambda: None
    said = "torch 2.12.0+cu130 is built for CUDA 13.0, but the NVIDIA driver supports CUDA up to 12.4"
    ensure.__globals__["torch_build_notice"] = lambda: said
    ensure()
    assert f"Warning: {said}" in capsys.readouterr().out
    ensure.__globals__["torch_build_notice"] = lambda: None
    ensure()
    assert "Warning" not in capsys.readouterr().out
    if not (Path("/proc/driver/nvidia").is_dir() or shutil.which("nvidia-smi")):  # no driver: nothing asked
        assert install["torch_build_notice"]() is None


def test_a_changed_copy_is_installed_and_an_imported_old_version_asks_for_a_restart(bootstrap, capsys):
    install, code = bootstrap
    ensure, built = install["ensure_installed"], []
    ensure.__globals__["installed_record"] = lambda: {"fingerprint": "0" * 64, "version": "0.1.0"}
    ensure.__globals__["build_and_install"] = lambda src, record: built.append((src, record))
    ensure.__globals__["imported_record"] = lambda: None
    ensure()
    assert built and built[0][0] == code and built[0][1]["fingerprint"] == install["fingerprint"](code)
    assert "Installing CloudML" in capsys.readouterr().out
    ensure.__globals__["imported_record"] = lambda: {"fingerprint": "0" * 64, "version": "0.1.0"}
    with pytest.raises(install["InstallProblem"]) as e:
        ensure()
    assert "Runtime > Restart session" in str(e.value) and "CloudML 0.1.0" in str(e.value)
    lines = e.value._render_traceback_()
    assert "Problem:" in lines[0] and not any("Traceback" in x for x in lines)


def test_without_a_copy_on_drive_it_says_where_to_put_it(bootstrap, tmp_path):
    install, _ = bootstrap
    with pytest.raises(install["InstallProblem"], match="Put the CloudML repository there"):
        install["ensure_installed"](tmp_path / "empty")


def test_a_failed_pip_install_is_shown_with_what_pip_said(bootstrap, monkeypatch):
    install, code = bootstrap
    (code / "pyproject.toml").write_text("this is not TOML [")
    with pytest.raises(install["InstallProblem"], match="pip exit status") as e:
        install["build_and_install"](code, {"fingerprint": install["fingerprint"](code)})
    assert "pip said" in str(e.value)


# ------------------------------------------------------------- the install cell under Drive's weather


def refused(install, code, *must):
    """The install refuses the copy with one message naming every `must`, and installs nothing."""
    ensure = install["ensure_installed"]
    ensure.__globals__["installed_record"] = lambda: None
    ensure.__globals__["build_and_install"] = lambda *a: pytest.fail("installed a copy with problems")
    with pytest.raises(install["InstallProblem"]) as e:
        ensure()
    text = str(e.value)
    for word in (*must, "Nothing was installed", "run this cell again"):
        assert word in text, text
    assert not any("Traceback" in line for line in e.value._render_traceback_())
    return text


def test_a_copy_with_missing_or_misshapen_parts_is_named_part_by_part(bootstrap):
    install, code = bootstrap
    import shutil

    (code / "pyproject.toml").unlink()
    (code / "pyproject.toml").mkdir()  # a sync client made a folder of it
    shutil.rmtree(code / "configs")
    text = refused(install, code, "pyproject.toml: is a folder", "configs: is missing")
    assert "no copy of CloudML" not in text


def test_an_unreadable_folder_a_strange_name_and_a_pipe_are_named_not_skipped(bootstrap, monkeypatch):
    import os

    install, code = bootstrap
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(os.fsdecode(path)) == code / "configs" / "sweeps":
            raise PermissionError(13, "Permission denied", os.fsdecode(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)  # (as root, chmod 000 would not stop a read)
    os.close(os.open(os.fsencode(code / "cloudml_lib") + b"/caf\xe9.py", os.O_CREAT | os.O_WRONLY))
    os.mkfifo(code / "configs" / "pipe.yaml")
    refused(
        install,
        code,
        "configs/sweeps/: the folder cannot be read (Permission denied)",
        "the file name is not UTF-8",
        "configs/pipe.yaml: is not a regular file",
    )


def test_a_file_that_vanishes_or_changes_while_installing_installs_nothing(bootstrap, monkeypatch):
    install, code = bootstrap
    build, ran = install["build_and_install"], []
    build.__globals__["subprocess"] = type("S", (), {"run": lambda *a, **k: ran.append(a)})
    record = {"fingerprint": install["fingerprint"](code)}
    demo = code / "configs" / "demo.yaml"
    demo.write_text(demo.read_text() + "\n# Drive synced a newer version meanwhile\n")
    with pytest.raises(install["InstallProblem"], match="changed while it was being installed"):
        build(code, record)
    real_open = open

    def flaky(path, *a, **k):
        if Path(path) == demo:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *a, **k)

    build.__globals__["open"] = flaky
    with pytest.raises(install["InstallProblem"], match="still syncing") as e:
        build(code, {"fingerprint": "x"})
    assert str(demo) in str(e.value) and "Nothing was installed" in str(e.value)
    assert ran == [], "pip ran on a copy that was not the fingerprinted one"


def test_files_are_hashed_in_pieces_with_the_same_fingerprint(bootstrap, tmp_path):
    """A big file costs no memory; the fingerprint is the same whatever the piece size."""
    import hashlib
    import tracemalloc

    install, code = bootstrap
    big = code / "configs" / "big.json"
    big.write_bytes(b"[" + b"0," * (24 << 20) + b"0]")  # 48 MB
    whole = hashlib.sha256()
    for rel in install["source_files"](code):
        whole.update(rel.as_posix().encode() + b"\0" + (code / rel).read_bytes() + b"\0")
    tracemalloc.start()
    got = install["fingerprint"](code)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == whole.hexdigest()
    assert peak < 8 << 20, f"hashing held {peak / 2**20:.0f} MiB"
    install["fingerprint"].__globals__["CHUNK"] = 7
    assert install["fingerprint"](code) == got


def test_the_installed_files_are_checked_against_the_copy(bootstrap, tmp_path):
    """pip says it installed, but a file is missing from site-packages: the cell says so and removes the
    record it installed, so that the next run installs again."""
    import shutil

    install, code = bootstrap
    build = install["build_and_install"]
    site = tmp_path / "site" / "cloudml_lib"

    def pip(cmd, **kwargs):  # lays the build copy out as setup.py would, then loses one module
        work = Path(cmd[-1])
        for rel in install["source_files"](work) + [Path("cloudml_lib/_source.json")]:
            target = install["installed_as"](rel, work)
            if target:
                (site / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(work / rel, site / target)
        if lose:
            (site / "train" / "loop.py").unlink()
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})

    build.__globals__["subprocess"] = type("S", (), {"run": pip})
    build.__globals__["installed_package"] = lambda: site
    record = {"fingerprint": install["fingerprint"](code)}
    lose = False
    build(code, record)  # laid out right: no complaint
    assert (site / "configs" / "demo.yaml").read_bytes() == (code / "configs" / "demo.yaml").read_bytes()
    assert json_of(site / "_source.json") == record
    lose = True
    with pytest.raises(install["InstallProblem"], match="do not match the copy") as e:
        build(code, record)
    assert "train/loop.py: missing" in str(e.value)
    assert not (site / "_source.json").exists(), "the record stayed: the next run would not reinstall"


def json_of(path):
    import json

    return json.loads(path.read_text())


def test_the_install_record_is_what_the_package_reports(monkeypatch):
    """cloudml_lib.SOURCE holds the record a Colab install wrote; colab.version() says it in words."""
    import cloudml_lib
    from cloudml_lib.colab import drive

    record = {
        "fingerprint": "ab" * 32,
        "version": "0.2.0",
        "copied_from": "/content/drive/MyDrive/CloudML/code",
        "installed_at": "2026-11-24 10:00:00",
    }
    monkeypatch.setattr(cloudml_lib, "SOURCE", record)
    assert drive.version() == (  # the version running, whatever the record says
        f"{cloudml_lib.__version__} (copy ababababab of /content/drive/MyDrive/CloudML/code, installed "
        "2026-11-24 10:00:00)"
    )
    monkeypatch.setattr(cloudml_lib, "SOURCE", {})
    assert drive.version() == f"{cloudml_lib.__version__} (from {Path(cloudml_lib.__file__).parent})"


def test_a_missing_optional_package_is_named_with_the_command_that_fits_where_the_user_is(monkeypatch):
    """In a terminal `pip install ...`; in a notebook, or in a command a notebook started, `%pip install ...`
    (it installs into the kernel's environment, which a bare `!pip` may not)."""
    import types

    from cloudml_lib.base.errors import install_command

    monkeypatch.delenv("CLOUDML_PARENT_PID", raising=False)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    assert install_command("optuna>=4.0") == "pip install 'optuna>=4.0'"
    assert install_command("kornia") == "pip install kornia"
    monkeypatch.setenv("CLOUDML_PARENT_PID", "123")
    assert install_command("optuna>=4.0") == "%pip install 'optuna>=4.0'"
    monkeypatch.delenv("CLOUDML_PARENT_PID")
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    assert install_command("tensorboard") == "%pip install tensorboard"


def test_the_package_lists_every_module_it_has():
    """cloudml_lib/colab/modules.py, the list the Colab install checks a Drive copy against, is the
    package."""
    from cloudml_lib.colab.modules import MODULES

    package = REPO / "cloudml_lib"
    have = sorted(
        p.relative_to(package).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts
    )
    assert sorted(MODULES) == have, (
        "cloudml_lib/colab/modules.py differs from the package's modules; set MODULES to:\n"
        + "\n".join(f'    "{m}",' for m in have)
    )


def test_a_copy_still_being_written_is_never_installed_as_a_success(bootstrap):
    """The install cell reported success for a partial package (83 of 102 files, commands/ missing) while
    Drive rewrote the copy: the fingerprint and the build saw the same incomplete tree. The package's own list
    of its modules names what is missing, and nothing is installed."""
    import shutil

    install, code = bootstrap
    shutil.rmtree(code / "cloudml_lib" / "commands")
    text = refused(
        install,
        code,
        "cloudml_lib/: ",
        "modules are missing (commands/__init__.py, commands/api.py, commands/cli.py",
    )
    assert "Is Google Drive still copying the folder?" in text  # refused(): and nothing was installed
    (code / "cloudml_lib" / "colab" / "modules.py").unlink()
    refused(install, code, "cloudml_lib/colab/modules.py: is missing or unreadable")


def test_the_licence_is_declared_where_tools_read_it_and_the_citation_names_this_version(wheel):
    """LICENSE (BSD-3-Clause) travels in the wheel and its metadata says so; no run-time dependency is GPL
    (icartt is a test oracle only); CITATION.cff is valid and names this release."""
    import zipfile

    import yaml

    import cloudml_lib

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licence = z.read(next(n for n in names if n.endswith("licenses/LICENSE"))).decode()
    assert "License-Expression: BSD-3-Clause" in meta.splitlines()
    assert licence.startswith("BSD 3-Clause License") and licence == (REPO / "LICENSE").read_text()
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "BSD-3-Clause"
    assert cff["version"] == cloudml_lib.__version__ and cff["title"] and cff["authors"]
    from cloudml_lib.commands.cli import build_parser  # the version README tells a citing user to find

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
