"""Helpers of the packaging tests: the checkout's files, a clean copy of them, the wheel built from it, and
a virtual environment with what Colab preinstalls (the Colab twin). Not a test module itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What Colab preinstalls that CloudML uses (Colab runtime of 2026-08); NOT there: netCDF4, icartt, mapie,
# optuna, kornia. The twin holds them to Colab's versions (COLAB_CONSTRAINTS, pip's -c): torch 2.11.0 from
# PyPI (a CUDA build, run on the CPU as Colab's runs before a GPU is chosen), numpy, IPython, ipykernel,
# ipywidgets as Colab has them; the rest of the suite runs this machine's torch.
COLAB_PYTHON = "3.13"
COLAB_CONSTRAINTS = REPO / "constraints" / "colab.txt"
COLAB_PACKAGES = [
    "numpy",
    "scipy",
    "h5py",
    "pyyaml",
    "tqdm",
    "matplotlib",
    "scikit-learn",
    "scikit-image",
    "tensorboard",
    "xarray",
    "h5netcdf",
    "safetensors",
    "ipykernel",
    "ipywidgets==7.7.1",
]
NOT_ON_COLAB = ["netCDF4", "icartt", "mapie", "optuna", "kornia"]
CACHES = ("__pycache__", ".pyc")


def checkout_files() -> list[Path]:
    """The files of the checkout, relative to it: what git tracks or would track (new files included,
    ignored ones such as caches, runs and build/ left out)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        files = [Path(line) for line in out.splitlines() if line and (REPO / line).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but the usual junk
        files = [
            p.relative_to(REPO)
            for p in REPO.rglob("*")
            if p.is_file()
            and not any(
                part.startswith(".") or part in ("build", "dist") for part in p.relative_to(REPO).parts
            )
        ]
    return sorted(f for f in files if not any(c in f.parts or f.name.endswith(c) for c in CACHES))


def copy_checkout(dest: Path) -> Path:
    for rel in checkout_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


def expected_wheel_files() -> set[str]:
    """What the wheel must hold, from the checkout: every file under cloudml_lib/, and the data folders
    setup.py maps into the package (configs/ -> cloudml_lib/configs/, benchmarks/results/ ->
    cloudml_lib/measured/)."""
    mapped = {"configs/": "cloudml_lib/configs/", "benchmarks/results/": "cloudml_lib/measured/"}
    out = set()
    for rel in checkout_files():
        path = rel.as_posix()
        if path.startswith("cloudml_lib/"):
            out.add(path)
        for source, target in mapped.items():
            if path.startswith(source):
                out.add(target + path[len(source) :])
    return out


def build_wheel(work: Path) -> Path:
    """The wheel of a clean copy of the checkout (a build/ left in the checkout can never leak into it)."""
    src = copy_checkout(work / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(work / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = (work / "dist").glob("cloudml-*.whl")
    return wheel


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def pip(python: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"pip install {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def uv_bin() -> str | None:
    """uv's program where it is installed (the `uv` package of the dev dependencies, or on PATH)."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def uv_install(python: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """`uv pip install` into the environment of `python` (pip's arguments: -c, requirements); pip where uv
    is missing or fails (an index only pip's configuration names, say)."""
    uv = uv_bin()
    if uv:
        # byte-compiled as pip does: else every process of the twin compiles torch's modules on import
        cmd = [uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode == 0:
            return r
    return pip(python, *args, timeout=timeout)


def colab_python() -> str:
    """A Python of Colab's release (COLAB_PYTHON): $CLOUDML_TWIN_PYTHON, `python3.13` on PATH, or a pyenv
    installation of it; this test's own Python where the machine has none (the twin then says which)."""
    found = [os.environ.get("CLOUDML_TWIN_PYTHON", ""), shutil.which(f"python{COLAB_PYTHON}") or ""]
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        if root:
            found += sorted(
                str(p) for p in Path(root).glob(f"versions/{COLAB_PYTHON}*/bin/python{COLAB_PYTHON}")
            )
    for python in filter(None, found):
        try:
            r = subprocess.run(
                [python, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except OSError:
            continue
        if r.returncode == 0 and r.stdout.strip() == COLAB_PYTHON:
            return python
    return sys.executable


def colab_pins() -> dict[str, str]:
    """The versions COLAB_CONSTRAINTS holds, by package name in lower case: {"torch": "2.11.0", ...}."""
    pins = {}
    for line in COLAB_CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    return pins


COLAB_STUB = {
    "__init__.py": '"""A stand-in for Colab\'s google.colab, for the tests\' Colab twin."""\n',
    "drive.py": (
        '"""drive.mount of the Colab twin: links the mount point to $CLOUDML_TWIN_DRIVE (Google Drive\'s '
        'stand-in)."""\n'
        "import os\n\n\n"
        "def mount(mountpoint, force_remount=False, **kwargs):\n"
        "    if not os.path.isdir(os.path.join(mountpoint, 'MyDrive')):\n"
        "        os.makedirs(os.path.dirname(mountpoint), exist_ok=True)\n"
        "        os.symlink(os.environ['CLOUDML_TWIN_DRIVE'], mountpoint)\n"
        "    print('Mounted at', mountpoint)\n"
    ),
}


def make_colab_venv(where: Path, python: str | None = None, constraints: Path | None = None) -> Path:
    """A fresh virtual environment of `python` (default: this one) with what Colab preinstalls, and a stub
    google.colab whose drive.mount links the mount point to the folder standing in for Google Drive
    ($CLOUDML_TWIN_DRIVE). With `constraints` (COLAB_CONSTRAINTS), every install is held to them and torch is
    their release; without, torch is this machine's release. torch goes first, so that the other packages keep
    it. The packages go in with uv where it is installed (a dev dependency): the same wheels from the same
    index, unpacked in parallel (the twin's 5 GB: 26 s of wall and 41 s of CPU here, downloads included,
    against pip's 98 s and 95 s with its wheels already downloaded); pip where uv is missing or fails. The
    environment keeps its own pip either way, for the tests' installs of CloudML as Colab's first cell makes
    them. Returns its python."""
    subprocess.run([python or sys.executable, "-m", "venv", str(where)], check=True)
    python = where / "bin" / "python"
    held = ("-c", str(constraints)) if constraints else ()
    uv_install(python, *held, f"torch=={colab_pins()['torch'] if constraints else torch_version()}")
    uv_install(python, *held, *COLAB_PACKAGES)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    stub = site / "google" / "colab"  # no google/__init__.py: "google" stays a namespace (protobuf)
    stub.mkdir(parents=True)
    for name, text in COLAB_STUB.items():
        (stub / name).write_text(text)
    return python


def freeze(python: Path) -> str:
    """Every distribution the environment of `python` holds, with its version (pip freeze --all)."""
    r = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "freeze", "--all"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


class TwinEnvironment:
    """The Colab twin's virtual environment (make_colab_venv with COLAB_CONSTRAINTS), built in the background
    from the session's start (`start`: under a minute here with uv, which downloads and unpacks PyPI's CUDA
    build of torch 2.11 and the rest, 5 GB; 1.5-3 minutes with pip), and kept between sessions where the
    machine allows: in $CLOUDML_TWIN_CACHE (default
    ~/.cache/cloudml-tests), under a key of everything it is made of (Colab's Python and pins, the packages,
    the google.colab stub). A kept one is used only if it holds exactly what it held when built (pip
    freeze, recorded then); the tests install CloudML into it, and `reset` removes what they added when they
    end. Where the folder cannot be kept (another session holds it, or none can be made), one is built in the
    session's temporary folder. $CLOUDML_TWIN_CACHE=off builds a fresh one each session."""

    def __init__(self, scratch: Path, state: Path | None = None):
        self.scratch = scratch
        self.state = state  # where the build's outcome is written for other processes (TwinBuiltElsewhere)
        self.python_exe: Path | None = None
        self.how = ""
        self.seconds: float | None = None
        self.began_at: float | None = None  # time.time() when the build began
        self._error: BaseException | None = None
        self._thread = None
        self._lock = None

    @staticmethod
    def key(base: str) -> str:
        import hashlib

        version = subprocess.run(
            [base, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
        ).stdout
        parts = [version, COLAB_CONSTRAINTS.read_text(), "\n".join(COLAB_PACKAGES), json.dumps(COLAB_STUB)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

    def start(self) -> None:
        import threading

        if self._thread is None:
            self._thread = threading.Thread(target=self._build, name="colab-twin-build", daemon=True)
            self._thread.start()

    def python(self, timeout: float = 1800) -> Path:
        """The twin's python, waiting for the build (started here if it was not)."""
        self.start()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the Colab twin's environment was not built in {timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError(
                f"the Colab twin's environment could not be built: {self._error}"
            ) from self._error
        return self.python_exe

    def _build(self) -> None:
        import time

        try:
            t0, self.began_at = time.monotonic(), time.time()
            base = colab_python()
            where = self._kept_folder(base)
            if where is None:
                where = self.scratch / "colab-twin"
                self.how = "built for this session"
            venv, record = where / "venv", where / "freeze.txt"
            python = venv / "bin" / "python"
            if record.is_file() and python.is_file() and self._pristine(python, record.read_text()):
                self.how = f"kept in {where} (as built)"
            else:
                shutil.rmtree(venv, ignore_errors=True)
                record.unlink(missing_ok=True)
                make_colab_venv(venv, base, constraints=COLAB_CONSTRAINTS)
                record.write_text(freeze(python))
                self.how = self.how or f"built into {where}"
            self.seconds = round(time.monotonic() - t0, 1)
            self.how += f", {self.seconds:.0f} s"
            self.python_exe = python
        except BaseException as e:  # noqa: BLE001 - said where the twin's tests ask for it
            self._error = e
        if self.state is not None:
            doc = {"python": str(self.python_exe or ""), "how": self.how, "seconds": self.seconds}
            doc["error"] = "" if self._error is None else f"{type(self._error).__name__}: {self._error}"
            partial = self.state.with_suffix(".partial")
            partial.write_text(json.dumps(doc))
            partial.replace(self.state)

    def _kept_folder(self, base: str) -> Path | None:
        """The folder of this key under the cache, locked for this session; None where it cannot be."""
        import fcntl

        root = os.environ.get("CLOUDML_TWIN_CACHE", str(Path.home() / ".cache" / "cloudml-tests"))
        if root == "off":
            return None
        where = Path(root) / f"colab-twin-{self.key(base)}"
        try:
            where.mkdir(parents=True, exist_ok=True)
            self._lock = open(where / ".lock", "w")  # noqa: SIM115 - held for the session
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None
        return where

    def _pristine(self, python: Path, recorded: str) -> bool:
        """The environment holds what it held when built, after removing what the tests added (`reset`), and
        where it was built: a moved one's scripts (tensorboard, jupyter) start the old place's python."""
        try:
            if not _scripts_start(python):
                return False
            self.reset(python, recorded)
            return freeze(python) == recorded
        except (AssertionError, OSError, subprocess.SubprocessError):
            return False

    def reset(self, python: Path | None = None, recorded: str | None = None) -> None:
        """Uninstall what is not in the recorded freeze (CloudML and what its wheel brought: mapie)."""
        python = python or self.python_exe
        if python is None:
            return
        recorded = (
            recorded if recorded is not None else (python.parent.parent.parent / "freeze.txt").read_text()
        )
        names = {line.split("==")[0].split(" @ ")[0].lower() for line in recorded.splitlines() if line}
        added = [
            line.split("==")[0].split(" @ ")[0]
            for line in freeze(python).splitlines()
            if line and line.split("==")[0].split(" @ ")[0].lower() not in names
        ]
        if added:
            subprocess.run(
                [str(python), "-m", "pip", "--disable-pip-version-check", "uninstall", "-y", "-q", *added],
                capture_output=True,
                text=True,
                timeout=600,
            )


def _scripts_start(python: Path) -> bool:
    """Whether every script of the environment of `python` whose first line names a python names this one
    (a virtual environment moved to another folder keeps its old place there, and its scripts fail)."""
    for script in python.parent.iterdir():
        try:
            with open(script, "rb") as f:
                first = f.readline(4096)
        except OSError:  # a folder, a dangling link
            continue
        words = first[2:].split() if first.startswith(b"#!") else []
        if words and b"python" in words[0] and Path(os.fsdecode(words[0])).parent != python.parent:
            return False
    return True


class TwinBuiltElsewhere(TwinEnvironment):
    """The Colab twin's environment as another process of the session builds it (under pytest-xdist, the
    controller: conftest.py), read from the outcome that process writes to `state` when its build ends."""

    def start(self) -> None:
        pass

    def python(self, timeout: float = 1800) -> Path:
        import time

        asked, t0 = time.time(), time.monotonic()
        deadline = t0 + timeout
        while not self.state.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Colab twin's environment was not built in {timeout:.0f} s")
            time.sleep(1)
        waited = self.state.parent / "asked.json"  # when the twin's tests first asked, for the suite's notes
        if not waited.exists():
            waited.write_text(json.dumps({"asked_at": asked, "waited_s": round(time.monotonic() - t0, 1)}))
        doc = json.loads(self.state.read_text())
        if doc["error"]:
            raise RuntimeError(f"the Colab twin's environment could not be built: {doc['error']}")
        self.python_exe, self.how, self.seconds = Path(doc["python"]), doc["how"], doc["seconds"]
        return self.python_exe


def colab_versions(python: Path) -> dict[str, str]:
    """What the environment of `python` holds of the packages COLAB_CONSTRAINTS pins, and its Python and
    torch's CUDA build: {"python": "3.13.0", "torch": "2.11.0+cu130", "torch.cuda": "13.0", ...}."""
    ask = (
        "import importlib.metadata as m, json, platform, sys, torch\n"
        "out = {'python': platform.python_version(), 'torch.cuda': str(torch.version.cuda)}\n"
        "out.update({n: m.version(n) for n in sys.argv[1:]})\n"
        "print(json.dumps(out))"
    )
    r = subprocess.run([str(python), "-c", ask, *colab_pins()], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def drifted_from_colab(versions: dict[str, str]) -> list[str]:
    """Each package whose version is not COLAB_CONSTRAINTS' (a local build tag such as +cu130 aside)."""
    return [
        f"{name} {versions.get(name)} (Colab: {pin})"
        for name, pin in colab_pins().items()
        if (versions.get(name) or "").split("+")[0] != pin
    ]


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def minimal_path() -> str:
    """A PATH for the twin's kernel holding system tools only: no environment's bin (no `tensorboard`)."""
    return os.pathsep.join(p for p in ("/usr/bin", "/bin") if os.path.isdir(p))
