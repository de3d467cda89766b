"""The whole-flight NetCDF as an archive takes it: a CF discrete-sampling-geometry trajectory with ACDD 1.3
discovery attributes, checked by the IOOS compliance-checker (a dev dependency, run offline with its packaged
standard-name table), and a `source` that names the model and its run, never a path of the machine."""

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import netCDF4
import numpy as np
import pytest

import cloudml_lib.science.predict as pr

pytestmark = pytest.mark.slow  # the module's product: a whole flight predicted (about 10 s)

# The variables CF's standard-name table has no name for: ACDD 1.3 asks every geophysical variable for one,
# and none is invented here. The test fails if the table gains one (then it should be used).
NO_CF_NAME = {"cloud_probability": "cloud_probability", "input_distance": "input_distance"}


def checked(path: Path, checker: str, tmp_path: Path) -> tuple[bool, bool, dict]:
    """(every high-priority check passed, an exception occurred in a check, the JSON report)."""
    from compliance_checker.runner import CheckSuite, ComplianceChecker

    CheckSuite.load_all_available_checkers()
    out = tmp_path / f"{checker.replace(':', '_')}.json"
    passed, errors = ComplianceChecker.run_checker(
        str(path), [checker], 0, "lenient", output_filename=str(out), output_format="json"
    )
    return passed, errors, json.loads(out.read_text())[checker]


def failures(report: dict) -> list[str]:
    """Every failed check's messages, by priority name (high, medium, low)."""
    out = []
    for level in ("high_priorities", "medium_priorities", "low_priorities"):
        for r in report.get(level, []):
            if r["value"][0] != r["value"][1]:
                out.append(f"{level.split('_')[0]}: {r['name']}: {'; '.join(r['msgs'])}")
    return out


def cf_names() -> set[str]:
    """The names of the CF standard-name table the compliance-checker ships."""
    import compliance_checker

    table = Path(compliance_checker.__file__).parent / "data" / "cf-standard-name-table.xml"
    return {e.get("id") for e in ET.parse(table).getroot().iter("entry")}


@pytest.fixture(scope="module")
def product(shared_tiny_run, tmp_path_factory) -> Path:
    """The session tiny run's test flight predicted into a folder of this module."""
    run, _, _ = shared_tiny_run
    (path,) = pr.predict_flights(run, out_dir=tmp_path_factory.mktemp("archive"))
    return path


def test_the_product_passes_cf_and_acdd_in_the_ioos_compliance_checker(product, tmp_path):
    passed, errors, cf = checked(product, "cf:1.8", tmp_path)
    assert passed and not errors and failures(cf) == [], failures(cf)  # CF: no failure at any priority
    passed, errors, acdd = checked(product, "acdd:1.3", tmp_path)
    assert not errors
    high = [f for f in failures(acdd) if f.startswith("high")]
    # the one kind of high-priority gap left: a standard_name CF does not have, for the variables named
    gaps = {re.search(r'variable "([^"]+)"', f).group(1) for f in high}
    assert all(f.endswith(": standard_name") for f in high) and gaps <= set(NO_CF_NAME), high
    assert not set(NO_CF_NAME.values()) & cf_names()  # CF still has no name for them
    medium = " ".join(f for f in failures(acdd) if f.startswith("medium"))
    for known in ("geospatial_lat_min", "time_coverage_start", "history", "date_created", "id", "summary"):
        assert known not in medium, medium  # what CloudML knows of the file is there


def test_the_product_is_a_trajectory_that_names_its_model_and_no_path(product, shared_tiny_run):
    run, _, entries = shared_tiny_run
    with netCDF4.Dataset(product) as nc:
        assert nc.featureType == "trajectory" and nc.cdm_data_type == "Trajectory"
        trajectory = [v for v in nc.variables.values() if getattr(v, "cf_role", "") == "trajectory_id"]
        assert len(trajectory) == 1 and trajectory[0][...] == entries[2]["name"]
        assert nc.platform.startswith("NASA ER-2") and "Cloud Physics Lidar" in nc.instrument
        assert nc.source.startswith("CloudML ") and f"of run '{run.name}'" in nc.source
        assert "epoch" in nc.source and "convolutional network" in nc.source
        every = " ".join(str(getattr(nc, a)) for a in nc.ncattrs())
        assert str(run.parent) not in every  # no path of the writer's machine, in any attribute
        t = nc["time"][:]
        assert nc.time_coverage_start < nc.time_coverage_end and nc.time_coverage_duration.startswith("PT")
        assert float(nc.time_coverage_duration[2:-1]) == pytest.approx(float(t.max() - t.min()), abs=1)
        lat = nc["lat"][:]
        assert nc.geospatial_lat_min == pytest.approx(float(np.min(lat)))
        assert nc.history.startswith(nc.date_created) and "python -m cloudml_lib predict" in nc.history
