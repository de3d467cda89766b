"""An ER-2 flight's files: where they are (by role: IR, CPL, nav), which the config requires, and the IR
file's frame times and shape.

The rest of the reading is split by concept, each module below the label reader (cpl.py): HDF5 values
(hdf5.py), dates and times (times.py), the navigation per frame (nav.py). Frames themselves are read by the
cache builder (cache.py) straight from the open HDF5 dataset. The IR `Time/TimeUTC` is Unix epoch seconds,
may hold a stray 0 or fill value, and may be longer than the frames (ER2_DATA.md, "Corrections from public
evidence"). Every missing file, dataset or inconsistent value raises DataError naming the flight, the file
and the key."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cloudml_lib.base.config import MIN_FRAME_SIDE, DataConfig, FlightConfig
from cloudml_lib.base.errors import DataError
from cloudml_lib.data.hdf5 import dataset, numbers, open_h5
from cloudml_lib.data.times import flight_date, to_epoch_seconds

log = logging.getLogger(__name__)


def required_roles(data: DataConfig) -> tuple[str, ...]:
    """The files a flight needs: the nav file only when the sun angles come from it."""
    return ("ir", "cpl", "nav") if data.angles_source == "nav" else ("ir", "cpl")


def _resolve(root: Path, name: str, flight: str) -> Path:
    """A path relative to data.dir, or a glob pattern (e.g. 10Feb25/CPL_L2_*.hdf5) matching one file."""
    if not any(ch in name for ch in "*?["):
        return root / name
    matches = sorted(root.glob(name))
    if len(matches) > 1:
        raise DataError(
            f"flight {flight}: pattern {name!r} matches {len(matches)} files in {root} "
            f"({', '.join(m.name for m in matches[:5])}); make it match exactly one"
        )
    return matches[0] if matches else root / name


def flight_paths(flight: FlightConfig, data: DataConfig) -> dict[str, Path]:
    root = Path(data.dir)
    return {
        role: _resolve(root, getattr(flight, f"{role}_file"), flight.name) for role in required_roles(data)
    }


def check_files(flight: FlightConfig, data: DataConfig) -> None:
    missing = [f"{role} file {p}" for role, p in flight_paths(flight, data).items() if not p.is_file()]
    if missing:
        raise DataError(
            f"flight {flight.name}: missing {'; '.join(missing)}. Put the file in data.dir "
            f"({data.dir}), fix its name in data.flights, or remove the flight from data.flights. If the "
            "flights have moved since this run was trained, pass --data-dir with the folder that now "
            "holds them."
        )


def check_increasing(frame_t: np.ndarray, where: str) -> None:
    """The frames' times must increase (unusable values, NaN here, apart): a file whose times repeat or run
    backwards is refused by name, as lidar heights matched by time would attach to the wrong frames."""
    usable = np.flatnonzero(np.isfinite(frame_t))
    steps = np.diff(frame_t[usable])
    bad = np.flatnonzero(steps <= 0)
    if bad.size == 0:
        return
    i, j = usable[bad[0]], usable[bad[0] + 1]
    raise DataError(
        f"{where}: the frames' times do not increase: {int((steps == 0).sum())} repeat the time before and "
        f"{int((steps < 0).sum())} run backwards (first: frame {j} at {frame_t[j]:.3f} s after frame {i} at "
        f"{frame_t[i]:.3f} s). Lidar heights matched by time would attach to the wrong frames. Check the "
        "file (a merged or re-ordered export?) and replace it with one whose times increase, or leave the "
        "flight out (data.flights)."
    )


def read_ir_times(path: Path, flight: FlightConfig, data: DataConfig) -> tuple[np.ndarray, int, int, int]:
    """Epoch time per frame (NaN where unusable) and the raw frame shape."""
    k, name = data.keys, flight.name
    with open_h5(path, name) as f:
        signal = dataset(f, k.ir_signal, name, "ir_signal")
        if signal.ndim != 3:
            raise DataError(
                f"flight {name}: {path} '{k.ir_signal}' has shape {signal.shape}; "
                "expected (frames, rows, columns)"
            )
        n_frames, rows, cols = signal.shape
        if n_frames == 0:
            raise DataError(
                f"flight {name}: {path} has no frames: '{k.ir_signal}' (data.keys.ir_signal) has shape "
                f"{signal.shape}. Is the download complete? Replace the file, or remove flight {name} from "
                "data.flights."
            )
        if signal.dtype.kind not in "biuf":
            raise DataError(
                f"flight {name}: {path} '{k.ir_signal}' (data.keys.ir_signal) holds {signal.dtype} "
                "values, not image counts or temperatures; set data.keys.ir_signal to the frames"
            )
        raw_t = numbers(f, k.ir_time, name, "ir_time", "times (epoch seconds)").reshape(-1)
    where = f"flight {name}: {path} '{k.ir_time}'"
    if raw_t.size < n_frames:
        raise DataError(f"{where}: {raw_t.size} times for {n_frames} frames; every frame needs a time")
    if raw_t.size > n_frames:
        log.info(
            "flight %s: %s has %d times for %d frames; using the first %d",
            name,
            path.name,
            raw_t.size,
            n_frames,
            n_frames,
        )
        raw_t = raw_t[:n_frames]
    frame_t, fmt, n_bad = to_epoch_seconds(raw_t, data.ir_time_format, flight_date(flight), where)
    check_increasing(frame_t, where)
    log.info(
        "flight %s: IR times read as %s (%s)%s",
        name,
        "Unix epoch seconds" if fmt == "epoch" else "seconds of day",
        "detected" if data.ir_time_format == "auto" else "set by data.ir_time_format",
        f"; {n_bad} unusable values (0, fill or far off): those frames get no label" if n_bad else "",
    )
    if data.swath_slice[1] > rows:
        raise DataError(
            f"flight {name}: data.swath_slice {data.swath_slice} needs {data.swath_slice[1]} "
            f"sensor rows but {path} frames have {rows}; valid: end_row <= {rows}"
        )
    if cols // data.downsample < MIN_FRAME_SIDE:
        raise DataError(
            f"flight {name}: {path} frames are {cols} columns wide, {cols // data.downsample} after "
            f"data.downsample {data.downsample}; the network's three blocks need at least {MIN_FRAME_SIDE}"
            + (
                f": set data.downsample to at most {cols // MIN_FRAME_SIDE}"
                if cols >= MIN_FRAME_SIDE
                else ": these frames are too narrow for the network"
            )
        )
    return frame_t, n_frames, rows, cols
