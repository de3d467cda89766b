import numpy as np
import pytest
from conftest import fit_and_finish

from cloudml_lib.core.network.metrics import regression_metrics
from cloudml_lib.science.evaluate import evaluate_run


def test_metrics_on_known_numbers():
    true = np.array([1.0, 2.0, 3.0, 4.0])
    pred = np.array([1.5, 2.0, 2.5, 5.0])
    m = regression_metrics(true, pred)
    assert m["n"] == 4
    assert m["mae_km"] == pytest.approx(0.5)
    assert m["rmse_km"] == pytest.approx(np.sqrt((0.25 + 0 + 0.25 + 1) / 4))
    assert m["bias_km"] == pytest.approx(0.25)
    assert m["r2"] == pytest.approx(1 - 1.5 / 5.0)
    assert m["std_ratio"] == pytest.approx(pred.std() / true.std())
    assert regression_metrics(true, np.full(4, true.mean()))["r2"] == pytest.approx(0.0)
    assert regression_metrics(np.array([]), np.array([]))["n"] == 0


@pytest.mark.slow
def test_evaluate_reproduces_the_training_report(tiny_config, tmp_path):
    from cloudml_lib.train import Trainer

    report = fit_and_finish(Trainer(tiny_config, tmp_path / "run").setup())
    for name in ("predictions.csv", "plots/scatter.png"):
        (tmp_path / "run" / name).unlink()
    again = evaluate_run(tmp_path / "run")
    assert again["overall"]["r2"] == pytest.approx(report["overall"]["r2"], abs=1e-6)
    assert again["baseline"] == report["baseline"] and again["best_epoch"] == report["best_epoch"]
    assert (tmp_path / "run" / "predictions.csv").is_file() and (
        tmp_path / "run" / "plots" / "scatter.png"
    ).is_file()
