"""What every command shares: error handling and output."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import typer

from fsdpkit.errors import FsdpkitError


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
