"""Never crash where a safe choice exists: injected GPU out-of-memory, compile failures, NaN losses."""

import math

import pytest
import torch
from conftest import fit_and_finish

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.core.run.checkpoint import find_checkpoints, load_state
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.train import Trainer


def oom_above(limit, calls=None):
    """A forward that raises CUDA out-of-memory for micro-batches larger than `limit`."""

    def wrap(forward):
        def f(frames, scalars):
            if calls is not None and torch.is_grad_enabled():  # training calls (validation runs without grad)
                calls.append(len(frames))
            if len(frames) > limit:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected above {limit})")
            return forward(frames, scalars)

        return f

    return wrap


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_close(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, **tol)


def fit(cfg, run, *, forward_wrap=None, micro=None, eval_wrap=None):
    trainer = Trainer(cfg, run).setup()
    if micro is not None:
        trainer.progress.micro_batch_size = micro
    if forward_wrap is not None:
        trainer.forward = forward_wrap(trainer.forward)
    report = fit_and_finish(trainer)
    return trainer, report


@pytest.mark.slow
def test_oom_halves_the_micro_batch_and_matches_the_run_without_injection(tiny_config, tmp_path):
    """Injected OOM above 2 samples: the run completes in micro-batches of 2, with the batch size and LR
    of the plan, and its weights match an uninjected run that used micro-batches of 2 throughout."""
    calls = []
    tiny_config.train.batch_size = 8  # halved twice, to 4 then 2
    injected, report = fit(tiny_config, tmp_path / "a", forward_wrap=oom_above(2, calls))
    reference, _ = fit(tiny_config, tmp_path / "b", micro=2)
    assert report["overall"]["n"] > 0
    assert injected.progress.micro_batch_size == 2 and injected.progress.oom_recoveries == 2  # 8 -> 4 -> 2
    assert calls[:3] == [8, 4, 2] and max(calls[3:]) <= 2
    assert injected.progress.step == reference.progress.step == injected.total_steps
    assert injected.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    assert_close(weights(injected), weights(reference), rtol=1e-5, atol=1e-6)
    saved = load_state(find_checkpoints(RunFolder(tmp_path / "a"))[0] / "state.pt")
    assert saved["loop"]["micro_batch_size"] == 2
    log = (tmp_path / "a" / "train.log").read_text()
    assert "GPU out of memory at step 0: redoing the batch in micro-batches of 4 (batch size 8" in log


def test_micro_batches_keep_the_batch_math_without_batchnorm_coupling():
    """Without BatchNorm the split is exact: the gradients of 8 = 2 x 4 samples are the same."""
    from cloudml_lib.train import weighted_huber

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x, y, w = torch.randn(8, 3), torch.randn(8), torch.rand(8) + 0.5
    weighted_huber(lin(x).squeeze(1), y, w, 1.0, 0.0).backward()
    full = lin.weight.grad.clone()
    lin.zero_grad()
    for part in (slice(0, 4), slice(4, 8)):
        share = w[part].sum() / w.sum()
        (weighted_huber(lin(x[part]).squeeze(1), y[part], w[part], 1.0, 0.0) * share).backward()
    torch.testing.assert_close(lin.weight.grad, full)


@pytest.mark.slow
def test_oom_at_one_sample_stops_with_advice(tiny_config, tmp_path):
    with pytest.raises(
        CloudMLError, match="out of memory even with micro-batches of one sample. Use preset C"
    ):
        fit(tiny_config, tmp_path / "run", forward_wrap=oom_above(0))
    assert not (tmp_path / "run" / ".lock").exists()


def test_oom_during_validation_halves_the_evaluation_batch(tiny_config, tmp_path):
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    plain_loss, plain_metrics, plain_pred = trainer.validate()
    evaluated = trainer.evaluated  # the weights' average where there is one: what is validated
    encode = evaluated.encode_frames  # validation encodes frames, not windows

    def small_gpu(frames):
        if len(frames) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected above 3 frames)")
        return encode(frames)

    evaluated.encode_frames = small_gpu
    loss, metrics, pred = trainer.validate()
    trainer.close()
    assert trainer.progress.eval_batch_size == 2  # 10 -> 5 -> 2
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    torch.testing.assert_close(
        torch.from_numpy(pred.height_km), torch.from_numpy(plain_pred.height_km), rtol=1e-5, atol=1e-6
    )
    assert pred.cloud_prob is None and plain_pred.cloud_prob is None  # the probe is fitted when training ends


@pytest.mark.slow
def test_compile_failure_falls_back_to_eager_and_loses_nothing(tiny_config, tmp_path):
    """A compiled forward that breaks on its 3rd call ("static input data pointer changed")."""

    def broken_compiled(forward):
        n = {"calls": 0}

        def f(frames, scalars):
            n["calls"] += 1
            if n["calls"] >= 3:
                raise RuntimeError(
                    "static input data pointer changed.\ninput name: primals_1. data pointer "
                    "changed from 12919305216 to 12919242752."
                )
            return forward(frames, scalars)

        return f

    failing, _ = fit(tiny_config, tmp_path / "a", forward_wrap=broken_compiled)
    eager, _ = fit(tiny_config, tmp_path / "b")
    assert failing.forward is failing.model
    assert failing.progress.step == eager.progress.step
    assert_close(weights(failing), weights(eager), rtol=0, atol=0)  # bit-identical: nothing counted twice
    log = (tmp_path / "a" / "train.log").read_text()
    assert "torch.compile failed (RuntimeError: static input data pointer changed.)" in log
    assert "Continuing in eager mode from the same step; nothing is lost" in log


def test_errors_of_the_eager_model_are_not_swallowed(tiny_config, tmp_path):
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    trainer.model.forward = lambda *a: (_ for _ in ()).throw(ValueError("a real bug"))
    with pytest.raises(ValueError, match="a real bug"):
        trainer.fit()


def nan_on_calls(first, last=None):
    """A forward whose training outputs are NaN on its calls number first..last (all after, if None)."""

    def wrap(trainer):
        forward, n = trainer.forward, {"calls": 0}

        def f(frames, scalars):
            out = forward(frames, scalars)
            if torch.is_grad_enabled():
                n["calls"] += 1
                if n["calls"] >= first and (last is None or n["calls"] <= last):
                    return out._replace(height=out.height * float("nan"))
            return out

        trainer.forward = f

    return wrap


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_counted(tiny_config, tmp_path):
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    nan_on_calls(3, 4)(trainer)  # the 3rd and 4th batches give NaN
    report = fit_and_finish(trainer)
    assert trainer.progress.nonfinite_total == 2 and trainer.progress.nonfinite_in_a_row == 0
    assert trainer.progress.step == trainer.total_steps - 2  # two steps skipped, the rest taken
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert math.isfinite(report["overall"]["r2"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Non-finite loss at step 2" in log and "step skipped, weights unchanged" in log
    assert all(math.isfinite(h["train_loss"]) for h in trainer.progress.history)


def test_too_many_nonfinite_steps_stop_with_a_clear_message(tiny_config, tmp_path):
    tiny_config.train.max_nonfinite_steps = 3
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    nan_on_calls(2)(trainer)
    with pytest.raises(
        CloudMLError,
        match=r"3 optimizer steps in a row had a NaN or infinite loss .*"
        r"Lower train.learning_rate",
    ):
        trainer.fit()
    best = (
        torch.load(tmp_path / "run" / "best.pt", weights_only=True)
        if (tmp_path / "run" / "best.pt").exists()
        else None
    )
    assert best is None or all(
        torch.isfinite(v).all() for v in best["model"].values() if v.is_floating_point()
    )
    assert not (tmp_path / "run" / ".lock").exists()


@pytest.mark.slow
def test_loader_workers_do_not_change_the_result(tiny_config, tmp_path):
    tiny_config.train.epochs = 1
    a, _ = fit(tiny_config, tmp_path / "a")
    tiny_config.data.num_workers = 1
    b, _ = fit(tiny_config, tmp_path / "b")
    assert b.num_workers == 1
    assert_close(weights(a), weights(b), rtol=0, atol=0)


def test_epoch_line_reports_memory(tiny_config, tmp_path):
    tiny_config.train.epochs = 1
    fit(tiny_config, tmp_path / "run")
    log = (tmp_path / "run" / "train.log").read_text()
    assert "| peak RSS " in log and " GiB" in log
    import json

    epoch = [
        json.loads(x)
        for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"kind": "epoch"' in x
    ][0]
    assert epoch["memory"]["peak_rss_gib"] > 0.05
