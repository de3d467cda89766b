"""CloudML: cloud base height from ER-2 thermal-IR frame sequences, trained on a small GPU."""

import json as _json
from pathlib import Path as _Path

from cloudml_lib.base.config import Config, load_config
from cloudml_lib.base.errors import CloudMLError, ConfigError, DataError

__version__ = "0.3.0"  # 0.3: test flights untouched (data.validation), the cloud flag a base in range


def _source() -> dict:
    """What the Colab install recorded (colab/install.py): the Drive copy's fingerprint, version and time;
    {} for any other install (a checkout, a wheel)."""
    try:
        record = _json.loads((_Path(__file__).parent / "_source.json").read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


SOURCE = _source()

# The stated Python API (commands/api.py), imported on first use: `import cloudml_lib` stays light (no torch).
_API = ("Run", "load_run", "fit", "evaluate", "predict_flight", "adapt", "read_report", "export")


def __getattr__(name: str):
    if name in _API:
        from cloudml_lib.commands import api

        return getattr(api, name)
    raise AttributeError(f"module 'cloudml_lib' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])


__all__ = [
    "Config",
    "load_config",
    "CloudMLError",
    "ConfigError",
    "DataError",
    "SOURCE",
    "__version__",
    *_API,
]
