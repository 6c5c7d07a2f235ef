"""The `fsdpkit` command: a thin Typer app that parses, calls the library, formats output.

Every command is registered one way, in COMMANDS: its module defines `command_app` (a Typer
of one command, or of a group such as `bench`) and is imported only when the command is run or
asked for its help, so listing the commands stays fast (no torch). No command module imports
this one: what they share is in common.py and group.py.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import typer

from fsdpkit.checkpoint.offline.formats import CONVERT_HELP, RESHARD_LABELS

from .group import FsdpkitGroup

HELP_WIDTH = 100  # help fits 100 columns (fewer on a narrower terminal)
INTERRUPTED = 130  # the exit code of Ctrl-C

# name -> (module defining `command_app`, short help shown in `fsdpkit --help`), in the order listed
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (f"{__package__}.train_cmd", "Train a model with fsdpkit's sharded engine across several processes."),
    "plan": (
        f"{__package__}.plan_cmd",
        "Per-rank memory and predicted step time of a sharded run before launching it (meta device).",
    ),
    "convert": (f"{__package__}.convert_cmd", CONVERT_HELP),
    "reshard": (
        f"{__package__}.reshard_cmd",
        f"Lay a checkpoint ({RESHARD_LABELS}) out for another world size, offline, in its own format.",
    ),
    "inspect": (
        f"{__package__}.inspect_cmd",
        "Summarize a checkpoint: format, world size, step, tensors and bytes, dtypes, largest tensors, files.",
    ),
    "verify": (
        f"{__package__}.verify_cmd",
        "Check every checksum, file size, header, fragment coverage and path; exit 3 when anything is wrong.",
    ),
    "prepare-data": (f"{__package__}.data_cmd", "Tokenise a text file into a flat token file (.bin) for train --data."),
    "diff": (
        f"{__package__}.diff_cmd",
        "Compare two checkpoints of any format tensor by tensor; exit 0 when equal within the tolerance, 3 when not.",
    ),
    "report": (
        f"{__package__}.report_cmd",
        "Draw train --metrics, bench --json (busbw) or plan --scaling --json (TFLOPS/device) as a PNG.",
    ),
    "bench": (
        f"{__package__}.bench_cmd",
        "Collective benchmarks in the nccl-tests format (size, count, type, time, algbw, busbw, #wrong).",
    ),
}


class RootGroup(FsdpkitGroup):
    command_table = COMMANDS


# typer's help width, read when its help renderer is first imported (help only: a command's run never imports it)
os.environ.setdefault("TERMINAL_WIDTH", str(min(HELP_WIDTH, shutil.get_terminal_size((HELP_WIDTH, 24)).columns)))

app = typer.Typer(
    name="fsdpkit",
    cls=RootGroup,
    help="Fully Sharded Data Parallel training, sharded safetensors checkpoints and collective benchmarks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from fsdpkit import __version__
        from fsdpkit.dist import torch_window

        torch_version = torch_window.installed_torch_version()
        typer.echo(f"fsdpkit {__version__}" + (f" (torch {torch_version})" if torch_version else ""))
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool | None = typer.Option(
        None, "--version", callback=_print_version, is_eager=True, help="Print fsdpkit's version (and torch's) and exit."
    ),
) -> None:
    """Fully Sharded Data Parallel training, sharded safetensors checkpoints and collective benchmarks."""
    from fsdpkit.dist.torch_window import check_installed_torch

    check_installed_torch()


def main(early: Any = None) -> None:
    """The CLI; `early`: the workers a spread run's command line started before it was parsed."""
    app(obj=early)


if __name__ == "__main__":
    main()
