"""The `fsdpkit` command: a thin Typer app that parses, calls the library, formats output.

Usage errors, Typer's own included (a missing argument, an unknown option, a bad value), are
one line on stderr and exit 2. `train` and `plan` are loaded only when run or asked for help (their
options come from the training config, which imports torch); listing commands stays fast.
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

HELP_WIDTH = 100  # help fits 100 columns (fewer on a narrower terminal)
INTERRUPTED = 130  # the exit code of Ctrl-C

# name -> (module defining `command`, short help shown in `fsdpkit --help`)
LAZY_COMMANDS = {
    "train": ("fsdpkit_cli.train_cmd", "Train a model with fsdpkit's sharded engine across several processes."),
    "plan": ("fsdpkit_cli.plan_cmd", "Per-rank memory and predicted step time of a sharded run before launching it (meta device)."),
}


def _prepare_help(command: Any, ctx: Any) -> None:
    """Help as written: `[hf]` is shown, not taken as rich markup; and a flag takes no value, so
    no `<bool>` beside it."""
    command.help = literal(command.help)
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        if getattr(param, "help", None):
            param.help = literal(param.help)


def literal(text: str | None) -> str | None:
    """`text` with every `[` not yet escaped escaped, so rich markup shows it literally."""
    return None if text is None else re.sub(r"(?<!\\)\[", r"\\[", text)


def click_message(message: str) -> str:
    """Typer's usage message as one line in fsdpkit's style: 'missing argument 'src''."""
    text = " ".join(message.replace("Value error, ", "").split()).rstrip(".")
    return text[:1].lower() + text[1:]


class FsdpkitGroup(TyperGroup):
    """Typer's group with one-line usage errors, lazily loaded commands and flag-type-free help."""

    lazy_commands: dict[str, tuple[str, str]] = {}
    listing = False  # while listing commands (help, completion), lazy commands are not imported

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True, **extra: Any) -> Any:
        from typer._click.exceptions import ClickException, NoArgsIsHelpError

        from fsdpkit import log
        from fsdpkit.errors import FsdpkitError

        log.setup()
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as error:
            typer.echo(error.ctx.get_help() if error.ctx else str(error))
            code = 0
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
            typer.echo("error: interrupted", err=True)
        if standalone_mode:
            sys.exit(code)
        return code

    def list_commands(self, ctx: Any) -> list[str]:
        return [*self.lazy_commands, *(name for name in super().list_commands(ctx) if name not in self.lazy_commands)]

    def get_command(self, ctx: Any, name: str) -> Any:
        if name in self.lazy_commands:
            module_name, short_help = self.lazy_commands[name]
            if FsdpkitGroup.listing:
                return TyperCommand(name, short_help=short_help, help=short_help)
            command = typer.main.get_command(importlib.import_module(module_name).command_app)
            command.name = name
        else:
            command = super().get_command(ctx, name)
        if command is not None:
            _prepare_help(command, ctx)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _prepare_help(self, ctx)
        FsdpkitGroup.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            FsdpkitGroup.listing = False

    def shell_complete(self, ctx: Any, incomplete: str) -> Any:
        FsdpkitGroup.listing = True
        try:
            return super().shell_complete(ctx, incomplete)
        finally:
            FsdpkitGroup.listing = False


class RootGroup(FsdpkitGroup):
    lazy_commands = LAZY_COMMANDS


def _set_help_width() -> None:
    import shutil

    import typer.rich_utils

    typer.rich_utils.MAX_WIDTH = min(HELP_WIDTH, shutil.get_terminal_size((HELP_WIDTH, 24)).columns)


_set_help_width()

app = typer.Typer(
    name="fsdpkit",
    cls=RootGroup,
    help="Fully Sharded Data Parallel training, sharded safetensors checkpoints and collective benchmarks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        try:
            torch_version = f" (torch {metadata.version('torch')})"
        except metadata.PackageNotFoundError:
            torch_version = ""
        from fsdpkit import __version__

        typer.echo(f"fsdpkit {__version__}{torch_version}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool | None = typer.Option(
        None, "--version", callback=_print_version, is_eager=True, help="Print fsdpkit's version (and torch's) and exit."
    ),
) -> None:
    """Fully Sharded Data Parallel training, sharded safetensors checkpoints and collective benchmarks."""


def _register_commands() -> None:
    # Each command lives in its own module; importing it registers it on `app` (train: LAZY_COMMANDS).
    from . import (
        bench_cmd,  # noqa: F401
        checkpoint_cmd,  # noqa: F401
        data_cmd,  # noqa: F401
        diff_cmd,  # noqa: F401
        report_cmd,  # noqa: F401
    )


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
