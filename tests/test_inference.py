"""Each frame encoded once (inference.py) gives the numbers of the window-by-window path: whole flights
(predict), with the flight's ends, gaps (frames without angles or time) and T = 3, 5, 7, for the demo model
and a full-width model on real-size frames; label windows from the cache (evaluation, the cloud probe),
whose shared frames are encoded once; and a compiled encoder meets one batch shape.

"Same": heights within 1e-4 km, cloud probabilities within 1e-5 (the only differences are the order in
which floats are summed)."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch
from conftest import tiny_raw

from benchmarks.predict import predict_per_window
from cloudml_lib.base.config import build_config
from cloudml_lib.core.network import inference
from cloudml_lib.core.network.model import MultimodalRegressionModel
from cloudml_lib.data.dataset import CloudDataset, Scalers, n_scalar_inputs, prepare_data
from cloudml_lib.data.flights import resolve_config
from cloudml_lib.data.preprocess import SKIMAGE, FramePool
from cloudml_lib.data.synthetic import make_demo_flights
from cloudml_lib.science.predict import FlightPredictor, flights_to_predict, predict_flight

CPU = torch.device("cpu")
SCALERS = Scalers(45.0, 5.0, 1.0, 0.5)


def model_with_cloud(channels, head: str, seed: int = 0, scalars: int = 3) -> MultimodalRegressionModel:
    """A model of `scalars` scalar inputs (3: the angles alone; n_scalar_inputs(cfg.data.radiometry) for the
    samples of a cache)."""
    torch.manual_seed(seed)
    model = MultimodalRegressionModel(channels=channels, cloud_head=head, n_scalars=scalars)
    if head == "probe":  # a fitted probe: the model answers (B, 2)
        model.set_cloud_probe(torch.randn(channels[-1] + scalars) * 0.3, 0.1)
    # BatchNorm statistics away from their initial values, as in a trained model
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def both_paths(model, cfg, name: str, batch: int = 8):
    flight = flights_to_predict(cfg, [name])[name]
    with FramePool(0) as pool:
        ref_h, ref_p = predict_per_window(
            model, flight, cfg.data, SCALERS, CPU, batch, torch.no_grad, SKIMAGE, pool
        )
        predictor = FlightPredictor(model, SCALERS, CPU, batch, backend=SKIMAGE, pool=pool)
        new = predict_flight(predictor, flight, cfg.data)
    return ref_h, ref_p, new


def assert_same(ref_h, ref_p, new):
    at = new["frame_index"]
    np.testing.assert_array_equal(np.isfinite(ref_h[at]), np.isfinite(new["cbh_km"]))
    ok = np.isfinite(new["cbh_km"])
    assert np.abs(ref_h[at][ok] - new["cbh_km"][ok]).max() < 1e-4
    if new["cloud_probability"] is not None:
        assert np.abs(ref_p[at][ok] - new["cloud_probability"][ok]).max() < 1e-5


@pytest.fixture
def gappy_flights(tiny_flights, tmp_path):
    """The tiny flights, one of them with stretches of missing angles and frames without a usable time."""
    root, entries = tiny_flights
    data = tmp_path / "flights"
    shutil.copytree(root, data)
    with h5py.File(data / entries[0]["nav_file"], "a") as f:
        for key, stretch in (("nav/solarZenith", slice(50, 80)), ("nav/sunAzGrd", slice(60, 95))):
            values = f[key][()].astype("f8")
            values[stretch] = np.nan
            del f[key]
            f[key] = values
    with h5py.File(data / entries[0]["ir_file"], "a") as f:
        times = f["Time/TimeUTC"][()]
        times[[0, 1, 120, 239]] = 0  # no usable time: left out of the output
        f["Time/TimeUTC"][...] = times
    return data, entries


@pytest.mark.parametrize("t", [3, 5, 7])
@pytest.mark.parametrize("head", ["probe", "joint"])
@pytest.mark.slow
def test_a_whole_flight_encoded_once_equals_window_by_window(gappy_flights, tmp_path, t, head):
    data, entries = gappy_flights
    raw = tiny_raw(data, entries, tmp_path / "cache", clahe=True)
    raw["data"]["temporal_frames"] = t
    cfg = build_config(raw)
    model = model_with_cloud([4, 8, 8], head)
    ref_h, ref_p, new = both_paths(model, cfg, entries[0]["name"])
    assert new["counts"]["no_time"] == 4 and np.isnan(new["cbh_km"]).sum() == 0
    assert_same(ref_h, ref_p, new)
    assert new["cloud_probability"] is not None
    # the flight's ends: the first and last T // 2 frames use the window shifted inside the flight
    assert 239 - 1 in new["frame_index"] and 2 in new["frame_index"]


@pytest.mark.slow
def test_a_full_width_model_on_real_size_frames_gives_the_same_numbers(tmp_path):
    """Preset B's model (64/128/256) on 440 x 640 frames, T = 5, a flight of 7 frames (its two ends, each
    with windows shifted inside the flight: frames 0-1 and 5-6, and whole windows between: 2-4)."""
    entries = make_demo_flights(
        tmp_path / "flights", n_flights=2, seed=4, frames_per_flight=7, frame_shape=(512, 640)
    )
    raw = {
        "data": {
            "dir": str(tmp_path / "flights"),
            "flights": entries,
            "test_flights": [entries[1]["name"]],
            "temporal_frames": 5,
            "swath_slice": [40, 480],
        },
        "model": {"channels": [64, 128, 256]},
    }
    model = model_with_cloud([64, 128, 256], "probe", seed=1)
    ref_h, ref_p, new = both_paths(model, build_config(raw), entries[0]["name"], batch=6)
    assert_same(ref_h, ref_p, new)


@pytest.mark.parametrize("t", [3, pytest.param(5, marks=pytest.mark.slow), 7])  # 5: 5 s or more once
def test_label_windows_from_the_cache_are_encoded_once_with_the_same_outputs(
    tiny_flights, tmp_path, t, monkeypatch
):
    """Evaluation, the epoch's score and the cloud probe: label-centred windows; distinct frames encoded
    once."""
    root, entries = tiny_flights
    raw = tiny_raw(root, entries, tmp_path / "cache", clahe=True)
    raw["data"]["temporal_frames"] = t
    cfg, _ = resolve_config(build_config(raw))
    data = prepare_data(cfg)
    train_set, val_set = data.train_set, data.test_set  # a whole flight's samples
    model = model_with_cloud([4, 8, 8], "probe", scalars=n_scalar_inputs(cfg.data.radiometry))
    encoded = []
    real = model.encode_frames
    monkeypatch.setattr(model, "encode_frames", lambda frames: (encoded.append(len(frames)), real(frames))[1])
    matched = CloudDataset(
        train_set.caches, train_set.scalers, cloud=True
    )  # the probe's frames, no augmentation
    for dataset in (val_set, matched):
        indices = np.arange(len(dataset))[::-1][:41]  # any order, any subset
        for features in (False, True):
            encoded.clear()
            new, target = inference.predict(model, dataset, CPU, 8, indices=indices, features=features)
            ref, ref_target = inference._window_by_window(
                model.features if features else model, dataset, CPU, 8, torch.no_grad, indices, 0
            )
            np.testing.assert_array_equal(target, ref_target)
            pairs = [(new, ref)] if features else [(new[k], ref[k]) for k in ("height", "cloud_logit")]
            assert all(np.abs(a - b).max() < 1e-5 for a, b in pairs)
            windows = np.concatenate([c.windows for c in dataset.caches])[dataset._global()[indices]]
            assert sum(encoded) == len(np.unique(windows + 10_000 * dataset.flight_of[indices][:, None]))
    assert model.training is False


@pytest.mark.slow
def test_a_model_in_training_mode_is_scored_in_eval_mode_and_left_as_it_was(tiny_flights, tmp_path):
    root, entries = tiny_flights
    cfg, _ = resolve_config(build_config(tiny_raw(root, entries, tmp_path / "cache")))
    val_set = prepare_data(cfg).test_set
    model = model_with_cloud([4, 8, 8], "none", scalars=n_scalar_inputs(cfg.data.radiometry)).train()
    stats = [b.clone() for b in model.buffers()]
    inference.predict(model, val_set, CPU, 4)
    assert model.training and all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))


@pytest.mark.slow
def test_a_compiled_encoder_meets_one_batch_shape(tiny_flights, tmp_path):
    """compile.py compiles with static shapes: the last, partial batch of frames is padded, so scoring any
    number of samples compiles one graph for evaluation (no recompile per subset size)."""
    if shutil.which("g++") is None and shutil.which("clang++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    from cloudml_lib.core.network.compile import apply_compile

    root, entries = tiny_flights
    cfg, _ = resolve_config(build_config(tiny_raw(root, entries, tmp_path / "cache")))
    val_set = prepare_data(cfg).test_set
    model = model_with_cloud([4, 8, 8], "none", scalars=n_scalar_inputs(cfg.data.radiometry))
    eager, _ = inference.predict(model, val_set, CPU, 8)
    watch = apply_compile(model, True, "default", CPU)
    for n in (5, 13, len(val_set)):
        out, _ = inference.predict(model, val_set, CPU, 8, indices=np.arange(n))
        np.testing.assert_allclose(out["height"], eager["height"][:n], atol=1e-5)
    report = watch.update()
    assert report.graphs == 1 and report.recompiles == 0, report


def test_encodings_of_a_flight_are_small_whatever_its_length():
    """C float32 numbers per frame: a 12,000-frame flight of the full model holds 12 MB of encodings."""
    model = MultimodalRegressionModel(channels=[64, 128, 256])
    assert 12_000 * model.feature_width * 4 / 1e6 == pytest.approx(12.3, abs=0.1)
    frames = np.random.default_rng(0).normal(size=(10, 24, 32)).astype(np.float32)
    out = inference.encode_frames(model.eval(), frames, CPU, 4)
    assert out.shape == (10, 256) and out.dtype == np.float32


def test_out_of_gpu_memory_while_predicting_halves_the_frame_batch_and_changes_nothing(monkeypatch, caplog):
    model = MultimodalRegressionModel(channels=[4, 8, 8]).eval()
    frames = np.random.default_rng(1).normal(size=(9, 24, 32)).astype(np.float32)
    want = inference.encode_frames(model, frames, CPU, 9)
    real = inference.encode_frames

    def small_gpu(model, frames, device, batch, autocast):
        if batch > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, frames, device, batch, autocast)

    monkeypatch.setattr(inference, "encode_frames", small_gpu)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(__import__("logging").getLogger("cloudml_lib"), "propagate", True)
    encode = inference.StreamEncoder(model, CPU, 8)
    np.testing.assert_allclose(encode(frames), want, atol=1e-6)
    assert encode.batch == 2 and "encoding 2 frames at a time" in caplog.text
