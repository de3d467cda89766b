import numpy as np
import pytest
import torch

from cloudml_lib.base.errors import DataError
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.dataset import (
    CloudDataset,
    EpochBatchSampler,
    augment_sample,
    fit_scalers,
    quick_subset,
)
from cloudml_lib.data.splits import choose_split


def datasets(cfg):
    """(the parts trained on, the validation parts, their scalers), as prepare_data splits them."""
    fit, val, _ = choose_split(load_caches(cfg.data), cfg.data).parts(load_caches(cfg.data))
    return fit, val, fit_scalers(fit)


def test_scalers_are_fitted_on_the_part_trained_on_alone(tiny_config):
    caches = load_caches(tiny_config.data)
    fit, val, test = choose_split(caches, tiny_config.data).parts(caches)
    assert [c.name for c in test] == tiny_config.data.test_flights
    assert not {c.name for c in fit + val} & {c.name for c in test}
    scalers = fit_scalers(fit)
    fit_cbh = np.concatenate([c.cbh_km[c.has_height] for c in fit])  # heights only: NaN is "no height"
    for other in (val, test):  # the validation blocks and the test flight are never fitted on
        all_cbh = np.concatenate([c.cbh_km[c.has_height] for c in fit + other])
        assert scalers.cbh_mean != float(all_cbh.astype(np.float64).mean())
    assert scalers.cbh_mean == float(fit_cbh.astype(np.float64).mean())


def test_the_radiometric_scale_is_fitted_on_the_part_trained_on_alone(tiny_config):
    """A test flight (or a validation block) with its temperatures shifted changes no scaler; a flight trained
    on does (the check can fail); the shifted flight's own statistics reach its inputs on the fitted scale."""
    from cloudml_lib.data.dataset import split_data
    from cloudml_lib.data.preprocess import STAT_NAMES

    caches = load_caches(tiny_config.data)
    split = choose_split(caches, tiny_config.data)
    fit, val, test = split.parts(caches)
    first = split_data(tiny_config, caches)
    assert first.train_set.scalers.radiometry and tiny_config.data.radiometry == "statistics"

    def shifted(names):
        out = []
        for c in caches:
            c = c.part(np.arange(len(c)))
            if c.name in names:
                warmer = np.float32(40.0) * (np.array(STAT_NAMES) != "std")  # 40 K warmer, the same spread
                c.frame_stats = c.frame_stats + warmer
            out.append(c)
        return split_data(tiny_config, out)

    for others in ({c.name for c in test}, {c.name for c in val} - {c.name for c in fit}):
        again = shifted(others)
        assert again.train_set.scalers == first.train_set.scalers, others
    assert shifted({fit[0].name}).train_set.scalers != first.train_set.scalers
    moved = shifted({c.name for c in test}).test_set
    s = first.test_set.scalers
    before, after = first.test_set.inputs(np.arange(3))[0], moved.inputs(np.arange(3))[0]
    assert before.shape == (3, 3 + len(STAT_NAMES))
    np.testing.assert_allclose(after[:, 3:-1] - before[:, 3:-1], 40.0 / s.radiometry_scale, rtol=1e-4)
    np.testing.assert_array_equal(after[:, -1], before[:, -1])  # a spread does not move with the level


def test_a_run_without_radiometry_sees_the_angles_alone_and_old_scalers_load(tiny_config):
    from dataclasses import replace

    from cloudml_lib.data.dataset import Scalers

    train, _, scalers = datasets(tiny_config)
    assert not scalers.radiometry and set(scalers.to_dict()) == {"sza_mean", "sza_std", "cbh_mean", "cbh_std"}
    assert CloudDataset(train, scalers)[0]["scalars"].shape == (3,)
    old = Scalers.from_dict({"sza_mean": 1.0, "sza_std": 2.0, "cbh_mean": 0.5, "cbh_std": 0.3})  # 0.3's
    assert not old.radiometry
    both = replace(scalers, radiometry_offset=280.0, radiometry_scale=4.0, radiometry_units="K")
    assert Scalers.from_dict(both.to_dict()) == both
    both.check_units("K", "flight F")  # the same units: read
    with pytest.raises(DataError, match="flight F: its IR file states its numbers in counts, but this model"):
        both.check_units("counts", "flight F")
    scalers.check_units("counts", "flight F")  # a model that never saw a temperature reads any file


def test_items_are_standardised_and_nan_angles_filled(tiny_config):
    train, _, scalers = datasets(tiny_config)
    train[0].sza_deg[0] = np.nan
    ds = CloudDataset(train, scalers)
    item = ds[0]
    assert item["frames"].shape == (3, 32, 48) and item["frames"].dtype == torch.float32
    assert item["scalars"][0].item() == 0.0  # filled with the training mean
    assert item["scalars"].shape == (3,)  # zenith, sine and cosine of the azimuth
    az = np.radians((train[0].saa_deg[0] - train[0].heading_deg[0]) % 360)  # relative to the heading
    np.testing.assert_allclose(item["scalars"][1:].numpy(), [np.sin(az), np.cos(az)], atol=1e-6)
    expected = (train[0].cbh_km[0] - scalers.cbh_mean) / scalers.cbh_std
    assert abs(item["target"].item() - expected) < 1e-5


@pytest.mark.slow
def test_augmentation_is_deterministic_per_seed_epoch_and_sample(tiny_config):
    train, _, scalers = datasets(tiny_config)
    ds = CloudDataset(train, scalers, augment=True, seed=7)
    a, b = ds[3], ds[3]
    assert torch.equal(a["frames"], b["frames"]) and torch.equal(a["scalars"], b["scalars"])
    clean = CloudDataset(train, scalers, augment=False)[3]["frames"]
    differs = [not torch.equal(ds[i]["frames"], CloudDataset(train, scalers)[i]["frames"]) for i in range(8)]
    assert all(differs)  # jitter always applies
    ds.set_epoch(1)
    assert not torch.equal(ds[3]["frames"], a["frames"])  # a new epoch, new augmentation
    assert not torch.equal(clean, a["frames"])


def test_flip_mirrors_frames_and_azimuth(monkeypatch):
    from cloudml_lib.data import dataset as ds_mod

    monkeypatch.setattr(ds_mod, "FLIP_PROB", 1.0)
    monkeypatch.setattr(ds_mod, "ERASE_PROB", 0.0)
    monkeypatch.setattr(ds_mod, "CONTRAST", 0.0)
    monkeypatch.setattr(ds_mod, "BRIGHTNESS", 0.0)
    frames = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    out, az = augment_sample(frames, 100.0, np.random.default_rng(0), 0.0)  # relative azimuth, flight axis
    assert az == 260.0
    assert torch.equal(out, frames.flip(-1))
    assert (
        augment_sample(frames, 100.0, np.random.default_rng(0), 30.0)[1] == 320.0
    )  # ground: 2 * heading - a
    assert (
        augment_sample(frames, 100.0, np.random.default_rng(0), 90.0)[1] == 80.0
    )  # across the cross-track axis
    out, az = augment_sample(frames, 100.0, np.random.default_rng(0), None)  # no heading: never flipped
    assert az == 100.0 and torch.equal(out, frames)


def test_erasing_blanks_one_rectangle_in_every_frame(monkeypatch):
    from cloudml_lib.data import dataset as ds_mod

    monkeypatch.setattr(ds_mod, "FLIP_PROB", 0.0)
    monkeypatch.setattr(ds_mod, "ERASE_PROB", 1.0)
    frames = torch.ones(3, 20, 30)
    out, _ = augment_sample(frames, 50.0, np.random.default_rng(1), 0.0)
    zero = out == 0
    assert zero.any() and torch.equal(zero[0], zero[1]) and torch.equal(zero[0], zero[2])
    assert 0.01 < zero[0].float().mean() < 0.15


def test_validation_samples_are_never_augmented(tiny_config):
    _, val, scalers = datasets(tiny_config)
    ds = CloudDataset(val, scalers)
    np.testing.assert_array_equal(
        ds[0]["frames"].numpy(), val[0].frames.read(val[0].windows[0]).astype(np.float32)
    )


def test_epoch_order_depends_only_on_seed_and_epoch():
    s1, s2 = EpochBatchSampler(50, 8, seed=3), EpochBatchSampler(50, 8, seed=3)
    s1.set_epoch(2)
    s2.set_epoch(2)
    assert list(s1) == list(s2)
    s2.set_epoch(3)
    assert list(s1) != list(s2)
    s2.set_epoch(2, start_batch=4)
    assert list(s2) == list(s1)[4:] and len(s2) == len(s1) - 4
    assert sorted(i for b in s1 for i in b) == list(range(50))


def test_a_last_batch_of_one_is_merged():
    s = EpochBatchSampler(17, 8, seed=0)
    sizes = [len(b) for b in s]
    assert sizes == [8, 9] and len(s) == 2
    assert sorted(i for b in s for i in b) == list(range(17))
    assert [s.samples_before(b) for b in (0, 1, 2)] == [0, 8, 17]  # resume positions in samples


@pytest.mark.parametrize("world", [2, 3])
def test_each_process_takes_its_part_of_the_same_global_batches(world):
    one = EpochBatchSampler(51, 8, seed=3)  # a last batch of 3: no merge either way
    parts = [EpochBatchSampler(51, 8, seed=3, rank=r, world=world) for r in range(world)]
    for s in (one, *parts):
        s.set_epoch(2, start_batch=1)
    per_rank = [list(p) for p in parts]
    assert all(len(p) == len(one) == one.batches_per_epoch() - 1 for p in parts)
    for k, batch in enumerate(one):  # the order does not depend on the process count
        assert [i for p in per_rank for i in p[k]] == batch
        assert max(len(p[k]) for p in per_rank) - min(len(p[k]) for p in per_rank) <= 1


def test_a_last_batch_smaller_than_the_process_count_is_merged():
    s = EpochBatchSampler(18, 8, seed=0, rank=0, world=3)  # 8, 8, 2: the 2 go to the batch before
    assert [len(b) for b in s.batches(0)] == [8, 10] and s.batches_per_epoch() == 2
    assert [len(b) for b in s] == [3, 4]


def test_quick_subset_is_fixed_and_evenly_spread():
    a = quick_subset(100, 0.1)
    assert a.tolist() == quick_subset(100, 0.1).tolist()
    assert len(a) == 10 and a[0] == 0 and a[-1] == 99
    assert len(quick_subset(3, 0.1)) == 1


def test_the_atmosphere_is_scaled_on_the_part_trained_on_alone(tiny_config):
    """data.atmosphere: each predictor standardised over the part trained on; a test flight (or a validation
    block) with a shifted atmosphere changes no scaler, a flight trained on does (the check can fail); the
    shifted flight's own predictors reach its inputs on the fitted scale, after the angles and statistics."""
    from dataclasses import replace

    from cloudml_lib.base.config import derive
    from cloudml_lib.data.dataset import Scalers, split_data
    from cloudml_lib.data.preprocess import STAT_NAMES

    cfg = derive(tiny_config, {"data.atmosphere": "with_frames"})
    names = ("lcl_height", "sea_air_difference")
    rng = np.random.default_rng(0)
    caches = [
        replace(c, atmosphere=rng.normal([600.0, 1.0], [80.0, 1.0], (len(c), 2)), atmosphere_names=names)
        for c in load_caches(cfg.data)
    ]
    split = choose_split(caches, cfg.data)
    fit, val, test = split.parts(caches)
    first = split_data(cfg, caches)
    s = first.train_set.scalers
    values = np.concatenate([c.atmosphere for c in fit])
    assert s.atmosphere == list(names)
    np.testing.assert_allclose(s.atmosphere_mean, values.mean(0)) and np.testing.assert_allclose(
        s.atmosphere_std, values.std(0)
    )
    assert Scalers.from_dict(s.to_dict()) == s  # stored with the others, read back the same

    def shifted(flights):
        out = [c.part(np.arange(len(c))) for c in caches]
        return split_data(
            cfg, [replace(c, atmosphere=c.atmosphere + [300.0, 2.0]) if c.name in flights else c for c in out]
        )

    for others in ({c.name for c in test}, {c.name for c in val} - {c.name for c in fit}):
        assert shifted(others).train_set.scalers == s, others
    assert shifted({fit[0].name}).train_set.scalers != s
    before, after = (
        first.test_set.inputs(np.arange(3))[0],
        shifted({c.name for c in test}).test_set.inputs(np.arange(3))[0],
    )
    width = 3 + len(STAT_NAMES)
    assert before.shape == (3, width + 2)
    moved = np.tile(np.array([300.0, 2.0]) / s.atmosphere_std, (3, 1))
    np.testing.assert_allclose(after[:, width:] - before[:, width:], moved, rtol=1e-4)
    np.testing.assert_array_equal(after[:, :width], before[:, :width])
    item = first.test_set[0]["scalars"]
    np.testing.assert_allclose(item.numpy(), before[0], rtol=1e-6)  # __getitem__ and inputs agree
    # a frame without a position takes the training mean (0), never a NaN
    caches[0].atmosphere[0] = np.nan
    assert np.isfinite(split_data(cfg, caches).train_set.inputs(np.arange(5))[0]).all()
    # a predictor that barely varies over the part trained on (one flight's atmosphere) is scaled by the
    # size of a reanalysis' error at a point, not by almost nothing: another flight stays a few spreads away
    narrow = [
        replace(c, atmosphere=c.atmosphere * [1.0, 0.0] + [0.0, 1.0 + 1e-3 * rng.random()]) for c in caches
    ]
    assert split_data(cfg, narrow).train_set.scalers.atmosphere_std[1] == 0.5
    # scalers of a run before the setting, and a damaged record, named
    assert (
        Scalers.from_dict({"sza_mean": 1.0, "sza_std": 2.0, "cbh_mean": 0.5, "cbh_std": 0.3}).atmosphere
        is None
    )
    with pytest.raises(ValueError, match="one finite mean and one positive spread"):
        Scalers.from_dict({**s.to_dict(), "atmosphere_std": [1.0, -1.0]})
