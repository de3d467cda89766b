"""The demo generator (data/synthetic.py): version 3 puts the cloud's top in the frames and its base a varying
thickness below, each flight with its own sea and air, so no temperature statistic gives the base; version 2
is still written byte for byte for the runs made on it, and each says which it is."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import TINY_SHAPE

from cloudml_lib.base.config import build_config
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.preprocess import STAT_NAMES
from cloudml_lib.data.synthetic import (
    DEMO_VERSION,
    GENERATOR_ATTR,
    VERSION_FILE,
    Atmosphere,
    demo_flight_entries,
    emissivity,
    make_demo_flights,
)


def written(tmp_path, version: int):
    """Four small flights of `version` and their caches."""
    root = tmp_path / f"v{version}"
    entries = make_demo_flights(
        root, n_flights=4, seed=5, frames_per_flight=400, frame_shape=TINY_SHAPE, version=version
    )
    data = {
        "dir": str(root),
        "cache_dir": str(tmp_path / f"cache{version}"),
        "flights": entries,
        "test_flights": [entries[0]["name"]],
        "temporal_frames": 3,
        "swath_slice": [4, 36],
        "preprocess_workers": 0,
    }
    return root, entries, load_caches(build_config({"data": data}).data)


def best_single_statistic_r2(caches) -> float:
    """The R2 of the base against the best single brightness statistic, one line over every flight."""
    x = np.concatenate([c.frame_stats[c.has_height] for c in caches]).astype(np.float64)
    y = np.concatenate([c.cbh_km[c.has_height] for c in caches]).astype(np.float64)
    return max(float(np.corrcoef(x[:, j], y)[0, 1] ** 2) for j in range(len(STAT_NAMES)))


@pytest.mark.slow
def test_version_3_gives_no_statistic_the_base_where_version_2_did(tmp_path):
    root, entries, v3 = written(tmp_path, 3)
    _, _, v2 = written(tmp_path, 2)
    assert sum(int(c.has_height.sum()) for c in v3) > 100
    easy, honest = best_single_statistic_r2(v2), best_single_statistic_r2(v3)
    assert easy > 0.9  # version 2: the coldest pixels were the base's temperature
    assert honest < 0.9 and honest < easy - 0.1, (easy, honest)
    with h5py.File(root / entries[0]["ir_file"]) as f:  # the file says what it is
        attrs = dict(f["Product/Signal"].attrs)
        assert f.attrs[GENERATOR_ATTR] == DEMO_VERSION == 3
    assert (attrs["units"], attrs["scale_factor"], attrs["add_offset"]) == ("K", 0.01, 180.0)
    assert (root / VERSION_FILE).read_text().strip() == "3"
    with h5py.File(tmp_path / "v2" / entries[0]["ir_file"]) as f:  # version 2's bytes: no new attribute
        assert GENERATOR_ATTR not in f.attrs and dict(f["Product/Signal"].attrs) == {"units": "counts"}
    # the lidar's layer tops lie a varying thickness above the bases (version 2: 0.3 km everywhere)
    with h5py.File(root / entries[1]["cpl_file"]) as f:
        base, top = f["layer_descriptor/Layer_Base_Altitude"][:], f["layer_descriptor/Layer_Top_Altitude"][:]
    low = (base > 0) & (base < 3)
    thickness = (top - base)[low]
    assert thickness.std() > 0.03 and 0.1 < np.median(thickness) < 0.6


def test_a_thin_cloud_is_partly_transparent_and_the_top_is_colder_than_the_base():
    assert emissivity(0.05) == pytest.approx(0.21, abs=0.01)  # Stephens (1978) at 60% adiabatic water
    assert emissivity(0.3) > 0.99
    air = Atmosphere(sea_k=289.0, air_sea_k=1.0, lapse_k_per_km=9.0)
    assert air.top_k(1.0, 0.0) == pytest.approx(279.0)
    assert air.top_k(1.0, 0.4) == pytest.approx(277.0)  # 5 K/km inside the cloud


def test_an_unknown_generator_version_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="generator version 2 or 3"):
        make_demo_flights(tmp_path / "x", n_flights=2, frames_per_flight=20, version=7)
    assert not (tmp_path / "x").exists()


def test_an_earlier_versions_demo_flights_are_kept_for_the_runs_made_on_them(
    tmp_path, caplog, logs_reach_caplog
):
    """data.demo never writes over them: a run of CloudML 0.3 continues on the flights it was trained on, and
    the notebooks continue such a run with its own demo folder."""
    import logging

    import yaml

    from cloudml_lib.colab.drive import demo_folder_of
    from cloudml_lib.data.synthetic import ensure_demo_flights

    old = tmp_path / "flights"
    make_demo_flights(old, n_flights=2, frames_per_flight=20, frame_shape=(16, 16), version=2)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    data = build_config({"data": {"dir": str(old), "demo": True}}).data
    with caplog.at_level(logging.WARNING):
        assert ensure_demo_flights(data).dir == str(old)
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert "generator version 2; this one writes 3): they are kept" in caplog.text
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": str(old), "demo": True}}))
    assert demo_folder_of(run) == str(old)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": str(old), "demo": False}}))
    assert demo_folder_of(run) is None


def test_demo_flights_written_again_never_replace_a_file_the_user_put_where_one_goes(tmp_path):
    """`make-demo-data --out F` again with more flights: F's ledger lists the files of the first writing; a
    file the user put since where a new flight's file goes is named, before anything is written, and left as
    it was (nothing of F changes); without it, the flights are written and listed."""
    import hashlib

    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.base.ledger import listed

    out = tmp_path / "demo"
    make_demo_flights(out, n_flights=2, frames_per_flight=40, frame_shape=TINY_SHAPE)
    third = demo_flight_entries(3)[2]
    theirs = out / third["ir_file"]
    theirs.parent.mkdir()
    theirs.write_bytes(b"the user's own IR file")

    def tree():
        return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}

    before = tree()
    with pytest.raises(CloudMLError, match="was not written by CloudML") as e:
        make_demo_flights(out, n_flights=3, frames_per_flight=40, frame_shape=TINY_SHAPE)
    assert str(theirs) in str(e.value) and tree() == before
    theirs.unlink()
    make_demo_flights(out, n_flights=3, frames_per_flight=40, frame_shape=TINY_SHAPE)
    assert third["ir_file"] in listed(out) and (out / third["ir_file"]).read_bytes()[:4] == b"\x89HDF"
