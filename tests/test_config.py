from pathlib import Path

import pytest
import yaml

from cloudml_lib.config import Config, build_config, load_config, save_config
from cloudml_lib.errors import ConfigError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_configs_folder_has_the_presets():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "colab_optimized_full.yaml", "colab_full_stable.yaml", "colab_optimized.yaml"} <= names


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
    assert c.channels == [32, 64, 128] and not c.model.gradient_checkpointing and not c.train.torch_compile
    assert c.train.batch_size == 16
    assert a.data.temporal_frames == b.data.temporal_frames == c.data.temporal_frames == 5


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"train\.epocs: unknown key; did you mean 'train\.epochs'"):
        build_config({"train": {"epocs": 3}})


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as e:
        build_config({"train": {"batch_size": "big", "learning_rate": 5.0}, "model": {"gradient_checkpoint": True},
                      "data": {"edge_policy": "wrap"}})
    msg = str(e.value)
    assert "4 problem(s)" in msg
    assert "train.batch_size: expected an integer, got 'big'" in msg
    assert "train.learning_rate: 5.0 is out of range; valid: 1e-07 to 1.0" in msg
    assert "did you mean 'model.gradient_checkpointing'" in msg
    assert "data.edge_policy: 'wrap' is not valid; choose one of 'shift', 'pad', 'drop'" in msg


def test_overrides_beat_file_beat_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"demo": True}, "train": {"epochs": 7, "batch_size": 4}}))
    cfg = load_config(path, ["train.epochs=3", "model.memory_optimized=true"])
    assert cfg.train.epochs == 3                  # override
    assert cfg.train.batch_size == 4              # file
    assert cfg.train.learning_rate == 1e-3        # default
    assert cfg.channels == [32, 64, 128]


def test_bad_override_syntax_is_explained():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["epochs3"])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_with_checkpointing_is_refused(mode):
    raw = {"data": {"demo": True}, "model": {"gradient_checkpointing": True},
           "train": {"torch_compile": True, "torch_compile_mode": mode}}
    with pytest.raises(ConfigError, match="static input data pointer changed"):
        build_config(raw)
    raw["model"]["gradient_checkpointing"] = False          # without checkpointing the mode is allowed
    assert build_config(raw).train.torch_compile_mode == mode


def test_flight_lists_are_checked(tiny_raw_config):
    raw = tiny_raw_config
    raw["data"]["validation_flights"] = ["12Feb25"]
    raw["data"]["flights"][1]["name"] = raw["data"]["flights"][0]["name"]
    del raw["data"]["flights"][0]["nav_file"]
    with pytest.raises(ConfigError) as e:
        build_config(raw)
    msg = str(e.value)
    assert "data.validation_flights: 12Feb25 not in data.flights" in msg
    assert "flight names must be unique" in msg
    assert "data.flights[0].nav_file: missing" in msg


def test_a_random_split_is_never_the_default(tiny_raw_config):
    from cloudml_lib.data.flights import resolve_flights
    tiny_raw_config["data"]["validation_flights"] = []
    cfg = build_config(tiny_raw_config)                 # a config alone may leave it to cross-validation
    with pytest.raises(ConfigError, match="name at least one flight to hold out"):
        resolve_flights(cfg.data)                        # a run refuses before any work


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
