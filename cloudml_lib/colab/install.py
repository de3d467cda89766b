"""Installs CloudML on Colab from the copy in MyDrive/CloudML/code, and again whenever that copy changes.

The notebooks' first cell runs this file by its path in the Drive copy (`runpy.run_path`; in a `!python` line:
`python .../code/cloudml_lib/colab/install.py`), before anything of CloudML is installed, so it imports
nothing from the package: the standard library only.

1. The copy is fingerprinted: a SHA-256 over the files a wheel is built from (SOURCES).
2. The installed package records the fingerprint it was built from (cloudml_lib/_source.json). The same
   fingerprint: nothing to do. Another one (or none, or nothing installed): the copy's files are copied to
   a fresh folder on the VM's local disk and pip installs from there, so nothing is written into the
   Drive copy and no stale `build/` can be installed. Colab's own torch and ipywidgets stay as they are
   (the package asks for torch>=2.3 and no ipywidgets).
3. When this kernel had already imported another version, the new files would meet old modules in
   memory: it says so, and that the session must be restarted, instead of running on with old code.

`CLOUDML_CONTENT` moves Colab's /content (the tests' twin of Colab); everything else is Colab's layout.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE_NAME = "cloudml_lib"
RECORD = "_source.json"  # inside the installed package: the fingerprint it was built from
# What a wheel is built from (setup.py): the package, and the folders it carries as data
SOURCES = ("cloudml_lib", "configs", "benchmarks/results", "pyproject.toml", "setup.py")
BUILD_ONLY = ("README.md",)  # needed by the build (the package's description), not fingerprinted
SKIP = ("__pycache__", ".pyc", RECORD)


class InstallProblem(Exception):
    """Shown in a notebook as its message alone, in red, without a traceback."""

    def _render_traceback_(self) -> list[str]:
        first, *rest = str(self).splitlines() or [""]
        return [f"\x1b[31m\x1b[1mProblem:\x1b[0m {first}", *rest]


def content_dir() -> Path:
    return Path(os.environ.get("CLOUDML_CONTENT", "/content"))


def code_dir(content: Path | None = None) -> Path:
    return (content or content_dir()) / "drive" / "MyDrive" / "CloudML" / "code"


def source_files(code: Path) -> list[Path]:
    """The files of SOURCES under `code`, sorted (paths relative to it)."""
    out = []
    for name in SOURCES:
        path = code / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out += [
            p.relative_to(code) for p in found if not any(s in p.parts or p.name.endswith(s) for s in SKIP)
        ]
    return sorted(out)


def fingerprint(code: Path) -> str:
    """SHA-256 over each source file's path and bytes: any change to what would be installed changes it."""
    h = hashlib.sha256()
    for rel in source_files(code):
        h.update(rel.as_posix().encode() + b"\0" + (code / rel).read_bytes() + b"\0")
    return h.hexdigest()


def version_of(code: Path) -> str:
    text = (code / PACKAGE_NAME / "__init__.py").read_text(errors="replace")
    m = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", text)
    return m.group(1) if m else "?"


def installed_record() -> dict | None:
    """What the installed package was built from ({} for an install without a record, None: not installed)."""
    try:
        spec = importlib.util.find_spec(PACKAGE_NAME)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return json.loads((Path(list(spec.submodule_search_locations)[0]) / RECORD).read_text())
    except (OSError, ValueError, RecursionError):
        return {}


def imported_record() -> dict | None:
    """The record of the version this kernel imported (None: nothing imported yet)."""
    module = sys.modules.get(PACKAGE_NAME)
    if module is None:
        return None
    return getattr(module, "SOURCE", None) or {"version": getattr(module, "__version__", "?")}


def describe(record: dict | None) -> str:
    if not record:
        return "an earlier version"
    short = (record.get("fingerprint") or "")[:10]
    return f"CloudML {record.get('version', '?')}" + (f" (copy {short})" if short else "")


def _copy_sources(code: Path, into: Path) -> None:
    for rel in source_files(code) + [Path(n) for n in BUILD_ONLY if (code / n).is_file()]:
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(code / rel, into / rel)


def build_and_install(code: Path, record: dict) -> None:
    """Copy the sources to local disk, record the fingerprint in the copy, pip install it; the copy is
    removed."""
    work = Path(tempfile.mkdtemp(prefix="cloudml-install-"))
    try:
        _copy_sources(code, work)
        (work / PACKAGE_NAME / RECORD).write_text(json.dumps(record, indent=1))
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            str(work),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise InstallProblem(
                f"installing CloudML from {code} failed (pip exit status {done.returncode}). "
                f"Check that the folder is a complete copy of the repository, then run this cell "
                f"again. pip said:\n{tail}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    importlib.invalidate_caches()


def ensure_installed(content: Path | None = None) -> str:
    """Install CloudML from the Drive copy when the installed one differs; returns what is in use, in
    words."""
    code = code_dir(content)
    if not (code / "pyproject.toml").is_file() or not (code / PACKAGE_NAME).is_dir():
        raise InstallProblem(
            f"no copy of CloudML in {code}. Put the CloudML repository there (git clone, or "
            "upload the folder), then run this cell again."
        )
    record = {
        "fingerprint": fingerprint(code),
        "version": version_of(code),
        "copied_from": str(code),
        "installed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    installed, imported = installed_record(), imported_record()
    now = describe(record)
    if installed is None or installed.get("fingerprint") != record["fingerprint"]:
        print(
            f"Installing {now} from {code} (installed before: "
            f"{describe(installed) if installed is not None else 'none'}); about a minute...",
            flush=True,
        )
        build_and_install(code, record)
        installed = record
    if imported is not None and imported.get("fingerprint") != installed.get("fingerprint"):
        raise InstallProblem(
            f"{now} is installed, but this session had already imported {describe(imported)}, "
            "which stays in memory. Choose Runtime > Restart session, then Runtime > Run all: "
            "the new version is used from then on."
        )
    return f"{now}, installed from {code}"


if __name__ == "__main__":  # `!python .../cloudml_lib/colab/install.py` in a Colab cell
    try:
        print(ensure_installed())
    except InstallProblem as problem:
        print(f"Problem: {problem}", file=sys.stderr)
        sys.exit(2)
