"""Training, cross-validation and whole-flight prediction from the notebook, each as the same
`python -m cloudml_lib ...` command as in a terminal, run as a subprocess with a live view.

A subprocess, so that re-running the notebook is re-running the command (which resumes), the
interrupt button sends it SIGINT (it stops at the next step with a checkpoint), and its GPU memory is
released when it ends. The live view keeps together what is watched together: the step bar, the latest
epoch line, the curves, and the notices (resumed, stopped, rejected, warnings); the full log sits
folded under them, scrollable, never wrapping a table. Progress comes from the trainer's `@progress`
lines (train.ProgressLines), so the bar moves every step; tqdm is off in the subprocess.
"""

from __future__ import annotations

import html
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from cloudml_lib import plots
from cloudml_lib.checkpoint import find_latest_valid
from cloudml_lib.colab.show import UserError, plural, show
from cloudml_lib.train import ProgressLines

# How a run can end and still be continued: exit 130 (stopped with a checkpoint), or killed by a signal
# (a disconnect, or a stop that arrived before Python could catch it).
RESUMABLE = {130, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL}
NOTICE = re.compile(
    r"Resumed from|Stopped by|received: stopping|Rejected|Moved the rejected|[Ww]arning|"
    r"out of memory|torch\.compile|Non-finite|Early stopping|Taking over|skipped|"
    r"already finished|changed settings|Fold \w+:|Phase \d of 2"
)
# notices shown as warnings (amber, with a sign): something the user should read and may act on
WARN = re.compile(r"[Ww]arning|failed|out of memory|Non-finite|Rejected|not compiled|runs? eager|cannot")
EPOCH = re.compile(r"^Epoch \d+/\d+ \|")
LOG_LINES, NOTICES = 400, 8


def notice_html(text: str) -> str:
    """One notice line: a warning in amber with a warning sign, anything else plain."""
    if WARN.search(text):
        return f'<span style="color:#b45309">&#9888; {html.escape(text)}</span>'
    return f"&#9656; {html.escape(text)}"


class LiveView:
    """Step bar, status line, notices, curves and the folded log of one command (ipywidgets 7 and 8)."""

    def __init__(self, run_dir: Path | None, bar: bool = True):
        import ipywidgets as w

        self.run_dir, self.started = run_dir, time.time()
        self.bar = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="55%"))
        self.label = w.HTML("starting...")
        self.status = w.HTML()
        self.notices = w.HTML()
        self.curves = w.Image(format="png", layout=w.Layout(display="none", max_width="100%"))
        self.placeholder = w.HTML("<i>Curves appear after the first epoch.</i>" if bar else "")
        self.log = w.HTML(layout=w.Layout(max_height="22em", overflow="auto"))
        self.folded = w.Accordion(children=[self.log])
        self.folded.set_title(0, "Log")
        self.folded.selected_index = None  # folded: opened by a click
        self.lines, self.notice_lines, self.shown_epochs, self.metrics_size = (
            deque(maxlen=LOG_LINES),
            [],
            0,
            -1,
        )
        self.progress: dict = {}
        top = w.HBox([self.bar, self.label]) if bar else self.label
        show(w.VBox([top, self.status, self.notices, self.placeholder, self.curves, self.folded]))

    def line(self, text: str) -> None:
        if text.startswith(ProgressLines.PREFIX):
            try:
                self.progress = json.loads(text[len(ProgressLines.PREFIX) :])
            except ValueError:
                pass
            return
        self.lines.append(text)
        if EPOCH.match(text):
            self.status.value = f"<code>{html.escape(text)}</code>"
        if NOTICE.search(text):
            self.notice_lines = (self.notice_lines + [text])[-NOTICES:]
            self.notices.value = "<br>".join(notice_html(t) for t in self.notice_lines)

    def refresh(self) -> None:
        p = self.progress
        if p:
            self.bar.max, self.bar.value = max(1, p["total"]), min(p["step"], p["total"])
            self.label.value = (
                f"epoch {p['epoch']} of {p['epochs']} &middot; step {p['step']} of {p['total']} "
                f"({100 * p['step'] / max(1, p['total']):.0f}%)"
            )
        elif self.lines:  # no steps (prediction): the latest line
            self.label.value = html.escape(self.lines[-1][:160])
        self.log.value = "<pre style='margin:0'>" + html.escape("\n".join(self.lines)) + "</pre>"
        self.folded.set_title(0, f"Log ({plural(len(self.lines), 'line')}; click to open)")
        self._refresh_curves()

    def _refresh_curves(self) -> None:
        path = None if self.run_dir is None else self.run_dir / "metrics.jsonl"
        try:
            size = path.stat().st_size if path else -1
        except OSError:
            return
        if size == self.metrics_size:
            return
        self.metrics_size = size
        epochs = [r for r in read_records(path) if r.get("kind") == "epoch"]
        if epochs and len(epochs) != self.shown_epochs:
            self.curves.value = plots.curves_png(epochs)
            self.curves.layout.display, self.placeholder.layout.display = None, "none"
            self.shown_epochs = len(epochs)

    def end(self, code: int, words: str) -> None:
        """Finished: a full green bar. Stopped or disconnected: the bar stays as it stands, blue (it can
        continue). Failed: red."""
        if code == 0 and self.progress:  # progress lines come at most twice a second
            self.progress = dict(self.progress, step=self.progress["total"], epoch=self.progress["epochs"])
        self.refresh()
        if code == 0:
            self.bar.value, self.bar.bar_style = self.bar.max, "success"
        elif code not in RESUMABLE:
            self.bar.bar_style = "danger"
        self.label.value = (
            (self.label.value if self.progress else "")
            + (" &middot; " if self.progress else "")
            + f"<b>{html.escape(words)}</b>"
        )
        if not self.shown_epochs and self.placeholder.value:
            self.placeholder.value = f"<i>No epoch finished in this run: {html.escape(words)}.</i>"


def read_records(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written right now
    return out


def run_live(cmd: list[str], view: LiveView, env: dict | None = None) -> int:
    """Run `cmd`, feeding its output to `view` until it ends; the interrupt button stops it with a
    checkpoint (a second press stops it at once). Returns its exit status."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TQDM_DISABLE="1",
        CLOUDML_PROGRESS="1",
        CLOUDML_PARENT_PID=str(os.getpid()),
        **(env or {}),
    )
    # A session of its own: Jupyter interrupts the kernel's whole process group, and the SIGINT it would
    # deliver besides ours counts as a second Ctrl-C, which stops at once without a checkpoint. The
    # command stops by itself if this kernel dies (CLOUDML_PARENT_PID, cli.watch_parent).
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x.rstrip("\n")) for x in proc.stdout], daemon=True)
    reader.start()
    while True:
        try:
            while not lines.empty():
                view.line(lines.get())
            view.refresh()
            if proc.poll() is not None and not reader.is_alive() and lines.empty():
                return proc.returncode
            time.sleep(0.5)
        except KeyboardInterrupt:
            view.line(
                "Stop asked from the notebook: the run saves a checkpoint at the next step (press stop again "
                "to stop at once)."
            )
            proc.send_signal(signal.SIGINT)


def saved_step(run_dir: Path) -> str:
    found = find_latest_valid(run_dir, load=False) if run_dir.is_dir() else None
    if found is None or found.meta is None:
        return "no checkpoint was saved yet, so it starts from the beginning"
    return f"the last checkpoint is at step {found.meta['step']} of {found.meta.get('total_steps', '?')}"


def error_text(view: LiveView) -> str:
    """The command's own message ("error: ..." to the end), for a UserError."""
    lines = list(view.lines)
    starts = [i for i, t in enumerate(lines) if t.startswith("error: ")]
    return "\n".join(lines[starts[-1] :])[len("error: ") :] if starts else "\n".join(lines[-8:])


def report_end(code: int, view: LiveView, what: str, run_dir: Path | None) -> None:
    """Say how the command ended; a user error becomes a UserError, anything else unexpected a
    RuntimeError."""
    if code == 0:
        view.end(code, "finished")
        return
    if code in RESUMABLE:
        how = "stopped" if code in (130, -signal.SIGINT, -signal.SIGTERM) else "killed (as by a disconnect)"
        words = f"{how}; {saved_step(run_dir)}" if run_dir is not None else how
        view.end(code, words)
        print(f"{what.capitalize()} {words}. Run this cell again (or Runtime > Run all) to continue.")
        return
    view.end(code, f"ended with exit status {code}")
    if code == 2:
        raise UserError(error_text(view))
    tail = "\n".join(list(view.lines)[-12:])
    raise RuntimeError(
        f"{what} ended with exit status {code} (unexpected: please report it with the log):\n{tail}"
    )


def command(*args) -> list[str]:
    return [sys.executable, "-m", "cloudml_lib", *map(str, args)]
