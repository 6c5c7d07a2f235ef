"""Settings declared once: a config dataclass field carries its default, its help text and its
flag, and everything else is derived from it: the command-line options (fsdpkit_cli builds
them), reading a config file, and writing the effective config back as TOML.

    @dataclass(frozen=True)
    class OptimizerConfig:
        lr: float = setting(3e-3, "Peak learning rate.")

A config is a tree of sections; in a config file each section is a TOML table and its keys are
the field names (`[optimizer]` / `lr = 0.003`). Values are checked against the field's type
(a wrong type or an unknown key is a UsageError naming the key); the section's own
`__post_init__` then checks the values themselves.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import UsageError

_METADATA_KEY = "fsdpkit.setting"


@dataclass(frozen=True)
class Setting:
    """One key of a section: its type, default and how it looks on the command line."""

    key: str
    type: Any
    default: Any
    help: str
    panel: str = ""  # help panel of the command line ("" = the section's)
    flag: str = ""  # the long flag ("" = --key-with-dashes)
    off_flag: str = ""  # booleans: the flag that sets False ("" = --no-<flag>)
    short: str = ""  # a one-letter alias, e.g. -b
    choices: tuple[str, ...] = ()  # for a str setting: the values it takes (the config checks them)
    metavar: str = ""  # what the help shows for the value ("" = its type)
    shown_default: str = ""  # the default as the help shows it ("" = the default itself)
    parse: Callable[[str], Any] | None = None  # text (a flag or a string in a file) -> value

    @property
    def long_flag(self) -> str:
        return self.flag or "--" + self.key.replace("_", "-")


def setting(default: Any, help: str, **options: Any) -> Any:
    """A dataclass field that is also a setting; `options` are Setting's optional fields."""
    return field(default=default, metadata={_METADATA_KEY: {"help": help, **options}})


def settings_of(cls: type) -> tuple[Setting, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(
        Setting(key=f.name, type=hints[f.name], default=f.default, **f.metadata[_METADATA_KEY])
        for f in fields(cls)
        if _METADATA_KEY in f.metadata
    )


@dataclass(frozen=True)
class Section:
    """A group of settings that builds one object (a config dataclass, usually)."""

    name: str
    panel: str
    settings: tuple[Setting, ...]
    build: Callable[..., Any]  # build(**values) -> object; absent keys take their defaults
    values_of: Callable[[Any], dict[str, Any]]  # object -> {key: value}, the inverse of build

    @classmethod
    def of(cls, name: str, config_class: type, *, panel: str) -> Section:
        settings = settings_of(config_class)
        return cls(name, panel, settings, config_class, lambda obj: {s.key: getattr(obj, s.key) for s in settings})

    def from_values(self, values: Mapping[str, Any], *, where: str) -> Any:
        known = {s.key: s for s in self.settings}
        for key in values:
            if key not in known:
                raise UsageError(f"unknown setting {self.qualified(key)!r}{where}")
        return self.build(**{key: coerce(known[key], value, name=self.qualified(key)) for key, value in values.items()})

    def plain_values(self, obj: Any) -> dict[str, Any]:
        """The object's settings as a config file writes them (enums as strings, tuples as lists)."""
        values = self.values_of(obj)
        return {s.key: _plain(values[s.key]) for s in self.settings}

    def qualified(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key


def coerce(spec: Setting, value: Any, *, name: str) -> Any:
    """`value` (from a flag or a config file) as the setting's type; UsageError naming `name`."""
    if isinstance(value, str) and spec.parse is not None:
        value = spec.parse(value)
    return _coerce(spec.type, value, name)


def _coerce(kind: Any, value: Any, name: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, name)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"setting {name!r} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, name) for v in value)
        if len(value) != len(args):
            raise UsageError(f"setting {name!r} must have {len(args)} values, got {len(value)}: {value!r}")
        return tuple(_coerce(a, v, name) for a, v in zip(args, value, strict=True))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in kind)
            raise UsageError(f"unknown {name} {value!r}: use one of {choices}") from None
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))
    raise UsageError(f"setting {name!r} must be {expected}, got {value!r}")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def to_toml(values: Mapping[str, Any], *, header: str = "") -> str:
    """Top-level keys, then one table per section. A None value (unset, its default) is written
    as a comment so that every key shows."""
    lines = [f"# {line}" for line in header.splitlines()]
    tables = {k: v for k, v in values.items() if isinstance(v, Mapping)}
    lines += [_toml_line(k, v) for k, v in values.items() if not isinstance(v, Mapping)]
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [_toml_line(k, v) for k, v in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_line(key: str, value: Any) -> str:
    if value is None:
        return f"# {key} =   (not set)"
    return f"{key} = {_toml_value(value)}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def read_toml(path: str) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise UsageError(f"cannot read config file {path!r}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"config file {path!r} is not valid TOML: {error}") from None


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` over `base`, one level of tables deep (a section's keys merge)."""
    merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged[key] = dict(value) if isinstance(value, Mapping) else value
    return merged
