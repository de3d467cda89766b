"""The CloudML folder (on Drive in Colab), the data check, the preprocessing cache and the memory
diagnostics: the setup notebook's cells, and the config every notebook run uses.

With CLOUDML_SMOKE=1 (the headless test) everything uses the demo flights, a tiny run, and a
workspace in `.cloudml_smoke/`.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from cloudml_lib import hardware
from cloudml_lib.colab.show import plural, show_markdown, table, user_errors
from cloudml_lib.config import Config, load_config
from cloudml_lib.data import flights
from cloudml_lib.data.flights import ensure_demo_flights
from cloudml_lib.errors import CloudMLError

# Colab's /content (CLOUDML_CONTENT moves it: the tests' twin of Colab), the Drive mounted in it, the CloudML
# folder on Drive, and the cache on the VM's local disk (fast, lost at a disconnect)
CONTENT = Path(os.environ.get("CLOUDML_CONTENT", "/content"))
DRIVE_ROOT = CONTENT / "drive" / "MyDrive" / "CloudML"
VM_CACHE = CONTENT / "cloudml_cache"


def smoke() -> bool:
    """The headless test of the notebooks (CLOUDML_SMOKE=1): a tiny demo run; its checks are smoke.py's."""
    return os.environ.get("CLOUDML_SMOKE") == "1"


def version() -> str:
    """The CloudML in use, in words: its version and, after a Colab install, the Drive copy it came from."""
    import cloudml_lib

    s = cloudml_lib.SOURCE
    if s.get("fingerprint"):
        return (
            f"{cloudml_lib.__version__} (copy {s['fingerprint'][:10]} of {s.get('copied_from')}, installed "
            f"{s.get('installed_at')})"
        )
    return f"{cloudml_lib.__version__} (from {Path(cloudml_lib.__file__).parent})"


@dataclass
class Workspace:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def demo(self) -> Path:
        return self.root / "demo_flights"


@user_errors
def workspace() -> Workspace:
    """The CloudML folder: on Drive in Colab (mounted if needed), ./CloudML elsewhere
    (CLOUDML_HOME overrides), .cloudml_smoke in the smoke test. Creates data/, runs/, cache/."""
    if smoke():
        root = Path(".cloudml_smoke").resolve()
    elif hardware.is_colab():
        if not (CONTENT / "drive" / "MyDrive").is_dir():
            from google.colab import drive

            drive.mount(str(CONTENT / "drive"))
        root = DRIVE_ROOT
    else:
        root = Path(os.environ.get("CLOUDML_HOME", "CloudML")).resolve()
    ws = Workspace(root)
    for d in (ws.data, ws.runs, ws.cache):
        d.mkdir(parents=True, exist_ok=True)
    where = "Google Drive" if str(root).startswith(str(CONTENT / "drive")) else "this machine"
    print(
        f"CloudML folder on {where}: {root}\n  data/  your flights, as they came (one folder per flight is "
        "fine)\n"
        f"  runs/  one folder per training run\n  cache/ a lasting copy of the preprocessed frames\n"
        f"(Python {platform.python_version()}, ipywidgets {_widgets_version()}: worth quoting when reporting "
        "a problem)"
    )
    return ws


def _widgets_version() -> str:
    try:
        import ipywidgets

        return ipywidgets.__version__
    except ImportError:
        return "not installed"


def show_environment() -> None:
    report = hardware.system_report()
    print(hardware.format_machine(report))
    if not report["gpu"]:
        print("No GPU: in Colab choose Runtime > Change runtime type > T4 GPU, then run all cells again.")


# ------------------------------------------------------------------------------- which data, which config


def _real_config(ws: Workspace) -> Config:
    return load_config(hardware.preset_config_path("A"), [f"data.dir={ws.data}"])


def complete_flights(ws: Workspace) -> list[str]:
    """Names of the complete flights in the data folder (found by their file names; nothing is read)."""
    try:
        return [f.name for f in flights.find_flights(_real_config(ws).data) if not f.problems]
    except CloudMLError:
        return []


def uses_demo_data(ws: Workspace) -> bool:
    """True when no complete flight is in the data folder (or in the smoke test)."""
    return smoke() or not complete_flights(ws)


def default_heldout(ws: Workspace) -> tuple[list[str], str]:
    """The held-out flight(s) a run uses unless the user picks others: the presets' (12Feb25) when it is a
    complete flight here, else the newest complete flight; with a sentence saying which and why."""
    if uses_demo_data(ws):
        return [], "the demo's held-out flight"
    found = complete_flights(ws)
    preset = [f for f in _real_config(ws).data.validation_flights if f in found]
    if preset:
        return preset, f"the presets' held-out flight {', '.join(preset)}"
    wanted = ", ".join(_real_config(ws).data.validation_flights)
    return found[-1:], (
        f"{found[-1]}, because the presets' held-out flight {wanted} is not among the complete "
        "flights found; choose others in the picker"
    )


def _cache_overrides(ws: Workspace, sub: str) -> list[str]:
    """Where the cache lives: the VM's local disk with a lasting copy on Drive in Colab (and, to
    exercise that path, in the smoke test); the workspace's cache folder elsewhere."""
    if hardware.is_colab() or smoke():
        local = VM_CACHE if hardware.is_colab() else ws.root / "vm_local_cache"
        return [f"data.cache_dir={local / sub}", f"data.cache_copy_dir={ws.cache / sub}"]
    return [f"data.cache_dir={ws.cache / sub}", "data.cache_copy_dir="]


def run_config(
    ws: Workspace, preset: str, epochs: int | None = None, heldout: list[str] | None = None
) -> tuple[Path, list[str]]:
    """The config file and overrides a notebook run uses: the preset on the real flights (with the chosen
    held-out flights), or the demo configuration on the demo flights when the real ones are not there."""
    if uses_demo_data(ws):
        path, over = (
            hardware.preset_config_path("demo"),
            [f"data.dir={ws.demo}"] + _cache_overrides(ws, "demo"),
        )
        if smoke():
            from cloudml_lib.colab.smoke import OVERRIDES

            over += OVERRIDES
    else:
        path = hardware.preset_config_path(preset if preset in ("A", "B", "C") else "C")
        over = [f"data.dir={ws.data}"] + _cache_overrides(ws, "flights")
        over.append(f"data.validation_flights=[{', '.join(heldout if heldout else default_heldout(ws)[0])}]")
    if epochs and not smoke():
        over.append(f"train.epochs={epochs}")
    return path, over


# ------------------------------------------------------------------------------- the setup notebook's cells


@user_errors
def verify_data(ws: Workspace) -> bool:
    """One table: each flight found, its three files, frames, lidar profiles, labels kept and removed by
    each filter, or what is missing (long problems as numbered notes under it). Without real flights,
    writes the demo flights (progress bar). Returns True when every flight found is usable."""
    started, demo = time.time(), uses_demo_data(ws)
    if demo and not smoke():
        notes = flights.Notes()
        rows, _ = flights.check_rows(_real_config(ws).data, notes)
        show_markdown(
            f"**No complete flight in `{ws.data}`.** Put each flight's three files there (one folder per "
            "flight is fine) and run this notebook again. Until then the built-in demo flights are used, so "
            "that everything can be tried."
            + (
                "\n\nWhat was found:\n\n"
                + flights.format_table(rows, markdown=True)
                + "\n\n"
                + notes.text(markdown=True)
                if rows
                else ""
            )
        )
    cfg = load_config(*run_config(ws, "A"))
    data = ensure_demo_flights(cfg.data)  # writes them (progress bar) when missing
    notes = flights.Notes()
    rows, ok = flights.check_rows(data, notes)
    show_markdown(
        ("Demo flights" if demo else f"Your flights in `{ws.data}`")
        + f" (checked in {time.time() - started:.1f} s):\n\n"
        + flights.format_table(rows, markdown=True)
        + ("\n\n" + notes.text(markdown=True) if notes else "")
    )
    if not ok and data.skip_incomplete_flights:
        held, why = default_heldout(ws)
        print(
            "Flights marked missing or not usable are skipped (data.skip_incomplete_flights: true); the "
            "other "
            f"{plural(len(complete_flights(ws)), 'flight')} are used. Held out for validation: {why}."
        )
    return ok


@user_errors
def build_cache(ws: Workspace) -> dict:
    """Preprocess every complete flight once (progress bars), on the VM's local disk with a copy on Drive;
    a flight whose cache is on Drive is copied back instead of rebuilt. Says where and how long."""
    from cloudml_lib.data.cache import cache_root, load_caches

    cfg = load_config(*run_config(ws, "A"))
    started = time.time()
    data, _ = flights.prepare_flights(
        cfg.data, check_names=False
    )  # any flight may be held out later: cache all
    caches = load_caches(data)
    words = {"reused": "already on this machine", "copied": "copied from the Drive copy", "built": "built"}
    rows = [
        [c.name, words[c.source], f"{c.seconds:.1f} s", len(c), f"{c.meta['bytes'] / 1e6:.1f} MB"]
        for c in caches
    ]
    size, samples = sum(c.meta["bytes"] for c in caches), sum(len(c) for c in caches)
    copy = f"; a copy for later sessions in `{cfg.data.cache_copy_dir}`" if cfg.data.cache_copy_dir else ""
    show_markdown(
        table(["flight", "cache", "time", "samples", "size"], rows)
        + f"\n\n**Cache ready** in {time.time() - started:.1f} s: {samples} samples from "
        f"{plural(len(caches), 'flight')}, {size / 1e9:.3f} GB in `{cache_root(cfg.data)}`{copy}."
    )
    return {
        "samples": samples,
        "bytes": size,
        "flights": len(caches),
        "sources": [c.source for c in caches],
        "copy_dir": cfg.data.cache_copy_dir,
    }


@user_errors
def show_diagnostics(ws: Workspace) -> None:
    frames = list(ws.cache.rglob("frames.npy"))
    report = hardware.system_report({"data": str(ws.data), "cache": str(ws.cache), "runs": str(ws.runs)})
    print(hardware.format_machine(report))
    print("\nRecommendations:")
    for line in hardware.recommendations(report, sum(f.stat().st_size for f in frames) if frames else None):
        print(f"  - {line}")
    show_markdown(
        "**GPU memory of a training step**, each preset at its batch:\n\n"
        + hardware.memory_table(report["gpu"]["free_bytes"] if report["gpu"] else None, markdown=True)
    )


def free_gpu_memory() -> None:
    print(hardware.release_gpu_memory())


def check_setup(ws: Workspace, cache: dict | None) -> None:
    """What to do next; in the headless test (CLOUDML_SMOKE=1), smoke.py's checks of the set-up instead."""
    if smoke():
        from cloudml_lib.colab.smoke import check_cache as check

        check(cache)
        return
    print("Setup done. Next: open colab_training.ipynb and choose Runtime > Run all.")
