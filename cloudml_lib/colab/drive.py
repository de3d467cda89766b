"""The CloudML folder (on Drive in Colab), the data check, the preprocessing cache and the memory
diagnostics: the setup notebook's cells, and the config every notebook run uses.

With CLOUDML_SMOKE=1 (the headless test) everything uses the demo flights, a tiny run, and a
workspace in `.cloudml_smoke/`.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cloudml_lib.base.config import Config, load_config, renamed_keys
from cloudml_lib.base.errors import CloudMLError, install_command
from cloudml_lib.base.logs import attach_run_log
from cloudml_lib.colab.live import NotebookLog, folded_log
from cloudml_lib.colab.profile import choose, profile
from cloudml_lib.colab.show import plural, show_markdown, table, user_errors
from cloudml_lib.commands import presets
from cloudml_lib.core.machine import device
from cloudml_lib.core.network.compile import this_device
from cloudml_lib.data import flights, synthetic
from cloudml_lib.data.synthetic import ensure_demo_flights

# Colab's /content (CLOUDML_CONTENT moves it: the tests' twin of Colab), the Drive mounted in it, the CloudML
# folder on Drive, and the cache on the VM's local disk (fast, lost at a disconnect)
CONTENT = Path(os.environ.get("CLOUDML_CONTENT", "/content"))
DRIVE_ROOT = CONTENT / "drive" / "MyDrive" / "CloudML"
VM_CACHE = CONTENT / "cloudml_cache"


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
        # by generator version: the flights an earlier version wrote stay for the runs made on them
        return self.root / f"demo_flights_v{synthetic.DEMO_VERSION}"


def user_folder() -> Path:
    """The user's CloudML folder: on Drive in Colab (mounted if needed), else CLOUDML_HOME or ./CloudML."""
    if device.is_colab():
        if not (CONTENT / "drive" / "MyDrive").is_dir():
            from google.colab import drive

            drive.mount(str(CONTENT / "drive"))
        return DRIVE_ROOT
    return Path(os.environ.get("CLOUDML_HOME", "CloudML")).resolve()


@user_errors
def workspace() -> Workspace:
    """The CloudML folder: on Drive in Colab (mounted if needed), ./CloudML elsewhere
    (CLOUDML_HOME overrides), the profile's own in the smoke test. Creates data/, runs/, cache/. Where the
    notebooks' flow starts: the profile (profile.py) is chosen here."""
    root = choose().root or user_folder()
    # the library's warnings in this kernel: once each, with their level word (Colab's root logger has a
    # handler of its own, which printed them a second time without it)
    attach_run_log(None, screen=NotebookLog())  # a warning in amber, a problem in red, as every notice
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
    report = presets.system_report()
    print(presets.format_machine(report))
    if not report["gpu"] and not report.get("torch_build_problem"):  # else: a GPU this torch cannot use
        print("No GPU: in Colab choose Runtime > Change runtime type > T4 GPU, then run all cells again.")


# ------------------------------------------------------------------------------- which data, which config

CPU_EPOCHS = 2  # Auto without a GPU on the user's flights: a short run that shows the pipeline working
CPU_ADVICE = (
    "Preset: no GPU was found, and training your flights on the CPU is slow (hours per epoch even with "
    f"preset C, the smallest model). The training notebook's Auto trains preset C for {CPU_EPOCHS} epochs, "
    "to try it out; for a real training choose Runtime > Change runtime type > T4 GPU and run all again."
)


def cpu_advice(rows: int | None) -> str:
    """The setup's preset line without a GPU on the user's flights: what the training notebook's Auto does
    there, by the picker's rule (frames too small for preset C: the demo configuration)."""
    if preset_refusal("C", rows):
        return (
            f"Preset: no GPU was found. Your flights' frames have {rows} sensor rows, fewer than presets A, "
            f"B and C need ({preset_rows('C')}): the training notebook's Auto trains the demo configuration "
            "on them (a narrow model that trains on a CPU too)."
        )
    return CPU_ADVICE


SMALL = (
    "small"  # the demo configuration on the user's own flights: for frames of fewer rows than the presets'
)
FIXED_PRESETS = ("A", "B", "C")  # the GPU presets: the real camera's rows (data.swath_slice [40, 480])


def preset_rows(preset: str) -> int:
    """The sensor rows a preset's frames must have (the end of its data.swath_slice)."""
    name = "demo" if preset == SMALL else preset
    return int(load_config(presets.preset_config_path(name)).data.swath_slice[1])


def frame_rows(ws: Workspace) -> int | None:
    """The fewest sensor rows among the IR frames of the complete flights in data/ (each IR file's shape,
    no frame read); None without a flight whose shape reads."""
    shape = frame_shape(ws.data)
    return None if shape is None else shape[0]


def frame_shape(folder: Path) -> tuple[int, int] | None:
    """The smallest (rows, columns) of the IR frames of the complete flights in `folder` (each IR file's
    shape, no frame read); None without a flight whose shape reads."""
    import h5py

    data = load_config(presets.preset_config_path("A"), [f"data.dir={folder}"]).data
    rows, cols = [], []
    try:
        found = [f for f in flights.find_flights(data) if not f.problems]
    except CloudMLError:
        return None
    for f in found:
        try:
            with h5py.File(Path(data.dir) / f.files["ir"], "r") as h5:
                shape = h5[data.keys.ir_signal].shape
            if len(shape) == 3:
                rows.append(int(shape[1]))
                cols.append(int(shape[2]))
        except (OSError, KeyError, ValueError, TypeError):  # the flight table names what is wrong with it
            continue
    return (min(rows), min(cols)) if rows else None


def cached_samples(cfg: Config, count: str = "samples") -> dict[str, int]:
    """Samples per flight in the preprocessing cache the run will use (its flight caches' meta.json; the
    newest where a flight has several): {} before the setup notebook built it. `count`: "samples", those
    with a height (what an epoch trains on), or "cloud_samples", every frame a cloud label matched (what the
    end of a run reads: the probe, the scoring); a cache without that count gives "samples"."""
    from cloudml_lib.base.shapes import Damaged, read_json
    from cloudml_lib.data.cache import cache_root
    from cloudml_lib.data.cachefiles import CACHE_META, CACHE_META_LIMIT

    found: dict[str, tuple[float, int]] = {}
    root = cache_root(cfg.data)
    for meta in sorted(root.glob("*/meta.json")) if root.is_dir() else []:
        try:
            doc = read_json(meta, CACHE_META, CACHE_META_LIMIT)
            when, counts = meta.stat().st_mtime, doc["counts"]
            n = counts.get(count, counts.get("samples"))
        except (OSError, Damaged):
            continue
        if isinstance(n, int) and (doc["flight"] not in found or when > found[doc["flight"]][0]):
            found[doc["flight"]] = (when, n)
    return {k: n for k, (_, n) in found.items()}


def preset_refusal(preset: str, rows: int | None) -> str | None:
    """Why a preset cannot take frames of `rows` sensor rows, in plain words with what would; None: it can."""
    if rows is None or preset not in FIXED_PRESETS or rows >= preset_rows(preset):
        return None
    need = preset_rows(preset)
    return (
        f"preset {preset} is made for the ER-2 camera's frames: it keeps sensor rows 40 to {need} and needs "
        f"frames of at least {need} rows, but your flights' frames have {rows} rows (make-demo-data writes "
        f"{rows}-row frames unless given --size). Choose Auto: it takes the demo configuration, made for "
        f"frames of at least {preset_rows(SMALL)} rows; or put flights of the real camera in data/"
    )


def fits_presets(ws: Workspace) -> bool:
    """Whether the GPU presets take the frames of the flights in data/ (True without flights to judge)."""
    rows = frame_rows(ws)
    return rows is None or rows >= min(preset_rows(p) for p in FIXED_PRESETS)


def _found_config(ws: Workspace) -> Config:
    """The config flights are found with by their file names (no file is opened): the presets'."""
    return load_config(presets.preset_config_path("A"), [f"data.dir={ws.data}"])


def _real_config(ws: Workspace) -> Config:
    """The config the flights in data/ are judged and cached with: preset A's, or the demo configuration's
    where the frames are too small for the presets (and for no other reason)."""
    if fits_presets(ws):
        return load_config(presets.preset_config_path("A"), [f"data.dir={ws.data}"])
    return load_config(presets.preset_config_path("demo"), [f"data.dir={ws.data}", "data.demo=false"])


def complete_flights(ws: Workspace) -> list[str]:
    """Names of the complete flights in the data folder (found by their file names; nothing is read)."""
    try:
        return [f.name for f in flights.find_flights(_found_config(ws).data) if not f.problems]
    except CloudMLError:
        return []


def uses_demo_data(ws: Workspace) -> bool:
    """True when no complete flight is in the data folder (or the profile uses the demo alone)."""
    return profile().demo_only or not complete_flights(ws)


def default_heldout(ws: Workspace) -> tuple[list[str], str]:
    """The test flight(s) a run uses unless the user picks others: the presets' (12Feb25) when it is a
    complete flight here, else the newest complete flight; with a sentence saying which and why."""
    if uses_demo_data(ws):
        return [], "the demo's test flight"
    found = complete_flights(ws)
    wanted_list = load_config(presets.preset_config_path("A")).data.test_flights  # the presets' choice
    preset = [f for f in wanted_list if f in found]
    if preset:
        return preset, f"the presets' test flight {', '.join(preset)}"
    wanted = ", ".join(wanted_list)
    return found[-1:], (
        f"{found[-1]}, because the presets' test flight {wanted} is not among the complete "
        "flights found; choose others in the picker"
    )


def _listed(names: list[str]) -> str:
    return ", ".join(names) or "none"


@dataclass
class RunFlights:
    """The flights a run trained on (as its config.yaml records them) against the complete flights in
    data/ now, by name. A run never changes its flights: the notebook continues it on these (new flights
    in data/ are for a new run) and says so, in these words, when some of them are gone."""

    run: str  # the run's name
    entries: list[dict]  # its data.flights, as recorded: what a continued run is given again
    heldout: list[str]
    now: list[str]  # the complete flights in data/ now
    incomplete: dict = field(default_factory=dict)  # flights in data/ with a file missing: name -> what

    @property
    def names(self) -> list[str]:
        return [e["name"] for e in self.entries]

    @property
    def added(self) -> list[str]:
        return [f for f in self.now if f not in self.names]

    @property
    def removed(self) -> list[str]:
        return [f for f in self.names if f not in self.now]

    def missing_words(self, finished: bool) -> str:
        """Some of the run's flights are not in data/: what that means and what the user can do."""
        held, k = [f for f in self.removed if f in self.heldout], len(self.removed)
        partly = {f: self.incomplete[f] for f in self.removed if f in self.incomplete}
        absent = [f for f in self.removed if f not in partly]
        gone = (
            f"{k} of the {len(self.names)} flights run {self.run} trained on {'is' if k == 1 else 'are'} "
            "not complete in data/ now: "
            + "; ".join(
                [f"{f} is there, but incomplete ({why})" for f, why in partly.items()]
                + ([f"{_listed(absent)} {'is' if len(absent) == 1 else 'are'} not there"] if absent else [])
            )
            + (f" (test flights: {_listed(held)})" if held else "")
            + ". If Google Drive has not synced yet, wait a minute and run this cell again."
        )
        if len(self.now) < 2:  # no new run either: it needs one flight to train on and one to test on
            new = (
                "A new run needs two flights in data/ (one to train on, one to test it on): "
                f"{'only ' + _listed(self.now) + ' is' if self.now else 'none is'} complete there now."
            )
            if finished:
                return (
                    f"{gone} Its results are shown as it was trained; training it longer needs "
                    f"{_listed(self.removed)} back in data/. {new}"
                )
            return (
                f"{gone} The run continues only on the flights it started with: put them back in data/ and "
                f"run this cell again. {new}"
            )
        if finished:
            return (
                f"{gone} Its results are shown as it was trained. Training it longer would need "
                f"{_listed(self.removed)} back in data/; to train on the flights there now "
                f"({_listed(self.now)}), choose 'Start a new run' in the picker."
            )
        return (
            f"{gone} The run continues only on the flights it started with: put them back in data/ and "
            f"run this cell again, or choose 'Start a new run' in the picker to train on the "
            f"{plural(len(self.now), 'flight')} there now."
        )

    def added_words(self) -> str:
        return (
            f"New in data/ since run {self.run} started: {_listed(self.added)}. A run keeps the flights it "
            f"started with ({_listed(self.names)}); to train on all {len(self.now)}, choose 'Start a new "
            "run' in the picker."
        )


def run_flights(ws: Workspace, run_dir: Path, now: list[str] | None = None) -> RunFlights | None:
    """The flights of the run in `run_dir` against data/ now (`now`: the complete flights, when known);
    None for a run that has recorded none, or one on the demo flights (they never change)."""
    from cloudml_lib.base.runfiles import RunFiles

    run_dir = Path(run_dir)
    data = ((RunFiles(run_dir).config() if run_dir.is_dir() else None) or {}).get("data") or {}
    flights = data.get("flights") if isinstance(data.get("flights"), list) else []
    entries = [e for e in flights if isinstance(e, dict) and isinstance(e.get("name"), str)]
    if not entries or data.get("demo"):
        return None
    held = renamed_keys({"data": data})["data"].get("test_flights")  # an earlier run: validation_flights
    held = held if isinstance(held, list) else []
    now = complete_flights(ws) if now is None else now
    return RunFlights(
        run_dir.name, entries, [f for f in held if isinstance(f, str)], list(now), incomplete_flights(ws)
    )


def demo_folder_of(run_dir: Path) -> str | None:
    """The folder of demo flights a run on the demo was trained on, as its config.yaml records it (None: not
    a demo run, or none recorded): an earlier CloudML's demo run continues on its own flights, not on the
    demo this version writes elsewhere."""
    from cloudml_lib.base.runfiles import RunFiles

    data = ((RunFiles(run_dir).config() if Path(run_dir).is_dir() else None) or {}).get("data") or {}
    folder = data.get("dir")
    return folder if data.get("demo") is True and isinstance(folder, str) and folder else None


def incomplete_flights(ws: Workspace) -> dict[str, str]:
    """The flights in data/ that lack a file (or whose files are wrong): name -> what, in words."""
    try:
        return {
            f.name: "; ".join(f.problems) for f in flights.find_flights(_found_config(ws).data) if f.problems
        }
    except CloudMLError:
        return {}


def _cache_overrides(ws: Workspace, sub: str) -> list[str]:
    """Where the cache lives: the VM's local disk with a lasting copy on Drive in Colab (and where the
    profile exercises that path); the workspace's cache folder elsewhere."""
    if device.is_colab() or profile().cache_copy:
        local = VM_CACHE if device.is_colab() else ws.root / "vm_local_cache"
        return [f"data.cache_dir={local / sub}", f"data.cache_copy_dir={ws.cache / sub}"]
    return [f"data.cache_dir={ws.cache / sub}", "data.cache_copy_dir="]


def run_config(
    ws: Workspace,
    preset: str,
    epochs: int | None = None,
    heldout: list[str] | None = None,
    demo: bool | None = None,
) -> tuple[Path, list[str]]:
    """The config file and overrides a notebook run uses: the preset on the real flights (with the chosen
    test flights), or the demo configuration on the demo flights. `demo`: which of the two (a run
    the user started keeps its kind, whatever data/ holds now); None: the demo when no real flight is
    there. Preset SMALL: the demo configuration on the real flights (frames too small for A, B, C)."""
    on_demo = uses_demo_data(ws) if demo is None else demo
    if on_demo:
        path, over = (
            presets.preset_config_path("demo"),
            [f"data.dir={ws.demo}"] + _cache_overrides(ws, "demo") + profile().overrides,
        )
    elif preset == SMALL:  # the demo configuration on the user's flights (frames too small for A, B, C)
        path = presets.preset_config_path("demo")
        # as the presets do: a flight that lacks a file is listed and skipped, not a stop for the others
        over = [f"data.dir={ws.data}", "data.demo=false", "data.skip_incomplete_flights=true"]
        over += _cache_overrides(ws, "flights")
    else:
        path = presets.preset_config_path(preset if preset in FIXED_PRESETS else "C")
        over = [f"data.dir={ws.data}"] + _cache_overrides(ws, "flights")
        if this_device().type == "cpu":
            # a preset in a notebook without a GPU is a try-out (Auto: 2 epochs of C), too short to win back
            # compiling's first minute on a CPU; the presets compile for the GPU
            over.append("train.torch_compile=false")
    if not on_demo:
        over.append(f"data.test_flights=[{', '.join(heldout if heldout else default_heldout(ws)[0])}]")
    epochs = profile().epochs(epochs)
    if epochs:
        over.append(f"train.epochs={epochs}")
    return path, over


# ------------------------------------------------------------------------------- the setup notebook's cells


@user_errors
def verify_data(ws: Workspace) -> bool:
    """One table: each flight found, its three files, frames, lidar profiles, labels kept and removed by
    each filter, or what is missing (long problems as numbered notes under it). Without real flights,
    writes the demo flights (progress bar). Returns True when every flight found is usable."""
    started, demo = time.time(), uses_demo_data(ws)
    if demo and not profile().demo_only:
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
    cfg = load_config(*run_config(ws, "A" if demo or fits_presets(ws) else SMALL))
    with folded_log("How each flight was read"):  # the table first; the reading's details a click away
        data = ensure_demo_flights(cfg.data, profile().demo_frames)  # written (progress bar) when missing
        notes = flights.Notes()
        rows, ok = flights.check_rows(data, notes)
        _flights_table(ws, demo, started, rows, notes)
        _say_usable(ws, demo, ok, data, rows)
    return ok


def _flights_table(ws: Workspace, demo: bool, started: float, rows, notes) -> None:
    show_markdown(
        ("Demo flights" if demo else f"Your flights in `{ws.data}`")
        + f" (checked in {time.time() - started:.1f} s):\n\n"
        + flights.format_table(rows, markdown=True)
        + ("\n\n" + notes.text(markdown=True) if notes else "")
    )


def _say_usable(ws: Workspace, demo: bool, ok: bool, data, rows) -> None:
    """The line under the flights table: which flights a run can use, or why none."""
    usable = flights.usable_in(rows)
    if not ok and usable and data.skip_incomplete_flights:  # the line says what the table shows
        held, why = default_heldout(ws)
        print(
            "Flights marked missing or not usable are skipped (data.skip_incomplete_flights: true); "
            f"{plural(len(usable), 'flight')} can be used: {', '.join(usable)}. Test flight: "
            f"{why}."
        )
    elif not ok and usable:
        print(
            f"{plural(len(usable), 'flight')} can be used: {', '.join(usable)}. The flights marked missing "
            "or not usable stop a run of this configuration (data.skip_incomplete_flights is off): fix their "
            f"files, or move them out of {ws.data}, then run this notebook again."
        )
    elif not ok and not demo:
        print(
            "None of the flights found can be used: the notes under the table say why. Training needs two "
            f"usable flights in {ws.data}; fix or replace the files, then run this notebook again."
        )
    found = [] if demo else complete_flights(ws)
    if len(found) == 1:
        print(
            f"Only one complete flight ({found[0]}): training needs a second one, one to train on and one "
            f"to test it on. Add a second flight to {ws.data}, then run this notebook again."
        )


def ensure_package(module: str, requirement: str, why: str, without: str) -> bool:
    """`module` importable by this Python: installed with pip (`requirement`) when missing, saying `why`;
    False, with what pip said, what that means (`without`) and how to try again, when that fails."""
    if importlib.util.find_spec(module) is not None:
        return True
    print(f"{why}: installing {requirement} now (about a minute)...")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", requirement], capture_output=True, text=True
    )
    importlib.invalidate_caches()
    if r.returncode == 0 and importlib.util.find_spec(module) is not None:
        print(f"{module} installed.")
        return True
    tail = (r.stderr or r.stdout or "").strip().splitlines()[-3:]
    said = "\n  ".join(tail) or f"exit status {r.returncode}"
    print(
        f"{module} could not be installed, {without}. pip said:\n  {said}\n"
        f"To try again: `{install_command(requirement)}` in a cell (needs the internet), then run this cell "
        "again."
    )
    return False


@user_errors
def fetch_era5(ws: Workspace) -> dict:
    """Each flight's ERA5 files (the atmosphere a run can read, data.atmosphere): a table of what lies beside
    each flight; what is missing fetched from the Climate Data Store with the user's key (the notebook's
    secret CDSAPI_KEY, or ~/.cdsapirc), the client installed on demand (commands/era5.py). Without a key it
    says how to add one; nothing else depends on this cell."""
    from cloudml_lib.commands import era5 as fetching
    from cloudml_lib.data import predictors

    cfg = load_config(*run_config(ws, "A" if uses_demo_data(ws) or fits_presets(ws) else SMALL))
    data, _ = flights.prepare_flights(cfg.data, check_names=False)
    have = {f.name: predictors.flight_files(f, data) for f in data.flights}
    rows = [[n, ", ".join(p.name for p in files) or "none"] for n, files in have.items()]
    show_markdown("**ERA5 beside each flight:**\n\n" + table(["flight", "ERA5 files"], rows))
    missing = [n for n, files in have.items() if not files]
    result = {"flights": len(have), "missing": missing, "fetched": []}
    if not missing:
        print(
            "Every flight has its ERA5 files: a run with data.atmosphere can read each flight's atmosphere."
        )
        return result
    if fetching.colab_key() is None and not os.environ.get("CDSAPI_KEY") and not fetching.has_rc():
        print(
            f"No ERA5 for {', '.join(missing)}. The network and the atmosphere baselines can read each "
            "flight's atmosphere once its ERA5 files are there. To fetch them here you need "
            f"{fetching.KEY_HELP}; then run this cell again. Training works without them (on the frames "
            "alone)."
        )
        return result
    if not ensure_package(
        "cdsapi", fetching.CDSAPI, "ERA5 comes from the Climate Data Store's client", "so no ERA5 is fetched"
    ):
        return result
    with folded_log("How the ERA5 requests went"):
        done = fetching.fetch(cfg, missing)
    result["fetched"] = done["fetched"]
    print(f"Fetched {plural(len(done['fetched']), 'ERA5 file')} for {', '.join(missing)}.")
    return result


CACHE_WORDS = {"reused": "already on this machine", "copied": "copied from the Drive copy", "built": "built"}


@user_errors
def build_cache(ws: Workspace) -> dict:
    """Preprocess every complete flight once (progress bars), on the VM's local disk with a copy on Drive;
    a flight whose cache is on Drive is copied back instead of rebuilt. Says where and how long."""
    from cloudml_lib.data.cache import cache_root, load_caches

    cfg = load_config(*run_config(ws, "A" if uses_demo_data(ws) or fits_presets(ws) else SMALL))
    started = time.time()
    with folded_log("How each flight was cached"):  # the table first; the details a click away
        data, _ = flights.prepare_flights(cfg.data, check_names=False)  # any flight may be a test flight
        caches = load_caches(data)
        rows = [
            [c.name, CACHE_WORDS[c.source], f"{c.seconds:.1f} s", len(c), f"{c.meta['bytes'] / 1e6:.1f} MB"]
            for c in caches
        ]
        size, samples = sum(c.meta["bytes"] for c in caches), sum(len(c) for c in caches)
        kept = cfg.data.cache_copy_dir
        copy = f"; a copy for later sessions in `{kept}`" if kept else ""
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
    """The machine and plain-words advice; without a GPU on the user's flights, the preset line says what the
    training notebook does there (the command line's advice, the demo configuration, is not for them)."""
    frames = list(ws.cache.rglob("frames.npy"))
    report = presets.system_report({"data": str(ws.data), "cache": str(ws.cache), "runs": str(ws.runs)})
    print(presets.format_machine(report))
    print("\nRecommendations:")
    lines = presets.recommendations(report, sum(f.stat().st_size for f in frames) if frames else None)
    if not report["gpu"] and lines[0].startswith("Preset: ") and not uses_demo_data(ws):
        lines[0] = cpu_advice(frame_rows(ws))
    for line in lines:
        print(f"  - {line}")
    show_markdown(
        "**GPU memory of a training step**, each preset at its batch:\n\n"
        + presets.memory_table(
            report["gpu"]["free_bytes"] if report["gpu"] else None, markdown=True, runs=ws.runs
        )
    )


def free_gpu_memory() -> None:
    print(device.release_gpu_memory())


def check_setup(ws: Workspace, cache: dict | None) -> None:
    """What to do next; in the headless test, the profile's checks of the set-up instead."""
    if profile().after_setup(cache):
        return
    found = [] if uses_demo_data(ws) else complete_flights(ws)
    if len(found) == 1:  # said above the table's line: training refuses one flight, so setup is not done
        print(
            f"Setup is not finished: training needs a second flight in {ws.data} (only {found[0]} is "
            "there). Add one, then run this notebook again; the training notebook refuses a single flight."
        )
        return
    print("Setup done. Next: open colab_training.ipynb and choose Runtime > Run all.")
