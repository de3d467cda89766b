"""Files the package reads at run time, found the same way in a checkout and when installed.

setup.py puts two folders of the checkout inside the installed package; this module looks in the
installed place first, then in the checkout beside the package (a source tree, an editable install):

- presets and sweep spaces: cloudml_lib/configs/ installed, configs/ in the checkout
- figures the benchmarks measured and the library quotes: cloudml_lib/measured/ installed,
  benchmarks/results/ in the checkout
- the package's version, read from its __init__.py (the layers below the commands never import the package
  top, which reaches the commands' Python API)

Nothing here depends on the working directory.
"""

from __future__ import annotations

import json
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # cloudml_lib/ (this file is cloudml_lib/base/resources.py)
# installed folder inside the package -> the checkout's folder (setup.py maps the same pairs)
FOLDERS = {"configs": "configs", "measured": "benchmarks/results"}
# --preset NAME -> its file under configs/
PRESET_FILES = {
    "A": "colab_optimized_full.yaml",
    "B": "colab_full_stable.yaml",
    "C": "colab_optimized.yaml",
    "demo": "demo.yaml",
    "published": "reproduce_published.yaml",
}


def folder(kind: str) -> Path | None:
    """Where `kind` (configs, measured) is in this installation; None where it is missing."""
    for place in (PACKAGE / kind, PACKAGE.parent / FOLDERS[kind]):
        if place.is_dir():
            return place
    return None


def config_file(name: str) -> Path | None:
    """A packaged config or sweep space by its path under configs/ (e.g. "demo.yaml", "sweeps/demo.yaml")."""
    root = folder("configs")
    path = root / name if root else None
    return path if path is not None and path.is_file() else None


def packaged_alternative(path: str | Path, what: str) -> str:
    """For a --config or --space file that is not there: the packaged one of that name, in words ("" if
    none)."""
    name = Path(path).name
    if what == "--config":
        preset = next((k for k, v in PRESET_FILES.items() if v == name), None)
        return f"; that file comes with CloudML: use --preset {preset}" if preset else ""
    if what == "--space" and config_file(f"sweeps/{name}"):
        return "; that space comes with CloudML: leave --space out to use it" if name == "demo.yaml" else ""
    return ""


def measured(name: str) -> dict | None:
    """A benchmark's results (e.g. "gpu" for gpu.json), or None where it was never measured or is
    unreadable."""
    root = folder("measured")
    try:
        data = json.loads((root / f"{name}.json").read_text()) if root else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def package_version() -> str:
    """cloudml_lib.__version__, read from the text of the package's __init__.py ("?" if unreadable)."""
    import re

    try:
        text = (PACKAGE / "__init__.py").read_text(encoding="utf-8")
    except OSError:
        return "?"
    m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    return m.group(1) if m else "?"
