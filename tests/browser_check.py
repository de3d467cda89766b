"""Both notebooks in a real browser: what nbmake cannot see (widgets rendered, the bar's fill and colour,
Markdown tables rendered as tables, problems in red, the folded log, the page's length, tracebacks on the
page), and five scenarios, each in a JupyterLab and a CloudML folder of its own with a wall-time budget of
its own (BUDGET_S: one stuck scenario fails alone): a stop, kernel restart and Run all continuing the run; a
full disk for every checkpoint save (red problems, never "checkpoint saved"); the user's own flights after a
demo run (a new run on them by default); one flight (refused in words); the cross-validation live view.

    python tests/browser_check.py [--python PYTHON] [--kernel-python PYTHON] [--out DIR]
        [--notebooks colab_setup.ipynb ...] [--scenarios continue disk-full own-flights one-flight crossval]

starts JupyterLab from PYTHON's environment (default: this one; e.g. a venv with JupyterLab 3.6.8,
ipywidgets 7.7.1 and IPython 7.34, Colab's versions, or one with JupyterLab 4 and ipywidgets 8) on a copy of
the notebooks, drives Debian's Chromium through Playwright ("Run All Cells" with CLOUDML_SMOKE=1), checks the
page and saves screenshots and browser_check.json (each scenario's problems and seconds) in DIR.
Exit status 0 when every check passed. tests/test_browser.py runs it where Chromium, Playwright and
JupyterLab are installed, and is skipped elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path(os.environ.get("CLOUDML_CHROMIUM", "/usr/bin/chromium"))
RUN_TIMEOUT_S = 900
WIDGET_TEXT = "widget(s) not rendered ('Error displaying widget', or its text such as VBox(children=...))"
MAX_TRAIN_OUTPUT_PX = 3000  # the flooded Train cell was 14,567 px tall
# The training notebook after one run, in screens of a 1400 x 1000 window (issue 65: 14.9 screens, its
# Report cell repeating the evaluation): the notebook's height over what such a window shows of it
SCREEN = (1400, 1000)
MAX_TRAINING_SCREENS = 8
VISIBLE_NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden):not(.p-mod-hidden)"
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
RED, AMBER = "rgb(185, 28, 28)", "rgb(180, 83, 9)"  # live.py's #b91c1c (Problem:) and #b45309 (Warning:)
# Put first on the kernel's PYTHONPATH for the full-disk scenario: every checkpoint write of every process
# meets a full disk (as tests/test_notices.py does), patched when cloudml_lib.core.run.checkpoint is imported.
DISK_FULL_HOOK = """
import errno, importlib.abc, importlib.machinery, sys


def _full(src, dst):
    raise OSError(errno.ENOSPC, "No space left on device", str(dst))


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "cloudml_lib.core.run.checkpoint":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._copy_hashing = _full

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
"""
SCENARIOS = ("continue", "disk-full", "own-flights", "one-flight", "crossval")
# Each scenario's wall-time budget (s): every wait in it stops there, so one stuck scenario fails alone and
# the others still run, each in a JupyterLab and a CloudML folder of its own.
# (each about 4-6 times what it took on a 2-core machine: 91, 81, 103, 46 and 178 s)
BUDGET_S = {"continue": 600, "disk-full": 420, "own-flights": 600, "one-flight": 300, "crossval": 900}
_deadline = [float("inf")]  # the running scenario's end (time.time())
_scale = [1.0]  # the running scenario's time scale (time_scale())


def time_scale() -> float:
    """How much longer than on a quiet machine every wait and budget may take: CLOUDML_BROWSER_TIME_SCALE,
    else the load average per core here (1 to 3): on a loaded machine a scenario that works is slow, not
    broken (a scenario once failed only because its budget ran out while other work shared the cores)."""
    given = os.environ.get("CLOUDML_BROWSER_TIME_SCALE")
    if given:
        return max(1.0, float(given))
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return max(1.0, min(3.0, load))


FINAL_MARKS = {
    "colab_setup.ipynb": "Smoke test: setup checks passed",
    "colab_training.ipynb": "Smoke test passed",
}


def missing_tools(python: str = sys.executable) -> list[str]:
    """What this check needs and this machine lacks (empty: it can run)."""
    out = [] if CHROMIUM.is_file() else [f"Chromium ({CHROMIUM})"]
    try:
        import playwright  # noqa: F401
    except ImportError:
        out.append("the playwright package (pip install playwright)")
    probe = subprocess.run([python, "-c", "import jupyterlab, ipywidgets"], capture_output=True)
    if probe.returncode:
        out.append(f"JupyterLab and ipywidgets in {python}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def colab_layout(root: Path) -> None:
    """Colab's layout under `root`, for a kernel that takes this machine for Colab (the Colab twin's, whose
    google.colab stub mounts CLOUDML_TWIN_DRIVE): /content (CLOUDML_CONTENT) and a Drive holding the
    checkout's copy in MyDrive/CloudML/code, which the notebooks' first cell installs from."""
    sys.path.insert(0, str(REPO / "tests"))
    from install_helpers import copy_checkout

    (root / "content").mkdir(exist_ok=True)
    copy_checkout(root / "gdrive" / "MyDrive" / "CloudML" / "code")


def kernel_copy(python: str, base: Path) -> str:
    """A copy of the virtual environment of `python` in `base` (hard links: quick, and no space taken), so
    that the notebooks' install cell installs CloudML into the copy and never into the environment given
    (the suite's Colab twin keeps its own as built); `python` itself where it is not a virtual environment."""
    found = subprocess.run(
        [python, "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    prefix = Path(found[0])
    if found[0] == found[1] or not (prefix / "pyvenv.cfg").is_file():
        return python
    copy = base / "kernel-env"
    subprocess.run(["cp", "-al", str(prefix), str(copy)], check=True)
    return str(copy / "bin" / Path(python).name)


def start_lab(
    python: str, root: Path, log: Path, smoke: bool = True, pythonpath: str = "", kernel: str | None = None
) -> tuple[subprocess.Popen, str]:
    """JupyterLab from `python`'s environment over `root`; its kernel `kernel`'s Python where given (a
    kernelspec of its own named python3, as Colab's kernel runs in an environment of its own), else the
    server's."""
    port, token = _free_port(), secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k != "CLOUDML_SMOKE"}
    # PYTHON's own bin first: `jupyter` would otherwise start whichever jupyter-lab comes first on PATH, and
    # the kernel is the server's own Python (so its ipywidgets is the one checked).
    env.update(
        PYTHONPATH=pythonpath + str(REPO),
        JUPYTER_CONFIG_DIR=str(root / ".jupyter"),
        CLOUDML_HOME=str(root / "CloudML"),
        PATH=str(Path(python).parent) + os.pathsep + env.get("PATH", ""),
        **({"CLOUDML_SMOKE": "1"} if smoke else {}),
    )
    if kernel:  # found before the server's own python3 (JUPYTER_PATH comes first)
        colab_layout(root)
        spec = root / ".jupyter-data" / "kernels" / "python3"
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [kernel, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3",
                    "language": "python",
                    # CloudML as the first cell installs it from the Drive copy, not from the checkout
                    "env": {"PYTHONPATH": pythonpath.rstrip(os.pathsep)},
                }
            )
        )
        env["JUPYTER_PATH"] = str(root / ".jupyter-data")
        env.update(CLOUDML_CONTENT=str(root / "content"), CLOUDML_TWIN_DRIVE=str(root / "gdrive"))
    cmd = [
        python,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--allow-root",
    ]
    settings = root / ".jupyter" / "lab" / "user-settings" / "@jupyterlab"
    for path, value in (
        ("notebook-extension/tracker", {"windowingMode": "none"}),  # every cell in the page
        ("apputils-extension/notification", {"fetchNews": "false", "checkForUpdates": False}),
    ):
        (settings / path).parent.mkdir(parents=True, exist_ok=True)
        (settings / f"{path}.jupyterlab-settings").write_text(json.dumps(value))
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return proc, f"{url}/lab/tree/{{}}?token={token}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("JupyterLab did not answer within 60 s")


# Read in the page: every progress bar's fill and style, tables, folded logs, errors, the Train cell's height.
PAGE_FACTS = """() => {
  const bars = [...document.querySelectorAll('.progress-bar')].map(b => ({
      fill: b.parentElement.getBoundingClientRect().width ?
            b.getBoundingClientRect().width / b.parentElement.getBoundingClientRect().width : 0,
      classes: b.className}));
  const text = document.body.innerText;
  const cells = [...document.querySelectorAll('.jp-CodeCell')];
  const train = cells.find(c => (c.innerText || '').includes('colab.train(ws, picker)'));
  const pres = [...document.querySelectorAll('.jp-OutputArea-output pre')];
  const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  // A Markdown table that did not render: a line '| a | b |' outside a <table>, anywhere in the outputs.
  const raw_tables = new Set();
  for (const e of outs.flatMap(o => [...o.querySelectorAll('p, li, pre, .widget-html-content')])) {
    if (e.closest('table') || e.offsetParent === null) continue;  // a folded log is not shown
    for (const line of (e.innerText || e.textContent || '').split('\\n'))
      if (/^\\s*\\|.*\\|.*\\|\\s*$/.test(line)) raw_tables.add(line.trim().slice(0, 200));
  }
  // Every visible notice ('Problem:', 'Warning:', '⚠ ...' at a line's start) and its colour.
  const notices = [];
  for (const o of outs) {
    const w = document.createTreeWalker(o, NodeFilter.SHOW_TEXT);
    for (let n = w.nextNode(); n; n = w.nextNode()) {
      const el = n.parentElement;
      // not shown: hidden, or inside a closed <details> (laid out, but no text rendered)
      if (!el || el.offsetParent === null || !(el.innerText || '').trim()) continue;
      const hit = n.textContent.split('\\n').map(x => x.trim().match(/^(?:✖\\s*)?(Problem:|Warning:|⚠)/))
                   .find(Boolean);
      const line = (el.closest('p, li, div, pre') || el).innerText || '';
      if (hit) notices.push({kind: hit[1] === 'Problem:' ? 'problem' : 'warning',
                             color: getComputedStyle(el).color, text: line.trim().slice(0, 300)});
    }
  }
  // The notebook's whole height and the window's chrome above and below it (its scroller's own height)
  const panel = document.querySelector(
      '.jp-NotebookPanel:not(.lm-mod-hidden):not(.p-mod-hidden) .jp-Notebook');
  // from the first cell's top to the last cell's bottom (the scroller adds room to scroll past the end)
  const all = panel ? [...panel.querySelectorAll('.jp-Cell')] : [];
  const notebook_px = all.length ?
    all[all.length - 1].getBoundingClientRect().bottom - all[0].getBoundingClientRect().top : -1;
  // each cell's height, for a person to see where the room goes (browser_check.json)
  const cells_px = all.map(c => [Math.round(c.getBoundingClientRect().height),
                                 (c.innerText || '').trim().split('\\n')[0].slice(0, 60)]);
  const chrome_px = panel ? window.innerHeight - panel.clientHeight : -1;
  return {bars, text, raw_tables: [...raw_tables], notices, notebook_px, chrome_px, cells_px,
          tables: document.querySelectorAll('.jp-RenderedMarkdown table').length,
          tensorboard_frames: document.querySelectorAll('iframe[id^="tensorboard-frame"]').length,
          images: document.querySelectorAll('.jp-OutputArea-output img').length,
          widget_errors: (text.match(/Error displaying widget|model not found|x\\(children=/g) || []).length,
          tracebacks: (text.match(/Traceback \\(most recent call last\\)/g) || []).length,
          train_output_px: train ?
            train.querySelector('.jp-Cell-outputWrapper').getBoundingClientRect().height : -1,
          visible_logs:
            pres.filter(p => p.textContent.includes('Flights:') && p.offsetParent !== null).length,
          accordions: document.querySelectorAll(
            '.jupyter-widget-Accordion, .p-Accordion, .widget-accordion, .lm-Accordion').length};
}"""


def run_notebook(page, url: str, name: str, out: Path, tag: str = "") -> dict:
    _open(page, url, name)
    _menu(page, "Run", "Run All Cells")
    deadline, done, idle = min(time.time() + RUN_TIMEOUT_S, _deadline[0]), False, 0
    while time.time() < deadline and not done:
        time.sleep(3)
        text = page.inner_text("body")
        busy = page.query_selector_all(".jp-InputArea-prompt:has-text('[*]')")
        idle = 0 if busy else idle + 1
        done = FINAL_MARKS[name] in text or idle >= 5  # the last cell's words, or stopped (an error)
    for button in page.query_selector_all(".jp-toast-button:has-text('No')"):  # the news question
        button.click()
    time.sleep(2)  # the last outputs render
    facts = page.evaluate(PAGE_FACTS)
    facts["finished"] = FINAL_MARKS[name] in facts["text"]
    facts["screens"] = screens(facts)
    stem = tag or Path(name).stem
    page.screenshot(path=str(out / f"{stem}.png"), full_page=True)
    for i, cell in enumerate(
        page.query_selector_all(".jp-CodeCell")
    ):  # each cell's output, for a person to look at
        if cell.query_selector(".jp-OutputArea-output"):
            cell.screenshot(path=str(out / f"{stem}-cell{i:02d}.png"))
    return facts


def screens(facts: dict) -> float | None:
    """The notebook's length in screens of a SCREEN window: its height over what the window shows of it (the
    window's height less JupyterLab's bars; the width, and so the wrapping, is the same)."""
    if facts["notebook_px"] <= 0 or not 0 <= facts["chrome_px"] < SCREEN[1]:
        return None
    return round(facts["notebook_px"] / (SCREEN[1] - facts["chrome_px"]), 1)


def torch_version(python: str) -> str:
    r = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return r.stdout.strip() or "not installed"


def lab_version(python: str) -> str:
    return subprocess.run(
        [python, "-m", "jupyterlab", "--version"], capture_output=True, text=True
    ).stdout.strip()


def judge(name: str, facts: dict, colab_kernel: bool = False) -> list[str]:
    """What is wrong on the page (empty: all good)."""
    bad = []
    if not facts["finished"]:
        bad.append("the notebook did not finish running")
    if facts["widget_errors"]:
        bad.append(f"{facts['widget_errors']} " + WIDGET_TEXT)
    if facts["tracebacks"]:
        bad.append(f"{facts['tracebacks']} traceback(s) on the page")
    if facts["tables"] < 1:
        bad.append("no Markdown table rendered as a table")
    bad += judge_tables_and_notices(facts)
    if name == "colab_training.ipynb":
        fills = [(round(b["fill"], 2), b["classes"]) for b in facts["bars"]]
        if not any(f >= 0.99 and "success" in c for f, c in fills):
            bad.append(f"no full green bar for the finished training: {fills}")
        if not any(0.05 < f < 0.95 and "danger" not in c for f, c in fills):
            bad.append(f"no partly filled, not red bar for the simulated disconnect: {fills}")
        if any("danger" in c for _, c in fills):
            bad.append(f"a red bar: {fills}")
        if "Smoke test passed" not in facts["text"]:
            bad.append("the smoke test's final check did not pass")
        if facts["visible_logs"]:
            bad.append("the training log is unfolded (it should be folded under the curves)")
        if not 0 < facts["train_output_px"] <= MAX_TRAIN_OUTPUT_PX:
            bad.append(
                f"the Train cell's output is {facts['train_output_px']:.0f} px tall (at most "
                f"{MAX_TRAIN_OUTPUT_PX})"
            )
        if facts["images"] < 2:
            bad.append(f"{facts['images']} images (curves, scatter, along-flight figure expected)")
        if facts["screens"] is None or facts["screens"] > MAX_TRAINING_SCREENS:
            bad.append(
                f"the notebook is {facts['screens']} screens of a {SCREEN[0]} x {SCREEN[1]} window (at most "
                f"{MAX_TRAINING_SCREENS})"
            )
        # a Colab-like kernel (--kernel-python) shows TensorBoard through Colab's proxy, which is not here
        frames = 0 if colab_kernel or not has_tensorboard() else 1
        if facts["tensorboard_frames"] != frames:
            bad.append(
                f"{facts['tensorboard_frames']} TensorBoard frames in the TensorBoard cell ({frames} "
                "expected)"
            )
    if name == "colab_setup.ipynb":
        fills = [round(b["fill"], 2) for b in facts["bars"]]
        if not fills or min(fills) < 0.99:
            bad.append(f"a cache or demo progress bar is not full: {fills}")
        if "Smoke test: setup checks passed" not in facts["text"]:
            bad.append("the setup notebook's check did not pass")
    return bad


def judge_tables_and_notices(facts: dict) -> list[str]:
    """Every Markdown table rendered as a table; problems red, warnings amber; no "checkpoint saved" on a
    page that says a checkpoint could not be written."""
    bad = [f"a Markdown table shown as raw text, not a table: {line!r}" for line in facts["raw_tables"]]
    for n in facts["notices"]:
        want = RED if n["kind"] == "problem" else AMBER
        if not _near(n["color"], want):
            bad.append(
                f"a {n['kind']} is not {'red' if want == RED else 'amber'} ({n['color']}): {n['text']!r}"
            )
    failed = [
        n["text"] for n in facts["notices"] if n["kind"] == "problem" and "checkpoint" in n["text"].lower()
    ]
    if failed and "checkpoint saved" in facts["text"].lower():
        at = facts["text"].lower().index("checkpoint saved")
        bad.append(
            f"the page says 'checkpoint saved' ({facts['text'][max(0, at - 150) : at + 30]!r}) "
            f"and also: {failed[0]!r}"
        )
    return bad


def _near(color: str, want: str) -> bool:
    """Colour `color` ('rgb(r, g, b)') is `want` give or take a theme's shade (JupyterLab's error red, an
    ANSI red: both red)."""
    got, ref = (list(map(int, re.findall(r"\d+", c)[:3])) for c in (color, want))
    return len(got) == 3 and max(abs(a - b) for a, b in zip(got, ref)) <= 40


def _menu(page, menu: str, item: str) -> None:
    page.click(
        f".lm-MenuBar-itemLabel:text-is('{menu}'), .p-MenuBar-itemLabel:text-is('{menu}')", timeout=30_000
    )
    page.click(f".lm-Menu-itemLabel:text-is('{item}'), .p-Menu-itemLabel:text-is('{item}')", timeout=30_000)


def _wait_for(page, predicate, timeout_s: float, what: str):
    """`predicate()` once it is true, within `timeout_s` and the scenario's budget."""
    deadline = min(time.time() + timeout_s * _scale[0], _deadline[0])
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    budget = " (the scenario's wall-time budget ran out)" if time.time() >= _deadline[0] else ""
    raise RuntimeError(f"timed out waiting for {what}{budget}")


# The visible notebook's kernel is ready: JupyterLab 4's execution indicator or 3.6's kernel status, among
# the visible ones only (a restored workspace keeps a hidden notebook's indicator first in the page).
KERNEL_IDLE = """() => [...document.querySelectorAll(
    '.jp-Notebook-ExecutionIndicator, .jp-Toolbar-kernelStatus')].some(e => e.offsetParent !== null &&
    (e.getAttribute('data-status') === 'idle' || /idle/i.test(e.getAttribute('title') || '')))"""


def _open(page, url: str, name: str) -> None:
    """Open notebook `name` alone (the workspace reset: no notebook restored beside it), its kernel ready."""
    page.goto(url.format(name) + "&reset")
    page.wait_for_selector(VISIBLE_NOTEBOOK, timeout=120_000)
    try:
        page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    except Exception:  # noqa: BLE001 - a theme without either indicator: the kernel gets its seconds below
        pass
    time.sleep(3)  # the kernel connects


def _busy(page) -> bool:
    return bool(page.query_selector_all(".jp-InputArea-prompt:has-text('[*]')"))


def _wait_idle(page, timeout_s: float, what: str) -> None:
    """No cell running for 5 polls in a row (a notebook that ran to its end or stopped at an error)."""
    quiet = [0]

    def idle():
        quiet[0] = 0 if _busy(page) else quiet[0] + 1
        return quiet[0] >= 5

    _wait_for(page, idle, timeout_s, what)


def _cell_text(page, code: str) -> str:
    """The text of the first code cell whose source holds `code` (its outputs included)."""
    return page.inner_text(f".jp-CodeCell:has-text('{code}')")


def _run_cell(page, code: str) -> None:
    cell = page.locator(f".jp-CodeCell:has-text('{code}')").first
    cell.locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")


def _restart_and_run_all(page) -> None:
    _menu(page, "Kernel", "Restart Kernel and Run All Cells…")  # a new kernel, as after a disconnect
    page.click(".jp-Dialog-button.jp-mod-accept", timeout=30_000)


def _train_label(page) -> str:
    """The latest training view's label ('epoch e of E · step s of S ...')."""
    labels = page.eval_on_selector_all(
        ".widget-html-content, .widget-html", "xs => xs.map(x => x.textContent)"
    )
    return next((x for x in reversed(labels) if x.startswith("epoch ") and " · step " in x), "")


def scenario_continue(page, url: str, out: Path) -> list[str]:
    """Issue 15 A1, as a user does it (not the smoke test): pick 3 epochs, train, press stop; restart the
    kernel and Run all: the picker must come back with 3 epochs and the same run, and the run continue."""
    bad = []
    _open(page, url, "colab_training.ipynb")
    _menu(page, "Run", "Run All Cells")
    _wait_for(page, lambda: "step" in _train_label(page), 300, "training to start")
    _menu(page, "Kernel", "Interrupt Kernel")  # stop the default run: a checkpoint is saved
    _wait_for(page, lambda: "stopped" in _train_label(page), 120, "the stop")
    epochs = page.locator(".jp-OutputArea input[type='number']").first
    epochs.fill("3")
    epochs.press("Tab")  # the widget syncs its value
    train = page.locator(".jp-CodeCell:has-text('colab.train(ws, picker)')").first
    train.locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")  # train again: 3 epochs now
    # the 3-epoch run: its label reads "epoch e of 3 · step s of S", S its steps in all
    three = re.compile(r"epoch \d+ of 3 · step \d+ of (\d+)")
    _wait_for(
        page,
        lambda: three.search(_train_label(page)) and "stopped" not in _train_label(page),
        300,
        "the 3-epoch run",
    )
    steps = f"of {three.search(_train_label(page)).group(1)}"
    time.sleep(4)
    _menu(page, "Kernel", "Interrupt Kernel")
    _wait_for(page, lambda: "stopped" in _train_label(page), 120, "the second stop")
    page.screenshot(path=str(out / "continue-1-stopped.png"), full_page=True)
    _restart_and_run_all(page)
    _wait_for(page, lambda: "finished" in _train_label(page), 600, "the continued run to finish")
    note = page.inner_text(".jp-CodeCell:has-text('colab.preset_picker(ws)')")
    value = page.locator(".jp-OutputArea input[type='number']").first.input_value()
    label = _train_label(page)
    page.screenshot(path=str(out / "continue-2-run-all.png"), full_page=True)
    if value != "3":
        bad.append(f"after Run all the picker shows {value} epochs, not the 3 chosen")
    # the note is refreshed once the run ends: "Continuing run demo" while it trains, then that it finished
    train_text = page.inner_text(".jp-CodeCell:has-text('colab.train(ws, picker)')")
    if "Continuing run demo" not in note and "Run demo is finished" not in note:
        bad.append(f"the picker does not say it continues run demo: {note[:300]!r}")
    elif "Continuing run demo" in note and f"{steps})" not in note:  # a checkpoint of the 3-epoch run
        bad.append(f"the stop did not save a checkpoint of the 3-epoch run: {note[:300]!r}")
    if "Resumed from step" not in train_text:
        bad.append("the Train cell does not say the run resumed from the stop's checkpoint")
    if not three.search(label) or steps not in label:
        bad.append(f"the continued run is not the 3-epoch run (bar: {label!r})")
    return bad


def scenario_disk_full(page, url: str, out: Path) -> list[str]:
    """Issue 38 defect 2: the training notebook (smoke) with every checkpoint write meeting a full disk. Each
    failed save is a red problem, and nothing on the page says "checkpoint saved"."""
    facts = run_notebook(page, url, "colab_training.ipynb", out, tag="disk-full")
    bad = judge_tables_and_notices(facts)
    failed = [n for n in facts["notices"] if n["kind"] == "problem" and "could not be written" in n["text"]]
    if not failed:
        problems = [n["text"] for n in facts["notices"] if n["kind"] == "problem"]
        bad.append(f"no problem notice says a checkpoint could not be written (problems: {problems[:5]})")
    if any(not _near(n["color"], RED) for n in failed):
        bad.append("a failed checkpoint save is not said in red")
    for claim in ("checkpoint saved", "progress saved"):
        if claim in facts["text"].lower():
            at = facts["text"].lower().index(claim)
            bad.append(
                f"after failed saves the page says {claim!r}: {facts['text'][max(0, at - 150) : at + 30]!r}"
            )
    if facts["widget_errors"]:
        bad.append(f"{facts['widget_errors']} " + WIDGET_TEXT)
    return bad


def _picker_facts(page) -> dict:
    """The picker as shown: its note, the run mode pressed, the held-out list's options."""
    cell = ".jp-CodeCell:has-text('colab.preset_picker(ws)')"
    return {
        "note": page.inner_text(cell),
        "mode": page.eval_on_selector_all(
            f"{cell} .widget-toggle-button.mod-active", "xs => xs.map(x => x.textContent.trim())"
        ),
        "heldout": page.eval_on_selector_all(
            f"{cell} select[multiple] option", "xs => xs.map(x => x.textContent.trim())"
        ),
    }


def _make_flights(ctx, n: int) -> list[str]:
    """`n` flights of the user's own (the real file layout, frames the demo configuration takes) copied into
    the CloudML folder's data/ER2 as a user would; their names."""
    made = ctx.root / "made-flights"
    if not made.is_dir():
        env = dict(os.environ, PYTHONPATH=str(REPO))
        subprocess.run(
            [ctx.python, "-m", "cloudml_lib", "make-demo-data", "--out", str(made), "--flights", "5"]
            + ["--frames", "160"],
            env=env,
            check=True,
            capture_output=True,
        )
    names = sorted(d.name for d in made.iterdir() if d.is_dir())[:n]
    for name in names:
        shutil.copytree(made / name, ctx.home / "data" / "ER2" / name)
    return names


def _run_all_to_its_end(page, url: str, name: str, timeout_s: float, picture: Path) -> dict:
    """Notebook `name` opened alone, Run all, until no cell runs (its end, or a cell that stopped it): the
    page's facts, and its screenshot in `picture`."""
    _open(page, url, name)
    _menu(page, "Run", "Run All Cells")
    _wait_for(page, lambda: _busy(page), 60, f"{name} to start")
    _wait_idle(page, timeout_s, name)
    facts = page.evaluate(PAGE_FACTS)
    page.screenshot(path=str(picture), full_page=True)
    return facts


def _stop_training(page, what: str) -> None:
    """■ on the running Train cell (Interrupt Kernel), then the notebook's remaining cells run out."""
    _menu(page, "Kernel", "Interrupt Kernel")
    _wait_for(page, lambda: "stopped" in _train_label(page), 120, f"the stop of {what}")
    _wait_idle(page, 180, "the notebook after the stop")


def scenario_own_flights(page, url: str, out: Path, ctx) -> list[str]:
    """Issue 45 item 2 as a user meets it: a demo run stopped; four flights of their own copied into data/;
    setup Run all shows them; training Restart and Run all: a new run on them is the default (not "Continue
    demo"), the demo run kept and offered, the held-out list the user's flights, and the new run trains."""
    bad = []
    _open(page, url, "colab_training.ipynb")
    _menu(page, "Run", "Run All Cells")
    _wait_for(page, lambda: "step" in _train_label(page), 300, "the demo run to start")
    _stop_training(page, "the demo run")
    names = _make_flights(ctx, 4)
    setup = _run_all_to_its_end(page, url, "colab_setup.ipynb", 600, out / "own-flights-1-setup.png")
    bad += [f"setup: {b}" for b in judge_tables_and_notices(setup)]
    if setup["tracebacks"]:
        bad.append(f"setup: {setup['tracebacks']} traceback(s) on the page")
    missing = [n for n in names if n not in setup["text"]]
    if missing:
        bad.append(f"setup's flight table does not show the user's flights {missing}")
    if "Setup done" not in setup["text"]:
        bad.append("setup does not end with 'Setup done' for four usable flights")
    _open(page, url, "colab_training.ipynb")
    _restart_and_run_all(page)
    _wait_for(page, lambda: _picker_facts(page)["mode"], 180, "the picker")
    picker = _picker_facts(page)
    if "Your flights are in data/ now" not in picker["note"]:
        bad.append(f"the picker's note does not speak of the user's flights: {picker['note'][:400]!r}")
    if "The demo run demo is kept" not in picker["note"]:
        bad.append("the picker's note does not say the demo run is kept")
    if picker["mode"] != ["Start a new run"]:
        bad.append(f"the picker's default is {picker['mode']}, not a new run on the user's flights")
    if not picker["heldout"] or any("demo" in o or o not in names for o in picker["heldout"]):
        bad.append(f"the held-out list shows {picker['heldout']}, not the user's flights {names}")
    _wait_for(page, lambda: "step" in _train_label(page), 420, "the new run to start")
    train_text = _cell_text(page, "colab.train(ws, picker)")
    if "Resumed from step" in train_text or "Continuing run demo" in train_text:
        bad.append("the Train cell continued the demo run instead of a new run on the user's flights")
    _stop_training(page, "the new run")
    facts = page.evaluate(PAGE_FACTS)
    page.screenshot(path=str(out / "own-flights-2-training.png"), full_page=True)
    bad += judge_tables_and_notices(facts)
    if facts["tracebacks"] or facts["widget_errors"]:
        bad.append(f"{facts['tracebacks']} traceback(s), {facts['widget_errors']} widget error(s)")
    return bad


def scenario_one_flight(page, url: str, out: Path, ctx) -> list[str]:
    """Issue 45 item 6: one flight in data/. Setup says it is not finished (no "Setup done"); the picker says
    the problem once, in red, and nothing under it says what would be trained; the Train cell refuses in
    words, with no traceback."""
    bad = []
    (name,) = _make_flights(ctx, 1)
    setup = _run_all_to_its_end(page, url, "colab_setup.ipynb", 300, out / "one-flight-1-setup.png")
    if "Setup is not finished: training needs a second flight" not in setup["text"]:
        bad.append("setup does not say it is not finished for want of a second flight")
    if "Setup done" in setup["text"]:
        bad.append("setup says 'Setup done' with one flight")
    if name not in setup["text"]:
        bad.append(f"setup's table does not show the flight {name}")
    bad += [f"setup: {b}" for b in judge_tables_and_notices(setup)]
    facts = _run_all_to_its_end(page, url, "colab_training.ipynb", 240, out / "one-flight-2-training.png")
    note = _picker_facts(page)["note"]
    if "Only one complete flight" not in note or "Nothing is trained until this is fixed" not in note:
        bad.append(f"the picker does not refuse one flight in words: {note[:400]!r}")
    if "Trains preset" in note:
        bad.append("under its problem the picker still says what it trains")
    if "Add a second flight" not in _cell_text(page, "colab.train(ws, picker)"):
        bad.append("the Train cell does not say to add a second flight")
    if not any(n["kind"] == "problem" for n in facts["notices"]):
        bad.append("no problem on the page is said in red")
    if facts["tracebacks"]:
        bad.append(f"{facts['tracebacks']} traceback(s) on the page for a refusal in words")
    bad += judge_tables_and_notices(facts)
    return bad


def scenario_crossval(page, url: str, out: Path, ctx) -> list[str]:
    """The cross-validation cell's live view (smoke flights): after the smoke run, the box ticked and the cell
    run, the view follows each fold ("fold k of n (FLIGHT held out)"), and its table renders; no red, no
    traceback."""
    facts = run_notebook(page, url, "colab_training.ipynb", out, tag="crossval-1-smoke")
    if not facts["finished"]:
        return ["the smoke run did not finish, so cross-validation was not started"]
    tables_before = facts["tables"]
    page.get_by_text("Then cross-validate").first.click()  # the box's label ticks it
    time.sleep(2)  # the widget syncs its value to the (idle) kernel
    _run_cell(page, "colab.crossval(ws, picker, run_dir)")
    folds: set[str] = set()

    def fold_labels():
        labels = page.eval_on_selector_all(
            ".widget-html-content, .widget-html", "xs => xs.map(x => x.textContent)"
        )
        folds.update(m.group(0) for x in labels if (m := re.search(r"fold \d+ of \d+ \([^)]*\)", x)))
        return folds

    _wait_for(page, fold_labels, 300, "the first fold")
    quiet = [0]

    def done():
        fold_labels()
        quiet[0] = 0 if _busy(page) else quiet[0] + 1
        return quiet[0] >= 5

    _wait_for(page, done, BUDGET_S["crossval"], "cross-validation to finish")
    facts = page.evaluate(PAGE_FACTS)
    page.screenshot(path=str(out / "crossval-2-done.png"), full_page=True)
    bad = judge_tables_and_notices(facts)
    counts = {int(re.search(r"of (\d+)", f).group(1)) for f in folds}
    seen = sorted({int(re.search(r"fold (\d+)", f).group(1)) for f in folds})
    if len(counts) != 1 or not seen or seen[0] != 1:
        bad.append(f"the live view's folds: {sorted(folds)}")
    elif len(seen) < 2:
        bad.append(f"the live view followed one fold only: {sorted(folds)}")
    if facts["tables"] <= tables_before:
        bad.append("no cross-validation table rendered after the folds")
    if facts["tracebacks"] or facts["widget_errors"]:
        bad.append(f"{facts['tracebacks']} traceback(s), {facts['widget_errors']} widget error(s)")
    return bad


# name: (the scenario, smoke mode, a label for the results)
SCENARIO_RUNS = {
    "continue": (lambda page, url, out, ctx: scenario_continue(page, url, out), False,
                 "continue after stop and restart"),
    "disk-full": (lambda page, url, out, ctx: scenario_disk_full(page, url, out), True,
                  "a full disk at every checkpoint save"),
    "own-flights": (scenario_own_flights, False, "own flights after a demo run"),
    "one-flight": (scenario_one_flight, False, "one flight"),
    "crossval": (scenario_crossval, True, "cross-validation live view"),
}  # fmt: skip


def _in_lab(python: str, base: Path, out: Path, name: str, kernel: str | None = None) -> dict:
    """Scenario `name` in a JupyterLab and a folder of its own, within its wall-time budget; its problems (a
    timeout is one, with a screenshot) and how long it took."""
    from types import SimpleNamespace

    from playwright.sync_api import sync_playwright

    scenario, smoke, _ = SCENARIO_RUNS[name]
    root = base / name
    root.mkdir(parents=True)
    for nb in ("colab_setup.ipynb", "colab_training.ipynb"):
        shutil.copy(REPO / nb, root / nb)
    shutil.copytree(REPO / "configs", root / "configs")
    pythonpath = ""
    if name == "disk-full":
        (root / "disk-full-hook").mkdir()
        (root / "disk-full-hook" / "sitecustomize.py").write_text(DISK_FULL_HOOK)
        pythonpath = str(root / "disk-full-hook") + os.pathsep
    t0 = time.time()
    _scale[0] = time_scale()
    _deadline[0] = t0 + BUDGET_S[name] * _scale[0]
    lab, url = start_lab(
        python, root, out / f"jupyterlab-{name}.log", smoke=smoke, pythonpath=pythonpath, kernel=kernel
    )
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 4200})
            page.set_default_timeout(60_000 * _scale[0])
            try:
                # the CloudML folder: CLOUDML_HOME, or on a Colab-like kernel the Drive's (colab_layout)
                home = root / "gdrive" / "MyDrive" / "CloudML" if kernel else root / "CloudML"
                ctx = SimpleNamespace(root=root, python=kernel or python, home=home)
                problems = scenario(page, url, out, ctx)
            except Exception as e:  # noqa: BLE001 - a timeout is a failed check, with a picture
                page.screenshot(path=str(out / f"{name}-failed.png"), full_page=True)
                problems = [f"{type(e).__name__}: {e}"]
            browser.close()
    finally:
        _deadline[0] = float("inf")
        _stop(lab)
        _stop_tensorboards(root)
    budget = round(BUDGET_S[name] * _scale[0])
    return {"problems": problems, "seconds": round(time.time() - t0), "budget_s": budget, "scale": _scale[0]}


def check(
    python: str, out: Path, notebooks: list[str], scenarios: tuple = SCENARIOS, kernel: str | None = None
) -> dict:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="cloudml-browser-"))
    kernel = kernel_copy(kernel, base) if kernel else None
    root = base / "notebooks"
    root.mkdir()
    for name in notebooks:
        shutil.copy(REPO / name, root / name)
    shutil.copytree(REPO / "configs", root / "configs")
    lab, url = start_lab(python, root, out / "jupyterlab.log", kernel=kernel)
    results, kernel_versions = {}, "unknown"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
            # Tall: JupyterLab scrolls inside its panel, so the page is as long as the window.
            page = browser.new_page(viewport={"width": 1400, "height": 4200})
            for name in notebooks:
                facts = run_notebook(page, url, name, out)
                found = re.search(r"Python [\d.]+, ipywidgets [\d.]+", facts["text"])
                kernel_versions = found.group(0) if found else "unknown"
                results[name] = {
                    "problems": judge(name, facts, colab_kernel=kernel is not None),
                    **{k: v for k, v in facts.items() if k != "text"},
                }
            browser.close()
    finally:
        _stop(lab)
        _stop_tensorboards(root)
    for name in scenarios:
        results[SCENARIO_RUNS[name][2]] = _in_lab(python, base, out, name, kernel)
    results["versions"] = (
        f"server: JupyterLab {lab_version(python)}; kernel: {kernel_versions}, "
        f"torch {torch_version(kernel or python)}"
    )
    shutil.rmtree(base, ignore_errors=True)
    (out / "browser_check.json").write_text(json.dumps(results, indent=1))
    return results


def has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _stop_tensorboards(root: Path) -> None:
    """TensorBoard servers the notebooks started over `root` (a kernel's end leaves them running)."""
    if not has_tensorboard():
        return
    from tensorboard import manager

    for info in manager.get_all():
        if str(info.logdir).startswith(str(root)):
            try:
                os.kill(info.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _stop(lab: subprocess.Popen) -> None:
    lab.terminate()
    try:
        lab.wait(timeout=20)
    except subprocess.TimeoutExpired:
        lab.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--python", default=sys.executable, help="the Python whose JupyterLab and kernel are used"
    )
    ap.add_argument(
        "--kernel-python",
        default=None,
        help="the Python the notebooks' kernel runs (its own environment, as on Colab: e.g. the Colab "
        "twin's, Python 3.13 with torch 2.11 and ipykernel 6.17.1); default: --python's",
    )
    ap.add_argument("--out", default="browser-check", help="folder for screenshots and browser_check.json")
    ap.add_argument("--notebooks", nargs="+", default=["colab_setup.ipynb", "colab_training.ipynb"])
    ap.add_argument(
        "--scenarios",
        nargs="*",
        default=list(SCENARIOS),
        choices=SCENARIOS,
        help="continue: stop, restart and Run all; disk-full: every checkpoint save fails; own-flights: "
        "the user's flights after a demo run; one-flight; crossval: its live view (none: skip all)",
    )
    args = ap.parse_args()
    lacking = missing_tools(args.python)
    if lacking:
        print("cannot run the browser check; missing: " + "; ".join(lacking), file=sys.stderr)
        return 2
    results = check(args.python, Path(args.out), args.notebooks, tuple(args.scenarios), args.kernel_python)
    print(results.pop("versions"))
    for name, r in results.items():
        print(f"{name}: " + ("OK" if not r["problems"] else "PROBLEMS:\n  - " + "\n  - ".join(r["problems"])))
    return 0 if all(not r["problems"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
