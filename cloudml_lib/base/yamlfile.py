"""Reading a YAML file a user wrote (a config, a search space): UTF-8 text, a mapping at the top, no key
given twice; every problem a ConfigError that names the file, the line and what would be valid."""

from __future__ import annotations

from pathlib import Path

import yaml

from cloudml_lib.base.errors import ConfigError, shown


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(
                    f"{self.name}: key {shown(key)} appears twice (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); the second would silently replace the first. "
                    "Merge them into one."
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(
    path: str | Path,
    what: str = "--config",
    example: str = "configs/demo.yaml",
    sections: str = "sections data/model/train/checkpoint",
) -> dict:
    """A mapping from a YAML file the user wrote; every way it can be wrong is a ConfigError naming the
    file."""
    path = Path(path)
    if path.is_dir():
        examples = ", ".join(str(p) for p in sorted(path.glob("*.yaml"))[:4]) or f"e.g. {example}"
        raise ConfigError(f"{path} is a folder; {what} takes a YAML file in it ({examples})")
    if not path.is_file():
        from cloudml_lib.base.resources import packaged_alternative

        raise ConfigError(f"{what.lstrip('-')} file not found: {path}{packaged_alternative(path, what)}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not a UTF-8 text file (byte {e.start}: {e.reason}); a config is a YAML "
            f"text file such as {example}"
        ) from None
    try:
        loader = _UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    except ValueError as e:  # an integer of over 4300 digits (Python's limit on converting one)
        raise ConfigError(f"{path}: a value YAML cannot read ({shown(str(e), 200)})") from None
    except RecursionError:
        raise ConfigError(
            f"{path} nests lists or mappings too deeply to read; a config nests a few levels at most"
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected {sections} at the top level")
    return raw
