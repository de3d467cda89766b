"""Each input file's SHA-256, computed once per file version: remembered in the cache folder
(`file_sha256.json`, keyed by path, size and modification time), streamed in small chunks so that a
whole-flight predict keeps its memory flat. The record of what a run was made from (core/run/provenance.py)
and the cache's keys use it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from cloudml_lib.base import ledger
from cloudml_lib.base.files import open_regular
from cloudml_lib.base.ownership import is_marked
from cloudml_lib.base.shapes import ANY, Damaged, MapOf, read_json

log = logging.getLogger(__name__)

MEMO = "file_sha256.json"
MEMO_LIMIT = 16 << 20  # bytes: a memo of every input file a user could have


CHUNK = 1 << 20  # small: a whole-flight predict keeps its memory flat


def file_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """The SHA-256 of a whole file, remembered in `memo_dir` by (resolved path, size, mtime)."""
    path = Path(path)
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    # the memo lives only in a cache folder CloudML marked as its own; a damaged one is rebuilt, never fatal
    memo_path = Path(memo_dir) / MEMO if memo_dir and is_marked(memo_dir, "preprocessing cache") else None
    memo = read_memo(memo_path) if memo_path else {}
    if isinstance(memo.get(key), str):
        return memo[key]
    t0, h = time.time(), hashlib.sha256()
    with open_regular(path) as f:
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
    if memo_path and ledger.skip_unless_mine(memo_path, "replace"):  # listed when the cache was claimed
        memo[key] = digest
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f"{MEMO}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(memo, indent=0))
            os.replace(tmp, memo_path)
        except OSError as e:  # a memo that cannot be written costs time, not results
            log.debug("could not write %s (%s)", memo_path, e)
    return digest


def read_memo(path: Path) -> dict:
    """The memo: {key: hex digest}, read as untrusted (type, size and depth); {} where it is missing or
    damaged (it is rebuilt: it saves time, it decides nothing)."""
    try:
        doc = read_json(path, MapOf(ANY), MEMO_LIMIT) if os.path.lexists(path) else {}
    except (OSError, Damaged):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, str) and len(v) == 64}


def input_files(paths: dict[str, Path], memo_dir: Path | None = None) -> dict:
    """{role: {name, bytes, sha256}} of one flight's files."""
    return {
        role: {"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": file_sha256(p, memo_dir)}
        for role, p in paths.items()
    }
