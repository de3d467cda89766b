"""The whole-flight product's variables: one table (name, units and CF attributes, dtype, CSV column and
format) drives the NetCDF file, the CSV and the per-flight summary, so a new variable is one entry here.

Values arrive as float arrays over the predicted frames (predict.py's result), NaN where missing (a flag:
also -1); the NetCDF file stores a missing value as the variable's _FillValue, the CSV as an empty cell. A
variable the model cannot give (no cloud output: None in the result) is left out of the NetCDF file and
empty in the CSV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FILL = -9999.0  # CF _FillValue of the float variables
FLAG_FILL = -1  # of the flags


@dataclass(frozen=True)
class Variable:
    name: str  # in the NetCDF file
    key: str  # in predict's result
    dtype: str  # f8, f4, i4 or i1 (a flag)
    attrs: dict = field(default_factory=dict)  # CF attributes; "{coverage}" is the intervals' coverage
    csv: str = ""  # its column in the CSV
    digits: int | None = 4  # decimals in the CSV; None: a whole number
    coordinate: bool = False  # time, lat, lon: the coordinates of every other variable
    always: bool = False  # never missing (no _FillValue)

    @property
    def flag(self) -> bool:
        return self.dtype == "i1"


FLAGS = {"flag_values": np.array([0, 1], np.int8), "flag_meanings": "clear_sky cloud"}  # any CPL layer
HEIGHT = {"units": "km"}
VARIABLES = (
    Variable(
        "time",
        "t",
        "f8",
        {
            "standard_name": "time",
            "long_name": "time of the thermal-IR frame (UTC)",
            "units": "seconds since 1970-01-01 00:00:00",
            "calendar": "standard",
            "axis": "T",
        },
        "time_utc_s",
        2,
        coordinate=True,
        always=True,
    ),
    Variable(
        "frame_index",
        "frame_index",
        "i4",
        {"long_name": "frame index in the IR file", "units": "1"},
        "frame_index",
        None,
        coordinate=True,  # an auxiliary coordinate: which frame of the IR file each value is
        always=True,
    ),
    Variable(
        "lat",
        "lat",
        "f8",
        {"standard_name": "latitude", "long_name": "latitude of the aircraft", "units": "degrees_north"},
        "lat",
        coordinate=True,
    ),
    Variable(
        "lon",
        "lon",
        "f8",
        {"standard_name": "longitude", "long_name": "longitude of the aircraft", "units": "degrees_east"},
        "lon",
        coordinate=True,
    ),
    Variable(
        "cloud_probability",
        "cloud_probability",
        "f4",
        {
            "long_name": "probability of a cloud layer below the aircraft",
            "units": "1",
            "valid_range": np.array([0.0, 1.0], np.float32),
        },
        "cloud_probability",
    ),
    Variable(
        "cloud_flag",
        "cloud_flag",
        "i1",
        {"long_name": "cloud below the aircraft (cloud_probability >= cloud_threshold)", **FLAGS},
        "cloud_flag",
        None,
    ),
    Variable(
        "cloud_base_height",
        "cbh_km",
        "f4",
        {
            "standard_name": "cloud_base_altitude",
            "long_name": "predicted cloud base height above sea level (missing where no cloud base in the "
            "product's range is flagged, where the frame is blank, and where the height cannot be a cloud "
            "base: see cloud_base_height_qc)",
            "ancillary_variables": "cloud_base_height_lower cloud_base_height_upper cloud_flag "
            "cloud_base_height_qc",
            **HEIGHT,
        },
        "cbh_km",
    ),
    Variable(
        "cloud_base_height_qc",
        "cbh_qc",
        "i1",
        {
            "long_name": "quality of cloud_base_height: inside the bounds a cloud base can have (the global "
            "attribute cloud_base_height_bounds), or masked for lying below the surface or above the upper "
            "bound (the aircraft, else data.cbh_max_km), or kept but outside the span of the labels the "
            "model learned from (the global attribute cloud_base_height_outside_labels says which span: an "
            "extrapolation), or kept inside that span but on a frame whose inputs lie outside those of the "
            "samples the model was trained on (the global attribute inputs_vs_training: an extrapolation "
            "too); "
            "missing where no height was predicted",
            # 3 and 4 were appended later: files written before keep the meanings of 0-2 (0-3)
            "flag_values": np.array([0, 1, 2, 3, 4], np.int8),
            "flag_meanings": (
                "inside_bounds below_surface_masked above_upper_bound_masked outside_labels_range "
                "inputs_outside_training"
            ),
        },
        "cbh_qc",
        None,
    ),
    Variable(
        "input_distance",
        "input_distance",
        "f4",
        {
            "long_name": "Mahalanobis distance of the frame's inputs (sun angles, brightness statistics, the "
            "atmosphere, as the network sees them) from those of the samples the model was trained on; "
            "beyond the global attribute input_distance_threshold the frame is outside (cloud_base_height_qc "
            "4)",
            "units": "1",
        },
        "input_distance",
    ),
    Variable(
        "cloud_base_height_lower",
        "lower",
        "f4",
        {
            # the interval's bounds are cloud base altitudes too (quantiles of the prediction)
            "standard_name": "cloud_base_altitude",
            "long_name": "lower bound of the {coverage} prediction interval of cloud_base_height",
            **HEIGHT,
        },
        "cbh_lower_km",
    ),
    Variable(
        "cloud_base_height_upper",
        "upper",
        "f4",
        {
            "standard_name": "cloud_base_altitude",
            "long_name": "upper bound of the {coverage} prediction interval of cloud_base_height",
            **HEIGHT,
        },
        "cbh_upper_km",
    ),
    Variable(
        "cpl_cloud_base_height",
        "label",
        "f4",
        {
            "standard_name": "cloud_base_altitude",
            "long_name": "CPL lidar cloud base height (label) where one was matched to the frame",
            "source": "Cloud Physics Lidar (CPL) L2 layer product",
            **HEIGHT,
        },
        "cpl_cbh_km",
    ),
    Variable(
        "cpl_cloud_flag",
        "cpl_cloud",
        "i1",
        {"long_name": "CPL lidar: a layer in the profile matched to the frame (Number_Layers > 0)", **FLAGS},
        "cpl_cloud",
        None,
    ),
)


def missing(v: Variable, values: np.ndarray) -> np.ndarray:
    """Where a variable has no value: NaN, and -1 for a flag."""
    out = ~np.isfinite(values)
    return out | (values < 0) if v.flag else out


def attributes(v: Variable, coverage: str) -> dict:
    return {k: a.format(coverage=coverage) if isinstance(a, str) else a for k, a in v.attrs.items()}


# what the cloud flag marks (data.cloud_flag), for the files' words
FLAG_DEFINITIONS = {
    "base_in_range": "a cloud base in the height product's range (the label range, data.cbh_min_km to "
    "data.cbh_max_km); cloud whose base lies above the range (high cloud alone) or below it is its own "
    "class, "
    "and has no height",
    "any_layer": "any CPL layer (Number_Layers > 0), thin cirrus included (the cloud flag of runs made "
    "before "
    "data.cloud_flag)",
}
CLASS_MEANINGS = ("clear_sky", "cloud_base_in_range", "cloud_base_above_range", "cloud_base_below_range")
BT_MEANINGS = (
    "warmer_than_window_clear_sky_or_fog",
    "cloud_base_in_range",
    "colder_than_window_cloud_above_range",
)


def flag_definition(definition: str) -> str:
    return FLAG_DEFINITIONS.get(definition, definition)


def flag_variables(flagging) -> dict:
    """The cloud variables' attributes for how the file's flag was made (flagging.Flagging): what cloud_flag,
    cpl_cloud_flag and cloud_probability mean, by variable name."""
    if flagging.definition != "base_in_range":
        bt = {
            "long_name": "cloud flag of the brightness-temperature baseline (frame_p10 below the threshold "
            "fitted on the training flights)",
            **FLAGS,
        }
        return {"cloud_flag": bt} if flagging.source == "bt_threshold" else {}
    classes = {
        "flag_values": np.arange(len(CLASS_MEANINGS), dtype=np.int8),
        "flag_meanings": " ".join(CLASS_MEANINGS),
    }
    if flagging.source == "bt_threshold":
        flag = {
            "long_name": "cloud flag of the brightness-temperature baseline (frame_p10 inside the window "
            "fitted on "
            "the training flights: a cloud base in the range)",
            "flag_values": np.arange(len(BT_MEANINGS), dtype=np.int8),
            "flag_meanings": " ".join(BT_MEANINGS),
        }
    else:
        flag = {
            "long_name": "what is below the aircraft: a cloud base in the height product's range where "
            "cloud_probability >= cloud_threshold, else the likeliest other class (a model whose cloud "
            "output "
            "has no classes gives 0 or 1)",
            **classes,
        }
    return {
        "cloud_flag": flag,
        "cpl_cloud_flag": {"long_name": "CPL lidar: what the profile matched to the frame holds", **classes},
        "cloud_probability": {
            "long_name": "probability of a cloud base in the height product's range below the aircraft",
            "units": "1",
            "valid_range": np.array([0.0, 1.0], np.float32),
        },
    }


# ACDD 1.3's coverage_content_type of each variable (what kind of numbers it holds)
CONTENT = {
    "time": "coordinate",
    "lat": "coordinate",
    "lon": "coordinate",
    "frame_index": "referenceInformation",
    "cloud_probability": "modelResult",
    "cloud_flag": "thematicClassification",
    "cloud_base_height": "modelResult",
    "cloud_base_height_qc": "qualityInformation",
    "input_distance": "qualityInformation",
    "cloud_base_height_lower": "modelResult",
    "cloud_base_height_upper": "modelResult",
    "cpl_cloud_base_height": "physicalMeasurement",
    "cpl_cloud_flag": "thematicClassification",
}


def _iso(seconds: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(float(seconds), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def time_coverage(t: np.ndarray) -> dict:
    """ACDD's time coverage of the frames' times (seconds since 1970): start, end, duration, resolution."""
    if not np.isfinite(t).any():
        return {}
    start, end = float(np.nanmin(t)), float(np.nanmax(t))
    step = float(np.nanmedian(np.diff(t))) if t.size > 1 else 0.0
    return {
        "time_coverage_start": _iso(start),
        "time_coverage_end": _iso(end),
        "time_coverage_duration": f"PT{end - start:.0f}S",
        "time_coverage_resolution": f"PT{step:.2f}S",
    }


def discovery_attributes(flight: str, result: dict, source: str, version: str) -> dict:
    """The file's CF trajectory and ACDD 1.3 discovery attributes: what it is, where and when it lies, what
    made it (`source`: the model and its run, never a path; CloudML's `version`) and when."""
    import datetime as dt

    t = np.asarray(result["t"], np.float64)
    lat, lon = (np.asarray(result.get(k, np.full(t.size, np.nan)), np.float64) for k in ("lat", "lon"))
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = {
        "Conventions": "CF-1.8, ACDD-1.3",
        "featureType": "trajectory",
        "cdm_data_type": "Trajectory",
        "title": f"Cloud base height along NASA ER-2 flight {flight}, predicted from thermal-IR frames",
        "summary": (
            "Cloud base height (km above sea level) at every thermal-IR camera frame of ER-2 flight "
            f"{flight}, "
            "predicted by a CloudML neural network trained on Cloud Physics Lidar (CPL) cloud bases of other "
            "frames and flights, with the model's cloud flag, a quality flag (cloud_base_height_qc), "
            "prediction intervals where calibrated, and the CPL base where a lidar profile was matched"
        ),
        "keywords": "cloud base height, cloud base altitude, marine boundary layer clouds, thermal infrared "
        "imagery, lidar, ER-2, machine learning",
        "id": f"{flight}_cbh",
        "source": source,
        "history": f"{now} python -m cloudml_lib predict (CloudML {version}): {source}",
        "date_created": now,
        "processing_level": "L2: a geophysical variable at every frame along the flight track",
        "product_version": f"CloudML {version}",
        "platform": "NASA ER-2 high-altitude aircraft",
        "instrument": "thermal-infrared camera (the frames); Cloud Physics Lidar, CPL (the labels)",
        "standard_name_vocabulary": "CF Standard Name Table v93",
        "acknowledgment": "The thermal-IR frames, the Cloud Physics Lidar layers and the navigation are "
        "NASA's, from ER-2 flights of its airborne science programme",
    }
    out |= time_coverage(t)
    if np.isfinite(lat).any() and np.isfinite(lon).any():
        south, north, west, east = (float(f(a)) for a in (lat, lon) for f in (np.nanmin, np.nanmax))
        out |= {
            "geospatial_lat_min": south,
            "geospatial_lat_max": north,
            "geospatial_lon_min": west,
            "geospatial_lon_max": east,
            "geospatial_lat_units": "degrees_north",
            "geospatial_lon_units": "degrees_east",
            "geospatial_bounds": f"POLYGON (({west} {south}, {east} {south}, {east} {north}, {west} {north}, "
            f"{west} {south}))",
            "geospatial_bounds_crs": "EPSG:4326",
        }
    if "height_bounds" in result:  # the heights a cloud base may have here (bound_heights)
        low, high = result["height_bounds"]
        out |= {
            "geospatial_vertical_min": float(low) * 1000.0,
            "geospatial_vertical_max": float(high) * 1000.0,
            "geospatial_vertical_units": "m",
            "geospatial_vertical_positive": "up",
        }
    return out


def netcdf_dataset(result: dict, attrs: dict, coverage: str, overrides: dict | None = None):
    """An xarray Dataset of the variables the result holds, and the encoding (dtype, _FillValue,
    compression). `overrides`: variable name -> attributes that replace the table's (flag_variables)."""
    import xarray as xr

    coords, variables, encoding = {}, {}, {}
    for v in VARIABLES:
        values = result.get(v.key)
        if values is None:  # a model without a cloud output: no cloud variables
            continue
        values = np.asarray(values, np.float64)
        data = values.astype(v.dtype) if v.always else np.where(missing(v, values), np.nan, values)
        attrs_v = dict((overrides or {}).get(v.name) or attributes(v, coverage))
        attrs_v.setdefault("coverage_content_type", CONTENT.get(v.name, "auxiliaryInformation"))
        (coords if v.coordinate else variables)[v.name] = ("time", data, attrs_v)
        encoding[v.name] = {
            "dtype": v.dtype,
            "_FillValue": None if v.always else (FILL if v.dtype.startswith("f") else FLAG_FILL),
        }
        if not v.coordinate and not v.always:
            encoding[v.name]["zlib"] = True
    # CF's discrete sampling geometry: one trajectory (the flight), named by its cf_role variable
    coords["trajectory"] = ((), str(attrs.get("id", "flight")).removesuffix("_cbh"), TRAJECTORY)
    return xr.Dataset(variables, coords=coords, attrs=attrs), encoding


TRAJECTORY = {"cf_role": "trajectory_id", "long_name": "the ER-2 flight"}


def csv_header() -> list[str]:
    return [v.csv for v in VARIABLES]


def csv_rows(result: dict):
    """The CSV's rows, one per predicted frame, in the table's column order."""
    n = len(result["t"])
    columns = []
    for v in VARIABLES:
        values = result.get(v.key)
        values = np.full(n, np.nan) if values is None else np.asarray(values, np.float64)
        gone = missing(v, values)
        text = (f"{{:.{v.digits}f}}" if v.digits is not None else "{:.0f}").format
        columns.append(["" if g else text(x) for x, g in zip(values, gone)])
    return zip(*columns)


def summary(result: dict) -> dict:
    """Per variable: how many frames have a value, and the range of the numbers (for summary.json)."""
    out = {}
    for v in VARIABLES:
        values = result.get(v.key)
        if values is None or v.coordinate or v.always:
            continue
        values = np.asarray(values, np.float64)
        ok = values[~missing(v, values)]
        out[v.name] = {
            "valid": int(ok.size),
            "min": float(ok.min()) if ok.size else None,
            "max": float(ok.max()) if ok.size else None,
        }
    return out
