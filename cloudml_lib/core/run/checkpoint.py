"""What a checkpoint holds, how it is committed to a disk that may be Google Drive, found and verified.

A checkpoint is a folder `RUN_DIR/checkpoints/step-00000400/` with
- `state.pt`   everything a bit-exact resume needs (see train/state.py), tensors and plain
               Python types only, so it loads with `torch.load(..., weights_only=True)`;
- `meta.json`  the human-readable manifest: step, epoch, time, metric, size and sha256 of state.pt;
- `COMMITTED`  the commit marker, written last.

Commit order: save to fast local disk; copy into `checkpoints/.step-N.tmp-PID/` while hashing,
flush and fsync; write the manifest; rename the folder into place; write the marker; fsync the
folder. A crash at any point leaves either a complete, marked checkpoint or something the
verifier rejects, and the previous checkpoints are untouched: old ones are deleted only after a
new one is committed, and each is renamed out of sight before its files go, so a kill mid-delete
never leaves half a checkpoint. Writes run in a background thread, at most one in flight; a failed
write (disk full, Drive gone) is logged and training goes on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cloudml_lib.base import faults, ledger
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.files import open_regular
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.liveness import process_alive
from cloudml_lib.base.outputs import refuse_link
from cloudml_lib.base.ownership import write_marker
from cloudml_lib.base.shapes import INT, NUM, TEXT, Damaged, Obj, read_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
COMMITTED, STATE, META = "COMMITTED", "state.pt", "meta.json"
REJECTED_DIR = RunLayout.REJECTED


class Key:
    """The keys of a checkpoint's dict, one spelling each: written by train/state.py (state.pt) and
    train/saving.py (best.pt), verified here, read by resume, evaluate and predict."""

    FORMAT, MODEL, OPTIMIZER, SCHEDULER, SCALER, LOOP = (
        "format",
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "loop",
    )
    SAMPLER, RNG, RNG_RANKS, PROCESSES = "sampler", "rng", "rng_ranks", "processes"
    CONFIG, SCALERS, FINGERPRINT, PROVENANCE = "config", "scalers", "data_fingerprint", "provenance"
    METRICS_BYTES, EPOCH, STEP, VAL_LOSS, TRAIN_MEAN_KM = (
        "metrics_bytes",
        "epoch",
        "step",
        "val_loss",
        "train_mean_km",
    )
    PROBE_STEP = "probe_step"  # best.pt: the final step of the training whose end fitted its cloud probe
    # the run's header (every checkpoint and best.pt): the span of the heights the model was fitted on (km),
    # and which data played which role (data/splits.py); runs made before them lack them
    LABEL_RANGE, SPLIT = "label_range_km", "split"
    # the header too: the inputs of the samples trained on (data/domain.py), for the domain check of a new
    # flight; runs made before it lack it (their flights cannot be checked)
    DOMAIN = "input_domain"
    # best.pt, written by the end of the run: the brightness-temperature baseline's cloud flag, fitted on the
    # training flights (science/clouds.py), for predict --cloud-flag bt_threshold
    CLOUD_BASELINE = "cloud_baseline"
    # a run with train.ema_decay: the average of its weights (train/averaging.py), an optional piece of state
    EMA = "ema"


# The pieces of a run's state, each its state_dict() under its key (train/state.py: stateful)
PIECES = (Key.MODEL, Key.OPTIMIZER, Key.SCHEDULER, Key.SCALER, Key.LOOP)
# What a resumable state.pt must hold; checked after the checksum, before use.
REQUIRED_KEYS = (Key.FORMAT, *PIECES, Key.SAMPLER, Key.RNG, Key.CONFIG, Key.SCALERS, Key.METRICS_BYTES)
# What best.pt must hold to evaluate or predict with it
BEST_KEYS = (Key.MODEL, Key.CONFIG, Key.SCALERS, Key.TRAIN_MEAN_KM, Key.EPOCH)
STAGING_PREFIX = "cloudml-ckpt-"
STAGING = "checkpoint staging"  # the marker's kind of a staging folder (ownership.py)
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_CHUNK = 4 << 20


# ------------------------------------------------------------------------------------ weights


def to_cpu(obj):
    """A CPU copy of every tensor in a nested structure; the originals stay on their device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ------------------------------------------------------------------------------ small files


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some FUSE file systems (Drive) do not fsync folders
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_atomic(obj: dict, path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename into place (a symbolic link where
    `path` belongs is refused, as for every file a run writes: outputs.refuse_link)."""
    path = Path(path)
    refuse_link(path)
    ledger.refuse_unless_mine(path, "replace")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            tmp.unlink()
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        ledger.add(path)  # listed first: a kill between the two never leaves it unlisted
        os.replace(tmp, path)
    except OSError as e:
        raise (e if e.filename else OSError(e.errno, e.strerror or str(e), str(path))) from None
    except RuntimeError as e:  # torch reports a full disk as "[enforce fail at inline_container.cc...]"
        raise OSError(
            errno.ENOSPC,
            f"No space left on device? torch could not write it: {str(e).splitlines()[0][:120]}",
            str(path),
        ) from None
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path, follow=False) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(state_dict: dict) -> str:
    """The sha256 of a model's weights (names, dtypes, shapes and values, in name order), whatever file or
    memory layout holds them: what an evaluation scored and an export carries are the same weights exactly
    when their digests are."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# best_weights_sha256's answers, by the file's identity and its last change: a run's state is asked often (the
# picker's list, compare, the Train cell's monitor), best.pt read once until it changes
_WEIGHTS_OF: dict[tuple, str | None] = {}


def best_weights_sha256(path: Path) -> str | None:
    """weights_sha256 of the model a best.pt holds; None where it is missing or cannot be loaded."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _WEIGHTS_OF:
        try:
            model = load_checkpoint(path)[Key.MODEL]
            weights = weights_sha256(model) if isinstance(model, dict) else None
        except (CloudMLError, OSError, AttributeError, TypeError, RuntimeError):
            return None  # not kept: a read that failed once (a network mount) may succeed the next time
        _WEIGHTS_OF[key] = weights
        while len(_WEIGHTS_OF) > 64:
            del _WEIGHTS_OF[next(iter(_WEIGHTS_OF))]
    return _WEIGHTS_OF[key]


def _copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, h.hexdigest()


# ------------------------------------------------------------------------- fault injection


# ------------------------------------------------------------------ commit, verify, find


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def commit(state: dict, meta: dict, run: RunLayout, local_dir: Path) -> Path:
    """Write one checkpoint of `run` with the commit protocol above; returns its folder."""
    ckpt_dir = run.checkpoints
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{meta['step']:08d}"
    final = ckpt_dir / name
    if (final / COMMITTED).exists() and ledger.mine(final):
        return final  # this step is already safe on disk
    ledger.refuse_unless_mine(final, "replace")
    local = Path(local_dir) / f"{name}.pt"
    try:
        torch.save(state, local)
    except RuntimeError as e:  # torch reports a full disk as "[enforce fail at inline_container.cc...]"
        local.unlink(missing_ok=True)
        free = shutil.disk_usage(local_dir).free
        raise OSError(
            errno.ENOSPC,
            f"no space left on the local disk for the checkpoint's staging copy "
            f"({free / 1e6:.0f} MB free in {local_dir}; torch said: "
            f"{str(e).splitlines()[0][:120]})",
        ) from None
    tmp = ckpt_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        size, digest = _copy_hashing(local, tmp / STATE)
        faults.point("commit-copied")
        meta = dict(meta, file=STATE, bytes=size, sha256=digest, saved_at=time.time(), format=FORMAT_VERSION)
        write_durable(tmp / META, json.dumps(meta, indent=1).encode())
        if final.exists():  # an uncommitted leftover of this step
            _delete(final)
        ledger.add(final)  # listed first: a kill between the two never leaves it unlisted
        os.replace(tmp, final)
        faults.point("commit-renamed")
        write_durable(final / COMMITTED, digest.encode())
        _fsync_dir(ckpt_dir)
        faults.point("committed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        local.unlink(missing_ok=True)
    return final


META_LIMIT = 1 << 16  # bytes: a manifest is a few lines of JSON
META_SHAPE = Obj({"step": INT, "epoch": INT, "bytes": INT, "sha256": TEXT, "saved_at": NUM, "file": TEXT})


def read_meta(folder: Path) -> dict:
    """meta.json, read as untrusted: a regular file (never a FIFO), JSON, an object whose fields have the
    types a manifest has; ValueError (or OSError) says why not."""
    try:
        return read_json(Path(folder) / META, META_SHAPE, META_LIMIT)
    except Damaged as e:
        raise ValueError(f"meta.json is not a manifest ({str(e)[:120]})") from None


def verify(folder: Path) -> str | None:
    """None if the checkpoint is complete and intact; otherwise why it is rejected."""
    folder = Path(folder)
    if not (folder / COMMITTED).is_file():
        return "not committed (its write was interrupted)"
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as e:
        return (
            f"meta.json missing or unreadable ({str(e)[:120]})"
            if isinstance(e, ValueError)
            else ("meta.json missing or unreadable")
        )
    state = folder / meta.get("file", STATE)
    if not state.is_file():
        return f"{state.name} is missing"
    size = state.stat().st_size
    if size != meta.get("bytes"):
        return f"truncated or resized: {size} bytes, the manifest says {meta.get('bytes')}"
    try:
        digest = sha256_file(state)
    except OSError as e:
        return f"cannot read {state.name} ({e.strerror or e}): it is treated like a corrupt checkpoint"
    if digest != meta.get("sha256"):
        return "checksum mismatch: the file was corrupted after it was written"
    return None


def load_state(path: Path) -> dict:
    """torch.load with weights_only=True: a file that carries code to run is refused, not run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the file cannot be trusted
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CloudMLError(f"refused to load {path}: {first}") from None


def check_manifest(meta: dict, state: dict) -> str | None:
    """None if meta.json (which its checksum does not cover) agrees with the verified state.pt: an edited or
    damaged manifest must not make `status` or a resume believe another position."""
    try:
        loop, epochs = state[Key.LOOP], state[Key.CONFIG]["train"]["epochs"]
        same = {
            "step": int(loop["step"]),
            "epoch": int(loop["epoch"]),
            "batch": int(loop["batch"]),
            "finished": bool(loop["finished"]),
            "epochs": int(epochs),
        }
    except (KeyError, TypeError, ValueError) as e:
        return f"incomplete: the loop state lacks {e}"
    wrong = [f"{k} {meta.get(k)!r} (state.pt: {v!r})" for k, v in same.items() if meta.get(k) != v]
    total, per_epoch = meta.get("total_steps"), meta.get("batches_per_epoch")
    if not (
        isinstance(total, int)
        and isinstance(per_epoch, int)
        and 0 <= same["step"] <= total
        and 0 <= same["batch"] <= per_epoch
        and per_epoch > 0
    ):
        wrong.append(
            f"total_steps {total!r} / batches_per_epoch {per_epoch!r} do not fit step {loop['step']}"
        )
    return (
        f"meta.json disagrees with state.pt ({'; '.join(wrong)}): the manifest was edited or damaged"
        if wrong
        else None
    )


def check_structure(state) -> str | None:
    """None if a loaded state.pt has this format's structure; otherwise why it cannot be resumed."""
    if not isinstance(state, dict):
        return f"not a checkpoint (a {type(state).__name__}, not a dict)"
    if state.get(Key.FORMAT) != FORMAT_VERSION:
        return f"format {state.get(Key.FORMAT)!r}, this version reads format {FORMAT_VERSION}"
    missing = [k for k in REQUIRED_KEYS if k not in state]
    return f"incomplete: no {', '.join(missing)}" if missing else None


@dataclass
class Found:
    """The checkpoint to resume from (or None), its manifest (empty where none), and what was rejected on
    the way."""

    folder: Path | None
    state: dict | None
    rejected: list[dict]
    meta: dict = field(default_factory=dict)


def find_checkpoints(run: RunLayout) -> list[Path]:
    """The run's checkpoint folders, newest step first."""
    d = run.checkpoints
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0, reverse=True)  # each has a step (above)


def check_folder(folder: Path, load: bool = True) -> tuple[str | None, dict | None, dict | None]:
    """(why it is rejected or None, its state if loaded, its manifest): the one verification used
    by resume and by status. `load=False` skips the full load (not used to decide anything)."""
    reason = verify(folder)
    if reason is not None:
        return reason, None, None
    meta = read_meta(folder)
    if not load:
        return None, None, meta
    try:
        state = load_state(folder / meta.get("file", STATE))
    except CloudMLError as e:
        return str(e), None, None
    reason = check_structure(state) or check_manifest(meta, state)
    return (reason, None, None) if reason else (None, state, meta)


def find_latest_valid(run: RunLayout, load: bool = True) -> Found:
    """Walk the checkpoints newest first to the first that verifies, loads and has the right structure.

    A folder pruned by a running save while it is being read (another process) is skipped, not an error."""
    for _ in range(3):
        rejected: list[dict] = []
        try:
            for folder in find_checkpoints(run):
                reason, state, meta = check_folder(folder, load)
                if reason is None:
                    return Found(folder, state, rejected, meta or {})
                rejected.append(
                    {"path": str(folder), "reason": reason, "committed": (folder / COMMITTED).is_file()}
                )
            return Found(None, None, rejected)
        except FileNotFoundError:
            time.sleep(0.05)  # pruned under our feet: walk again
    return Found(None, None, rejected)


def set_aside_rejected(run: RunLayout, rejected: list[dict]) -> None:
    """After a resume walked past them: a committed checkpoint that failed verification moves to
    RUN_DIR/rejected/ (kept for inspection; its step will be committed again), an uncommitted
    one (an interrupted write, or anything else named step-*) is deleted. No re-run meets them again."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for r in rejected:
        folder = Path(r["path"])
        if not folder.exists() or not ledger.skip_unless_mine(folder, "move aside or delete"):
            continue
        if r.get("committed"):
            aside = run.rejected / f"{folder.name}-{stamp}"
            aside.parent.mkdir(exist_ok=True)
            ledger.add(aside)
            os.replace(folder, aside)
            ledger.drop(folder)
            log.warning("Moved the rejected checkpoint %s to %s", folder, aside)
        else:
            _delete(folder)


def prune(run: RunLayout, keep_last: int) -> None:
    """Keep the run's newest `keep_last` committed checkpoints; drop older ones and stale leftovers."""
    committed = [p for p in find_checkpoints(run) if (p / COMMITTED).is_file()]
    if not committed:
        return
    newest = step_of(committed[0]) or 0  # a checkpoint folder's name always has its step
    for p in committed[keep_last:]:
        _delete(p)
    for p in find_checkpoints(run):
        if not (p / COMMITTED).is_file() and (step_of(p) or 0) < newest:
            _delete(p)
    for p in run.checkpoints.glob(".step-*.tmp-*"):  # a write whose process is gone
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or (int(pid) != os.getpid() and not process_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)
    for p in run.checkpoints.glob(".trash-*"):
        shutil.rmtree(p, ignore_errors=True)


def _delete(folder: Path) -> None:
    """Rename out of sight first, then delete: a kill mid-delete never leaves a half checkpoint. Only a
    folder the run's ledger lists (another tool's `step-*` is left as it is, and named once)."""
    if not ledger.skip_unless_mine(folder, "delete"):
        return
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(folder, trash)
    except OSError:
        return
    ledger.drop(folder)
    shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------- background writer


class CheckpointWriter:
    """Commits snapshots in a background thread, at most one in flight."""

    def __init__(self, run: RunLayout, keep_last: int):
        self.run, self.keep_last = run, keep_last
        self.local_dir = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
        write_marker(self.local_dir, STAGING)  # a leftover is cleaned only where this proves it CloudML's
        self._thread: threading.Thread | None = None
        self.failures, self.failures_in_a_row = 0, 0
        self.last_error: str | None = None
        self.last_exception: BaseException | None = None

    def submit(self, state: dict, meta: dict, wait: bool = False, before=None) -> float:
        """Start writing `state` (already a CPU snapshot), after `before()` (files that must not lag behind
        the checkpoint: the TensorBoard events); returns how long the caller waited."""
        t0 = time.perf_counter()
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(state, meta, before), name="cloudml-checkpoint", daemon=True
        )
        self._thread.start()
        if wait:
            self.wait()
        return time.perf_counter() - t0

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, state: dict, meta: dict, before=None) -> None:
        if before is not None:
            try:
                before()
            except OSError as e:  # the checkpoint matters more: the next save copies the events again
                log.warning(
                    "TensorBoard events could not be copied into %s (%s); the checkpoint is written all "
                    "the same, and the next one copies them again.",
                    self.run.path,
                    e,
                )
        try:
            commit(state, meta, self.run, self.local_dir)
            prune(self.run, self.keep_last)
            self.failures_in_a_row, self.last_error = 0, None
        except Exception as e:  # noqa: BLE001 - one failed save must not stop training (the trainer counts them)
            self.failures += 1
            self.failures_in_a_row += 1
            self.last_exception = e
            self.last_error = f"{type(e).__name__}: {e}"
            log.error(
                "Checkpoint at step %d could not be written (%s: %s). Training continues; %s Free space on "
                "the disk or check that Drive is still mounted.",
                meta.get("step", -1),
                type(e).__name__,
                e,
                previous_checkpoint_words(self.run),
            )

    def close(self) -> None:
        self.wait()
        shutil.rmtree(self.local_dir, ignore_errors=True)


def newest_committed_step(run: RunLayout) -> int | None:
    """The step of the newest checkpoint with its commit marker (not verified: for a message), None when
    there is none or the folder cannot be read (Drive gone)."""
    try:
        return next((step_of(p) for p in find_checkpoints(run) if (p / COMMITTED).is_file()), None)
    except OSError:
        return None


def previous_checkpoint_words(run: RunLayout) -> str:
    """After a failed save, what a resume would start from, said as it is on disk: never "the previous
    checkpoint is intact" when there is none."""
    step = newest_committed_step(run)
    if step is None:
        return (
            "no checkpoint of this run has been written yet, so a stop or disconnect now would start it "
            "again from the beginning."
        )
    return f"the previous checkpoint is intact (step {step}): a resume starts from there."


def load_checkpoint(path: str | Path) -> dict:
    """Load best.pt or a state.pt safely; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise CloudMLError(f"checkpoint not found: {path}")
    ckpt = load_state(path)
    if not isinstance(ckpt, dict) or Key.MODEL not in ckpt or Key.CONFIG not in ckpt:
        raise CloudMLError(f"{path} is not a CloudML checkpoint (no 'model' and 'config' entries)")
    return ckpt
