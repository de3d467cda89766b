"""What the notebooks show: Markdown and tables, user errors without a traceback, the presets, a run's
status, its evaluation and its report.

A mistake the user can fix (a config, data or folder problem; a full disk) reaches a notebook as a
`UserError`: IPython shows its message and what to do instead of a traceback (`_render_traceback_`),
and "Run all" stops there, as it should before work that depends on the failed step.
"""

from __future__ import annotations

import functools
import hashlib
import html
import os
import re
import sys
import tempfile
from pathlib import Path

from cloudml_lib.base import tables
from cloudml_lib.base.config import load_config
from cloudml_lib.base.errors import CloudMLError, explain_os_error
from cloudml_lib.base.files import read_text
from cloudml_lib.commands import presets
from cloudml_lib.core.machine import device
from cloudml_lib.core.machine.memory import GIB
from cloudml_lib.core.network.compile import plan, this_device
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.status import format_status


def in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None
    except ImportError:
        return False


def show(obj) -> None:
    """A widget or display object in a notebook; its text elsewhere."""
    if in_notebook():
        from IPython.display import display

        display(obj)
    else:
        print(getattr(obj, "data", obj))


def show_markdown(text: str) -> None:
    if in_notebook():
        from IPython.display import Markdown

        show(Markdown(text))
    else:
        print(text)


def table(header: list[str], rows: list[list]) -> str:
    return tables.markdown(header, rows)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class UserError(Exception):
    """A problem the user can fix, shown in a notebook as its message alone (no traceback)."""

    def _render_traceback_(self) -> list[str]:
        red, bold, reset = "\x1b[31m", "\x1b[1m", "\x1b[0m"
        first, *rest = str(self).splitlines() or [""]
        return [
            f"{red}{bold}Problem:{reset} {first}",
            *rest,
            "(Nothing was lost. Fix this, then run this cell again, or Runtime > Run all.)",
        ]


def user_errors(fn):
    """A notebook cell's function: CloudMLError and disk errors become a UserError (no traceback)."""

    @functools.wraps(fn)
    def cell(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CloudMLError as e:
            raise UserError(str(e)) from None
        except OSError as e:
            message = explain_os_error(e)
            if message is None:
                raise
            raise UserError(message) from None

    return cell


# ------------------------------------------------------------------------------- presets


@user_errors
def show_presets(ws=None) -> None:
    """The presets with their GPU memory: estimated from the model (presets.preset_memory), and measured
    beside it where the GPU benchmark has measured it, and where a run of yours (`ws`'s runs) with the
    preset's step ran on this kind of device (core/machine/timing.py: run.json's "measured")."""
    from cloudml_lib.core.machine.estimate import StepShape
    from cloudml_lib.core.machine.timing import device_name, peak_words, signature

    gpu = presets.measured_gpu()
    reserved = {
        k: v.get("peak_reserved_gib") for k, v in gpu.get("presets", {}).items() if isinstance(v, dict)
    }
    where = (
        f"on an {gpu['device']} capped at {gpu.get('memory_cap_gib')} GiB"
        if gpu.get("device")
        else "on a GPU"
    )
    rows, device = [], this_device()
    for p in presets.preset_memory():
        name = p.name
        cfg = load_config(presets.preset_config_path(name))
        mem = (
            f"about {p.need() / GIB:.1f} GiB (estimated)"
            if p.estimate
            else f"about {p.reported_bytes / GIB:.0f} GiB (reported by users)"
        )
        if isinstance(reserved.get(name), (int, float)):
            mem += f"; {reserved[name]:.1f} GiB reserved, measured {where}"
        if ws is not None and isinstance(cfg.train.batch_size, int):
            sig = signature(StepShape.of(cfg, None), cfg.train.batch_size)
            yours = peak_words(ws.runs, device_name(device), sig)
            mem += f"; {yours}" if yours else ""
        rows.append(
            [
                name,
                "/".join(map(str, cfg.channels)),
                "on" if cfg.model.gradient_checkpointing else "off",
                plan(cfg.train.torch_compile, cfg.train.torch_compile_mode, device),
                cfg.train.batch_size,
                mem,
            ]
        )
    show_markdown(
        table(
            ["preset", "channels", "checkpointing", "torch.compile here", "batch", "GPU memory at its batch"],
            rows,
        )
    )


# ------------------------------------------------------------------------------- a run


@user_errors
def show_status(run_dir: Path | None) -> None:
    """Where the run stands: for a second browser tab, or after a reconnect."""
    if run_dir is None:
        print("No run yet: choose a preset and run the Train cell.")
        return
    try:
        status = RunFolder.of(run_dir).status()
    except CloudMLError as e:
        print(e)
        return
    print(format_status(status))
    if (
        not status.get("crossval")
        and status["latest_checkpoint_age_s"] is not None
        and not status["finished"]
    ):
        print(f"Minutes since the last checkpoint: {status['latest_checkpoint_age_s'] / 60:.1f}")


@user_errors
def show_evaluation(run_dir: Path | None) -> None:
    """Per-flight and overall metrics against the baseline, the verdict on them in a sentence (the model beats
    the training mean, or is of no use yet and what to try), the scatter plot, and where the files are."""
    from cloudml_lib.base.runfiles import RunFiles

    files = RunFiles(Path(run_dir)) if run_dir is not None else None
    report = files.evaluation() if files is not None else None
    if files is not None and files.damaged:
        raise CloudMLError(
            f"{files.damaged[0]}. Run `!python -m cloudml_lib evaluate {run_dir}` to write it again."
        )
    if not report:
        print("No evaluation yet: it is written when training finishes.")
        return
    from cloudml_lib.base.layout import RunLayout
    from cloudml_lib.core.run.status import run_state

    state = run_state(RunLayout(Path(run_dir)))
    if state.kind == "trained":  # evaluation.json scored other weights or another step than the run's
        print(
            f"The run is {state.words}: its evaluation.json is not of its weights now, so it is not shown. "
            "Run the Train cell (or Run all) again: it ends the run."
        )
        return
    from cloudml_lib.science.report import test_parts

    # Markdown tables and the verdicts in sentences (a monospace block wrapped them mid-word); the verdict
    # is added for a run evaluated before verdicts existed. The verdicts and the metrics first, the rest
    # folded (the page was 10 screens with all of it open)
    history = [r for r in files.metrics() if r.get("kind") == "epoch"]
    head, more = test_parts(report, history)
    show_markdown("\n".join(head))
    if in_notebook():
        show_markdown(
            f"<details><summary>{MORE_WORDS} (click to open)</summary>\n\n"
            + "\n".join(more)
            + "\n\n</details>"
        )
    else:
        show_markdown("\n".join(more))
    scatter = RunFolder(run_dir).plots / "scatter.png"
    if scatter.exists() and in_notebook():
        from IPython.display import Image

        show(Image(filename=str(scatter), width=SCATTER_WIDTH_PX))
    print(
        f"Predictions: {run_dir / 'predictions.csv'}\nPlots: {run_dir / 'plots'}\nBest model: "
        f"{run_dir / 'best.pt'}"
    )


SCATTER_WIDTH_PX = 340  # the evaluation's scatter in the notebook (its file: 550 px square)
# what show_evaluation folds: test_parts' second part
MORE_WORDS = (
    "The skill against each baseline, heights by range, the cloud flag's table, the intervals, the "
    "validation scores"
)


@user_errors
def show_report(run_dir: Path | None) -> None:
    """RUN_DIR/report.md, pointed to, with only what the cells above do not show: the training's device and
    compile, then the data's provenance, the cross-validation and any file that could not be read, each folded
    (a click away). Its test flights, curves, scatter and whole flights are the Evaluation, Train and Whole
    flights cells' (the page repeated them in full: five screens)."""
    path = None if run_dir is None else RunFolder(run_dir).newest_report
    if path is None or not path.is_file():
        print("No report yet: it is written when training finishes.")
        return
    sections = report_sections(read_text(path, limit=1 << 24, follow=False))
    shown_here = [t for t in sections if t not in SHOWN_ABOVE]
    show_markdown(
        f"**The run's report**: `{path}` (for GitHub or a Markdown viewer; its plots are in `plots/`). "
        f"Above: {', '.join(t for t in sections if t in SHOWN_ABOVE) or 'nothing yet'}."
    )
    for title in shown_here:
        body = sections[title].strip()
        if title == "Training":
            show_markdown(f"**{title}.** " + " ".join(body.split("\n\n")))
        elif in_notebook():  # Markdown inside the fold: its tables rendered as tables once opened
            show_markdown(
                f"<details><summary>{html.escape(title)} (click to open)</summary>\n\n{body}\n\n</details>"
            )
        else:
            print(f"{title}:\n{body}")


def show_page(folder: Path) -> None:
    """FOLDER/report.md whole (a sweep's, which no cell above shows): its text as Markdown, each linked plot
    as an image (a notebook does not resolve the report's relative image paths itself)."""
    path = RunFolder(folder).newest_report
    if not path.is_file():
        print("No report yet.")
        return
    text = []
    for line in read_text(path, limit=1 << 24, follow=False).splitlines() + [""]:
        image = re.fullmatch(r"!\[[^\]]*\]\(([^)]+)\)", line.strip())
        if image is None:
            text.append(line)
            continue
        if "".join(text).strip():
            show_markdown("\n".join(text))
        text = []
        if (folder / image.group(1)).is_file() and in_notebook():
            from IPython.display import Image

            show(Image(filename=str(folder / image.group(1))))
    if "".join(text).strip():
        show_markdown("\n".join(text))
    print(f"The same page for GitHub or a Markdown viewer: {path}")


# what report.md holds that the training notebook's cells above the report already show
SHOWN_ABOVE = ("Test flights", "Training curves", "Predicted vs true", "Whole flights")


def report_sections(text: str) -> dict[str, str]:
    """report.md's "## " sections by title, in order (the title line and the page's heading left out)."""
    sections: dict[str, str] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


@user_errors
def show_tensorboard(run_dir: Path | None) -> None:
    """TensorBoard over the runs folder (every run's curves side by side), in the notebook, opened on the loss
    curves; how to install it when it is missing. Its events are committed with each checkpoint, so after a
    disconnect it shows the run up to its last checkpoint. Started from this kernel's own environment
    (use_this_pythons_tensorboard); when it cannot start, TensorBoard's own magic says why."""
    from cloudml_lib.base.errors import install_command
    from cloudml_lib.core.run.events import has_tensorboard

    if run_dir is None:
        return
    logdir = Path(run_dir).parent
    if not has_tensorboard():
        show_markdown(
            f"TensorBoard is not installed, so runs write no event files (the live curves above need "
            f"nothing). To have it: `{install_command('tensorboard')}` in a cell, then **Run all** again: "
            "the run resumes "
            "and writes its events from then on."
        )
        return
    if not in_notebook():
        print(f"tensorboard --logdir {logdir}")
        return
    from IPython import get_ipython
    from tensorboard import manager

    use_this_pythons_tensorboard()
    started = manager.start(["--logdir", str(logdir), "--reload_interval", "30"])
    port = getattr(getattr(started, "info", None), "port", None)  # launched, or one already serving it
    if port is not None:
        show(tensorboard_frame(port))
        return
    ip = get_ipython()  # failed or timed out: the magic tries again and says why in TensorBoard's words
    ip.run_line_magic("load_ext", "tensorboard")
    ip.run_line_magic("tensorboard", f'--logdir "{logdir}" --reload_interval 30')


# TensorBoard's URL state (its time-series dashboard reads `tagFilter` from the query): the loss curves first,
# not the alphabetical first card (epoch/lr). Whether its settings pane is open is kept in the browser's
# storage for TensorBoard's page, which no URL parameter sets.
TENSORBOARD_QUERY, TENSORBOARD_PAGE = {"tagFilter": "loss"}, "timeseries"


# TensorBoard's frame is folded: the Train cell's live curves come first, and 800 px open took the training
# notebook past 8 screens of a 1400 x 1000 window (tests/browser_check.py measures it)
TENSORBOARD_SUMMARY = "TensorBoard: every run's curves side by side (click to open)"


def tensorboard_frame(port: int, height: int = 800):
    """The frame `%tensorboard` shows (tensorboard.notebook: Colab's proxied port; elsewhere the page's host
    at `port`, or $TENSORBOARD_PROXY_URL), opened on the loss curves, folded under TENSORBOARD_SUMMARY. Its
    id starts "tensorboard-frame" as TensorBoard's own does."""
    import json
    import secrets

    from IPython.display import HTML, Javascript

    query = "".join(
        f"url.searchParams.set({json.dumps(k)}, {json.dumps(v)});" for k, v in TENSORBOARD_QUERY.items()
    )
    view = f"{query} url.hash = {json.dumps(TENSORBOARD_PAGE)};"
    if device.is_colab():
        return Javascript(
            "(async () => {"
            f" const url = new URL(await google.colab.kernel.proxyPort({int(port)}, {{'cache': true}}));"
            f" url.searchParams.set('tensorboardColab', 'true'); {view}"
            " const frame = document.createElement('iframe'); frame.src = url;"
            f" frame.setAttribute('width', '100%'); frame.setAttribute('height', '{int(height)}');"
            " frame.setAttribute('frameborder', 0);"
            " const fold = document.createElement('details');"
            " const summary = document.createElement('summary');"
            f" summary.textContent = {json.dumps(TENSORBOARD_SUMMARY)}; fold.appendChild(summary);"
            " fold.appendChild(frame); document.body.appendChild(fold);"
            " })();"
        )
    proxy = os.environ.get("TENSORBOARD_PROXY_URL")
    where = json.dumps(proxy.replace("%PORT%", str(int(port))) if proxy else "/")
    frame = f"tensorboard-frame-{secrets.token_hex(8)}"
    return HTML(
        f"<details><summary>{html.escape(TENSORBOARD_SUMMARY, quote=False)}</summary>"
        f'<iframe id="{frame}" width="100%" height="{int(height)}" frameborder="0"></iframe>'
        "</details>\n<script>"
        f"(function() {{ const url = new URL({where}, window.location);"
        + ("" if proxy else f" url.port = {int(port)};")
        + f" {view} document.getElementById({json.dumps(frame)}).src = url; }})();</script>"
    )


def use_this_pythons_tensorboard() -> str:
    """Point %tensorboard at this kernel's own TensorBoard. The magic starts the `tensorboard` executable on
    PATH (or $TENSORBOARD_BINARY); a kernel whose Python runs from a virtual environment that is not activated
    (a registered Jupyter kernel) has none there, or another environment's. Used: the executable beside this
    Python, else a small launcher that runs `python -m tensorboard.main` with this Python. Returns it."""
    given = os.environ.get("TENSORBOARD_BINARY")
    if given and Path(given).is_file():
        return given
    beside = Path(sys.executable).parent / "tensorboard"
    if beside.is_file() and os.access(beside, os.X_OK):
        binary = beside
    else:
        key = hashlib.sha1(sys.executable.encode()).hexdigest()[:10]
        binary = Path(tempfile.gettempdir()) / f"cloudml-tensorboard-{key}"
        binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tensorboard.main "$@"\n')
        binary.chmod(0o755)
    os.environ["TENSORBOARD_BINARY"] = str(binary)
    return str(binary)


@user_errors
def show_comparison(folders) -> None:
    """Runs, cross-validations or sweeps side by side (`compare.py`): the settings that differ, test
    metrics, epochs, time, compiled. `folders`: one folder of runs (each run in it) or a list of run
    folders."""
    from cloudml_lib.commands.compare import compare_runs, format_comparison

    base = None
    if (
        isinstance(folders, (str, Path))
        and not RunFolder.of(folders).holds_run()
        and not RunFolder.of(folders).is_crossval()
        and not (Path(folders) / "sweep.json").is_file()
    ):
        base = Path(folders)
        folders = sorted(
            p
            for p in base.iterdir()
            if RunFolder(p).holds_run() or RunFolder(p).is_crossval() or (p / "sweep.json").is_file()
        )
        if not folders:
            show_markdown(f"No runs in {base} yet.")
            return
    rows = compare_runs(folders if isinstance(folders, list) else [folders])
    for row in rows:
        if base is not None:  # names as in the runs folder, not full paths
            row["run"] = str(Path(row["run"]).relative_to(base))
    show_markdown(format_comparison(rows))
