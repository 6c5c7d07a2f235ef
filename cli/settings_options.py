"""Command-line options made from settings (fsdpkit.settings): each setting of each section
becomes one Typer option (its flag, help, help panel, default, choices), and the values of the
options given on the command line come back nested as in a config file, so that flags and
`--config` files go through the same path.

    parameters = setting_parameters(SECTIONS)
    command = with_parameters(body, parameters + [...])   # body(ctx, **values)
    given = given_values(SECTIONS, ctx, values)            # {"optimizer": {"lr": 0.001}, ...}
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from fsdpkit.settings import Section, Setting

_SEPARATOR = "__"
_OFF = "__off"  # the hidden --no-<flag> of an on/off setting that is off by default


def parameter_name(section: Section, spec: Setting) -> str:
    return f"{section.name}{_SEPARATOR}{spec.key}" if section.name else spec.key


def setting_parameters(sections: Sequence[Section], *, panel_order: Sequence[str] = ()) -> list[inspect.Parameter]:
    """One keyword parameter per setting (two for an on/off one that is off by default: its
    --no-<flag>, hidden from the help, turns off what a config file turned on)."""
    parameters = []
    for section in sections:
        for spec in section.settings:
            name = parameter_name(section, spec)
            parameters.append(
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=_annotation(section, spec), default=_default(spec))
            )
            if _has_hidden_off_flag(spec):
                off = typer.Option(spec.off_flag or "--no-" + spec.long_flag[2:], hidden=True)
                parameters.append(
                    inspect.Parameter(name + _OFF, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[bool, off], default=False)
                )
    order = {panel: index for index, panel in enumerate(panel_order)}
    return sorted(parameters, key=lambda p: order.get(_panel_of(p), len(order)))


def _panel_of(parameter: inspect.Parameter) -> str:
    return next((a.rich_help_panel for a in typing.get_args(parameter.annotation)[1:] if getattr(a, "rich_help_panel", None)), "")


def _has_hidden_off_flag(spec: Setting) -> bool:
    return _base_type(spec.type) is bool and spec.default is False and spec.parse is None


def given_values(sections: Sequence[Section], ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The settings whose flags were on the command line, nested by section, as plain values
    (what a config file would hold); the others are left out, so a file or the default holds."""
    nested: dict[str, Any] = {}
    for section in sections:
        for spec in section.settings:
            name = parameter_name(section, spec)
            if _has_hidden_off_flag(spec) and _given(ctx, name + _OFF):
                value: Any = False
            elif _given(ctx, name):
                value = values[name]
            else:
                continue
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, list):
                value = tuple(value)
            (nested.setdefault(section.name, {}) if section.name else nested)[spec.key] = value
    return nested


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def with_parameters(body: Callable[..., Any], parameters: list[inspect.Parameter]) -> Callable[..., Any]:
    """`body` with the signature Typer reads its options from."""

    def command(**values: Any) -> Any:
        return body(**values)

    command.__name__ = body.__name__
    command.__doc__ = body.__doc__
    keyword_only = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters]
    command.__signature__ = inspect.Signature(keyword_only)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


def _base_type(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(kind) if a is not type(None)]
        return inner
    return kind


def _annotation(section: Section, spec: Setting) -> Any:
    kind = _base_type(spec.type)
    names = [spec.long_flag]
    metavar = spec.metavar or None
    if spec.parse is not None:
        python_type: Any = str
    elif kind is bool:
        if not _has_hidden_off_flag(spec):
            names = [f"{spec.long_flag}/{spec.off_flag or '--no-' + spec.long_flag[2:]}"]
        python_type = bool
        metavar = ""
    elif spec.choices:
        python_type = enum.Enum(spec.key, {choice: choice for choice in spec.choices}, type=str)
    elif typing.get_origin(kind) is tuple:
        python_type = list[typing.get_args(kind)[0]]
    else:
        python_type = kind
    if spec.short:
        names.append(spec.short)
    option = typer.Option(
        *names, help=spec.help, rich_help_panel=spec.panel or section.panel, show_default=_default_text(spec), metavar=metavar
    )
    return Annotated[python_type | None, option]


def _default(spec: Setting) -> Any:
    """The option's default as Typer shows it (never used as a value: see given_values)."""
    value = spec.default
    if spec.shown_default:
        return spec.shown_default
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if spec.parse else list(value)
    return value


def _default_text(spec: Setting) -> bool:
    value = spec.default
    return not (value is None or value is False or value == ())
