"""Training, cross-validation and whole-flight prediction from the notebook, each as the same
`python -m cloudml_lib ...` command as in a terminal, run as a subprocess with a live view.

A subprocess, so that re-running the notebook is re-running the command (which resumes), the
interrupt button sends it SIGINT (it stops at the next step with a checkpoint), and its GPU memory is
released when it ends. The live view keeps together what is watched together: the step bar, the latest
epoch line, the curves, and the notices (resumed, stopped, rejected, warnings); the full log sits
folded under them, scrollable, never wrapping a table. Progress comes from the trainer's `@progress`
lines (train.ProgressLines), so the bar moves every step; tqdm is off in the subprocess.

A notice's colour comes from its level word (logs.py: "Warning: " amber, "Problem: " red), never from what
the message happens to say; INFO lines become notices by the NOTICE patterns. Advice written for a terminal
("run the same command again") is shown in the notebook's words (notebook_words). Cross-validation's view
follows the fold being trained ("fold 2 of 5 (test flight 12Feb25)") and its curves.
"""

from __future__ import annotations

import html
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from cloudml_lib.base.logs import PROBLEM_WORD, WARNING_WORD, level_word
from cloudml_lib.colab.show import UserError, in_notebook, plural, show
from cloudml_lib.core.run.checkpoint import find_latest_valid
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.science import plots
from cloudml_lib.train import ProgressLines

# How a run can end and still be continued: exit 130 (stopped with a checkpoint), or killed by a signal
# (a disconnect, or a stop that arrived before Python could catch it).
RESUMABLE = {130, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL}
NOTICE = re.compile(
    r"Resumed from|Stopped by|received: stopping|Rejected|Moved the rejected|[Ww]arning|"
    r"out of memory|torch\.compile|Non-finite|Early stopping|Taking over|skipped|"
    r"nothing to train|[Tt]he end of the run|changed settings|Fold \w+:|Phase \d of 2"
)
# The level a line carries (logs.py's words; a Python warning's own format; the log file's "warning:")
PROBLEM_LINE = re.compile(rf"^{re.escape(PROBLEM_WORD)}")
WARNING_LINE = re.compile(rf"^(?:{re.escape(WARNING_WORD)}|warning: |\S+:\d+: \w*Warning: )")
EPOCH = re.compile(r"^Epoch \d+/\d+ \|")
FOLD = re.compile(r"^Fold ([^\s:]+):")  # crossval.py, as each fold starts
# crossval.py's list of folds: flights, or campaigns (data.fold_by campaign: "NAME (FLIGHT, ...); ...")
FOLDS = re.compile(r"^Cross-validation over \d+ (flights|campaigns), each [^:]*: (.+)$")
LOG_LINES, NOTICES = 400, 8
# Advice written for a terminal, in the notebook's words (the command runs under a cell and a picker)
NOTEBOOK_WORDS = [
    (re.compile(r"\bSIGINT received: stopping"), "Stop (\u25a0) pressed: stopping"),
    (re.compile(r"\bStopped by SIGINT at step (\d+)"), "Stopped at step \\1, as asked (\u25a0)"),
    (re.compile(r"\b([Rr])un the same (?:\w+ )?command(?: again)?(?! with)"), r"\1un this cell again"),
    (re.compile(r"\b([Rr])aise train\.epochs"), r"\1aise Epochs in the picker"),
    (re.compile(r"\buse another --run-dir for a new run"), 'choose "Start a new run" in the picker'),
    (re.compile(r"\bCtrl-C again"), "press stop (\u25a0) again"),
]


def notebook_words(text: str) -> str:
    for pattern, words in NOTEBOOK_WORDS:
        text = pattern.sub(words, text)
    return text


def classify(text: str) -> str | None:
    """What a line is, by its level word: "problem" (an error: red), "warning" (amber); else "notice" (an INFO
    line worth seeing, by the NOTICE patterns) or None."""
    if PROBLEM_LINE.match(text):
        return "problem"
    if WARNING_LINE.match(text):
        return "warning"
    return "notice" if NOTICE.search(text) else None


def notice_html(text: str) -> str:
    """One notice line, in the notebook's words: a problem in red, a warning in amber with a warning sign,
    anything else plain."""
    kind, text = classify(text), notebook_words(text)
    if kind == "problem":
        rest = html.escape(text[len(PROBLEM_WORD) :])
        return f'<span style="color:#b91c1c">&#10006; <b>Problem:</b> {rest}</span>'
    if kind == "warning":
        rest = text[len(WARNING_WORD) :] if text.startswith(WARNING_WORD) else text
        return f'<span style="color:#b45309">&#9888; {html.escape(rest)}</span>'
    return f"&#9656; {html.escape(text)}"


class NotebookLog(logging.Handler):
    """The package's log lines in the kernel (setup's data check and cache, the picker): a warning or a
    problem as the notebook shows every notice (notice_html: amber with a warning sign, red with
    "Problem:"), once per kernel (a cell that meets it again folds it); any other line as plain text that
    does not break a running progress bar, or, inside `folded_log`, collected and shown folded after the
    cell's result. Outside a notebook the console's lines, with their level word."""

    shown_notices: set[str] = set()  # the warnings and problems shown in this kernel, by text
    folded: list[str] | None = None  # the lines of the cell that folds them (folded_log)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = level_word(record.levelno) + self.format(record)
            notice = record.levelno >= logging.WARNING and in_notebook()
            if notice and text in NotebookLog.shown_notices and NotebookLog.folded is not None:
                NotebookLog.folded.append(f"{self.format(record)} (said above, by an earlier cell)")
            elif notice:
                from IPython.display import HTML

                NotebookLog.shown_notices.add(text)
                sys.stdout.flush()  # the plain lines before it stay before it
                show(HTML(f'<div style="white-space:pre-wrap">{notice_html(text)}</div>'))
            elif NotebookLog.folded is not None:
                NotebookLog.folded.append(text)
            else:
                tqdm.write(text, file=sys.stdout)
        except Exception:  # noqa: BLE001 - logging must never raise
            pass


@contextmanager
def folded_log(what: str):
    """A cell whose result (a table) must not drown in log lines: the package's plain lines of the block are
    kept, and shown after it folded ("<what>: N lines"), a click away; notices stay where they arise."""
    NotebookLog.folded = lines = []
    try:
        yield
    finally:
        NotebookLog.folded = None
        if lines and in_notebook():
            from IPython.display import HTML

            show(
                HTML(
                    f"<details><summary>{html.escape(what)}: {plural(len(lines), 'line')} (click to open)"
                    f'</summary><pre style="white-space:pre-wrap">{html.escape(chr(10).join(lines))}</pre>'
                    "</details>"
                )
            )
        elif lines:
            print("\n".join(lines))


class LiveView:
    """Step bar, status line, notices, curves and the folded log of one command (ipywidgets 7 and 8).
    `folds`: a cross-validation's folder: the view follows the fold being trained (its curves, "fold k of
    n")."""

    def __init__(self, run_dir: Path | None, bar: bool = True, folds: Path | None = None):
        import ipywidgets as w

        self.run_dir, self.folds, self.started = run_dir, folds, time.time()
        self.metrics_path = None if run_dir is None else RunFolder(run_dir).metrics
        self.fold, self.fold_names, self.folds_seen, self.fold_kind = None, [], [], "flight"
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
            except (ValueError, RecursionError):
                pass
            return
        self.lines.append(text)
        if self.folds is not None:
            self._follow_folds(text)
        if EPOCH.match(text):
            self.status.value = f"<code>{html.escape(text)}</code>"
        if classify(text):
            self.notice_lines = (self.notice_lines + [text])[-NOTICES:]
            self.notices.value = "<br>".join(notice_html(t) for t in self.notice_lines)

    def _follow_folds(self, text: str) -> None:
        """A cross-validation's lines: the list of folds, then each fold as it starts (a new sub-run: its own
        bar and curves)."""
        listed, started = FOLDS.match(text), FOLD.match(text)
        if listed:
            self.fold_kind = "campaign" if listed.group(1) == "campaigns" else "flight"
            parts = listed.group(2).split("; " if self.fold_kind == "campaign" else ",")
            self.fold_names = [n.split(" (")[0].strip() for n in parts]
        if started:
            self.fold = started.group(1)
            if self.fold not in self.folds_seen:
                self.folds_seen.append(self.fold)
            self.metrics_path = RunFolder(Path(self.folds) / "folds" / self.fold / "model").metrics
            self.progress, self.metrics_size, self.shown_epochs = {}, -1, 0

    def fold_words(self) -> str:
        """ "fold 2 of 5 (test flight 12Feb25)" while a cross-validation trains a fold; "" otherwise."""
        if self.fold is None:
            return ""
        names = self.fold_names or self.folds_seen
        of = f" of {len(self.fold_names)}" if self.fold_names else ""
        k = names.index(self.fold) + 1 if self.fold in names else len(self.folds_seen)
        return f"fold {k}{of} (test {self.fold_kind} {self.fold})"

    def refresh(self) -> None:
        p, fold = self.progress, html.escape(self.fold_words())
        if p:
            self.bar.max, self.bar.value = max(1, p["total"]), min(p["step"], p["total"])
            self.label.value = (fold + " &middot; " if fold else "") + (
                f"epoch {p['epoch']} of {p['epochs']} &middot; step {p['step']} of {p['total']} "
                f"({100 * p['step'] / max(1, p['total']):.0f}%)"
            )
        elif self.lines:  # no steps (prediction, a fold's set-up): the latest line
            self.label.value = (fold + " &middot; " if fold else "") + html.escape(self.lines[-1][:160])
        # <pre> that never wraps (a table stays a table; long lines scroll sideways), whatever the page's CSS
        self.log.value = (
            "<pre style='margin:0;white-space:pre;overflow-wrap:normal;word-break:normal;overflow-x:auto'>"
            + html.escape("\n".join(self.lines))
            + "</pre>"
        )
        self.folded.set_title(0, f"Log ({plural(len(self.lines), 'line')}; click to open)")
        self._refresh_curves()

    def _refresh_curves(self) -> None:
        path = self.metrics_path
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
        words = notebook_words(words)
        self.label.value = (
            (self.label.value if self.progress else "")
            + (" &middot; " if self.progress else "")
            + f"<b>{html.escape(words)}</b>"
        )
        if not self.shown_epochs and self.placeholder.value:
            if code == 0:  # nothing to draw, and nothing went wrong: no sentence about it
                self.placeholder.layout.display = "none"
            else:
                self.placeholder.value = f"<i>No epoch finished in this run: {html.escape(words)}.</i>"

    def outcome(self, how: str, code: int) -> str:
        """How the command ended, in words; a cross-validation's from its folder: the folds finished, and
        where a stopped one continues from."""
        if self.folds is None:
            return how if code == 0 or self.run_dir is None else f"{how}; {saved_step(self.run_dir)}"
        done = len(list((Path(self.folds) / "folds").glob("*/fold.json")))
        n = len(self.fold_names) or len(self.folds_seen)
        if code == 0 or self.fold is None:
            return f"{how}: {done} of {n} folds" if n else how
        fold_dir = Path(self.folds) / "folds" / self.fold
        sub = fold_dir / ("scalars_only" if RunFolder(fold_dir / "model").is_finished() else "model")
        return f"{how} in {self.fold_words()}; {saved_step(sub)}; {done} of {n} folds finished"


def read_records(path: Path) -> list[dict]:
    """metrics.jsonl's records as the live view follows them (a FIFO or a damaged line is skipped, never
    waited on or raised: the run's own reader, runfiles.py, names the damage)."""
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.base.files import read_text

    out = []
    try:
        text = read_text(path, follow=False)
    except (OSError, CloudMLError):
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line being written right now
        if isinstance(record, dict):
            out.append(record)
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
    found = find_latest_valid(RunFolder(run_dir), load=False) if run_dir.is_dir() else None
    if found is None or not found.meta:
        return "no checkpoint was saved yet, so it starts from the beginning"
    return f"the last checkpoint is at step {found.meta['step']} of {found.meta.get('total_steps', '?')}"


def error_text(view: LiveView) -> str:
    """The command's own message ("error: ..." to the end), for a UserError, in the notebook's words."""
    lines = list(view.lines)
    starts = [i for i, t in enumerate(lines) if t.startswith("error: ")]
    text = "\n".join(lines[starts[-1] :])[len("error: ") :] if starts else "\n".join(lines[-8:])
    return notebook_words(text)


def report_end(code: int, view: LiveView, what: str, run_dir: Path | None) -> None:
    """Say how the command ended; a user error becomes a UserError, anything else unexpected a
    RuntimeError."""
    if code == 0:
        view.end(code, view.outcome("finished", code))
        return
    if code in RESUMABLE:
        how = "stopped" if code in (130, -signal.SIGINT, -signal.SIGTERM) else "killed (as by a disconnect)"
        words = view.outcome(how, code) if run_dir is not None or view.folds is not None else how
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
