"""Each input file's SHA-256, computed once per file version: remembered in the cache folder
(`file_sha256.json`, keyed by path, size and modification time), streamed in small chunks so that a
whole-flight predict keeps its memory flat. The record of what a run was made from (core/provenance.py) and
the cache's keys use it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

MEMO = "file_sha256.json"


CHUNK = 1 << 20  # small: a whole-flight predict keeps its memory flat


def file_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """The SHA-256 of a whole file, remembered in `memo_dir` by (resolved path, size, mtime)."""
    path = Path(path)
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = Path(memo_dir) / MEMO if memo_dir else None
    memo = {}
    if memo_path and memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            memo = {}
    if key in memo:
        return memo[key]
    t0, h = time.time(), hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if st.st_size > (256 << 20):
        log.info(
            "SHA-256 of %s (%.1f GB) for the provenance record: %.0f s, once",
            path.name,
            st.st_size / 1e9,
            time.time() - t0,
        )
    if memo_path:
        memo[key] = digest
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f"{MEMO}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(memo, indent=0))
            os.replace(tmp, memo_path)
        except OSError as e:  # a memo that cannot be written costs time, not results
            log.debug("could not write %s (%s)", memo_path, e)
    return digest


def input_files(paths: dict[str, Path], memo_dir: Path | None = None) -> dict:
    """{role: {name, bytes, sha256}} of one flight's files."""
    return {
        role: {"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": file_sha256(p, memo_dir)}
        for role, p in paths.items()
    }
