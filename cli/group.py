"""The command groups of `fsdpkit` (the root and `bench`): commands loaded from a table only when
run or asked for help, one-line usage errors, help shown as written.

Usage errors, Typer's own included (a missing argument, an unknown option, a bad value), are
one line on stderr and exit 2; a group run with no arguments prints its help once and exits 2.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import importlib
import inspect
import os
import re
import select
import sys
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

LISTING = "fsdpkit.listing"  # ctx.meta key: commands are being listed (help, completion), not run
INTERRUPTED = 130  # the exit code of Ctrl-C


def literal(text: str | None) -> str | None:
    """`text` with every `[` not yet escaped escaped, so rich markup shows it literally."""
    return None if text is None else re.sub(r"(?<!\\)\[", r"\\[", text)


def unwrapped(text: str | None) -> str | None:
    """`text` with each paragraph on one line, so the terminal wraps it (rich keeps line breaks)."""
    if text is None:
        return None
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def prepare_help(command: Any, ctx: Any) -> None:
    """Help as written: `[hf]` is shown, not taken as rich markup; a paragraph wraps at the
    terminal's edge only; and a flag takes no value, so no `<bool>` beside it."""
    command.help = literal(unwrapped(command.help))
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        if getattr(param, "help", None):
            param.help = literal(param.help)


def click_message(message: str) -> str:
    """Typer's usage message as one line in fsdpkit's style: 'missing argument 'src''."""
    text = " ".join(message.replace("Value error, ", "").split()).rstrip(".")
    return text[:1].lower() + text[1:]


def suggestion(name: str, commands: list[str]) -> str:
    """'; did you mean 'train'?' for a mistyped command name, '' when nothing is close."""
    close = difflib.get_close_matches(name, commands, n=3)
    return f"; did you mean {' or '.join(repr(command) for command in close)}?" if close else ""


def load_command(module_name: str, name: str) -> Any:
    """The click command of `module_name`'s `command_app` (a Typer of one command, or a group)."""
    command = typer.main.get_command(importlib.import_module(module_name).command_app)
    command.name = name
    return command


def pass_plain_values(params: list[Any]) -> list[Any]:
    """`params`, each coercing its value through `PlainValues` where Typer coerces through pydantic."""
    for param in params:
        if getattr(param, "_runtime_param", False) is None and laid_out_as_known(param):  # Typer's own not built yet
            param._runtime_param = PlainValues()
    return params


def laid_out_as_known(param: Any) -> bool:
    """Whether `param` has the parts of a Typer parameter that `PlainValues` uses: they are Typer's
    private layout, which another Typer may change (its own coercion then serves)."""
    descriptor = getattr(param, "type_descriptor", None)
    info = getattr(descriptor, "parameter_info", None)
    known = all(hasattr(info, name) for name in ("parser", "min", "max", "case_sensitive"))
    return known and hasattr(descriptor, "annotation") and callable(getattr(param, "get_runtime_param", None))


class PlainValues:
    """Typer's coercion of one parameter's value, its pydantic validator built (and pydantic
    imported, a tenth of a second) only for a value that needs more than passing through as
    Typer's would: none given, one of the plain type the parameter takes (str, int, float) with no
    bounds, or the exact spelling of one of its choices (an Enum's); Typer's own for anything else."""

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return () if param.multiple or param.nargs == -1 else None
        annotation, info = param.type_descriptor.annotation, param.type_descriptor.parameter_info
        if info.parser is None and annotation in (str, int, float) and type(value) is annotation and (info.min, info.max) == (None, None):
            return value
        if info.parser is None and isinstance(annotation, type) and issubclass(annotation, enum.Enum) and type(value) is str:
            exact = info.case_sensitive and ctx.token_normalize_func is None
            for choice in annotation if exact else ():
                if str(choice.value) == value:
                    return choice
        param._runtime_param = None  # Typer's own, built now
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)


def stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reader has closed it (`fsdpkit ... | head` after head's lines)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's captured output)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


@contextlib.contextmanager
def output_may_be_cut_short() -> Iterator[None]:
    """A reader of stdout gone (`| head`) ends the command with exit 0 and nothing on stderr, as
    `ls | head` does: what is left to print goes nowhere. Any other broken pipe is an error."""
    try:
        yield
    except SystemExit as error:  # rich's answer to a broken pipe while it prints help: stdout made /dev/null, exit 1
        if error.code != 1 or not isinstance(error.__context__, BrokenPipeError):
            raise
        raise typer.Exit(0) from None
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, sys.stdout.fileno())  # the text still buffered is flushed there at exit
        os.close(nowhere)
        raise typer.Exit(0) from None


class FsdpkitGroup(TyperGroup):
    """Typer's group with one-line usage errors, commands loaded from `command_table`
    (name -> (module defining `command_app`, short help)) and flag-type-free help."""

    command_table: dict[str, tuple[str, str]] = {}

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True, **extra: Any) -> Any:
        from typer._click.exceptions import ClickException

        from fsdpkit import log
        from fsdpkit.errors import FsdpkitError

        log.setup()
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as error:
            ctx = getattr(error, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None and error.exit_code == 2 else ""
            typer.echo(f"error: {click_message(error.format_message())}{hint}", err=True)
            code = error.exit_code
        except FsdpkitError as error:  # raised while parsing, e.g. an unknown bench collective
            typer.echo(f"error: {error}", err=True)
            code = error.exit_code
        code = code if isinstance(code, int) else 0
        if code == INTERRUPTED:  # Typer's code for a KeyboardInterrupt, wherever it came (parsing, loading torch, a command)
            try:
                if standalone_mode:
                    sys.exit(code)
            finally:  # written as the exit is under way, when a further Ctrl-C raises nothing (entry.py): once
                typer.echo("error: interrupted", err=True)
        if standalone_mode:
            sys.exit(code)
        return code

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with output_may_be_cut_short():  # --help is printed while the context is made
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with output_may_be_cut_short():  # a command's output, or its --help
            return super().invoke(ctx)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            text = ctx.get_help()  # rich prints it and returns ''
            if text:
                typer.echo(text)
            raise typer.Exit(2)  # a command is a missing argument
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and not args[0].startswith("-") and not ctx.resilient_parsing and args[0] not in self.list_commands(ctx):
            ctx.fail(f"no such command {args[0]!r}{suggestion(args[0], self.list_commands(ctx))}")
        return super().resolve_command(ctx, args)

    def list_commands(self, ctx: Any) -> list[str]:
        return [*self.command_table, *(name for name in super().list_commands(ctx) if name not in self.command_table)]

    def get_command(self, ctx: Any, name: str) -> Any:
        if name in self.command_table:
            module_name, short_help = self.command_table[name]
            if ctx.meta.get(LISTING):
                return TyperCommand(name, short_help=short_help, help=short_help)
            command = load_command(module_name, name)
        else:
            command = super().get_command(ctx, name)
        if command is not None:
            prepare_help(command, ctx)
            pass_plain_values(command.get_params(ctx))
        return command

    def get_params(self, ctx: Any) -> list[Any]:
        return pass_plain_values(super().get_params(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        prepare_help(self, ctx)
        ctx.meta[LISTING] = True
        try:
            super().format_help(ctx, formatter)
        finally:
            ctx.meta[LISTING] = False

    def shell_complete(self, ctx: Any, incomplete: str) -> Any:
        ctx.meta[LISTING] = True
        try:
            return super().shell_complete(ctx, incomplete)
        finally:
            ctx.meta[LISTING] = False
