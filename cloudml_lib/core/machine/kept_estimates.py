"""Estimates kept on this machine: a step's memory and FLOPs (estimate.py) computed once per machine, torch
and CloudML code, then read back by every later process instead of counted again (a few seconds of CPU
each time: `diagnose`, the setup notebook's table, then the training notebook's, `train --preset auto`).

One small JSON file per step shape in the temporary folder's cloudml-estimates-<user> (one per user, as
inductor's kernels: on Colab it lives as long as the runtime), named by what decides the numbers: the
shape, torch's release and a digest of the code that builds and counts the step (cloudml_lib/core). A file
is read back only if it is a regular file of this user's folder, holds the key it is named by, numbers in
range and the SHA-256 it was written with; anything else is named in a warning and left as it is (the
estimate is counted afresh, and nothing is written over a file CloudML cannot prove it wrote unchanged).
A file is only ever created, never replaced: two processes counting the same shape at once write the same
numbers, and the second finds the first's file in place."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

import torch

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.files import NotRegularFile, read_text
from cloudml_lib.core.network.compile_cache import user_name

log = logging.getLogger(__name__)

FORMAT = 1
WHAT = "CloudML's memory and FLOPs estimate of one training step (cloudml_lib/core/machine/estimate.py)"
MAX_BYTES = 16 << 10  # a kept estimate is well under 1 KiB
MAX_PEAK = 1e15  # bytes: a peak line beyond a petabyte is not a step of this network
MAX_FLOPS = 1e18  # per sample


def folder() -> Path:
    """This user's folder of kept estimates on this machine (TMPDIR is read each time)."""
    return Path(tempfile.gettempdir()) / f"cloudml-estimates-{user_name()}"


@functools.cache
def code_digest() -> str:
    """A digest of the code an estimate depends on (every module of cloudml_lib/core: the network, the
    synthetic step, the counting), so that a changed model is never given an older model's figures."""
    core = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(core.rglob("*.py")):
        h.update(str(path.relative_to(core)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def key_of(shape: dict) -> dict:
    """What decides a step's figures, as JSON reads it back (tuples as lists)."""
    key = {"format": FORMAT, "torch": torch.__version__, "code": code_digest(), "shape": shape}
    return json.loads(json.dumps(key, sort_keys=True))


def path_of(key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return folder() / f"{name}.json"


def _checksum(doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _problem(doc, key: dict) -> str | None:
    """Why `doc` is not a kept estimate of `key` (None: it is)."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("sha256") != _checksum(doc):
        return "its SHA-256 does not match its content (changed since CloudML wrote it)"
    if doc.get("key") != key:
        return "it holds the estimate of another shape, torch or code than its name says"
    for part in ("train", "infer"):
        line = doc.get(part)
        if not isinstance(line, dict) or set(line) != {"fixed", "per_sample"}:
            return f"{part!r} is not a peak line (fixed, per_sample)"
        for name, value in line.items():
            if not _number(value, 0.0, MAX_PEAK):
                return f"{part}.{name} {value!r} is out of range (0 to {MAX_PEAK:.0e} bytes)"
    if not _number(doc.get("flops_per_sample"), 0.0, MAX_FLOPS):
        return f"flops_per_sample {doc.get('flops_per_sample')!r} is out of range (0 to {MAX_FLOPS:.0e})"
    return None


def _number(value, low: float, high: float) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


def _own_folder(where: Path) -> bool:
    """`where` is a real folder of this user (not a link, not another user's in a shared /tmp)."""
    try:
        st = os.lstat(where)
    except OSError:
        return False
    import stat

    return stat.S_ISDIR(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())


def read(key: dict) -> dict | None:
    """The kept figures of `key` ({"train": {...}, "infer": {...}, "flops_per_sample": ...}), or None where
    none is kept or the file cannot be trusted (said in a warning, the file left as it is)."""
    path = path_of(key)
    if not _own_folder(path.parent):
        return None
    try:
        doc = json.loads(read_text(path, MAX_BYTES, follow=False))
    except FileNotFoundError:
        return None
    except (OSError, CloudMLError, NotRegularFile, ValueError) as e:
        why = str(e)[:200]
    else:
        why = _problem(doc, key)
        if why is None:
            return {k: doc[k] for k in ("train", "infer", "flops_per_sample")}
    log.warning("kept memory estimate %s not used: %s; counted afresh, the file left as it is", path, why)
    return None


def keep(key: dict, figures: dict) -> None:
    """Write `figures` for `key`, unless a file of that name is there already (never replaced); a folder
    that cannot be made or written only means the next process counts again."""
    path = path_of(key)
    doc = {"what": WHAT, "key": key, **figures}
    doc["sha256"] = _checksum(doc)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _own_folder(path.parent):
            return
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".writing-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(doc, sort_keys=True, indent=1) + "\n")
            os.link(temp, path)  # fails where the name exists: a file is created, never replaced
        finally:
            os.unlink(temp)
    except OSError as e:
        log.debug("memory estimate not kept in %s: %s", path, e)
