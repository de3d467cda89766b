"""What the two Colab notebooks call, one function per cell: the workspace on Drive, the data
check, the cache, diagnostics, the preset picker, training with live curves, monitoring and
evaluation.

Training runs as a subprocess (`python -m cloudml_lib train ...`, the same command as in a
terminal) while the notebook redraws the curves from `metrics.jsonl`: re-running the notebook is
re-running the command, which resumes; the interrupt button sends the run SIGINT, which stops it at
the next step with a checkpoint; and the GPU memory is released when the run ends.

With CLOUDML_SMOKE=1 (the headless test) everything uses the demo flights, a tiny run, and a
workspace in `.cloudml_smoke/`; the training notebook then also checks itself.
"""
from __future__ import annotations

import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cloudml_lib import hardware, plots
from cloudml_lib.checkpoint import find_checkpoints, load_checkpoint, read_meta, verify
from cloudml_lib.config import Config, load_config
from cloudml_lib.data import flights
from cloudml_lib.data.synthetic import ensure_demo_flights
from cloudml_lib.errors import CloudMLError
from cloudml_lib.evaluate import format_report
from cloudml_lib.rundir import format_status, run_status

DRIVE_ROOT = Path("/content/drive/MyDrive/CloudML")
SMOKE_EPOCHS, SMOKE_DISCONNECT_STEP = 2, 25
SMOKE_OVERRIDES = ["train.epochs=2", "checkpoint.every_steps=10", "train.log_every_steps=5"]


def smoke() -> bool:
    return os.environ.get("CLOUDML_SMOKE") == "1"


def _show(obj) -> None:
    """Markdown in a notebook, plain text elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(obj))
            return
    except ImportError:
        pass
    print(obj)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- workspace

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


def workspace() -> Workspace:
    """The CloudML folder: on Drive in Colab (mounted if needed), ./CloudML elsewhere
    (CLOUDML_HOME overrides), .cloudml_smoke in the smoke test. Creates data/, runs/, cache/."""
    if smoke():
        root = Path(".cloudml_smoke").resolve()
    elif hardware.is_colab():
        if not Path("/content/drive/MyDrive").is_dir():
            from google.colab import drive
            drive.mount("/content/drive")
        root = DRIVE_ROOT
    else:
        root = Path(os.environ.get("CLOUDML_HOME", "CloudML")).resolve()
    ws = Workspace(root)
    for d in (ws.data, ws.runs, ws.cache):
        d.mkdir(parents=True, exist_ok=True)
    where = "Google Drive" if str(root).startswith("/content/drive") else "this machine"
    print(f"CloudML folder on {where}: {root}\n  data/  your flights, as they came (one folder per flight is fine)\n"
          f"  runs/  one folder per training run\n  cache/ a lasting copy of the preprocessed frames")
    return ws


def show_environment() -> None:
    report = hardware.system_report()
    print(hardware.format_report(report))
    if not report["gpu"]:
        print("No GPU: in Colab choose Runtime > Change runtime type > T4 GPU, then run all cells again.")


# ------------------------------------------------------------------------------- data

VM_CACHE = Path("/content/cloudml_cache")       # the Colab VM's local disk: fast, lost at a disconnect


def _real_config(ws: Workspace) -> Config:
    return load_config(hardware.preset_config_path("A"), [f"data.dir={ws.data}"])


def uses_demo_data(ws: Workspace) -> bool:
    """True when no complete flight is in the data folder (or in the smoke test)."""
    if smoke():
        return True
    try:
        return not any(not f.problems for f in flights.find_flights(_real_config(ws).data))
    except CloudMLError:
        return True


def _cache_overrides(ws: Workspace, sub: str) -> list[str]:
    """Where the cache lives: the VM's local disk with a lasting copy on Drive in Colab (and, to
    exercise that path, in the smoke test); the workspace's cache folder elsewhere."""
    if hardware.is_colab() or smoke():
        local = VM_CACHE if hardware.is_colab() else ws.root / "vm_local_cache"
        return [f"data.cache_dir={local / sub}", f"data.cache_copy_dir={ws.cache / sub}"]
    return [f"data.cache_dir={ws.cache / sub}", "data.cache_copy_dir="]


def run_config(ws: Workspace, preset: str, epochs: int | None = None) -> tuple[Path, list[str]]:
    """The config file and overrides a notebook run uses: the preset on the real flights, or the
    demo configuration on the demo flights when the real ones are not there."""
    if uses_demo_data(ws):
        path, over = hardware.preset_config_path("demo"), [f"data.dir={ws.demo}"] + _cache_overrides(ws, "demo")
        if smoke():
            over += SMOKE_OVERRIDES
    else:
        path, over = hardware.preset_config_path(preset), [f"data.dir={ws.data}"] + _cache_overrides(ws, "flights")
    if epochs and not smoke():
        over.append(f"train.epochs={epochs}")
    return path, over


def verify_data(ws: Workspace) -> bool:
    """One table: each flight found, its three files, frames, labels kept and removed by each filter,
    or what is missing. Without real flights, writes the demo flights (progress bar).
    Returns True when every flight found is usable."""
    started, demo = time.time(), uses_demo_data(ws)
    if demo and not smoke():
        rows, _ = flights.check_rows(_real_config(ws).data)
        _show(f"**No complete flight in `{ws.data}`.** Put each flight's three files there (one folder per "
              "flight is fine) and run this notebook again. Until then the built-in demo flights are used, so "
              "that everything can be tried." + ("\n\nWhat was found:\n\n" + flights.format_table(
                  rows, markdown=True) if rows else ""))
    cfg = load_config(*run_config(ws, "A"))
    ensure_demo_flights(cfg.data)                     # writes them (progress bar) when missing
    rows, ok = flights.check_rows(cfg.data)
    _show(("Demo flights" if demo else f"Your flights in `{ws.data}`") + f" (checked in {time.time() - started:.1f} s):"
          "\n\n" + flights.format_table(rows, markdown=True))
    if not ok and cfg.data.skip_incomplete_flights:
        print("Flights marked missing are skipped (data.skip_incomplete_flights: true); the others are used.")
    return ok


def build_cache(ws: Workspace) -> dict:
    """Preprocess every flight once (progress bars), on the VM's local disk with a copy on Drive;
    a flight whose cache is on Drive is copied back instead of rebuilt. Says where and how long."""
    from cloudml_lib.data.cache import cache_root, load_caches
    cfg = load_config(*run_config(ws, "A"))
    started = time.time()
    flights.prepare_flights(cfg.data)
    caches = load_caches(cfg.data)
    words = {"reused": "already on this machine", "copied": "copied from the Drive copy", "built": "built"}
    rows = [[c.name, words[c.source], f"{c.seconds:.1f} s", len(c), f"{c.meta['bytes'] / 1e6:.1f} MB"]
            for c in caches]
    size, samples = sum(c.meta["bytes"] for c in caches), sum(len(c) for c in caches)
    copy = f"; a copy for later sessions in `{cfg.data.cache_copy_dir}`" if cfg.data.cache_copy_dir else ""
    _show(_table(["flight", "cache", "time", "samples", "size"], rows)
          + f"\n\n**Cache ready** in {time.time() - started:.1f} s: {samples} samples from {len(caches)} flights, "
            f"{size / 1e9:.3f} GB in `{cache_root(cfg.data)}`{copy}.")
    return {"samples": samples, "bytes": size, "flights": len(caches), "sources": [c.source for c in caches],
            "copy_dir": cfg.data.cache_copy_dir}


def show_diagnostics(ws: Workspace) -> None:
    frames = list(ws.cache.rglob("frames.npy"))
    report = hardware.system_report({"data": str(ws.data), "cache": str(ws.cache), "runs": str(ws.runs)})
    print(hardware.format_report(report))
    print("\nRecommendations:")
    for line in hardware.recommendations(report, sum(f.stat().st_size for f in frames) if frames else None):
        print(f"  - {line}")


def free_gpu_memory() -> None:
    print(hardware.free_gpu_memory())


def check_setup(ws: Workspace, cache: dict) -> None:
    """Smoke test: the data check passed and the cache holds samples."""
    if not smoke():
        print("Setup done. Next: open colab_training.ipynb and choose Runtime > Run all.")
        return
    assert cache["flights"] == 5 and cache["samples"] > 500, cache
    copies = list(Path(cache["copy_dir"]).glob("*/meta.json"))
    assert len(copies) == 5, f"the cache was not copied to {cache['copy_dir']}: {copies}"
    print("Smoke test: setup checks passed.")


# ------------------------------------------------------------------------------- presets

def show_presets() -> None:
    """The presets with their memory on a T4: measured where benchmarks/results/gpu.json has it."""
    measured = {}
    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu.json"
    if results.is_file():
        measured = {k: v.get("peak_reserved_gib") for k, v in json.loads(results.read_text())["presets"].items()}
    rows = []
    for name in ("A", "B", "C"):
        cfg = load_config(hardware.preset_config_path(name))
        mem = (f"{measured[name]:.1f} GiB (measured)" if measured.get(name)
               else f"about {hardware.PRESET_PEAK_GIB[name]:.0f} GiB (estimate, users' T4 runs)")
        rows.append([name, "/".join(map(str, cfg.channels)), "on" if cfg.model.gradient_checkpointing else "off",
                     cfg.train.torch_compile_mode if cfg.train.torch_compile else "no", cfg.train.batch_size, mem])
    _show(_table(["preset", "channels", "checkpointing", "compile", "batch", "GPU memory on a T4"], rows))


class Picker:
    """The preset picker: A, B, C or Auto, plus epochs and run name (ipywidgets 7 and 8)."""

    def __init__(self, ws: Workspace):
        import ipywidgets as widgets
        from IPython.display import display
        self.ws, self.demo = ws, uses_demo_data(ws)
        recommended, self.reason = hardware.choose_preset(hardware.system_report())
        default = recommended if recommended in ("A", "B", "C") else "Auto"
        epochs = load_config(hardware.preset_config_path("demo" if self.demo else default if default != "Auto"
                                                          else "A")).train.epochs
        style = {"description_width": "initial"}
        self.preset = widgets.Dropdown(options=["A", "B", "C", "Auto"], value=default, description="Preset:",
                                       style=style)
        self.epochs = widgets.IntText(value=SMOKE_EPOCHS if smoke() else epochs, description="Epochs:", style=style)
        self.run_name = widgets.Text(value=self._default_name(default), description="Run name:", style=style)
        self.crossval = widgets.Checkbox(value=False, description="Then leave-one-flight-out cross-validation "
                                         "(one run per flight: hours on real data)", style=style)
        self.preset.observe(self._follow_preset, names="value")
        display(widgets.VBox([self.preset, self.epochs, self.run_name, self.crossval]))
        print(f"Default: {default}, because {self.reason}.\nRe-running with the same run name continues that run.")
        if smoke():
            print("Smoke test: the choices above are not used; a tiny demo run (2 epochs) trains instead.")
        elif self.demo:
            print(f"No flights were found in {ws.data}: training uses the demo configuration (demo.yaml, "
                  f"{epochs} epochs) on the demo flights, whichever preset is chosen. Put your flights there and "
                  "run this notebook again to train a preset on them.")

    def _default_name(self, preset: str) -> str:
        return "smoke" if smoke() else "demo" if self.demo else f"preset_{preset}"

    def _follow_preset(self, change) -> None:
        """The run name follows the preset until the user types a name of their own."""
        if self.run_name.value.strip() == self._default_name(change["old"]):
            self.run_name.value = self._default_name(change["new"])

    @property
    def run_dir(self) -> Path:
        return self.ws.runs / (self.run_name.value.strip() or self._default_name(self.preset.value))

    def choice(self) -> tuple[str, int, str]:
        """(preset A/B/C/demo, epochs, run name) as the controls read now."""
        preset = self.preset.value
        if preset == "Auto":
            preset, why = hardware.choose_preset(hardware.system_report())
            print(f"Auto: preset {preset}, because {why}.")
        name = self.run_name.value.strip() or self._default_name(preset)
        return preset, int(self.epochs.value), name


def preset_picker(ws: Workspace) -> Picker:
    return Picker(ws)


# ------------------------------------------------------------------------------- training

def _command(ws: Workspace, picker: Picker) -> tuple[list[str], Path, Config]:
    """The training command for the picker's choice, its run directory and the config it resolves to."""
    preset, epochs, name = picker.choice()
    config, overrides = run_config(ws, preset if preset != "demo" else "A", epochs)
    run_dir = ws.runs / name
    cmd = [sys.executable, "-m", "cloudml_lib", "train", "--config", str(config), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd, run_dir, load_config(config, overrides)


def _read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass                            # a line being written right now
    return out


def _run_live(cmd: list[str], run_dir: Path, env: dict) -> tuple[int, list[str]]:
    """Run the training command, echo its lines, redraw the curves and a step bar until it ends."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", **env)
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    live = _LiveProgress(run_dir, started)
    try:
        while True:
            while not lines.empty():
                line = lines.get().rstrip()
                live.output.append(line)
                print(line)
            live.refresh()
            if proc.poll() is not None and lines.empty():
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("Stopping: the run saves a checkpoint at the next step (run this cell again to continue)...")
        proc.send_signal(signal.SIGINT)
        proc.wait()
    time.sleep(0.2)
    while not lines.empty():
        live.output.append(lines.get().rstrip())
    live.refresh()
    live.end(proc.returncode)
    return proc.returncode, live.output


class _LiveProgress:
    """The step bar and the curves of one start of a run. The bar is created only once this start's
    run.json gives the total (a widget's maximum does not follow a later change of `total`); a run
    that stopped and can resume keeps its bar, blue and partly filled, not a red one."""

    def __init__(self, run_dir: Path, started: float):
        self.run_dir, self.started, self.output = run_dir, started, []
        self.curves, self.bar, self.step = plots.LiveCurves(), None, 0

    def refresh(self) -> None:
        from tqdm.auto import tqdm
        info = _read_json(self.run_dir / "run.json")
        if self.bar is None and info and info.get("started_at", 0) >= self.started - 1:
            self.bar = tqdm(total=info["total_steps"], initial=info["start_step"], desc="training", unit="step")
        records = _read_records(self.run_dir)
        steps = [r["step"] for r in records if r.get("kind") in ("step", "epoch")]
        if steps and self.bar is not None:
            self.step = min(max(steps), self.bar.total)
            self.bar.n = self.step
            self.bar.refresh()
        self.curves.update([r for r in records if r.get("kind") == "epoch"])

    def end(self, code: int) -> None:
        words = {0: "finished", 130: "stopped with a checkpoint: run the cell again to continue",
                 -signal.SIGKILL: "killed (as by a disconnect): run the cell again to resume"}
        what = words.get(code, f"ended with exit status {code}")
        self.curves.note(f"No epoch finished in this run: {what}.")
        if self.bar is None:
            return
        if code == 0:
            self.bar.n = self.bar.total
            self.bar.close()
        elif code in words:                       # resumable: leave the bar as it stands, not a red "error"
            self.bar.set_description(f"training ({what.split(':')[0]} at step {self.step})")
            self.bar.refresh()
        else:
            self.bar.close()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train(ws: Workspace, picker: Picker) -> Path:
    """Train (or resume) the chosen preset with live curves; returns the run directory."""
    cmd, run_dir, cfg = _command(ws, picker)
    data = "the demo flights" if cfg.data.demo else f"your flights in {ws.data}"
    print(f"Training {Path(cmd[cmd.index('--config') + 1]).name} on {data}, {cfg.train.epochs} epochs; "
          f"run directory: {run_dir}")
    code, output = _run_live(cmd, run_dir, {})
    if code == 130:
        print("Stopped with a checkpoint. Run this cell again to continue where it left off.")
    elif code != 0:
        tail = "\n".join(output[-8:])
        raise CloudMLError(f"training ended with exit status {code}:\n{tail}")
    return run_dir


def crossval(ws: Workspace, picker: Picker) -> Path | None:
    """With the picker's cross-validation box ticked: every flight held out once, with baselines
    (the same `python -m cloudml_lib crossval` command, resumable: run the cell again after a
    disconnect). Shows crossval.md. Returns the cross-validation folder, or None when not asked for."""
    if not picker.crossval.value:
        print("Cross-validation not asked for (tick the box in the preset picker, then run this cell).")
        return None
    cmd, run_dir, _ = _command(ws, picker)
    cv_dir = run_dir.with_name(run_dir.name + "_crossval")
    cmd[cmd.index("train")] = "crossval"
    cmd[cmd.index("--run-dir") + 1] = str(cv_dir)
    print(f"Cross-validation into {cv_dir} (run this cell again to continue after a disconnect)")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, TQDM_DISABLE="1"))
    if proc.returncode != 0:
        raise CloudMLError(f"cross-validation ended with exit status {proc.returncode}:\n"
                           + "\n".join(proc.stdout.splitlines()[-8:]))
    _show((cv_dir / "crossval.md").read_text())
    return cv_dir


def show_report(run_dir: Path) -> None:
    """RUN_DIR/report.md: its text as Markdown, each linked plot as an image (a notebook does not
    resolve the report's relative image paths itself)."""
    import re

    from IPython.display import Image, display
    path = run_dir / "report.md"
    if not path.is_file():
        print(f"No report yet in {run_dir}: training has not finished.")
        return
    text = []
    for line in path.read_text().splitlines() + [""]:
        image = re.fullmatch(r"!\[[^\]]*\]\(([^)]+)\)", line.strip())
        if image is None:
            text.append(line)
            continue
        if "".join(text).strip():
            _show("\n".join(text))
        text = []
        if (run_dir / image.group(1)).is_file():
            display(Image(filename=str(run_dir / image.group(1))))
    if "".join(text).strip():
        _show("\n".join(text))
    print(f"The same page for GitHub or a Markdown viewer: {path}")


def simulate_disconnect(ws: Workspace, picker: Picker) -> None:
    """Smoke test only: start the run and kill it hard mid-epoch, as a Colab disconnect would."""
    if not smoke():
        print("(Only in the smoke test: a simulated disconnect, to check that training resumes.)")
        return
    cmd, run_dir, _ = _command(ws, picker)
    shutil.rmtree(run_dir, ignore_errors=True)
    code, _ = _run_live(cmd, run_dir, {"CLOUDML_KILL_AT": f"step:{SMOKE_DISCONNECT_STEP}"})
    assert code == -signal.SIGKILL, f"the simulated disconnect did not happen (exit status {code})"
    print(f"Simulated disconnect at step {SMOKE_DISCONNECT_STEP}: the run was killed. The next cell resumes it.")


def check_smoke_run(run_dir: Path) -> None:
    """Smoke test: trained, checkpointed, resumed after the disconnect, evaluated."""
    if not smoke():
        return
    log = (run_dir / "train.log").read_text()
    assert "Resumed from step" in log, "the second start did not resume"
    newest = find_checkpoints(run_dir)[0]
    assert verify(newest) is None and read_meta(newest)["finished"], f"no finished, verified checkpoint: {newest}"
    epochs = [r for r in _read_records(run_dir) if r.get("kind") == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, SMOKE_EPOCHS + 1)), epochs
    report = json.loads((run_dir / "evaluation.json").read_text())
    assert report["overall"]["n"] > 100 and math.isfinite(report["overall"]["r2"]), report["overall"]
    assert load_checkpoint(run_dir / "best.pt")["model"]
    assert "## Held-out flights" in (run_dir / "report.md").read_text(), "no report.md"
    print(f"Smoke test passed: trained {SMOKE_EPOCHS} epochs, checkpointed, resumed after a disconnect at step "
          f"{SMOKE_DISCONNECT_STEP}, evaluated (held-out R2 {report['overall']['r2']:.2f}).")


# ------------------------------------------------------------------------------- monitor, evaluate

def show_status(run_dir: Path) -> None:
    """Where the run stands: for a second browser tab, or after a reconnect."""
    try:
        status = run_status(run_dir)
    except CloudMLError as e:
        print(e)
        return
    print(format_status(status))
    if status["latest_checkpoint_age_s"] is not None:
        print(f"Minutes since the last checkpoint: {status['latest_checkpoint_age_s'] / 60:.1f}")


def show_evaluation(run_dir: Path) -> None:
    """Per-flight and overall metrics against the baseline, the scatter plot, and where the files are."""
    from IPython.display import Image, display
    path = run_dir / "evaluation.json"
    if not path.exists():
        print(f"No evaluation yet in {run_dir}: training has not finished.")
        return
    print(format_report(json.loads(path.read_text())))
    scatter = run_dir / "plots" / "scatter.png"
    if scatter.exists():
        display(Image(filename=str(scatter)))
    print(f"Predictions: {run_dir / 'predictions.csv'}\nPlots: {run_dir / 'plots'}\nBest model: {run_dir / 'best.pt'}")
