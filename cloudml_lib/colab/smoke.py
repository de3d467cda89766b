"""The headless test of the notebooks (CLOUDML_SMOKE=1, `pytest --nbmake`): its tiny run, the simulated
disconnect, and the checks the notebooks' last cells make. Imported only in smoke mode; in normal use nothing
here runs."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
import urllib.parse
import urllib.request
from pathlib import Path

from cloudml_lib.colab.live import LiveView, read_records, run_live
from cloudml_lib.colab.show import show_markdown
from cloudml_lib.core.run.checkpoint import find_checkpoints, load_checkpoint, read_meta, verify
from cloudml_lib.core.run.folder import RunFolder

OVERRIDES = ["train.epochs=2", "checkpoint.every_steps=10", "train.log_every_steps=5"]
EPOCHS = 2
DEMO_FRAMES = 700  # frames per demo flight, half the demo's: the same flow at half the cost
DISCONNECT_STEP = 25


def check_cache(cache: dict | None) -> None:
    """The set-up notebook: the data check passed and the cache holds samples, copied to its lasting place."""
    assert cache and cache["flights"] == 5 and cache["samples"] > 250, cache
    copies = list(Path(cache["copy_dir"]).glob("*/meta.json"))
    assert len(copies) == 5, f"the cache was not copied to {cache['copy_dir']}: {copies}"
    print("Smoke test: setup checks passed.")


def simulate_disconnect(run_dir: Path, command: list[str]) -> None:
    """Kill the run at step DISCONNECT_STEP, as a Colab disconnect would; the Train cell then continues it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    show_markdown(f"**Smoke test:** a simulated disconnect, killing the run at step {DISCONNECT_STEP}.")
    view = LiveView(run_dir)
    code = run_live(command, view, {"CLOUDML_KILL_AT": f"step:{DISCONNECT_STEP}"})
    assert code == -signal.SIGKILL, f"the simulated disconnect did not happen (exit status {code})"
    # as a Colab disconnect and Run all would leave it: the bar stopped where the run was killed, with its
    # words (report_end's advice to run the cell again is the cell's next step here), its curves hidden (the
    # resumed view below draws every epoch again) and its log folded
    view.end(code, view.outcome("killed (as by a disconnect)", code))
    view.curves.layout.display = "none"


def check_run(run_dir: Path | None) -> None:
    """The training notebook: trained, checkpointed, resumed after the disconnect, evaluated, a whole flight
    predicted, TensorBoard serving the run."""
    if run_dir is None or not RunFolder.of(run_dir).is_finished():
        print("Smoke test not checked: the run was stopped before it finished (run all again to finish it).")
        return
    log = (RunFolder(run_dir).log).read_text()
    assert "Resumed from step" in log, "the second start did not resume"
    newest = find_checkpoints(RunFolder(run_dir))[0]
    assert verify(newest) is None and read_meta(newest)["finished"], (
        f"no finished, verified checkpoint: {newest}"
    )
    epochs = [r for r in read_records(RunFolder(run_dir).metrics) if r.get("kind") == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1)), epochs
    report = json.loads((RunFolder(run_dir).evaluation).read_text())
    assert report["overall"]["n"] > 50 and math.isfinite(report["overall"]["r2"]), report["overall"]
    assert load_checkpoint(RunFolder(run_dir).best)["model"]
    assert "## Test flights" in (RunFolder(run_dir).report).read_text(), "no report.md"
    assert list((run_dir / "predictions").glob("*_cbh.nc")), "no whole-flight prediction"
    from cloudml_lib.science.export import EXPORT_FILES

    missing = [n for n in EXPORT_FILES if not (run_dir / "export" / n).is_file()]
    assert not missing, f"the Export cell did not write {', '.join(missing)}"
    board = check_tensorboard_served(run_dir)
    print(
        f"Smoke test passed: trained {EPOCHS} epochs, checkpointed, resumed after a disconnect at step "
        f"{DISCONNECT_STEP}, evaluated (test R2 {report['overall']['r2']:.2f}), whole flight predicted, "
        "exported"
        f"{board}."
    )


def check_tensorboard_served(run_dir: Path, wait_s: float = 60.0) -> str:
    """Smoke test: the TensorBoard the notebook started serves this run's curves (one value per step); then
    it is stopped, as the headless kernel's end would leave it running."""
    from cloudml_lib.core.run.events import has_tensorboard

    if not has_tensorboard():
        return ""
    from tensorboard import manager

    deadline, mine = time.time() + wait_s, []
    while True:  # a start that outlasted the manager's wait (a loaded machine) is still coming up
        mine = [i for i in manager.get_all() if Path(i.logdir).resolve() == run_dir.parent.resolve()]
        if mine or time.time() > deadline:
            break
        time.sleep(1.0)
    assert mine, f"no TensorBoard was started for {run_dir.parent} (none serves it after {wait_s:.0f} s)"
    name = f"{run_dir.name}/tensorboard"
    url = f"http://localhost:{mine[0].port}/data/plugin/scalars/scalars?" + urllib.parse.urlencode(
        {"run": name, "tag": "train/loss"}
    )
    try:
        deadline, steps = time.time() + wait_s, []
        while time.time() < deadline and not steps:
            try:
                steps = [row[1] for row in json.loads(urllib.request.urlopen(url, timeout=5).read())]
            except OSError:  # not loaded yet (400 until the run is found)
                time.sleep(1.0)
        assert steps, (
            f"TensorBoard at port {mine[0].port} did not serve {name}'s train/loss within {wait_s:.0f} s"
        )
        assert steps == sorted(set(steps)), f"TensorBoard shows repeated steps after the resume: {steps}"
    finally:
        for info in mine:
            try:
                os.kill(info.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return f", TensorBoard served {len(steps)} loss values, one per step"
