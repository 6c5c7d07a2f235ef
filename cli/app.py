"""The `fsdpkit` command: a thin Typer app that parses, calls the library, formats output."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="fsdpkit",
    help="Fully Sharded Data Parallel training, sharded safetensors checkpoints and collective benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Fully Sharded Data Parallel training, sharded safetensors checkpoints and collective benchmarks."""


def _register_commands() -> None:
    # Each command lives in its own module; importing it registers it on `app`.
    from . import train_cmd  # noqa: F401
    from . import bench_cmd  # noqa: F401
    from . import checkpoint_cmd  # noqa: F401
    from . import plan_cmd  # noqa: F401


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
