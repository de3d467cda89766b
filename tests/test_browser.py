"""Both notebooks in a real browser (tests/browser_check.py): widgets rendered, the bar's fill and colour,
every Markdown table rendered as a table (no raw '| a | b |' text), problems red and warnings amber, the
folded log, the Train cell's height, no traceback on the page; then its five scenarios, each in its own
JupyterLab within its own wall-time budget: the picker continuing the run the user started after a stop and
a kernel restart; a full disk at every checkpoint save said in red, never as "checkpoint saved"; the user's
own flights after a demo run; one flight; the cross-validation live view. Needs Debian's Chromium, the
playwright package and JupyterLab; skipped where any is missing (CI has none of them)."""

import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import browser_check  # noqa: E402

pytestmark = pytest.mark.skipif(
    bool(browser_check.missing_tools()),
    reason="browser check needs: " + "; ".join(browser_check.missing_tools()),
)


@pytest.mark.slow
def test_the_notebooks_in_a_real_browser(tmp_path):
    results = browser_check.check(sys.executable, tmp_path, ["colab_setup.ipynb", "colab_training.ipynb"])
    results.pop("versions")
    problems = {name: r["problems"] for name, r in results.items() if r["problems"]}
    assert not problems, f"{problems} (screenshots in {tmp_path})"
