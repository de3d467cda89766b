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
4. Where an NVIDIA driver is installed, the installed CloudML is asked (in a process of its own) whether this
   torch can use the GPU: a `pip install -U torch` brings a CUDA build newer than Colab's driver, and the
   warning says so, and the way back, in the first cell's output.

`CLOUDML_CONTENT` moves Colab's /content (the tests' twin of Colab); everything else is Colab's layout.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE_NAME = "cloudml_lib"
RECORD = "_source.json"  # inside the installed package: the fingerprint it was built from
# What a wheel is built from (setup.py): the package, and the folders it carries as data
SOURCES = ("cloudml_lib", "configs", "benchmarks/results", "pyproject.toml", "setup.py")
REQUIRED = ("cloudml_lib", "configs", "pyproject.toml", "setup.py")  # benchmarks/results is optional
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


CHUNK = 1 << 20  # files are hashed and copied in pieces: a file of any size costs no memory
NOTHING = "Nothing was installed; the copy is left as it is."
MAPPED = {"configs": "cloudml_lib/configs", "benchmarks/results": "cloudml_lib/measured"}  # as setup.py
DATA = (".yaml", ".json")  # the data files setup.py packs from MAPPED


def _skipped(rel: Path) -> bool:
    return any(s in rel.parts or rel.name.endswith(s) for s in SKIP)


def _name_problem(rel: str) -> str | None:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # os.walk hands an undecodable name over with surrogate escapes
        return f"{ascii(rel)}: the file name is not UTF-8; rename the file (or delete it)"
    return None


def _scan_file(code: Path, rel: Path, problems: list[str]) -> bool:
    try:
        st = os.stat(code / rel)
    except OSError as e:
        problems.append(f"{rel.as_posix()}: cannot be read ({e.strerror or e})")
        return False
    if stat.S_ISDIR(st.st_mode):
        problems.append(
            f"{rel.as_posix()}: is a folder; it must be the file of that name from the repository"
        )
        return False
    if not stat.S_ISREG(st.st_mode):
        problems.append(f"{rel.as_posix()}: is not a regular file (a pipe, socket or device); delete it")
        return False
    return True


def scan(code: Path) -> tuple[list[Path], list[str]]:
    """The files of SOURCES under `code`, sorted (relative to it), and what is wrong with the copy: a
    required part missing, a folder that cannot be read, a name that is not UTF-8, a special file."""
    files: list[Path] = []
    problems: list[str] = []
    for name in SOURCES:
        top = code / name
        if not os.path.lexists(top):
            if name in REQUIRED:
                problems.append(f"{name}: is missing (the copy needs {', '.join(REQUIRED)})")
            continue
        if name.endswith((".toml", ".py")):
            if _scan_file(code, Path(name), problems):
                files.append(Path(name))
            continue
        if not top.is_dir():
            problems.append(
                f"{name}: is not a folder; it must be the folder of that name from the repository"
            )
            continue

        def unreadable(e: OSError, name: str = name) -> None:
            where = Path(e.filename).relative_to(code).as_posix() if e.filename else name
            problems.append(f"{where}/: the folder cannot be read ({e.strerror or e})")

        for folder, dirs, names in os.walk(top, onerror=unreadable):
            dirs.sort()
            base = Path(folder).relative_to(code)
            for d in list(dirs):
                if _skipped(base / d) or (bad := _name_problem((base / d).as_posix())):
                    dirs.remove(d)
                    if not _skipped(base / d):
                        problems.append(bad)
            for n in sorted(names):
                rel = base / n
                if _skipped(rel):
                    continue
                if bad := _name_problem(rel.as_posix()):
                    problems.append(bad)
                elif _scan_file(code, rel, problems):
                    files.append(rel)
    if not problems:
        problems += _missing_modules(code, files)
    if not problems and not any(f.parts[0] == "configs" and f.suffix == ".yaml" for f in files):
        problems.append("configs/: holds no preset (*.yaml); copy the repository's configs/ folder again")
    return sorted(files), problems


MODULE_LIST = "colab/modules.py"  # inside the package: every module's path


def _missing_modules(code: Path, files: list[Path]) -> list[str]:
    """The package's own list of its modules against the copy: a copy still being written by Google Drive
    looks complete to a fingerprint and a build (they see the same tree), not to this list."""
    listing = code / PACKAGE_NAME / MODULE_LIST
    try:
        tree = ast.parse(listing.read_text(encoding="utf-8"))
        listed = next(
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["MODULES"]
        )
    except (OSError, SyntaxError, ValueError, StopIteration, UnicodeDecodeError):
        return [f"{PACKAGE_NAME}/{MODULE_LIST}: is missing or unreadable (the package's list of its modules)"]
    have = {f.as_posix() for f in files}
    missing = [m for m in listed if f"{PACKAGE_NAME}/{m}" not in have]
    if not missing:
        return []
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return [
        f"{PACKAGE_NAME}/: {len(missing)} of its {len(listed)} modules are missing ({shown}). Is Google "
        "Drive still copying the folder? Wait until it is done"
    ]


def source_files(code: Path) -> list[Path]:
    """The files of SOURCES under `code`, sorted (paths relative to it); InstallProblem naming every
    problem of the copy at once."""
    files, problems = scan(code)
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise InstallProblem(
            f"the copy of CloudML in {code} cannot be installed:\n"
            + "\n".join(f"  - {p}" for p in shown)
            + f"\n{NOTHING} Fix the copy (or copy the repository there again), then run this cell again."
        )
    return files


def _vanished(code: Path, rel: Path, e: OSError) -> InstallProblem:
    return InstallProblem(
        f"{code / rel} could not be read while it was being installed ({e.strerror or e}). "
        f"Is Google Drive still syncing the copy? Wait until it is done, then run this cell again. {NOTHING}"
    )


def _hash_into(h, code: Path, rel: Path, out: Path | None = None) -> None:
    """Add the file's path and bytes to `h`, read in pieces; with `out`, copy the same bytes there."""
    h.update(rel.as_posix().encode() + b"\0")
    try:
        with open(code / rel, "rb") as src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                raise OSError(0, "it is no longer a regular file")
            dst = open(out, "wb") if out is not None else None
            try:
                while piece := src.read(CHUNK):
                    h.update(piece)
                    if dst is not None:
                        dst.write(piece)
            finally:
                if dst is not None:
                    dst.close()
    except OSError as e:
        raise _vanished(code, rel, e) from None
    h.update(b"\0")


def fingerprint(code: Path) -> str:
    """SHA-256 over each source file's path and bytes: any change to what would be installed changes it."""
    h = hashlib.sha256()
    for rel in source_files(code):
        _hash_into(h, code, rel)
    return h.hexdigest()


def _file_digest(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while piece := f.read(CHUNK):
                h.update(piece)
    except OSError:
        return None
    return h.hexdigest()


def version_of(code: Path) -> str:
    try:
        text = (code / PACKAGE_NAME / "__init__.py").read_text(errors="replace")
    except OSError:
        return "?"
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


def _copy_sources(code: Path, into: Path) -> str:
    """Copy the source files to `into`, hashing the bytes copied; returns their fingerprint."""
    h = hashlib.sha256()
    for rel in source_files(code):
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        _hash_into(h, code, rel, into / rel)
    for name in BUILD_ONLY:  # the package's description: a stand-in where Drive has not synced it
        try:
            shutil.copyfile(code / name, into / name)
        except OSError:
            (into / name).write_text("CloudML\n")
    return h.hexdigest()


def installed_as(rel: Path, work: Path) -> str | None:
    """Where a source file lands inside the installed package (relative to it), as setup.py packs it;
    None for a file the wheel does not carry."""
    parts = rel.parts
    if parts[0] == PACKAGE_NAME:
        inside = all((work / Path(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts)))
        carried = rel.suffix == ".py" or rel == Path(PACKAGE_NAME, RECORD)
        return Path(*parts[1:]).as_posix() if carried and inside else None
    for source, target in MAPPED.items():
        n = len(Path(source).parts)
        if Path(*parts[:n]).as_posix() == source and rel.suffix in DATA:
            if any(part.startswith((".", "__")) for part in parts[n:-1]):
                return None
            return Path(target, *parts[n:]).relative_to(PACKAGE_NAME).as_posix()
    return None


def installed_package() -> Path | None:
    """The folder this Python imports the package from now (sys.path searched afresh)."""
    importlib.invalidate_caches()
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def verify_installed(work: Path, files: list[Path]) -> list[str]:
    """What differs between the build copy and the package as installed: a file missing or other bytes."""
    package = installed_package()
    if package is None:
        return ["the package cannot be found where this Python looks for packages"]
    wrong = []
    for rel in [*files, Path(PACKAGE_NAME, RECORD)]:
        target = installed_as(rel, work)
        if target is None:
            continue
        got = _file_digest(package / target)
        if got != _file_digest(work / rel):
            wrong.append(f"{target}: {'missing' if got is None else 'differs from the copy'}")
    return wrong


def build_and_install(code: Path, record: dict) -> None:
    """Copy the sources to local disk (checked against the fingerprint taken before), record the
    fingerprint in the copy, pip install it and check the installed files against the copy; the copy is
    removed."""
    work = Path(tempfile.mkdtemp(prefix="cloudml-install-"))
    try:
        if _copy_sources(code, work) != record["fingerprint"]:
            raise InstallProblem(
                f"the copy in {code} changed while it was being installed. Is Google Drive still syncing "
                f"it? Wait until it is done, then run this cell again. {NOTHING}"
            )
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
        wrong = verify_installed(work, source_files(work))
        if wrong:
            package = installed_package()
            if package is not None:  # the record is ours: without it the next run installs again
                (package / RECORD).unlink(missing_ok=True)
            raise InstallProblem(
                f"CloudML was installed from {code}, but the installed files do not match the copy "
                f"({len(wrong)}: " + "; ".join(wrong[:5]) + ("; ..." if len(wrong) > 5 else "") + "). "
                "Run this cell again; if it says the same, choose Runtime > Disconnect and delete runtime, "
                "then Run all."
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    importlib.invalidate_caches()


def torch_build_notice() -> str | None:
    """core/machine/device.py's words when this torch cannot use the machine's NVIDIA GPU (a CUDA build newer
    than the driver, a CPU-only build), from the installed package in a process of its own (this file imports
    nothing of it); None without an NVIDIA driver (no process started) and wherever the answer fails."""
    if not (os.path.isdir("/proc/driver/nvidia") or shutil.which("nvidia-smi")):
        return None
    ask = f"from {PACKAGE_NAME}.core.machine.device import torch_build_notice as n; print(n() or '')"
    try:
        done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def ensure_installed(content: Path | None = None) -> str:
    """Install CloudML from the Drive copy when the installed one differs; returns what is in use, in
    words."""
    code = code_dir(content)
    if not any(os.path.lexists(code / name) for name in ("pyproject.toml", "setup.py", PACKAGE_NAME)):
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
    notice = torch_build_notice()
    if notice:
        print(f"Warning: {notice}", flush=True)
    return f"{now}, installed from {code}"


if __name__ == "__main__":  # `!python .../cloudml_lib/colab/install.py` in a Colab cell
    try:
        print(ensure_installed())
    except InstallProblem as problem:
        print(f"Problem: {problem}", file=sys.stderr)
        sys.exit(2)
