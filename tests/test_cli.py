import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import yaml

from cloudml_lib.cli import main

REPO = Path(__file__).parent.parent


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "cloudml_lib", *args], cwd=cwd, capture_output=True, text=True)


def test_bad_config_exits_2_with_a_short_message(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"demo": True}, "train": {"epocs": 3, "batch_size": 0}}))
    r = run_cli("train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2
    assert "train.epocs: unknown key; did you mean 'train.epochs'?" in r.stderr
    assert "train.batch_size: 0 is out of range; valid: 1 to 4096" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_flight_file_exits_2_naming_it(tiny_raw_config, tmp_path):
    tiny_raw_config["data"]["flights"][1]["ir_file"] = "GLOVE2025_IRAI_L1B_Rev-_20241104.h5"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    r = run_cli("train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2
    assert "missing ir file" in r.stderr and "GLOVE2025_IRAI_L1B_Rev-_20241104.h5" in r.stderr
    assert "Traceback" not in r.stderr


def test_usage_error_exits_2():
    r = run_cli("train")
    assert r.returncode == 2 and "--config" in r.stderr


def test_train_then_evaluate_json(tiny_raw_config, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    r = run_cli("train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--set", "train.epochs=1")
    assert r.returncode == 0, r.stderr
    assert "Epoch 1/1 |" in r.stdout
    r = run_cli("evaluate", "--run-dir", str(tmp_path / "run"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("overall", "baseline"):
        assert {"r2", "mae_km", "rmse_km", "n"} <= set(out[key])
    name = tiny_raw_config["data"]["validation_flights"][0]
    assert {"r2", "mae_km", "rmse_km", "n"} <= set(out["per_flight"][name])
    assert out["overall"]["n"] == out["per_flight"][name]["n"] > 0


def test_data_dir_flag_overrides_the_config(tiny_raw_config, tiny_flights, tmp_path):
    tiny_raw_config["data"]["dir"] = str(tmp_path / "nowhere")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    r = run_cli("train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--data-dir",
                str(tiny_flights[0]), "--set", "train.epochs=1")
    assert r.returncode == 0, r.stderr


def test_evaluate_without_a_run_exits_2(tmp_path):
    r = run_cli("evaluate", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and "has no best.pt" in r.stderr


def test_make_demo_data_writes_the_real_layout(tmp_path):
    r = run_cli("make-demo-data", "--out", str(tmp_path), "--flights", "2", "--frames", "20", "--size", "32x40")
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 6
    ir = next(tmp_path.glob("*_IRAI_L1B_*.h5"))
    cpl = next(tmp_path.glob("CPL_L2_*_01kmLay_*.hdf5"))
    nav = next(tmp_path.glob("CRS_*_nav.hdf"))
    with h5py.File(ir) as f:
        assert f["Product/Signal"].shape == (20, 32, 40) and f["Time/TimeUTC"].shape == (20,)
    with h5py.File(cpl) as f:
        g = f["layer_descriptor"]
        assert {"Profile_Decimal_Julian_Day", "Layer_Base_Altitude", "Lidar_Surface_Altitude",
                "DEM_Surface_Altitude"} <= set(g)
        base = g["Layer_Base_Altitude"][()]
        assert base.ndim == 2 and (base[:, 0] == -9999).any() and (g["DEM_Surface_Altitude"][()] > 0).any()
    with h5py.File(nav) as f:
        assert {"solarZenith", "sunAzGrd", "IWG_lat", "IWG_lon"} <= set(f["nav"])
    assert run_cli("make-demo-data", "--out", str(tmp_path), "--flights", "1").returncode == 2


def test_unexpected_errors_are_not_disguised(monkeypatch):
    from cloudml_lib import cli
    monkeypatch.setattr(cli, "_evaluate", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):           # python -m then exits 1 with the traceback
        main(["evaluate", "--run-dir", "x"])


def test_preset_auto_picks_the_demo_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto would pick A, B or C")
    r = run_cli("train", "--preset", "auto", "--run-dir", str(tmp_path / "run"), "--set", "train.epochs=1",
                "--set", f"data.dir={tmp_path / 'flights'}", "--set", f"data.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Preset auto: demo, because no CUDA GPU was found" in r.stdout
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["channels"] == [16, 32, 64]


def test_config_and_preset_are_exclusive():
    r = run_cli("train", "--preset", "A", "--config", "configs/demo.yaml")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_run_dir_that_is_a_file_is_explained(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    r = run_cli("train", "--config", "configs/demo.yaml", "--run-dir", str(target))
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr and "Traceback" not in r.stderr
    assert target.read_text() == "keep me"
