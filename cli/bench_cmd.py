"""`fsdpkit bench <collective>`: nccl-tests style collective benchmarks. Parse, run, format.

The options are the settings of BenchOptions (with nccl-tests' short flags) and of
LaunchOptions (the same launch flags as `train`), made by settings_options.
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fsdpkit.bench.busbw import BUSBW_FORMULAS, COLLECTIVES, VARIANTS
from fsdpkit.bench.options import BenchOptions
from fsdpkit.dist.launch import LaunchOptions
from fsdpkit.errors import RunError, UsageError
from fsdpkit.paths import check_writable_file
from fsdpkit.settings import Section, settings_of

from .common import FsdpkitCommand, handle_errors, print_json
from .group import FsdpkitGroup
from .settings_options import given_values, setting_parameters, with_parameters

_FORMULAS_HELP = (
    "algbw = size / time (GB = 1e9 bytes); busbw = algbw * factor, with factor "
    "allreduce 2(n-1)/n; allgather, reducescatter, alltoall (n-1)/n; broadcast 1 (n = ranks). "
    "time = max over ranks of each rank's mean. For allgather and reducescatter, size is the "
    "full tensor and count is per rank; sizes are rounded down to valid counts as nccl-tests "
    "does (per-rank share a multiple of 16 bytes). torch's all_reduce and broadcast exist only in "
    "place and all-to-all runs out of place only: the other columns read N/A. The table header "
    "gives the nccl-tests command line that measures the same thing."
)

_CHOICES = ", ".join((*COLLECTIVES, "all"))


class _BenchGroup(FsdpkitGroup):
    """Names an unknown or a missing collective in one line (exit 2) instead of a usage panel."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in self.get_help_option_names(ctx):
            raise UsageError(f"missing collective before {args[0]}: fsdpkit bench COLLECTIVE [OPTIONS], with COLLECTIVE one of {_CHOICES}")
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            raise UsageError(f"unknown collective {args[0]!r}: choose from {_CHOICES}")
        return super().resolve_command(ctx, args)


command_app = typer.Typer(
    cls=_BenchGroup,
    add_completion=False,
    no_args_is_help=True,
    short_help="Collective benchmarks in the nccl-tests format (size, count, type, time, algbw, busbw, #wrong).",
    help="Collective benchmarks, nccl-tests style: size, count, type, time, algbw, busbw, #wrong. " + _FORMULAS_HELP,
)

LAUNCH = Section.of("launch", LaunchOptions, panel="Launch")


def _bench_section(collectives: tuple[str, ...], *, with_variant: bool) -> Section:
    settings = tuple(s for s in settings_of(BenchOptions) if with_variant or s.key != "variant")
    return Section(
        "",
        "Benchmark",
        settings,
        functools.partial(BenchOptions, collectives),
        lambda options: {s.key: getattr(options, s.key) for s in settings},
    )


def _run(
    ctx: typer.Context,
    *,
    sections: tuple[Section, ...],
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document on stdout instead of the table.", rich_help_panel="Output")
    ] = False,
    csv_file: Annotated[
        Path | None,
        typer.Option(
            "--csv", help="Also write one CSV row per collective, size and mode to FILE.", rich_help_panel="Output", metavar="FILE"
        ),
    ] = None,
    **settings: Any,
) -> None:
    given = given_values(sections, ctx, settings)
    bench, launch = sections
    options = bench.from_values({k: v for k, v in given.items() if k != "launch"}, where="")
    launch_options = launch.from_values(given.get("launch", {}), where="")
    if csv_file is not None:
        check_writable_file(str(csv_file), "--csv")
    from fsdpkit.bench.report import report_document, write_csv  # torch: after every flag is checked
    from fsdpkit.bench.runner import bench_spec, raise_if_wrong, run_bench_spec, table_stream

    spec = bench_spec(options, launch_options=launch_options)
    if json_output:
        report = run_bench_spec(spec, launch_options=launch_options)
        print_json(report_document(report))
    else:
        table = table_stream(spec, world_size=launch_options.world_size, write=_echo_now)
        table.start()
        report = run_bench_spec(spec, launch_options=launch_options, on_row=table.row)
        table.finish(report)
    if csv_file is not None:
        try:
            with open(csv_file, "w", newline="") as stream:
                write_csv(report, stream)
        except OSError as error:
            raise RunError(f"--csv {csv_file}: cannot write: {error.strerror or error}") from None
    raise_if_wrong(report)


def _echo_now(text: str) -> None:
    """One or more lines on stdout, flushed at once (a pipe too)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _command(collectives: tuple[str, ...], *, with_variant: bool) -> Any:
    sections = (_bench_section(collectives, with_variant=with_variant), LAUNCH)
    own = [p for name, p in inspect.signature(_run, eval_str=True).parameters.items() if name not in ("sections", "settings")]
    body = functools.partial(_run, sections=sections)
    functools.update_wrapper(body, _run)
    return handle_errors(with_parameters(body, setting_parameters(sections) + own))


_DESCRIPTIONS = {
    "allgather": "All-gather: every rank's shard into one full tensor on every rank (FSDP's unshard).",
    "reducescatter": "Reduce-scatter: sum a full tensor over ranks, each keeps its chunk (FSDP's gradient reduction).",
    "allreduce": "All-reduce: sum a tensor over ranks, every rank gets the sum (DDP, HYBRID_SHARD replicas).",
    "broadcast": "Broadcast: rank 0's tensor to every rank.",
    "alltoall": "All-to-all: chunk p of every rank's tensor goes to rank p.",
}

for _name in COLLECTIVES:
    command_app.command(
        _name,
        cls=FsdpkitCommand,
        short_help=f"{_DESCRIPTIONS[_name]} {BUSBW_FORMULAS[_name]}.",
        help=f"{_DESCRIPTIONS[_name]} {BUSBW_FORMULAS[_name]} (n = ranks). {_FORMULAS_HELP}",
    )(_command((_name,), with_variant=_name in VARIANTS))
command_app.command(
    "all",
    cls=FsdpkitCommand,
    short_help="Every collective, one table after another (allgather: flat).",
    help=f"Every collective, one table after another (allgather: flat). {_FORMULAS_HELP}",
)(_command(COLLECTIVES, with_variant=False))
