"""Reading a recipe config: a YAML file's raw data, `key.sub=value` overrides on it, and the typed
sections built from it, every value checked against its field's type."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import typing
from pathlib import Path

import yaml

from .errors import ConfigError
from .renamed import move_renamed_keys, renamed_override_key

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def read_config_file(path: str | Path) -> dict:
    """A config file's raw data; a missing file is named with the configs that ship, a broken one with
    YAML's reason (ConfigError either way: the CLI prints it, no traceback)."""
    path = Path(path)
    if not path.is_file():
        shipped = ", ".join(f"recipes/configs/{p.name}" for p in sorted(SHIPPED_CONFIGS.glob("*.yaml")))
        raise ConfigError(f"{path}: no such config file; the configs that ship: {shipped}")
    try:
        with open(path) as f:
            data = coerce_numbers(yaml.safe_load(f) or {})
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping, got {data!r}")
    return move_renamed_keys(data, str(path))


# YAML 1.1 (PyYAML) reads "1e-6" as a string; numbers in scientific notation are meant as floats.
_SCIENTIFIC = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def coerce_numbers(node):
    if isinstance(node, dict):
        return {k: coerce_numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [coerce_numbers(v) for v in node]
    if isinstance(node, str) and _SCIENTIFIC.match(node.strip()):
        return float(node)
    return node


def apply_override(data: dict, item: str) -> None:
    """`a.b.c=value` into raw config data, value parsed as YAML (numbers, booleans, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, raw = item.split("=", 1)
    parts = renamed_override_key(key.strip()).split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    try:
        node[parts[-1]] = coerce_numbers(yaml.safe_load(raw)) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key.strip()}: the value {raw!r} is not YAML ({e.problem})") from e


# -- reading and checking ----------------------------------------------------------------------------

_KINDS = {int: "an int", float: "a float", str: "a string", bool: "true or false", dict: "a mapping",
          list: "a list"}


def build_section(cls, data, path: str = ""):
    """An instance of the dataclass `cls` from a mapping, each value checked against its field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'the config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {path + '.' if path else ''}{close[0]}?)" if close else ""
            raise ConfigError(f"{dotted}: unknown key{hint}; known: {', '.join(names)}")
        if dotted == "rollout.determinism" and value is False:
            value = "off"  # YAML 1.1 reads a bare `off` as false
        values[key] = _convert(value, hints[key], dotted)
    return cls(**values)


def _convert(value, hint, path: str):
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if dataclasses.is_dataclass(hint):  # a section, or an optional one (null: off)
        return build_section(hint, value, path)
    kind = typing.get_origin(hint) or hint
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and issubclass(kind, str):
        kind = str  # a string enum is read as text; its section converts it (RolloutConfig.determinism)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # `lr: 1` means 1.0
    if isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
        if kind is list and typing.get_args(hint):
            return [_convert(v, typing.get_args(hint)[0], f"{path}[{i}]") for i, v in enumerate(value)]
        return value
    expected = _KINDS.get(kind, kind.__name__)
    raise ConfigError(f"{path} must be {expected}{' or null' if optional else ''}, got {value!r}")

