import copy
import inspect
from contextlib import nullcontext

import pytest
import torch

from cloudml_lib.base.config import build_config
from cloudml_lib.core.network import model as model_mod
from cloudml_lib.core.network.compile import unwrap_model
from cloudml_lib.core.network.model import MultimodalRegressionModel, build_model, count_parameters
from cloudml_lib.core.run.checkpoint import to_cpu


def batch(b=4, t=3, h=32, w=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, h, w, generator=g), torch.randn(b, 3, generator=g)


def test_output_is_one_value_per_sample_even_for_one_sample():
    m = MultimodalRegressionModel([4, 8, 8]).eval()
    for b in (1, 3):
        frames, scalars = batch(b)
        assert m(frames, scalars).height.shape == (b,)


def test_widths_follow_memory_optimized():
    full = build_model(build_config({"data": {"demo": True}}))
    small = build_model(build_config({"data": {"demo": True}, "model": {"memory_optimized": True}}))
    assert full.encoder.blocks[2].conv.out_channels == 256
    assert small.encoder.blocks[2].conv.out_channels == 128
    assert 400_000 < count_parameters(full) < 600_000  # "about 0.5 M parameters"
    assert count_parameters(small) < count_parameters(full) / 2


def _step(m, frames, scalars):
    m.train()
    m(frames, scalars).height.pow(2).mean().backward()
    bn = {k: v.clone() for k, v in m.state_dict().items() if "running_" in k or "num_batches" in k}
    grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    return bn, grads


def test_checkpointing_changes_neither_batchnorm_statistics_nor_gradients():
    torch.manual_seed(0)
    plain = MultimodalRegressionModel([4, 8, 8], dropout=0.0)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    frames, scalars = batch()
    bn_a, g_a = _step(plain, frames, scalars)
    bn_b, g_b = _step(ckpt, frames, scalars)
    assert bn_a.keys() == bn_b.keys() and len(bn_a) == 9  # 3 BatchNorms x (mean, var, count)
    for k in bn_a:
        torch.testing.assert_close(bn_a[k], bn_b[k], rtol=0, atol=1e-6, msg=k)
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        torch.testing.assert_close(g_a[k], g_b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_without_the_freeze_recomputation_would_update_statistics_twice(monkeypatch):
    """The test above can fail: naive checkpointing counts every batch twice."""
    monkeypatch.setattr(model_mod, "frozen_batchnorm_stats", lambda module: nullcontext())
    torch.manual_seed(0)
    m = MultimodalRegressionModel([4, 8, 8])
    m.set_grad_checkpointing(True)
    bn, _ = _step(m, *batch())
    assert int(bn["encoder.blocks.0.bn.num_batches_tracked"]) == 2 * 3  # T=3 frames, twice each


def test_scalars_only_model_ignores_the_frames():
    m = MultimodalRegressionModel([4, 8, 8], scalars_only=True).eval()
    f1, s = batch(seed=1)
    f2, _ = batch(seed=2)
    assert torch.equal(m(f1, s).height, m(f2, s).height)


def test_model_module_has_no_device_amp_or_compile_code():
    """Compiling is applied from outside (compile.py); the model only asks whether it is being traced,
    to checkpoint in a way Dynamo can trace when a whole-model compile wraps it."""
    src = inspect.getsource(model_mod)
    for word in ("cuda", "autocast", "torch.compile(", "GradScaler", ".to("):
        assert word not in src, word


def test_compiled_wrapper_saves_plain_keys():
    m = MultimodalRegressionModel([4, 8, 8])
    compiled = torch.compile(m)  # wrapping is lazy: nothing is compiled by this test
    keys = list(to_cpu(dict(unwrap_model(compiled).state_dict())))
    assert keys == list(m.state_dict()) and not any("_orig_mod" in k for k in keys)
    p = next(m.parameters())
    assert (
        to_cpu(dict(unwrap_model(compiled).state_dict()))[next(iter(m.state_dict()))].data_ptr()
        != p.data_ptr()
    )  # a copy


@pytest.mark.parametrize("t", [1, 5])
def test_any_number_of_frames(t):
    m = MultimodalRegressionModel([4, 8, 8]).eval()
    assert m(*batch(t=t)).height.shape == (4,)
