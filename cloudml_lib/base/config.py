"""Run configuration: nested dataclasses, YAML loading, `--set` overrides and validation.

Precedence is overrides > file > defaults. Every problem in a file is collected and reported
together, each naming the key and what would be valid. The dataclasses hold only plain types so
that `asdict(config)` can be stored inside a `weights_only` checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from cloudml_lib.base import bucket
from cloudml_lib.base.errors import ConfigError, shown
from cloudml_lib.base.yamlfile import loads, read_yaml

# Compile modes that capture CUDA graphs: their replay needs every input at a fixed address,
# which gradient checkpointing's recomputation breaks ("static input data pointer changed").
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")
# The network's three conv blocks each halve a frame (model.py): a side below 8 pixels after the
# crop and downsampling leaves nothing for the last block.
MIN_FRAME_SIDE = 8
MAX_DEM_SURFACE_M = 10.0  # above this a "sea level" threshold keeps coastal land
# model.cloud_head: how the cloud / no-cloud output is made (model.py; benchmarks/cloud_head.py chose probe)
CLOUD_HEADS = ("probe", "joint", "none")
# model.height_head: bounded (between the surface and data.cbh_max_km) or unbounded (runs before it existed)
HEIGHT_HEADS = ("bounded", "unbounded")
# What the network's shape is made of, here so that the network (core/network) imports no data reader:
# the classes of its cloud output (data/cpl.py: what a CPL profile says of the cloud under the aircraft, by
# the base of the flag's layer against the label range), and its scalar inputs (data/dataset.py: the angles,
# then a frame's radiometric statistics by name, data/preprocess.py's frame_statistics, in this order: where
# the coldest pixels (cloud tops) and the warmest (the sea) lie, and between).
CLEAR, BASE_IN_RANGE, BASE_ABOVE, BASE_BELOW = 0, 1, 2, 3
CLASS_MEANINGS = ("clear_sky", "cloud_base_in_range", "cloud_base_above_range", "cloud_base_below_range")
ANGLE_INPUTS = 3  # the zenith angle, the azimuth's sine and cosine
STAT_PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 99)
STAT_NAMES = tuple(f"p{q}" for q in STAT_PERCENTILES) + ("mean", "std")


def n_scalar_inputs(radiometry: str, n_atmosphere: int = 0) -> int:
    """How many scalar inputs the network takes with data.radiometry `radiometry` and `n_atmosphere`
    predictors of the atmosphere."""
    return ANGLE_INPUTS + (len(STAT_NAMES) if radiometry != "none" else 0) + n_atmosphere


SURFACE_KM = 0.0  # the lowest a cloud base can be: the labels are over the ocean (DEM_Surface_Altitude 0)
# data.validation: where the data that chooses (the best epoch, early stopping, the intervals' width) comes
# from. "test_flights" is the reading of runs made before the setting existed (CloudML 0.2 and earlier chose
# on the test flights); it is kept for them alone, never offered for a new run (load_config refuses it).
VALIDATION_RULES = ("auto", "flight", "time_blocks")
LEGACY_VALIDATION = "test_flights"
STORED_ONLY = (LEGACY_VALIDATION,)  # values only an earlier release's stored config may hold: never offered
VALIDATION = Literal["auto", "flight", "time_blocks", "test_flights"]
# data.radiometry: what the network sees of the frames' temperatures besides the per-frame reading
RADIOMETRY = ("statistics", "none")
# data.atmosphere: what the network sees of the flight's atmosphere (data/predictors.py)
ATMOSPHERE = ("none", "with_frames", "alone")
# data.cloud_flag: what the cloud / no-cloud output marks (any_layer: runs made before the setting existed)
CLOUD_FLAGS = ("base_in_range", "any_layer")
# keys an earlier release named otherwise: read under today's name (section, old name) -> new name
RENAMED = {("data", "validation_flights"): "test_flights"}
RENAMED_NOTICE = (
    "data.validation_flights is read as data.test_flights: the flights scored once, at the end, on which "
    "nothing is chosen (CloudML 0.2 also chose the best epoch and the intervals on them). Validation data "
    "now "
    "come from the training flights (data.validation). Rename the key in your config to silence this notice."
)
# A setting's rule when a stopped run resumes (_f's `resume`)
SAME, NEW = "must stay the same", "may change"
AUTO = Literal["auto"]  # a value resolved when the run starts (measured, or chosen for the machine)


def _f(
    default,
    help: str,
    range: tuple | None = None,
    choices: tuple | None = None,
    legacy: dict | None = None,
    resume: str = SAME,
    absent=None,
):
    """A dataclass field with its help text, valid values and resume rule, used by validation, resume and
    docs. `legacy`: values an earlier version wrote (in run folders and checkpoints) and what they mean now.
    `resume`: SAME, the setting is part of the run's math (a resumed run must keep it); NEW, a resumed run
    takes the new value (paths, cadences, devices, the number of epochs) and says so. `absent`: what a stored
    config (a run folder's, a checkpoint's) that lacks the key means, where the version that saved it behaved
    otherwise than today's default (None: the default): an old run keeps computing what it was trained
    with."""
    assert resume in (SAME, NEW), resume
    meta = {"help": help, "range": range, "choices": choices, "legacy": legacy or {}, "resume": resume}
    meta["absent"] = default if absent is None else absent
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class FlightConfig:
    """One ER-2 flight: its files, as paths relative to `data.dir` (sub-folders allowed)."""

    name: str = _f("", "flight label used in splits and reports, e.g. 10Feb25")
    ir_file: str = _f(
        "",
        "IRAI L1B camera file (.h5), e.g. 10Feb25/GLOVE2025_IRAI_L1B_Rev-_20250210-003.h5; "
        "a path or a glob pattern matching exactly one file",
    )
    cpl_file: str = _f("", "CPL L2 layer file (.hdf5); its name carries the date, e.g. _10feb25")
    nav_file: str = _f(
        "",
        "navigation file: .hdf (HDF5 inside) or ICARTT text (*_MetNav_ER2_*.ict, matched by "
        "time); not needed with data.angles_source: cpl",
    )
    date: str = _f("", "YYYY-MM-DD; empty: taken from the CPL file name")


@dataclass
class DataKeys:
    """HDF5 dataset names; defaults are the names in the users' real files."""

    ir_signal: str = _f("Product/Signal", "IR frames, first axis = frame (float or big-endian uint16 counts)")
    ir_time: str = _f(
        "Time/TimeUTC", "one time per IR frame (epoch seconds in the real files); may be longer"
    )
    cpl_time: str = _f(
        "layer_descriptor/Profile_Decimal_Julian_Day",
        "decimal day of year per profile, (N, 3) start/centre/end: the column data.cpl_time_column "
        "is used; (N,) accepted",
    )
    cpl_base: str = _f(
        "layer_descriptor/Layer_Base_Altitude", "(profiles, 10) km, layer 0 on top, -9999 = none"
    )
    cpl_layer_count: str = _f(
        "layer_descriptor/Number_Layers",
        "valid layers per profile; when absent, counted from the non-fill bases",
    )
    cpl_lidar_surface: str = _f("layer_descriptor/Lidar_Surface_Altitude", "km")
    cpl_dem_surface: str = _f("layer_descriptor/DEM_Surface_Altitude", "0 over ocean")
    cpl_year: str = _f(
        "metadata_parameters/File_Year", "year of the Julian days; when absent, from the file name"
    )
    cpl_zenith: str = _f("geolocation/Solar_Zenith_Angle", "per profile, degrees (data.angles_source: cpl)")
    cpl_azimuth: str = _f(
        "geolocation/Solar_Azimuth_Angle",
        "per profile, degrees clockwise from north, as nav/sunAzGrd (data.angles_source: cpl)",
    )
    cpl_lat: str = _f("geolocation/CPL_Latitude", "per profile, (N, 3) or (N,) (data.angles_source: cpl)")
    cpl_lon: str = _f("geolocation/CPL_Longitude", "per profile, (N, 3) or (N,) (data.angles_source: cpl)")
    nav_zenith: str = _f("nav/solarZenith", "solar zenith angle, degrees")
    nav_azimuth: str = _f("nav/sunAzGrd", "solar azimuth, degrees")
    nav_lat: str = _f("nav/IWG_lat", "latitude, degrees")
    nav_lon: str = _f("nav/IWG_lon", "longitude, degrees")
    nav_altitude: str = _f(
        "nav/IWG_alt",
        "aircraft altitude in metres (IWG1 GPS_MSL_Alt), if the file has it: predict masks a height above "
        "the aircraft; absent: heights are bounded by data.cbh_max_km",
        resume=NEW,
    )
    nav_time: str = _f(
        "nav/Time",
        "nav time axis, if the file has one; the users' files have none, and then nav row i is IR frame i",
    )
    nav_heading: str = _f(
        "nav/trueHdg",
        "aircraft true heading, degrees from north (IWG1 True_Hdg, named like "
        "sunAzGrd); absent: flips are off for that flight",
    )
    ict_time: str = _f(
        "Time_Start",
        "ICARTT nav (*_MetNav_ER2_*.ict): seconds of day of each record; the other "
        "ict_* keys name its columns, | separates alternatives",
    )
    ict_lat: str = _f("Latitude|Lat", "ICARTT nav: latitude column")
    ict_lon: str = _f("Longitude|Lon", "ICARTT nav: longitude column")
    ict_heading: str = _f("True_Heading|True_Hdg", "ICARTT nav: true heading column")
    ict_altitude: str = _f(
        "GPS_Altitude|GPS_MSL_Alt|GPS_Alt",
        "ICARTT nav: aircraft altitude column, metres; absent: heights are bounded by data.cbh_max_km",
        resume=NEW,
    )
    ict_zenith: str = _f("Solar_Zenith_Angle|Solar_Zenith|SZA", "ICARTT nav: solar zenith angle column")
    ict_azimuth: str = _f(
        "Sun_Azimuth|Sun_Az_Grd|Solar_Azimuth_Angle",
        "ICARTT nav: sun azimuth from the ground column, degrees from north",
    )


@dataclass
class DataConfig:
    dir: str = _f(
        "data",
        "folder holding the flight files, searched recursively (absolute, or relative to the "
        "working directory when the config is loaded; a run records it absolute)",
        resume=NEW,
    )
    cache_dir: str = _f(
        "",
        "preprocessing cache, best on a fast local disk (on a cluster, each machine's own: e.g. "
        "$SLURM_TMPDIR/cache; ~ and environment variables are expanded); empty: <data.dir>/cache",
        resume=NEW,
    )
    cache_copy_dir: str = _f(
        "",
        "a lasting copy of the cache: a folder (e.g. on Drive) or a bucket's URL (gs://BUCKET/folder with "
        "gcsfs, s3://... with s3fs, any fsspec URL); a flight's cache is copied from it (its checksum "
        "checked) when data.cache_dir lacks it, and copied to it after being built; empty: none",
        resume=NEW,
    )
    demo: bool = _f(
        False, "generate the built-in demo flights into data.dir when they are missing", resume=NEW
    )
    flights: list = _f(
        [], "list of {name, ir_file, cpl_file, nav_file}; empty: found in data.dir by their names"
    )
    skip_incomplete_flights: bool = _f(
        False, "skip (and list) a flight that lacks a file instead of stopping the run", resume=NEW
    )
    test_flights: list = _f(
        [],
        "the test flights: scored once, at the end, and nothing is chosen on them (not the best epoch, early "
        "stopping, the cloud probe, the intervals, a sweep's best trial); never used to fit anything. "
        "Earlier releases called this key validation_flights",
    )
    validation: list | VALIDATION = _f(
        "auto",
        "the validation data that choose the best epoch, stop early and calibrate the intervals, drawn from "
        "the training flights (never the test flights): flight (a whole training flight, the one whose label "
        "count is closest to the median, needs 2 or more), time_blocks (the last data.validation_share of "
        "each training flight's labels in time, after a gap of data.validation_gap_frames), auto (flight "
        "with "
        "3 or more training flights, else time_blocks), or a list of training flight names; run.json records "
        "what was chosen. Runs made before this setting chose on their test flights (test_flights) and keep "
        "that reading",
        absent=LEGACY_VALIDATION,
    )
    fold_by: str = _f(
        "flight",
        "what crossval holds out in each fold: flight (each flight once), or campaign (each campaign's "
        "flights together: data.campaigns, else read from the IR file names' prefix, e.g. GLOVE2025 in "
        "GLOVE2025_IRAI_L1B_...; the validation data then come from the other campaigns)",
        choices=("flight", "campaign"),
    )
    campaigns: list = _f(
        [],
        "data.fold_by campaign: the grouping, a list of {name, flights} (e.g. {name: WHYMSIE2024, flights: "
        "[12Aug24, 15Aug24]}), each flight in one; empty: each flight's campaign from its IR file name",
    )
    validation_share: float = _f(
        0.2,
        "data.validation time_blocks: the share of each training flight's labels, its last in time, held "
        "back "
        "for validation",
        range=(0.05, 0.5),
    )
    validation_gap_frames: int = _f(
        60,
        "data.validation time_blocks: frames between a flight's training part and its validation block that "
        "neither uses (neighbouring frames are nearly identical; at least data.temporal_frames)",
        range=(0, 1_000_000),
    )
    cloud_flag: str = _f(
        "base_in_range",
        "what the cloud flag marks. base_in_range: a cloud whose base (data.label_layer's) lies in "
        "data.cbh_min_km..cbh_max_km, the height product's range; clouds whose base lies above it (high "
        "cloud alone) or below it are classes of their own, and no height is given for them. any_layer: any "
        "CPL layer (Number_Layers > 0, thin cirrus included), as runs made before this setting (they keep "
        "it)",
        choices=CLOUD_FLAGS,
        absent="any_layer",
    )
    temporal_frames: int = _f(
        5, "T, frames per sample, centred on the labelled frame (odd: 1, 3, 5, 7, ...)", range=(1, 31)
    )
    swath_slice: list = _f([40, 480], "[first, last) sensor rows kept")
    downsample: int = _f(
        1, "integer block-average factor after cropping (memory), 1 = full size", range=(1, 16)
    )
    edge_policy: str = _f(
        "shift",
        "windows at a flight's ends: shift inside, pad with the edge frame, or drop",
        choices=("shift", "pad", "drop"),
    )
    clahe_clip_limit: float = _f(
        0.01, "CLAHE clip limit (scikit-image units); 0 disables CLAHE", range=(0.0, 1.0)
    )
    radiometry: str = _f(
        "statistics",
        "what the network sees of the frames' radiometry, which the per-frame reading (min-max, CLAHE, "
        "z-score) removes. statistics: beside the frames, the labelled frame's percentiles, mean and spread "
        "in the units the IR file states (kelvin, or counts), on a scale fitted on the part of the training "
        "flights trained on (benchmarks/results/radiometry.json measured it against none). none: the "
        "per-frame reading alone, as runs made before this setting (they keep it)",
        choices=RADIOMETRY,
        absent="none",
    )
    atmosphere: str = _f(
        "none",
        "what the network sees of each flight's atmosphere, from the ERA5 files beside the flights "
        "(data/predictors.py; fetch-era5 downloads them): none: the frames and the sun alone, as runs made "
        "before this setting (they keep it); with_frames: the reanalysis predictors (lifting condensation "
        "level, sea-air difference, humidity, stability, ...) beside the frames, each scaled on the part of "
        "the training flights trained on (flights without ERA5 files: the frames alone, said in one line); "
        "alone: the predictors and the sun's angles, no frames. The default is none: on the demo's flights "
        "the frames alone did best (benchmarks/results/atmosphere.json); measure yours with crossval",
        choices=ATMOSPHERE,
        absent="none",
    )
    cbh_min_km: float = _f(0.1, "labels below this are dropped", range=(0.0, 20.0))
    cbh_max_km: float = _f(2.0, "labels above this are dropped", range=(0.0, 20.0))
    max_lidar_surface_km: float = _f(
        0.9, "drop profiles with |Lidar_Surface_Altitude| (km) above this", range=(0.0, 10.0)
    )
    label_layer: str = _f(
        "lowest",
        "which layer's base is the label: lowest (the physical cloud base), top (the "
        "users' published labels, base of layer 0) or single (single-layer profiles only)",
        choices=("lowest", "top", "single"),
    )
    layer_order: str = _f(
        "top_first",
        "order of the 10 layers in the CPL file: top_first (layer 0 is the top "
        "layer, as in the real files; checked on every flight) or bottom_first",
        choices=("top_first", "bottom_first"),
    )
    cpl_time_column: str = _f(
        "centre",
        "which time of a ~5 s lidar profile is matched to a frame: start, centre "
        "or end (columns 0, 1, 2 of Profile_Decimal_Julian_Day); the users' published "
        "labels used start",
        choices=("start", "centre", "end"),
    )
    cpl_time_round: bool = _f(
        False, "round each lidar time to whole seconds before matching (as the users' published labels)"
    )
    cpl_time_offset_s: float = _f(
        0.0,
        "seconds added to every lidar time before matching (a clock offset "
        "between lidar and camera; the log estimates it when few labels match)",
        range=(-3600.0, 3600.0),
    )
    max_dem_surface_m: float = _f(
        0.0,
        "profiles whose DEM_Surface_Altitude (metres) is above this are over land "
        "and dropped; 0: ocean only (DEM exactly 0, the only safe value)",
    )
    sun_azimuth: str = _f(
        "relative",
        "the sun azimuth the network sees: relative (to the aircraft heading, where "
        "the sun acts on the image; unknown, and filled, where a flight has no heading) or ground "
        "(from north, as nav/sunAzGrd)",
        choices=("relative", "ground"),
    )
    along_track_axis: str = _f(
        "rows",
        "the image axis the aircraft flies along; the horizontal flip mirrors the "
        "columns, so across the flight axis for rows, along it for columns",
        choices=("rows", "columns"),
    )
    angles_source: str = _f(
        "nav",
        "sun angles of a label from the nav file (row = IR frame) or from the CPL profile itself",
        choices=("nav", "cpl"),
    )
    match_tolerance_s: float = _f(
        0.5, "a label is matched to the nearest IR frame within this time", range=(0.0, 60.0)
    )
    min_nav_match: float = _f(
        0.5,
        "the fewest of a flight's IR frames (those with a time) that must find a nav record (within 2 s, "
        "or a row); below it train refuses the flight, labels flags it, predict warns. 0.5: a nav file "
        "covers its whole flight, so half unmatched means a wrong date, file or clock, while a nav file "
        "cut short or with gaps still trains; 0: any",
        range=(0.0, 1.0),
    )
    ir_time_format: str = _f("auto", "IR time units", choices=("auto", "seconds_of_day", "epoch"))
    keys: DataKeys = field(default_factory=DataKeys, metadata={"help": "HDF5 dataset names"})
    overweight_flight: str = _f("", "training flight whose samples weigh more in the loss (empty: none)")
    overweight_factor: float = _f(1.0, "loss weight of overweight_flight's samples", range=(1.0, 100.0))
    augment: bool = _f(
        True,
        "training-only augmentation: flip (mirroring the sun azimuth; off for a flight "
        "without a heading), brightness/contrast jitter, erasing",
    )
    num_workers: int | AUTO = _f(
        "auto", "DataLoader worker processes; auto: 0 on Colab, else up to 4", range=(0, 64), resume=NEW
    )
    preprocess_workers: int | AUTO = _f(
        "auto",
        "processes that preprocess frames (cache build, predict); auto: every "
        "core this process may use; 0: none, in the main process",
        range=(0, 256),
        resume=NEW,
    )
    preprocess_device: str = _f(
        "auto",
        "where CLAHE runs: cpu (scikit-image on the CPU cores), cuda (scikit-image's algorithm "
        "in torch on the GPU: the same frames) or auto (cuda with a CUDA GPU, else cpu; a "
        "model's own in predict, evaluate, resume)",
        choices=("auto", "cpu", "cuda"),
        resume=NEW,
    )


@dataclass
class ModelConfig:
    memory_optimized: bool = _f(
        False, "32/64/128 channels instead of 64/128/256: about half the activation memory"
    )
    channels: list = _f([], "explicit channels of the three conv blocks; empty: chosen by memory_optimized")
    gradient_checkpointing: bool = _f(
        False,
        "recompute each frame's CNN pass in backward: less memory, ~15% slower; the same results "
        "(BatchNorm statistics and gradients: tests/test_model.py), so a resumed run may change it",
        resume=NEW,
    )
    dropout: float = _f(0.3, "dropout before the regression head", range=(0.0, 0.9))
    scalars_only: bool = _f(False, "control model that sees only the solar angles, not the frames")
    cloud_head: str = _f(
        "probe",
        "the cloud / no-cloud output. probe: fitted when training ends (a logistic "
        "regression on the trained network's features, every frame a CPL profile matches, clear "
        "sky included); the height is trained as without it. joint: a second output trained with "
        "the height (train.cloud_loss_weight). none: height only. true/false in older runs mean "
        "joint/none",
        choices=CLOUD_HEADS,
        legacy={True: "joint", False: "none"},
    )
    cloud_threshold: float = _f(
        0.5, "cloud probability at or above which a frame is flagged cloudy (predict)", range=(0.0, 1.0)
    )
    height_head: str = _f(
        "bounded",
        "how the height output is made. bounded: a sigmoid scaled between 0 km (the sea surface) and "
        "data.cbh_max_km, so no height can lie below the surface or above the labels' range. unbounded: a "
        "plain linear output, as in runs made before this setting (they keep it); predict masks its heights "
        "outside those bounds",
        choices=HEIGHT_HEADS,
        absent="unbounded",
    )


@dataclass
class TrainConfig:
    epochs: int = _f(50, "passes over the training flights", range=(1, 10000), resume=NEW)
    batch_size: int | AUTO = _f(
        16,
        "samples per optimizer step (before accumulation); auto: the largest that fits the GPU, measured",
        range=(1, 4096),
    )
    grad_accum_steps: int = _f(1, "batches whose gradients add up to one optimizer step", range=(1, 1024))
    last_batch: str = _f(
        "whole",
        "how an epoch's last batch runs when the few samples left over were merged into it (more than "
        "batch_size). whole: in one forward pass, so BatchNorm sees the whole batch and one process computes "
        "what several do; split: in pieces of batch_size (the last one small), as in runs made before "
        "CloudML 0.3 (they keep it)",
        choices=("whole", "split"),
        absent="split",
    )
    learning_rate: float = _f(1e-3, "peak AdamW learning rate", range=(1e-7, 1.0))
    min_lr_ratio: float = _f(0.01, "final learning rate as a fraction of the peak", range=(0.0, 1.0))
    weight_decay: float = _f(1e-2, "AdamW weight decay", range=(0.0, 1.0))
    warmup_steps: int = _f(
        100,
        "linear warm-up length in optimizer steps (at most a fifth of the run: a longer one is shortened)",
        range=(0, 10_000_000),
    )
    warmup_fit: bool = _f(
        True,
        "shorten a warm-up longer than a fifth of the run's optimizer steps, so that the run reaches its "
        "learning rate (runs made before the setting: not shortened)",
        absent=False,
    )
    memory_format: str = _f(
        "auto",
        "the model's memory format in training: auto (channels_last where benchmarks/memory_format.py "
        "measured it to pay on the device, for an eager run on one process; the same numbers to float "
        "rounding), channels_last or default "
        "(runs made before the setting: default)",
        choices=("auto", "channels_last", "default"),
        absent="default",
    )
    grad_clip_norm: float = _f(1.0, "gradient norm clip; 0 disables", range=(0.0, 1e6))
    huber_delta: float = _f(1.0, "Huber loss delta on the standardised target", range=(1e-6, 100.0))
    hard_example_weight: float = _f(0.0, "extra loss weight on hard examples (0: off)", range=(0.0, 10.0))
    height_loss_weight: float = _f(
        1.0,
        "weight of the height's Huber loss (0 with model.cloud_head: joint: a "
        "cloud-only model, as in the benchmark of a separate cloud model)",
        range=(0.0, 100.0),
    )
    cloud_loss_weight: float = _f(
        0.5,
        "weight of the cloud / no-cloud loss (binary cross-entropy) beside the "
        "height's Huber loss (model.cloud_head: joint only)",
        range=(0.0, 100.0),
    )
    ema_decay: float | AUTO = _f(
        "auto",
        "an exponential moving average of the weights (and BatchNorm statistics), updated after every "
        "optimizer step: the average is validated each epoch, chosen as best.pt and ends the run, so the "
        "chosen epoch is not one batch's luck (benchmarks/results/stability.json). auto: over about the last "
        "10% of the run's steps (decay 1 - 1/span, span 10 to 2000 steps); a number: that decay per step; 0: "
        "off, the raw weights, as runs made before this setting (they keep it)",
        range=(0.0, 0.99999),
        absent=0.0,
    )
    interval_coverage: float = _f(
        0.9, "share of true heights the prediction intervals should hold", range=(0.5, 0.99)
    )
    interval_calibration: str = _f(
        "per_flight",
        "how the intervals are calibrated on the validation heights (never on a test flight). per_flight: "
        "each "
        "validation flight (or time block) with enough heights calibrated on its own and the widest taken, "
        "so "
        "that every one of them holds the target (flights differ: a pooled calibration can cover a third of "
        "a "
        "flight's heights); pooled: all validation heights together, narrower. With one validation flight "
        "both are the same",
        choices=("per_flight", "pooled"),
        absent="pooled",
        resume=NEW,
    )
    tolerances_km: list = _f(
        [0.1, 0.25],
        "the report's shares of test heights within these distances (km) of the lidar's, as cloud-base "
        "papers quote them (e.g. within 0.5 km)",
        resume=NEW,
    )
    adaptation_labels: list = _f(
        [10, 25, 50],
        "crossval's adaptation curve: for each test flight, its fold's network (its head) fine-tuned on the "
        "flight's first N labels in time for each N here, and scored, beside the baselines given the same N "
        "labels, only after a gap (science/adapt.py); [] : no curve",
        resume=NEW,
    )
    pretrain_flight: str = _f(
        "",
        "two-phase protocol: first train on this flight alone (RUN_DIR/pretrain), then "
        "fine-tune on all training flights with it weighted by data.overweight_factor; "
        "empty: one phase",
    )
    pretrain_epochs: int = _f(
        10, "epochs of the pre-training phase (train.pretrain_flight)", range=(1, 10000)
    )
    early_stopping_patience: int = _f(
        10, "epochs without a better validation loss before stopping; 0: never", range=(0, 10000), resume=NEW
    )
    quick_val_fraction: float = _f(
        0.1, "fixed share of validation samples scored every epoch", range=(0.001, 1.0)
    )
    max_nonfinite_steps: int = _f(
        10,
        "optimizer steps in a row with a NaN/inf loss (each skipped) before training stops",
        range=(1, 100000),
        resume=NEW,
    )
    log_every_steps: int = _f(
        10, "optimizer steps between metrics.jsonl step records", range=(1, 1_000_000), resume=NEW
    )
    seed: int = _f(42, "seeds data order, augmentation and initialisation", range=(0, 2**31 - 1))
    deterministic: bool = _f(
        False,
        "deterministic GPU algorithms: a resumed or repeated run equal bit for bit on a GPU too, at some "
        "speed (a CPU run is deterministic anyway)",
        resume=NEW,
    )
    device: str = _f(
        "auto", "auto: CUDA when available, else CPU", choices=("auto", "cuda", "cpu"), resume=NEW
    )
    torch_compile: bool = _f(
        False,
        "compile the frame encoder with torch.compile (on a CPU too: needs a C++ "
        "compiler; a failure falls back to eager)",
        resume=NEW,
    )
    compile_cache_dir: str = _f(
        "",
        "where torch.compile's kernels are kept for the next session (a new Colab VM compiles from "
        "scratch otherwise); empty: the run folder's compile_cache/",
        resume=NEW,
    )
    torch_compile_mode: str = _f(
        "default",
        "compile mode; CUDA-graph modes cannot be combined with checkpointing",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        resume=NEW,
    )


@dataclass
class CheckpointConfig:
    every_steps: int = _f(100, "optimizer steps between checkpoints", range=(1, 10_000_000), resume=NEW)
    every_minutes: float = _f(
        10.0, "minutes between checkpoints, whichever comes first", range=(0.1, 10_000.0), resume=NEW
    )
    keep_last: int = _f(2, "committed checkpoints kept besides the best", range=(1, 100), resume=NEW)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def channels(self) -> list[int]:
        return conv_channels(self.model.channels, self.model.memory_optimized)


def conv_channels(channels, memory_optimized) -> list:
    """The three conv blocks' channels: model.channels, or by model.memory_optimized where it is empty."""
    if channels:
        return list(channels)
    return [32, 64, 128] if memory_optimized else [64, 128, 256]


# ---------------------------------------------------------------------------------------------
# Building a Config from nested dicts, collecting every problem.


def value_type(tp) -> tuple[type, tuple]:
    """(the type, the words also accepted) of a field: `int | AUTO` is (int, ("auto",)); `int` is (int,
    ())."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        words = tuple(w for a in args if typing.get_origin(a) is Literal for w in typing.get_args(a))
        return next(a for a in args if typing.get_origin(a) is not Literal), words
    return tp, ()


def _coerce(value, tp, key: str, meta: dict, problems: list[str]):
    """Check one leaf value against its declared type, range and choices."""
    tp, words = value_type(tp)
    if value in words:
        return value
    alt = "".join(f" or {w!r}" for w in words if w not in STORED_ONLY)  # "an integer or 'auto'"
    legacy = meta.get("legacy") or {}
    if any(value is k for k in legacy):  # `is`: True must not match 1
        return legacy[value]
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{key}: expected true/false{alt}, got {shown(value)}")
            return None
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                problems.append(f"{key}: expected an integer{alt}, got {shown(value)}")
                return None
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{key}: expected a number{alt}, got {shown(value)}")
            return None
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            problems.append(f"{key}: expected a string{alt}, got {shown(value)}")
            return None
    elif tp is list:
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list{alt}, got {shown(value)}")
            return None
    lo_hi = meta.get("range")
    if lo_hi is not None and not (lo_hi[0] <= value <= lo_hi[1]):
        problems.append(f"{key}: {shown(value)} is out of range; valid: {lo_hi[0]} to {lo_hi[1]}")
        return None
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        problems.append(f"{key}: {shown(value)} is not valid; choose one of {', '.join(map(repr, choices))}")
        return None
    return value


def _key_text(key) -> str:
    """A key as a message names it: as written, cut where it is long."""
    text = str(key)
    return text if len(text) <= 80 else text[:77] + "..."


def _listed(names: list, most: int = 8) -> str:
    """Flight names in a message, the first `most` of them, each cut where it is long."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(_key_text(n) for n in names[:most]) + more


def _build(cls, raw, prefix: str, problems: list[str]):
    """Instantiate dataclass `cls` from dict `raw`; unknown keys name the closest valid key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{prefix or 'config'}: expected a mapping of keys, got {shown(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs, listed = {}, False
    for key, value in raw.items():
        full = f"{prefix}{_key_text(key)}"
        if key not in fields:
            close = difflib.get_close_matches(_key_text(key), list(fields), n=1, cutoff=0.5)
            valid = "as above" if listed else ", ".join(fields)  # listed once per section
            listed = listed or not close
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {valid}"
            problems.append(f"{full}: unknown key{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{full}.", problems)
            continue
        checked = _coerce(value, tp, full, dict(fields[key].metadata), problems)
        if checked is not None:
            kwargs[key] = checked
    return cls(**kwargs)


def check_flight_names(
    d: DataConfig, names: list[str], where: str = "data.flights", require_test: bool = True
) -> list[str]:
    """The rules on flight names: test, validation and overweighted flights exist, a test flight is never a
    validation flight, and one flight stays for training. Run on the config's flights, and again on the
    flights a run resolves. `require_test=False` (a config file on its own: cross-validation names each fold's
    test flight itself) leaves "name at least one test flight" to the run."""
    problems = []
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"data.flights: flight names must be unique; repeated: {_listed(dupes)}")
    if not all(isinstance(v, str) for v in d.test_flights):
        return problems + [f"data.test_flights: expected a list of flight names, got {shown(d.test_flights)}"]
    unknown = [v for v in d.test_flights if v not in names]
    if unknown:
        problems.append(
            f"data.test_flights: {_listed(unknown)} not in {where} (known: {_listed(names) or 'none'})"
        )
    training = [n for n in names if n not in d.test_flights]
    if not d.test_flights and require_test:
        problems.append(
            "data.test_flights: name at least one flight to test on (scored once, at the end); random splits "
            "inside a flight leak through time autocorrelation"
        )
    elif d.test_flights and not training:
        problems.append("data.test_flights: every flight is a test flight; leave at least one for training")
    if d.test_flights and training:
        problems += check_validation(d, training)
    if d.overweight_flight and d.overweight_flight not in names:
        problems.append(
            f"data.overweight_flight: {shown(d.overweight_flight)} not in {where} "
            f"(known: {_listed(names) or 'none'})"
        )
    if d.overweight_flight and d.overweight_flight in d.test_flights:
        problems.append(f"data.overweight_flight: {shown(d.overweight_flight)} is a test flight")
    return problems


def check_validation(d: DataConfig, training: list[str]) -> list[str]:
    """data.validation against the training flights (the flights that are not test flights)."""
    v = d.validation
    if v == "flight" and len(training) < 2:
        return [
            f"data.validation: flight needs two training flights (one to validate on), and there is one "
            f"({_listed(training)}); use time_blocks (the last part of each training flight) or name another "
            "training flight"
        ]
    if not isinstance(v, list):
        return []
    tested = [n for n in v if n in d.test_flights]
    unknown = [n for n in v if n not in training and n not in d.test_flights]
    out = []
    if tested:
        out.append(
            f"data.validation: {_listed(tested)} is a test flight; nothing may be chosen on a test flight: "
            "name training flights, or use auto"
        )
    if unknown:
        out.append(
            f"data.validation: {_listed(unknown)} not among the training flights ({_listed(training)})"
        )
    if not tested and not unknown and set(training) <= set(v):
        out.append(
            "data.validation: every training flight is a validation flight; leave at least one to train on, "
            "or use time_blocks (the last part of each training flight)"
        )
    return out


def _check_cross_field(cfg: Config, problems: list[str], packages: bool = True) -> None:
    """Rules that involve more than one key."""
    _check_places(cfg.data, problems, packages)
    _check_flights(cfg.data, problems)
    _check_frames(cfg.data, problems)
    _check_settings(cfg, problems)


def _check_places(d: DataConfig, problems: list[str], packages: bool = True) -> None:
    """A URL (scheme://...) is a bucket: valid for the cache's lasting copy alone (its scheme known, and, with
    `packages`, the package that reads it installed); the flights and the cache itself are read from a local
    disk."""
    for key in PATH_KEYS:
        value = getattr(d, key)
        if not bucket.is_url(value):
            continue
        if key == "cache_copy_dir":
            problem = bucket.url_problem(f"data.{key}", value, packages)
            problems.extend([problem] if problem else [])
        else:
            problems.append(
                f"data.{key}: {shown(value)} is a URL, but data.{key} must be a folder on this machine "
                "(the cache is read from a local disk at every step); a bucket can hold the cache's lasting "
                "copy: data.cache_copy_dir"
            )


def _check_flights(d: DataConfig, problems: list[str]) -> None:
    """data.flights entries built and checked (each names its files), and the flight names they give."""
    flights = []
    roles = ("ir_file", "cpl_file", "nav_file") if d.angles_source == "nav" else ("ir_file", "cpl_file")
    for i, raw in enumerate(d.flights):
        flight = _build(FlightConfig, raw, f"data.flights[{i}].", problems)
        for name in ("name",) + roles:
            if not getattr(flight, name):
                problems.append(
                    f"data.flights[{i}].{name}: missing; each flight needs name, " + ", ".join(roles)
                )
        if isinstance(flight.name, str) and flight.name and not plain_name(flight.name):
            problems.append(
                f"data.flights[{i}].name: {shown(flight.name)} is not a plain name: a flight's name "
                "names its cache folder and its files, so it holds no '/' or '\\' and is not '.' or '..' "
                "(e.g. 10Feb25)"
            )
        flights.append(flight)
    d.flights = flights
    if isinstance(d.validation, list) and not all(isinstance(v, str) for v in d.validation):
        problems.append(f"data.validation: expected a list of flight names, got {shown(d.validation)}")
    elif flights:
        problems += check_flight_names(d, [f.name for f in flights], require_test=False)
    elif not all(isinstance(v, str) for v in d.test_flights):
        problems.append(f"data.test_flights: expected a list of flight names, got {shown(d.test_flights)}")


def _check_frames(d: DataConfig, problems: list[str]) -> None:
    """The window (an odd T) and the frame's crop and downsampling (enough rows left for the network)."""
    if d.temporal_frames % 2 == 0:
        problems.append(
            f"data.temporal_frames: {d.temporal_frames} is even, so no frame is the centre of the window; "
            f"use an odd number such as {d.temporal_frames - 1} or {d.temporal_frames + 1}"
        )
    s = d.swath_slice
    ints = (
        isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
    )
    if not (ints and 0 <= s[0] < s[1]):
        problems.append(
            f"data.swath_slice: {shown(s)} is not valid; expected [first_row, end_row] with "
            "0 <= first_row < end_row, e.g. [40, 480]"
        )
    elif (s[1] - s[0]) // d.downsample < MIN_FRAME_SIDE:
        problems.append(
            f"data.swath_slice {s} with data.downsample {d.downsample} leaves frames "
            f"{(s[1] - s[0]) // d.downsample} rows high; the network's three blocks need at least "
            f"{MIN_FRAME_SIDE}: "
            + (
                f"set data.downsample to at most {(s[1] - s[0]) // MIN_FRAME_SIDE}, or keep at least "
                if s[1] - s[0] >= MIN_FRAME_SIDE
                else "keep at least "
            )
            + f"{MIN_FRAME_SIDE * d.downsample} rows in data.swath_slice"
            + (
                f" ({MIN_FRAME_SIDE} after data.downsample {d.downsample}), e.g. "
                f"[{s[0]}, {s[0] + MIN_FRAME_SIDE * d.downsample}]"
                if d.downsample > 1
                else f", e.g. [{s[0]}, {s[0] + MIN_FRAME_SIDE}]"
            )
        )


def plain_name(name: str) -> bool:
    """A name that is one folder's name and no path: no separator, not '.' or '..', no NUL."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


CAMPAIGN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a fold's folder is named after it


def _check_campaigns(campaigns, problems: list[str]) -> None:
    """data.campaigns: a list of {name, flights}, each name a plain folder name, no flight in two."""
    if not isinstance(campaigns, list):
        return  # _coerce said it
    seen: dict[str, str] = {}
    for i, entry in enumerate(campaigns):
        where = f"data.campaigns[{i}]"
        if not (isinstance(entry, dict) and set(entry) == {"name", "flights"}):
            problems.append(
                f"{where}: {shown(entry)} is not valid; expected {{name: NAME, flights: [FLIGHT, ...]}}"
            )
            continue
        name, flights = entry["name"], entry["flights"]
        if not (isinstance(name, str) and CAMPAIGN_NAME.fullmatch(name)):
            problems.append(
                f"{where}.name: {shown(name)} is not valid; expected letters, digits, '_', '-' or '.', "
                "starting with a letter or digit (a fold's folder is named after it)"
            )
        if not (isinstance(flights, list) and flights and all(isinstance(f, str) for f in flights)):
            problems.append(
                f"{where}.flights: {shown(flights)} is not valid; expected a list of flight names"
            )
            continue
        for flight in flights:
            if flight in seen:
                problems.append(
                    f"{where}.flights: {flight} is in campaign {seen[flight]} too; a flight is in one"
                )
            seen[flight] = str(name)


def _check_report_lists(t: TrainConfig, problems: list[str]) -> None:
    """train.tolerances_km and train.adaptation_labels: lists of numbers in their ranges."""
    tol = t.tolerances_km
    if not (
        isinstance(tol, list)
        and tol
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 20 for v in tol)
    ):
        problems.append(
            f"train.tolerances_km: {shown(tol)} is not valid; expected a list of distances in km above 0 "
            "and up to 20, e.g. [0.1, 0.25, 0.5]"
        )
    n = t.adaptation_labels
    if not (
        isinstance(n, list)
        and all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 10000 for k in n)
    ):
        problems.append(
            f"train.adaptation_labels: {shown(n)} is not valid; expected a list of label counts from 1 to "
            "10000, e.g. [10, 25, 50], or [] for no adaptation curve"
        )


def _check_settings(cfg: Config, problems: list[str]) -> None:
    """The label range, the DEM threshold, the model's channels, the losses, the batch and compile
    settings."""
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.cbh_min_km >= d.cbh_max_km:
        problems.append(f"data.cbh_min_km ({d.cbh_min_km}) must be below data.cbh_max_km ({d.cbh_max_km})")
    if isinstance(d.max_dem_surface_m, (int, float)) and not 0 <= d.max_dem_surface_m <= MAX_DEM_SURFACE_M:
        problems.append(
            f"data.max_dem_surface_m: {d.max_dem_surface_m!r} "
            + (
                "would drop every ocean profile (their DEM is 0)"
                if d.max_dem_surface_m < 0
                else f"would keep land (coasts rise above {MAX_DEM_SURFACE_M:.0f} m within a few km; the "
                "DEM's unit is "
                "not certain either)"
            )
            + f"; valid: 0 to {MAX_DEM_SURFACE_M:.0f} (metres), 0 = ocean only"
        )
    if m.channels and not (len(m.channels) == 3 and all(isinstance(c, int) and c > 0 for c in m.channels)):
        problems.append(
            f"model.channels: {shown(m.channels)} is not valid; expected three positive integers, "
            "e.g. [64, 128, 256], or [] to follow model.memory_optimized"
        )
    _check_campaigns(d.campaigns, problems)
    _check_report_lists(t, problems)
    if t.height_loss_weight == 0 and m.cloud_head != "joint":
        problems.append(
            f"train.height_loss_weight: 0 leaves nothing to train with model.cloud_head: {m.cloud_head} "
            "(only the height is trained; the probe is fitted afterwards); use a weight above 0, or "
            "model.cloud_head: joint for a cloud-only model"
        )
    if t.batch_size == "auto" and t.grad_accum_steps > 1:
        problems.append(
            "train.batch_size: 'auto' measures one batch per optimizer step; set a number when "
            "train.grad_accum_steps > 1"
        )
    if t.torch_compile and t.torch_compile_mode in CUDA_GRAPH_COMPILE_MODES and m.gradient_checkpointing:
        problems.append(cuda_graph_refusal(t.torch_compile_mode))


def cuda_graph_refusal(mode: str) -> str:
    return (
        f"train.torch_compile_mode: {mode!r} captures CUDA graphs, which crash under "
        "model.gradient_checkpointing ('static input data pointer changed'); use 'default' (or "
        "'max-autotune-no-cudagraphs'), or set model.gradient_checkpointing: false"
    )


# Folders a config names: made absolute when the config is built, so that a run records where its data and
# cache are, and every later command (evaluate, predict, resume) finds them from any working directory.
# A bucket's URL (data.cache_copy_dir) is kept as written.
PATH_KEYS = ("dir", "cache_dir", "cache_copy_dir")


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")  # $NAME or ${NAME}


def _absolute_paths(d: DataConfig) -> None:
    """Each folder made absolute, `~` and environment variables (`$SLURM_TMPDIR/cache`: a node-local disk
    whose path each machine of a cluster job knows) expanded where the config is built; an unset one is
    refused by name."""
    for key in PATH_KEYS:
        value = getattr(d, key)
        if value and not bucket.is_url(value):  # a bucket's URL is kept as written
            missing = [m.group(1) or m.group(2) for m in _VARIABLE.finditer(value)]
            missing = [name for name in missing if name not in os.environ]
            if missing:
                raise ConfigError(
                    f"data.{key}: {value!r} names the environment variable ${missing[0]}, which is not set "
                    "here; set it before the command, or give the folder itself"
                )
            setattr(d, key, os.path.abspath(os.path.expanduser(os.path.expandvars(value))))


MAX_PROBLEMS = 25  # listed in one message; the rest counted


def renamed_keys(raw, problems: list[str] | None = None):
    """`raw` (a nested dict, as loaded) with the keys an earlier release named otherwise under today's names
    (RENAMED); a copy where one was renamed. Both names given: a problem (appended to `problems`)."""
    if not isinstance(raw, dict):
        return raw
    out = raw
    for (section, old), new in RENAMED.items():
        part = raw.get(section)
        if not isinstance(part, dict) or old not in part:
            continue
        rest = {k: v for k, v in part.items() if k != old}
        if new in part and part[new] not in (None, [], part[old]):
            if problems is not None:
                problems.append(
                    f"{section}.{old} is the earlier name of {section}.{new}, and both are given "
                    f"({shown(part[old])} and {shown(part[new])}); keep {section}.{new}"
                )
            out = {**out, section: rest}
            continue
        out = {**out, section: {**rest, new: part[old]}}
    return out


def build_config(raw: dict | None, source: str = "config", packages: bool = True) -> Config:
    """A Config from a nested dict, every problem collected and named. `packages`: a bucket URL's package
    must be installed (False for a stored run's config: evaluating it elsewhere needs no bucket)."""
    problems: list[str] = []
    raw = renamed_keys(raw or {}, problems)
    cfg = _build(Config, raw, "", problems)
    if not problems:
        _check_cross_field(cfg, problems, packages)
    if problems:
        more = len(problems) - MAX_PROBLEMS
        shown_problems = problems[:MAX_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise ConfigError(f"{source} has {len(problems)} problem(s):\n  - " + "\n  - ".join(shown_problems))
    _absolute_paths(cfg.data)
    return cfg


def settings_table() -> str:
    """The settings as a Markdown table (docs/reference/configuration.md's, checked by tests/test_readme.py):
    key, default, valid values, whether a resumed run may change it, meaning. data.keys.* (the files' dataset
    names) are left out."""
    rows = ["| key | default | valid | on resume | meaning |", "|---|---|---|---|---|"]
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            m = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            words = [w for w in value_type(hints[f.name])[1] if w not in STORED_ONLY]
            valid = (
                ", ".join(map(str, m["choices"]))
                if m.get("choices")
                else (f"{m['range'][0]} to {m['range'][1]}" if m.get("range") else "")
            )
            valid = ", ".join([valid, *words]) if valid and words else valid or ", ".join(words)
            meaning = m["help"].replace("|", "&#124;")
            rows.append(
                f"| `{section.name}.{f.name}` | `{default!r}` | {valid} | {m['resume']} | {meaning} |"
            )
    return "\n".join(rows)


def field_metadata(cls=None, prefix: str = "") -> dict[str, dict]:
    """Each leaf key ("train.epochs"): its field's metadata (help, range, choices, legacy, resume) and
    default."""
    out = {}
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_metadata(hints[f.name], f"{prefix}{f.name}."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f"{prefix}{f.name}"] = {**f.metadata, "default": default}
    return out


def resume_rules() -> dict[str, str]:
    """Each leaf key ("train.epochs") and its rule when a stopped run resumes (SAME or NEW, from its
    field)."""
    return {key: meta.get("resume", SAME) for key, meta in field_metadata().items()}


def derive(cfg: Config, changes: dict) -> Config:
    """A new Config: `cfg` with `changes` ({"section.key": value}), validated like a loaded one. The config a
    user loaded is never changed: a run's resolved values (its flights, a measured batch size), a fold's
    test flight or a phase's flights are a derived config, recorded in the run. A bucket's package was checked
    where `cfg` was loaded (a stored run's config, evaluated elsewhere, needs none)."""
    raw = cfg.to_dict()
    for key, value in changes.items():
        _put(raw, key, _plain(value))
    return build_config(raw, source="derived config", packages=False)


def _put(raw: dict, key: str, value) -> None:
    """raw["section"]["key"] = value for key "section.key"."""
    *path, last = key.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def _leaf_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def absent_settings(stored) -> dict:
    """The settings a stored config (a run folder's, a checkpoint's) lacks whose meaning there is not today's
    default (their field's `absent`): {"model.height_head": "unbounded"} for a run saved before that setting
    existed. A resumed or reloaded old run takes these values, so it computes what it was trained with."""
    if not isinstance(stored, dict) or not all(isinstance(stored.get(s), dict) for s in ("data", "model")):
        return {}
    have = _leaf_keys(renamed_keys(stored))
    return {
        key: meta["absent"]
        for key, meta in field_metadata().items()
        if key not in have and meta["absent"] != meta["default"]
    }


def height_bounds_km(data: DataConfig) -> tuple[float, float]:
    """The heights a cloud base can have where nothing else is known (km): from the surface (SURFACE_KM) to
    the top of the labels' range (data.cbh_max_km; no model saw a higher label). model.height_head bounded
    keeps its output inside; predict masks a height outside (and above the aircraft, where the nav file gives
    its altitude)."""
    return SURFACE_KM, float(data.cbh_max_km)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(f"--set {shown(text)}: expected section.key=value, e.g. train.epochs=3")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {shown(text)}: expected section.key=value, e.g. train.epochs=3")
    try:
        parsed = loads(value, f"--set {key.strip()}") if value.strip() else ""
    except (yaml.YAMLError, ConfigError, ValueError, RecursionError):  # ValueError: over 4300 digits
        parsed = value
    return path, parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            nxt = node.get(part) if isinstance(node, dict) else None
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[path[-1]] = value
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """A user's config (a file, `--set` overrides): validated, with one notice where it uses an earlier name
    of a key; the protocol kept for earlier runs alone (data.validation: test_flights) is refused."""
    raw = read_yaml(path) if path else {}
    raw = apply_overrides(raw, list(overrides))
    source = str(path) if path else "config"
    if overrides:  # a problem may come from either: both are named
        source += " with --set " + " ".join(shown(o, 60) for o in list(overrides)[:5])
        source += " ..." if len(overrides) > 5 else ""
    data = raw.get("data") if isinstance(raw, dict) else None
    if isinstance(data, dict) and data.get("validation") == LEGACY_VALIDATION:
        raise ConfigError(
            f"{source}: data.validation: {LEGACY_VALIDATION!r} chose the best epoch and the intervals on the "
            "test flights, as runs made before CloudML 0.3 did (their test numbers are optimistic); it is "
            "kept "
            "for those runs to continue, never for a new one. Choose auto, flight, time_blocks or a list of "
            "training flights."
        )
    if isinstance(data, dict) and any(old in data for (section, old) in RENAMED if section == "data"):
        _notice_once(RENAMED_NOTICE)
    return build_config(raw, source=source)


_NOTICED: set[str] = set()


def _notice_once(text: str) -> None:
    """A notice about the user's config, said once per process (a config is loaded again by later steps)."""
    if text not in _NOTICED:
        _NOTICED.add(text)
        logging.getLogger(__name__).warning("Notice: %s", text)


def save_config(cfg: Config, path: str | Path) -> None:
    from cloudml_lib.base.outputs import write_text

    write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_from_dict(d: dict) -> Config:
    """Rebuild a Config stored as a plain dict (run directory, checkpoint); a setting added since it was
    stored takes its meaning for that older version (absent_settings)."""
    old = absent_settings(d)
    if old:
        d = copy.deepcopy(d)
        for key, value in old.items():
            _put(d, key, value)
    return build_config(d, source="stored config", packages=False)
