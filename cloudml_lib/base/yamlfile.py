"""Reading YAML, one loader for every place the kit reads it (config files, search spaces, `--set` values,
the config.yaml a run wrote): safe, no key given twice, and numbers by YAML 1.2's rule, so that `1e-3`, the
most common way to write a learning rate, is a number (PyYAML's YAML 1.1 rule reads it as text). A file a user
wrote (`read_yaml`): UTF-8 text, a mapping at the top; every problem a ConfigError that names the file, the
line and what would be valid."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cloudml_lib.base.errors import ConfigError, shown
from cloudml_lib.base.files import read_bytes

YAML_LIMIT = 16 << 20  # bytes: a config or a search space is a page of text


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently), and reads
    numbers as YAML 1.2 does: an exponent without a decimal point (1e-3, 2E5) is a float too."""

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


# YAML 1.2's float (its core schema): a mantissa with or without a dot, an optional exponent. Added after
# YAML 1.1's resolvers, so that what 1.1 reads as an integer, a boolean or a date stays as it was.
_FLOAT_1_2 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2, list("-+0123456789."))


# Brackets open at once that a document may hold: PyYAML's parser recurses per level (Python's recursion
# limit ends it near 500 levels) after a scan whose cost grows with the square of the depth (a second per
# hostile file); a config nests a few levels.
MAX_FLOW_DEPTH = 200
_BRACKETS = re.compile(r"[\[\]{}]")


def _deepest_flow(text: str) -> int:
    """The most `[` and `{` open at once (brackets inside quotes counted too: a bound, not a parse)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        depth = depth + 1 if m.group() in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def loads(text: str, name: str = "<text>"):
    """YAML text by the kit's one loader (SafeLoader, unique keys, YAML 1.2 numbers). Raises yaml.YAMLError,
    ConfigError (a key twice), ValueError (an integer of over 4300 digits) or RecursionError (nested too
    deep: over MAX_FLOW_DEPTH brackets at once, refused before parsing); the callers say which file or
    option."""
    if _deepest_flow(text) > MAX_FLOW_DEPTH:
        raise RecursionError(f"{name}: lists or mappings nested over {MAX_FLOW_DEPTH} deep")
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


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
        text = read_bytes(path, limit=YAML_LIMIT).decode("utf-8")  # a FIFO is refused, not waited on
    except OSError as e:
        raise ConfigError(
            f"{path} cannot be read ({e.strerror or e}); give a YAML file such as {example}"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not a UTF-8 text file (byte {e.start}: {e.reason}); a config is a YAML "
            f"text file such as {example}"
        ) from None
    try:
        raw = loads(text, str(path))
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
