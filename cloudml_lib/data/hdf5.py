"""HDF5 values of an ER-2 file, read with messages that name the flight, the file and the key (and the
config key that names it): a missing file, dataset or column, text where numbers belong, fill values. A
flight's values come from its own files: a path that is no regular file (a FIFO would block the read for
ever), an external link or a virtual dataset (data in another file, perhaps outside the data folder) is
refused, named."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from cloudml_lib.base.errors import DataError
from cloudml_lib.base.files import NotRegularFile, open_fd

log = logging.getLogger(__name__)


FILL_BELOW = -999.0  # fill values such as -9999 mean "none"


@contextmanager
def open_h5(path: Path, flight: str):
    try:
        os.close(open_fd(path, os.O_RDONLY))  # without blocking: a FIFO is named, never waited on
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise DataError(f"flight {flight}: file not found: {path}") from None
    except NotRegularFile as e:
        raise DataError(
            f"flight {flight}: {e.strerror}. A flight's data file must be a regular file: replace it with "
            f"the file itself, or remove flight {flight} from data.flights."
        ) from None
    except OSError as e:
        raise DataError(f"flight {flight}: cannot read {path} as HDF5 ({e}); is the file complete?") from None
    try:
        yield f
    finally:
        f.close()


def holds_dataset(path: Path, key: str) -> bool:
    """Whether `path` is a regular file (no link, no FIFO) that opens as HDF5 with a dataset at `key`: what an
    earlier CloudML wrote beside its record (ownership's second proof)."""
    if not path.is_file() or path.is_symlink():
        return False
    try:
        with h5py.File(path, "r") as f:
            return isinstance(f.get(key), h5py.Dataset)
    except (OSError, ValueError):
        return False


def outside(f: h5py.File, key: str) -> str | None:
    """Where `key` leads out of `f`, in words (an external link on its path, a virtual dataset); None when its
    data are in `f`."""
    parts = [p for p in key.split("/") if p]
    for i in range(1, len(parts) + 1):
        at = "/".join(parts[:i])
        link = f.get(at, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            return f"'{at}' is an external link to {link.filename}:{link.path}"
        if link is None:
            return None
    item = f.get(key)
    if isinstance(item, h5py.Dataset) and item.is_virtual:
        sources = sorted({m.file_name for m in item.virtual_sources()})
        return f"'{key}' is a virtual dataset reading {', '.join(sources[:3])}"
    return None


def dataset(f: h5py.File, key: str, flight: str, config_key: str) -> h5py.Dataset:
    elsewhere = outside(f, key)
    if elsewhere:
        raise DataError(
            f"flight {flight}: {f.filename} {elsewhere}: CloudML reads a flight's values from its own files "
            f"only (data.keys.{config_key}). Copy the data into the file (h5copy, or h5py), or set "
            f"data.keys.{config_key} to a dataset stored in it."
        )
    if key not in f or not isinstance(f[key], h5py.Dataset):
        present = []
        f.visit(lambda name: present.append(name) if isinstance(f[name], h5py.Dataset) else None)
        raise DataError(
            f"flight {flight}: {f.filename} has no dataset '{key}' (set by data.keys.{config_key}); "
            f"datasets present: {', '.join(present[:20]) or 'none'}"
        )
    return f[key]


def numbers(f: h5py.File, key: str, flight: str, config_key: str, expected: str = "numbers") -> np.ndarray:
    """A dataset's values as float64. Numbers stored as text are read (and logged); anything else that is
    not numbers (words, dates as text, compound records) is a DataError naming the dataset and its key."""
    ds = dataset(f, key, flight, config_key)
    raw = np.asarray(ds[()])
    where = f"flight {flight}: {f.filename} '{key}' (data.keys.{config_key})"
    if raw.dtype.kind in "biuf":
        return raw.astype(np.float64)
    if raw.dtype.kind in "SUO":
        try:
            values = raw.astype(np.float64)
        except (ValueError, TypeError):
            example = raw.reshape(-1)[0] if raw.size else ""
            example = example.decode(errors="replace") if isinstance(example, bytes) else example
            raise DataError(
                f"{where} holds text ({raw.dtype}, e.g. {str(example)[:40]!r}), not {expected}. Is it "
                f"the right dataset? Set data.keys.{config_key} to the dataset that holds {expected}."
            ) from None
        log.info("%s: stored as text (%s); read as numbers", where, raw.dtype)
        return values
    raise DataError(
        f"{where} holds {raw.dtype} values, not {expected}. Is it the right dataset? Set "
        f"data.keys.{config_key} to the dataset that holds {expected}."
    )


def read_column(f: h5py.File, key: str, flight: str, config_key: str, pick: int = 1) -> np.ndarray:
    """A per-profile array: (N,) as is, (N, 3) first/mean/last -> column `pick`, (N, 1) -> column 0."""
    x = numbers(f, key, flight, config_key)
    if x.ndim == 2 and x.shape[1] == 1:
        return x[:, 0]
    if x.ndim == 2 and x.shape[1] == 3:
        return x[:, pick]
    if x.ndim != 1:
        raise DataError(
            f"flight {flight}: {f.filename} '{key}' (data.keys.{config_key}) has shape {x.shape}; "
            "expected (profiles,) or (profiles, 3) with first, mean and last values"
        )
    return x
