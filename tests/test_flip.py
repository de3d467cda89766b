"""The flip keeps image and sun azimuth consistent: the azimuth the network sees is relative to the heading,
the flip mirrors it across the flight axis, and a flight without a heading is never flipped.

The check against the demo generator renders a scene, mirrors it, and asks which relative azimuth the
generator needs to draw the mirrored scene: the flipped sample's angle must be that one."""

from __future__ import annotations

import logging

import h5py
import numpy as np
import pytest
import torch

from cloudml_lib.data import cpl
from cloudml_lib.data import dataset as ds_mod
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.dataset import CloudDataset, augment_sample, fit_scalers, mirror_line, model_azimuth
from cloudml_lib.data.flights import check_rows
from cloudml_lib.data.synthetic import _cloud_field, scene_layers

pytestmark = pytest.mark.usefixtures("logs_reach_caplog")


@pytest.fixture
def always_flip(monkeypatch):
    for name, value in (("FLIP_PROB", 1.0), ("ERASE_PROB", 0.0), ("CONTRAST", 0.0), ("BRIGHTNESS", 0.0)):
        monkeypatch.setattr(ds_mod, name, value)


def scene(field, rel_az):
    """Cloud and shadow opacity of one generator frame, stacked (2, rows, cols)."""
    return np.stack(
        scene_layers(field, cam_row=60.0, rows=40, cols=48, h_km=1.2, sza_deg=50.0, rel_az_deg=rel_az)
    )


@pytest.mark.parametrize("heading", [0.0, 40.0, 135.0, 290.0])
def test_a_flipped_sample_has_the_angle_the_generator_draws_for_the_mirrored_scene(always_flip, heading):
    field = _cloud_field(np.random.default_rng(3), (160, 140), scale_px=2.0)
    saa = 205.0  # sun azimuth from the ground (north)
    rel = float(model_azimuth(saa, heading, "relative"))
    frames = torch.from_numpy(scene(field, rel))
    line = float(mirror_line(heading, "relative", "rows"))
    flipped, angle = augment_sample(frames, rel, np.random.default_rng(0), line)
    mirrored_scene = scene(field[:, ::-1], angle)  # the mirrored world, drawn at the returned angle
    np.testing.assert_allclose(flipped.numpy(), mirrored_scene, atol=1e-6)
    # in ground azimuths the same flip is a -> 2 * heading - a, and it draws the same mirrored scene
    _, ground = augment_sample(
        frames, saa, np.random.default_rng(0), float(mirror_line(heading, "ground", "rows"))
    )
    assert ground == pytest.approx((2 * heading - saa) % 360)
    np.testing.assert_allclose(scene(field[:, ::-1], (ground - heading) % 360), mirrored_scene, atol=1e-6)
    # the old rule (360 - a) is right only for a northbound aircraft: here the test would catch it
    old = (360.0 - saa) % 360.0
    if heading % 180:
        assert np.abs(scene(field[:, ::-1], (old - heading) % 360) - mirrored_scene).max() > 0.05


def test_columns_along_track_mirror_across_the_cross_track_axis(always_flip):
    frames = torch.zeros(1, 4, 4)
    _, angle = augment_sample(
        frames, 30.0, np.random.default_rng(0), float(mirror_line(10.0, "relative", "columns"))
    )
    assert angle == pytest.approx(150.0)  # r -> 180 - r
    assert np.isnan(mirror_line(np.nan, "relative", "rows"))  # no heading: no mirror line, no flip


def looks_flipped(augmented: torch.Tensor, original: np.ndarray) -> bool:
    """Whether an augmented sample (jittered, perhaps partly erased) is the mirrored original."""
    a, o = augmented.numpy().ravel(), original.astype(np.float32)
    return np.corrcoef(a, o[:, :, ::-1].ravel())[0, 1] > np.corrcoef(a, o.ravel())[0, 1]


def test_the_network_sees_the_azimuth_relative_to_the_heading_and_flips_it_consistently(copied_flights):
    root, entries, config = copied_flights
    cfg = config()
    caches = load_caches(cfg.data)
    c = caches[0]
    assert np.isfinite(c.heading_deg).all() and np.ptp(c.heading_deg) > 30  # the demo track turns
    with h5py.File(root / entries[0]["nav_file"]) as f:  # row i = frame i
        np.testing.assert_allclose(c.heading_deg, f["nav/trueHdg"][()][c.frame_index])
    ds = CloudDataset([c], fit_scalers([c]), augment=True, seed=1)
    flipped = 0
    for i in range(len(ds)):
        item = ds[i]
        rel = np.radians((c.saa_deg[i] - c.heading_deg[i]) % 360)
        was_flipped = looks_flipped(item["frames"], c.frames.read(c.windows[i]))
        expected = [-np.sin(rel), np.cos(rel)] if was_flipped else [np.sin(rel), np.cos(rel)]
        np.testing.assert_allclose(item["scalars"][1:].numpy(), expected, atol=1e-5)
        flipped += was_flipped
    assert 0.2 * len(ds) < flipped < 0.8 * len(ds)


def test_without_a_heading_flips_are_off_and_the_log_and_table_say_so(copied_flights, caplog):
    root, entries, config = copied_flights
    with h5py.File(root / entries[0]["nav_file"], "r+") as f:
        del f["nav/trueHdg"]
    cfg = config()
    labels = cpl.read_flight_labels(cfg.data.flights[0], cfg.data)
    assert np.isnan(labels.heading_deg).all() and labels.counts["no_heading"] == labels.heights
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "data.keys.nav_heading 'nav/trueHdg' not in" in warned and "flip is off" in warned
    rows, ok = check_rows(cfg.data)
    assert ok and rows[0][-1] == "off: no heading" and rows[1][-1] == "on"
    c = load_caches(cfg.data)[0]
    ds = CloudDataset([c], fit_scalers([c]), augment=True, seed=1)
    for i in range(len(ds)):  # never flipped, azimuth unknown (no direction)
        np.testing.assert_array_equal(ds[i]["scalars"][1:].numpy(), [0.0, 0.0])
        assert not looks_flipped(ds[i]["frames"], c.frames.read(c.windows[i]))
    # with the ground azimuth the angle is still known; the flip still stays off
    ground = CloudDataset([c], fit_scalers([c]), augment=True, seed=1, sun_azimuth="ground")
    assert np.isnan(ground.mirror[0]).all()
    az = np.radians(c.saa_deg[0])
    np.testing.assert_allclose(ground[0]["scalars"][1:].numpy(), [np.sin(az), np.cos(az)], atol=1e-5)
