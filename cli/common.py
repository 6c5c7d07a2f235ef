"""What every command shares: error handling and output."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import typer
from typer.core import TyperCommand

from fsdpkit.errors import FsdpkitError


class FsdpkitCommand(TyperCommand):
    """Accepts torchrun's underscore spellings of every flag: --nproc_per_node is --nproc-per-node."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        known = {name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)}
        rewritten = []
        for index, arg in enumerate(args):
            if arg == "--":
                rewritten += args[index:]
                break
            flag, equals, value = arg.partition("=")
            dashed = flag.replace("_", "-")
            if flag.startswith("--") and flag not in known and dashed in known:
                arg = dashed + equals + value
            rewritten.append(arg)
        return super().parse_args(ctx, rewritten)


def handle_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn fsdpkit's errors into one line on stderr and the documented exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except FsdpkitError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def print_json(document: Any) -> None:
    """One JSON document, one line, on stdout."""
    sys.stdout.write(json.dumps(document, separators=(",", ":"), sort_keys=False) + "\n")
    sys.stdout.flush()
