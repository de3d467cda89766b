import copy
from pathlib import Path

import pytest
import yaml
from conftest import fit_and_finish

from cloudml_lib.base.config import Config, build_config, load_config, save_config
from cloudml_lib.base.errors import ConfigError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_configs_folder_has_the_presets():
    names = {p.name for p in CONFIGS}
    assert {
        "demo.yaml",
        "colab_optimized_full.yaml",
        "colab_full_stable.yaml",
        "colab_optimized.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.data.temporal_frames >= 1


def test_presets_match_their_descriptions():
    a = load_config("configs/colab_optimized_full.yaml")
    b = load_config("configs/colab_full_stable.yaml")
    c = load_config("configs/colab_optimized.yaml")
    assert a.channels == [64, 128, 256] and a.model.gradient_checkpointing and a.train.torch_compile
    assert a.train.torch_compile_mode == "default" and a.train.batch_size == 20
    assert b.channels == [64, 128, 256] and not b.train.torch_compile and b.train.batch_size == 16
    assert c.channels == [32, 64, 128] and c.model.gradient_checkpointing and c.train.torch_compile
    assert c.train.batch_size == 16
    assert a.data.temporal_frames == b.data.temporal_frames == c.data.temporal_frames == 5


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"train\.epocs: unknown key; did you mean 'train\.epochs'"):
        build_config({"train": {"epocs": 3}})


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as e:
        build_config(
            {
                "train": {"batch_size": "big", "learning_rate": 5.0},
                "model": {"gradient_checkpoint": True},
                "data": {"edge_policy": "wrap"},
            }
        )
    msg = str(e.value)
    assert "4 problem(s)" in msg
    assert "train.batch_size: expected an integer or 'auto', got 'big'" in msg
    assert "train.learning_rate: 5.0 is out of range; valid: 1e-07 to 1.0" in msg
    assert "did you mean 'model.gradient_checkpointing'" in msg
    assert "data.edge_policy: 'wrap' is not valid; choose one of 'shift', 'pad', 'drop'" in msg


def test_overrides_beat_file_beat_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"demo": True}, "train": {"epochs": 7, "batch_size": 4}}))
    cfg = load_config(path, ["train.epochs=3", "model.memory_optimized=true"])
    assert cfg.train.epochs == 3  # override
    assert cfg.train.batch_size == 4  # file
    assert cfg.train.learning_rate == 1e-3  # default
    assert cfg.channels == [32, 64, 128]


def test_bad_override_syntax_is_explained():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["epochs3"])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_with_checkpointing_is_refused(mode):
    raw = {
        "data": {"demo": True},
        "model": {"gradient_checkpointing": True},
        "train": {"torch_compile": True, "torch_compile_mode": mode},
    }
    with pytest.raises(ConfigError, match="static input data pointer changed"):
        build_config(raw)
    raw["model"]["gradient_checkpointing"] = False  # without checkpointing the mode is allowed
    assert build_config(raw).train.torch_compile_mode == mode


def test_flight_lists_are_checked(tiny_raw_config):
    raw = tiny_raw_config
    raw["data"]["test_flights"] = ["12Feb25"]
    raw["data"]["flights"][1]["name"] = raw["data"]["flights"][0]["name"]
    del raw["data"]["flights"][0]["nav_file"]
    with pytest.raises(ConfigError) as e:
        build_config(raw)
    msg = str(e.value)
    assert "data.test_flights: 12Feb25 not in data.flights" in msg
    assert "flight names must be unique" in msg
    assert "data.flights[0].nav_file: missing" in msg


@pytest.mark.parametrize("name", ["../x", "/tmp/x", "..", "a\\b"])
def test_a_flight_name_is_a_plain_name_never_a_path(tiny_raw_config, name):
    """A flight's name names its cache folder: '../x' or an absolute path would write beyond the cache."""
    tiny_raw_config["data"]["flights"][1]["name"] = name
    with pytest.raises(ConfigError, match=r"data.flights\[1\].name: .* is not a plain name"):
        build_config(tiny_raw_config)


def test_a_random_split_is_never_the_default(tiny_raw_config):
    from cloudml_lib.data.flights import resolve_flights

    tiny_raw_config["data"]["test_flights"] = []
    cfg = build_config(tiny_raw_config)  # a config alone may leave it to cross-validation
    with pytest.raises(ConfigError, match="name at least one flight to test on"):
        resolve_flights(cfg.data)  # a run refuses before any work


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_saved_config_round_trips(tiny_config, tmp_path):
    save_config(tiny_config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.to_dict() == tiny_config.to_dict()


def test_duplicate_keys_binary_files_and_even_windows_are_refused(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  epochs: 3\ndata:\n  demo: true\ntrain:\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"key 'train' appears twice \(lines 1 and 5\)"):
        load_config(dup)
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  epochs: 3\n  epochs: 4\n")
    with pytest.raises(ConfigError, match=r"key 'epochs' appears twice \(lines 2 and 3\)"):
        load_config(nested)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(ConfigError, match="is not a UTF-8 text file"):
        load_config(binary)
    with pytest.raises(ConfigError, match="data.temporal_frames: 4 is even.*3 or 5"):
        load_config(None, ["data.temporal_frames=4", "data.demo=true"])


def test_the_loaded_config_is_never_changed_and_the_run_records_its_plan(tiny_raw_config, tmp_path):
    """What a run resolves (the flights found in data.dir, a measured batch size) is the run's plan, a derived
    config recorded in config.yaml and run.json; the config the user loaded stays as it was, through a fresh
    start, a resume, a fold of cross-validation and a moved data folder."""
    import json

    from cloudml_lib.commands.crossval import fold_config
    from cloudml_lib.core.machine.memory import CPU_AUTO_BATCH
    from cloudml_lib.train import Trainer

    raw = copy.deepcopy(tiny_raw_config)
    entries = raw["data"].pop("flights")
    raw["train"].update(batch_size="auto", epochs=1)
    cfg = build_config(raw)
    before = copy.deepcopy(cfg.to_dict())
    trainer = Trainer(cfg, tmp_path / "run").setup()
    trainer.fit()
    assert cfg.to_dict() == before and cfg.data.flights == [] and cfg.train.batch_size == "auto"
    assert trainer.cfg is not cfg and trainer.cfg.train.batch_size == CPU_AUTO_BATCH
    assert sorted(f.name for f in trainer.cfg.data.flights) == sorted(e["name"] for e in entries)
    plan = json.loads((tmp_path / "run" / "run.json").read_text())
    assert plan["batch_size"] == CPU_AUTO_BATCH and sorted(plan["flights"]) == sorted(
        e["name"] for e in entries
    )
    stored = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert stored["train"]["batch_size"] == CPU_AUTO_BATCH and len(stored["data"]["flights"]) == len(entries)
    fit_and_finish(Trainer(cfg, tmp_path / "run").setup())  # resumed (finished): still unchanged
    fold = fold_config(cfg, entries[0]["name"], scalars_only=True)
    assert (
        cfg.to_dict() == before and fold.data.test_flights == [entries[0]["name"]] and fold.model.scalars_only
    )
    from cloudml_lib.science.evaluate import load_run_model

    moved = load_run_model(tmp_path / "run", data_dir=str(tmp_path / "elsewhere")).cfg
    assert moved.data.dir == str(tmp_path / "elsewhere") and cfg.to_dict() == before


def test_each_setting_says_whether_a_resumed_run_may_change_it():
    from cloudml_lib.base.config import NEW, SAME, resume_rules
    from cloudml_lib.core.run.resume import compare_configs

    rules = resume_rules()
    assert (
        rules["train.epochs"] == NEW and rules["data.dir"] == NEW and rules["checkpoint.every_steps"] == NEW
    )
    assert rules["train.learning_rate"] == SAME and rules["data.temporal_frames"] == SAME
    assert rules["data.keys.ir_signal"] == SAME
    saved = build_config({"data": {"demo": True}}).to_dict()
    now = build_config({"data": {"demo": True}, "train": {"epochs": 3, "learning_rate": 0.5}}).to_dict()
    math, harmless = compare_configs(saved, now)
    assert [m.split(" ")[0] for m in math] == ["train.learning_rate"]
    assert [h.split(" ")[0] for h in harmless] == ["train.epochs"]
    del saved["train"]["height_loss_weight"]  # a setting an older version did not have: its default
    assert compare_configs(saved, build_config({"data": {"demo": True}}).to_dict()) == ([], [])


def _alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of YAML whose value, expanded, holds 9**9 (387 million) items: each list is nine
    references to the one before. Loading it is cheap (the lists are shared); printing it whole is not."""

    def level(k):
        if k == 0:
            return "&a0 [" + ",".join(["x"] * 9) + "]"
        return f"&a{k} [{level(k - 1)}," + ",".join([f"*a{k - 1}"] * 8) + "]"

    return level(levels - 1)


@pytest.mark.parametrize(
    "text, overrides",
    [
        (f"data:\n  swath_slice: {_alias_bomb()}\n", []),
        (f"train:\n  epochs: {_alias_bomb()}\n", []),
        ("train: {epochs: 1}\n", ["--set", f"data.test_flights={_alias_bomb()}"]),
    ],
)
def test_a_yaml_alias_bomb_gets_a_short_message(tmp_path, capsys, text, overrides):
    import time

    from cloudml_lib.commands.cli import main

    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    t0 = time.perf_counter()
    assert main(["labels", "--config", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 10  # unbounded, the message alone took 12 s and 0.5 GB
    assert len(err) < 2000 and "..." in err and "Traceback" not in err, len(err)
    assert err.startswith(f"error: {path}") and "has 1 problem(s)" in err


def test_values_yaml_cannot_hold_are_config_errors(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("data:\n  swath_slice: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nests lists or mappings too deeply"):
        load_config(deep)
    huge = tmp_path / "huge.yaml"
    huge.write_text("train:\n  epochs: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="a value YAML cannot read"):
        load_config(huge)
    with pytest.raises(ConfigError, match="train.epochs: expected an integer, got '9999.*\\.\\.\\.") as e:
        load_config(None, ["train.epochs=" + "9" * 5000])  # read as the text it is
    assert len(str(e.value)) < 400


def test_the_rows_left_after_downsampling_are_checked_naming_both_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.swath_slice=[0,60]", "data.downsample=8"])
    assert "data.swath_slice [0, 60] with data.downsample 8 leaves frames 7 rows high" in str(e.value)
    assert "set data.downsample to at most 7" in str(e.value)
    load_config(None, ["data.swath_slice=[0,64]", "data.downsample=8"])  # 8 rows: enough


@pytest.mark.parametrize("value", ["1e308", "1e400", ".nan", "-1e-3"])
def test_a_huge_or_impossible_number_from_set_is_out_of_range_naming_the_setting(value):
    """--set data.cbh_max_km=1e308 is a number YAML reads (YAML 1.2: 1e-3 too), out of the setting's range:
    the message names the key, the valid range and the --set it came from."""
    from cloudml_lib.base.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(Path(__file__).parent.parent / "configs" / "demo.yaml", [f"data.cbh_max_km={value}"])
    text = str(e.value)
    assert f"with --set 'data.cbh_max_km={value}'" in text
    assert "data.cbh_max_km:" in text and "out of range; valid: 0.0 to 20.0" in text


@pytest.mark.parametrize("swath, downsample", [([0, 6], 2), ([0, 20], 4), ([10, 12], 1), ([0, 20], 3)])
def test_the_advice_for_too_few_rows_is_enough_rows_after_the_downsampling(swath, downsample):
    """Following the advice gives a config that is accepted (with downsample 2 it named too few rows)."""
    from cloudml_lib.base.config import MIN_FRAME_SIDE

    raw = {"data": {"swath_slice": swath, "downsample": downsample}}
    with pytest.raises(ConfigError) as e:
        build_config(copy.deepcopy(raw))
    text = str(e.value)
    rows = int(text.split("keep at least ")[1].split(" rows")[0])
    assert rows == MIN_FRAME_SIDE * downsample
    raw["data"]["swath_slice"] = [swath[0], swath[0] + rows]
    build_config(raw)  # enough rows now
    if swath[1] - swath[0] >= MIN_FRAME_SIDE:
        at_most = int(text.split("set data.downsample to at most ")[1].split(",")[0])
        build_config({"data": {"swath_slice": swath, "downsample": at_most}})


def test_folders_expand_environment_variables_and_an_unset_one_is_refused_by_name(monkeypatch, tmp_path):
    """$TMPDIR/cache is each cluster machine's own disk; an unset variable stops the command before it
    starts, naming the key and the variable."""
    monkeypatch.setenv("CLOUDML_TEST_DISK", str(tmp_path))
    cfg = build_config({"data": {"cache_dir": "${CLOUDML_TEST_DISK}/cache", "dir": "$CLOUDML_TEST_DISK"}})
    assert cfg.data.cache_dir == str(tmp_path / "cache") and cfg.data.dir == str(tmp_path)
    monkeypatch.delenv("CLOUDML_TEST_DISK")
    with pytest.raises(ConfigError) as e:
        build_config({"data": {"cache_dir": "$CLOUDML_TEST_DISK/cache"}})
    assert (
        "data.cache_dir: '$CLOUDML_TEST_DISK/cache' names the environment variable $CLOUDML_TEST_DISK"
        in str(e.value)
    )
