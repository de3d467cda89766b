"""The torch backend's CLAHE (data/clahe.py) is scikit-image's, bit for bit, on the CPU: on random, smooth,
odd-sized, tiny and constant frames, on the demo flights' frames in batches, through a whole cache build (the
same key, the same float16 bytes), and a model trained on scikit-image frames scores the same on its frames
(issue 53). auto picks it where torch sees a CUDA GPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_preprocess import build, tiny_raw_config  # noqa: F401 - CLAHE on: this file's point

from cloudml_lib.base.errors import ConfigError
from cloudml_lib.data import clahe, er2, preprocess
from cloudml_lib.data.preprocess import SKIMAGE, Backend, FrameSpec, read_block, resolve_backend

TORCH_CPU = Backend("torch", "cpu")
# a model trained on scikit-image frames, fed the torch backend's: its scores may move by at most this much
# (the frames are the same bytes, so the measured change is 0)
MAX_R2_CHANGE = 0.005
MAX_MAE_CHANGE_M = 5.0


def skimage_clahe(x: np.ndarray, clip_limit: float) -> np.ndarray:
    from skimage import exposure

    return exposure.equalize_adapthist(x, clip_limit=clip_limit).astype(np.float32)


def frames(shape, seed: int = 0) -> np.ndarray:
    """(4, H, W) [0, 1] float32: uniform noise, a smooth field with noise, a coarse field, a narrow range."""
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[: shape[0], : shape[1]]
    smooth = np.sin(rows / 7.0) * np.cos(cols / 11.0) + 0.3 * rng.standard_normal(shape)
    coarse = np.round(rng.random(shape) * 5)
    narrow = 0.5 + 0.001 * rng.random(shape)
    out = np.stack([rng.random(shape), smooth, coarse, narrow]).astype(np.float32)
    lo, hi = out.min(axis=(1, 2), keepdims=True), out.max(axis=(1, 2), keepdims=True)
    return ((out - lo) / (hi - lo)).astype(np.float32)


@pytest.mark.parametrize("shape", [(64, 80), (97, 131), (13, 21), (7, 9), (2, 3), (440, 640)])
@pytest.mark.parametrize("clip_limit", [0.01, 0.0, 0.3])
def test_the_frames_are_scikit_image_s_bit_for_bit(shape, clip_limit):
    if shape == (440, 640) and clip_limit != 0.01:
        pytest.skip("the real size once, at the project's clip limit")
    x = frames(shape)
    ours = clahe.equalize_adapthist(torch.from_numpy(x), clip_limit).numpy()
    for i in range(len(x)):
        np.testing.assert_array_equal(ours[i], skimage_clahe(x[i], clip_limit))


def test_constant_frames():
    for value in (0.0, 0.5, 1.0):
        x = np.full((1, 30, 50), value, np.float32)
        ours = clahe.equalize_adapthist(torch.from_numpy(x), 0.01).numpy()
        np.testing.assert_array_equal(ours[0], skimage_clahe(x[0], 0.01))


def test_the_demo_frames_in_batches(tiny_config):
    flight = tiny_config.data.flights[0]
    spec = FrameSpec.of(tiny_config.data)
    ir = er2.flight_paths(flight, tiny_config.data)["ir"]
    block = read_block(str(ir), tiny_config.data.keys.ir_signal, flight.name, np.arange(40), spec, False)
    x = block.frames[~block.blank]  # (n, H, W) prepared: [0, 1] float32
    ours = clahe.equalize_adapthist(torch.from_numpy(x), spec.clip_limit, chunk=7).numpy()  # 7: chunks split
    reference = np.stack([skimage_clahe(f, spec.clip_limit) for f in x])
    assert float(np.abs(ours - reference).max()) == 0.0


def test_a_cache_built_by_torch_is_the_scikit_image_cache(tiny_config, tmp_path):
    tiny_config.data.flights = tiny_config.data.flights[:1]
    (sk,) = build(tiny_config, 0, tmp_path / "skimage", SKIMAGE)
    (to,) = build(tiny_config, 2, tmp_path / "torch", TORCH_CPU)
    assert sk.path.name == to.path.name  # one reading, one key: either cache serves either model
    a, b = (np.load(c.path / "frames.npy") for c in (sk, to))
    assert a.dtype == b.dtype == np.float16 and a.size > 10_000
    assert int((a.view(np.uint16) != b.view(np.uint16)).sum()) == 0  # differing float16 values
    assert (sk.backend, to.backend) == ("skimage", "torch")  # meta.json still says which made it
    assert to.meta["preprocess"]["device"] == "cpu"


def test_a_model_trained_on_scikit_image_frames_scores_the_same_on_torch_frames(
    tiny_run_copy, tmp_path, monkeypatch
):
    from cloudml_lib.science import evaluate

    run, _, _ = tiny_run_copy
    reference = evaluate.evaluate_run(run, write=False)
    # the torch backend on the CPU, building its own caches in an empty folder
    monkeypatch.setattr(evaluate, "resolve_backend", lambda *a, **k: TORCH_CPU)
    ours = evaluate.evaluate_run(run, write=False, cache_dir=str(tmp_path / "torch-cache"))
    assert (tmp_path / "torch-cache").is_dir()
    r2, mae = (reference["overall"][k] for k in ("r2", "mae_km"))
    assert abs(ours["overall"]["r2"] - r2) <= MAX_R2_CHANGE
    assert abs(ours["overall"]["mae_km"] - mae) * 1000 <= MAX_MAE_CHANGE_M
    assert ours["overall"] == reference["overall"]  # measured: the same numbers


def test_auto_picks_torch_where_there_is_a_cuda_gpu(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("cloudml_lib"), "propagate", True)  # a run's handler stops it
    caplog.set_level(logging.INFO, logger="cloudml_lib")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto") == resolve_backend("cuda") == Backend("torch", "cuda")
    assert resolve_backend("cpu") == SKIMAGE
    # a model trained on either half of the one reading takes the other: no warning
    assert resolve_backend("auto", trained="skimage") == Backend("torch", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto") == SKIMAGE
    assert resolve_backend("auto", trained="torch") == SKIMAGE
    assert "trained on" not in caplog.text
    with pytest.raises(ConfigError, match="cuda.*no CUDA GPU"):
        resolve_backend("cuda")
    monkeypatch.setattr(preprocess, "has_kornia", lambda: False)
    assert resolve_backend("auto", trained="kornia") == SKIMAGE  # an older kornia model: warned, named
    assert "trained on frames equalised by kornia, but skimage is used now" in caplog.text


def test_old_kornia_caches_keep_their_key(tiny_config):
    from cloudml_lib.data.cache import cache_key

    flight, data = tiny_config.data.flights[0], tiny_config.data
    keys = {b: cache_key(flight, data, Backend(b, "cpu")) for b in ("skimage", "torch", "kornia")}
    assert keys["skimage"] == keys["torch"] != keys["kornia"]
