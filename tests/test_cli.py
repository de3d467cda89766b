import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from conftest import REPO, run_cli

from cloudml_lib.commands.cli import main


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
    assert "IR file not found" in r.stderr and "GLOVE2025_IRAI_L1B_Rev-_20241104.h5" in r.stderr
    assert "data.skip_incomplete_flights: true" in r.stderr
    assert "Traceback" not in r.stderr


def test_usage_error_exits_2():
    r = run_cli("train")
    assert r.returncode == 2 and "--config" in r.stderr


@pytest.mark.slow
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
    name = tiny_raw_config["data"]["test_flights"][0]
    assert {"r2", "mae_km", "rmse_km", "n"} <= set(out["per_flight"][name])
    assert out["overall"]["n"] == out["per_flight"][name]["n"] > 0


@pytest.mark.slow
def test_data_dir_flag_overrides_the_config(tiny_raw_config, tiny_flights, tmp_path):
    tiny_raw_config["data"]["dir"] = str(tmp_path / "nowhere")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    r = run_cli(
        "train",
        "--config",
        str(cfg),
        "--run-dir",
        str(tmp_path / "run"),
        "--data-dir",
        str(tiny_flights[0]),
        "--set",
        "train.epochs=1",
    )
    assert r.returncode == 0, r.stderr


def test_evaluate_without_a_run_exits_2(tmp_path):
    r = run_cli("evaluate", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and "has no best.pt" in r.stderr


def test_make_demo_data_writes_the_real_layout(tmp_path):
    r = run_cli(
        "make-demo-data", "--out", str(tmp_path), "--flights", "2", "--frames", "40", "--size", "32x40"
    )
    assert r.returncode == 0, r.stderr
    # the train command it suggests has a run folder of its own (without one it would continue runs/demo)
    assert f"--set data.dir={tmp_path} --run-dir runs/{tmp_path.name}" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "01Mar25",
        "03Mar25",
    ]  # one folder per flight
    assert sorted(p.name for p in (tmp_path / "01Mar25").iterdir()) == [
        "CPL_L2_V1-02_01kmLay_900001_01mar25.hdf5",
        "CRS_20250301_nav.hdf",
        "ERA5_pressure_01Mar25_20250301.nc",  # generator 4: the flight's reanalysis beside it
        "ERA5_single_01Mar25_20250301.nc",
        "GLOVE2025_IRAI_L1B_Rev-_20250301-003.h5",
    ]
    assert (tmp_path / "03Mar25" / "GLOVE2025_IRAI_L1B_Rev-_20250303.h5").is_file()  # no revision suffix
    with h5py.File(tmp_path / "01Mar25" / "GLOVE2025_IRAI_L1B_Rev-_20250301-003.h5") as f:
        signal, t = f["Product/Signal"], f["Time/TimeUTC"][()]
        assert signal.shape == (40, 32, 40) and signal.dtype == np.dtype(">u2")  # big-endian counts
        assert t.shape == (43,) and 1.7e9 < np.median(t) < 1.8e9  # epoch s, longer than frames
    with h5py.File(tmp_path / "01Mar25" / "CPL_L2_V1-02_01kmLay_900001_01mar25.hdf5") as f:
        g = f["layer_descriptor"]
        julian, base, n = (
            g["Profile_Decimal_Julian_Day"][()],
            g["Layer_Base_Altitude"][()],
            g["Number_Layers"][()],
        )
        assert (
            julian.shape == (len(n), 3)
            and base.shape == (len(n), 10)
            and f["metadata_parameters/File_Year"][0] == b"2025"
        )
        assert np.all(np.diff(julian[:, 1]) * 86400 < 6)  # ~5 s apart
        two = n == 2
        assert two.any() and (base[two, 0] > base[two, 1]).all()  # layer 0 is the top one
        assert np.abs(g["Lidar_Surface_Altitude"][()][g["Lidar_Surface_Altitude"][()] > -999]).max() < 2  # km
        assert {"Solar_Zenith_Angle", "Solar_Azimuth_Angle", "CPL_Latitude"} <= set(f["geolocation"])
    with h5py.File(tmp_path / "01Mar25" / "CRS_20250301_nav.hdf") as f:
        assert set(f["nav"]) == {"solarZenith", "sunAzGrd", "trueHdg", "IWG_lat", "IWG_lon"}  # no time axis
        assert f["nav/solarZenith"].shape[0] != 40
    assert run_cli("make-demo-data", "--out", str(tmp_path), "--flights", "1").returncode == 2


def test_unexpected_errors_are_not_disguised(monkeypatch):
    from cloudml_lib.commands import cli

    monkeypatch.setattr(cli, "_evaluate", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # python -m then exits 1 with the traceback
        main(["evaluate", "--run-dir", "x"])


@pytest.mark.slow
def test_preset_auto_picks_the_demo_without_a_gpu(demo_flights):
    """Any command with --preset auto resolves it (cli.config_path): `labels` shows it without training (the
    demo preset's training is test_demo's, its flights written there)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto would pick A, B or C")
    r = run_cli("labels", "--preset", "auto", "--data-dir", str(demo_flights))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Preset auto: demo, because no CUDA GPU was found" in r.stdout + r.stderr
    assert "792 labels in 5 flights" in r.stdout  # the demo's five flights, read


def test_config_and_preset_are_exclusive():
    r = run_cli("train", "--preset", "A", "--config", "configs/demo.yaml")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_run_dir_that_is_a_file_is_explained(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    flights = tmp_path / "flights"
    r = run_cli("train", "--config", "configs/demo.yaml", "--run-dir", str(target), "--data-dir", flights)
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr and "Traceback" not in r.stderr
    assert target.read_text() == "keep me"
    assert not flights.exists()  # refused before the demo's flights were written


@pytest.mark.parametrize("command", ["train", "crossval", "sweep", "labels", "diagnose"])
def test_every_command_that_takes_a_config_takes_a_packaged_preset_from_any_folder(
    command, tmp_path, monkeypatch
):
    """--preset NAME works where --config FILE does, away from the checkout: the file comes from the
    package."""
    from cloudml_lib.commands import cli

    monkeypatch.chdir(tmp_path)
    extra = {"crossval": ["--run-dir", "cv"], "sweep": ["--trials", "1", "--run-dir", "sw"]}.get(command, [])
    args = cli.build_parser().parse_args([command, "--preset", "demo", *extra])
    path = cli.config_path(args)
    assert path.is_file() and path.name == "demo.yaml" and path.parent.name == "configs"
    seen = {}
    monkeypatch.setattr(
        "cloudml_lib.commands.sweep.sweep",
        lambda config, space, *a, **k: seen.update(config=config, space=space) or {},
    )
    if command == "sweep":  # --space left out: the packaged demo space
        assert cli.main(["sweep", "--preset", "demo", "--trials", "1", "--run-dir", "sw"]) == 0
        assert seen["config"] == path and Path(seen["space"]).as_posix().endswith("configs/sweeps/demo.yaml")


def test_a_config_path_from_the_checkout_used_elsewhere_names_the_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["labels", "--config", "configs/reproduce_published.yaml"]) == 2
    assert (
        "config file not found: configs/reproduce_published.yaml; that file comes with CloudML: use --preset "
        "published" in capsys.readouterr().err
    )
    assert (
        main(
            [
                "sweep",
                "--preset",
                "demo",
                "--space",
                "configs/sweeps/demo.yaml",
                "--trials",
                "1",
                "--run-dir",
                "sw",
            ]
        )
        == 2
    )
    assert "leave --space out to use it" in capsys.readouterr().err


# Every command of build_parser(), each with a bad argument (argparse's) and a missing file or folder (the
# command's own): exit 2, one paragraph on stderr, no traceback. In-process: one interpreter for them all.
BAD_ARGUMENTS = {
    "train": [["--config", "{t}/missing.yaml", "--run-dir", "{t}/run"], ["--config", "x", "--resume"]],
    "crossval": [
        ["--config", "{t}/missing.yaml", "--run-dir", "{t}/cv"],
        ["--config", "x"],
        ["--config", "x", "--run-dir", "{t}/cv", "--parallel", "0"],
    ],
    "sweep": [
        ["--config", "{t}/missing.yaml", "--trials", "1", "--run-dir", "{t}/sw"],
        ["--config", "x", "--trials", "many", "--run-dir", "{t}/sw"],
        ["--config", "x", "--trials", "2", "--parallel", "0", "--run-dir", "{t}/sw"],
        ["--config", "x", "--trials", "2", "--parallel", "two", "--run-dir", "{t}/sw"],
    ],
    "compare": [["{t}/nowhere"], []],
    "predict": [["--run-dir", "{t}/nowhere"], ["--run-dir", "{t}/nowhere", "--flights"]],
    "evaluate": [["--run-dir", "{t}/nowhere"], ["--run-dir", "{t}/nowhere", "--nope"]],
    "export": [["--run-dir", "{t}/nowhere"], ["--run-dir", "{t}/nowhere", "--out"]],
    "adapt": [["--run-dir", "{t}/nowhere"], ["--run-dir", "{t}/nowhere", "--labels", "many"]],
    "status": [["{t}/nowhere"], ["{t}/a", "{t}/b"]],
    "diagnose": [["--config", "{t}/missing.yaml"], ["--preset", "Z"]],
    "labels": [["--config", "{t}/missing.yaml"], ["--config", "x", "--preset", "demo"]],
    "make-demo-data": [["--out", "{t}/demo", "--size", "big"], ["--out", "{t}/demo", "--flights", "two"]],
    "fetch-era5": [["--config", "{t}/missing.yaml"], ["--preset", "demo", "--flights"]],
}


def test_every_command_is_covered_by_the_exit_status_test():
    from cloudml_lib.commands import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(BAD_ARGUMENTS)


@pytest.mark.parametrize("command", sorted(BAD_ARGUMENTS))
def test_a_bad_argument_or_missing_file_exits_2_with_one_paragraph(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args in BAD_ARGUMENTS[command]:
        argv = [command, *(a.format(t=tmp_path) for a in args)]
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own refusal
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2, (argv, out[-500:], err[-1000:])
        message = err[err.index("error: ") :]
        assert "Traceback" not in err and "\n\n" not in err.strip(), (argv, err)
        assert len(message) < 2000 and message.count("error: ") == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_labels_exits_2_naming_an_unusable_flight(tiny_raw_config, tmp_path, capsys):
    tiny_raw_config["data"]["flights"][1]["cpl_file"] = "nowhere/CPL_L2_missing.hdf5"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw_config))
    assert main(["labels", "--config", str(cfg)]) == 2
    out, err = capsys.readouterr()
    name = tiny_raw_config["data"]["flights"][1]["name"]
    assert f"\n{name} " in out  # the table is printed all the same
    assert f"error: 1 of 3 flights cannot be used ({name})" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_reader_that_leaves_the_pipe_early_is_no_error():
    """`diagnose | head -n 1`: the reader leaves; the command stops quietly, exit 141 (128 + SIGPIPE)
    as a shell would report it, without a traceback."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "cloudml_lib", "diagnose"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()  # before the command has written anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err
