"""What every command shares: error handling and output."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import typer
from typer.core import TyperCommand

from fsdpkit.errors import FsdpkitError, UsageError
from fsdpkit.progress import LINE_SECONDS

# flags of other tools, and the flag that says the same here (named when the command has it)
NEAR_MISSES = {
    "--world-size": ("--nproc-per-node", "the world size is --nnodes x --nproc-per-node"),
    "--nproc": ("--nproc-per-node", "processes on each node"),
    "--num-processes": ("--nproc-per-node", "processes on each node"),
}


class FsdpkitCommand(TyperCommand):
    """Accepts torchrun's underscore spellings of every flag (--nproc_per_node is --nproc-per-node),
    and names the flag meant by a near miss (NEAR_MISSES)."""

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
            elif flag.startswith("--") and dashed not in known and NEAR_MISSES.get(dashed, ("",))[0] in known:
                meant, why = NEAR_MISSES[dashed]
                raise UsageError(f"no such option: {flag}: did you mean {meant}? ({why})")
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
        except KeyboardInterrupt:  # the line is the group's (group.py), for every interrupt alike
            raise typer.Exit(130) from None

    return wrapper


@contextlib.contextmanager
def count_progress(desc: str, *, unit: str) -> Iterator[Callable[[int], None]]:
    """progress(n) callbacks that count items on stderr: a tqdm bar on a terminal, otherwise one
    plain line every LINE_SECONDS."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(unit=unit, desc=desc, file=sys.stderr, leave=False) as bar:
            yield bar.update
        return
    state = {"done": 0, "last": time.monotonic()}

    def log(done: int) -> None:
        state["done"] += done
        now = time.monotonic()
        if now - state["last"] >= LINE_SECONDS:
            state["last"] = now
            sys.stderr.write(f"{desc}: {state['done']:,} {unit}s\n")
            sys.stderr.flush()

    yield log


def print_json(document: Any) -> None:
    """One JSON document, one line, on stdout."""
    sys.stdout.write(json.dumps(document, separators=(",", ":"), sort_keys=False) + "\n")
    sys.stdout.flush()
