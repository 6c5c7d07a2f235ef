"""`fsdpkit bench <collective>`: nccl-tests style collective benchmarks. Parse, run, format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperGroup

from fsdpkit.bench.busbw import BUSBW_FORMULAS, COLLECTIVES, VARIANTS
from fsdpkit.errors import UsageError
from fsdpkit.sizes import parse_size

from .app import app
from .common import handle_errors, print_json

_FORMULAS_HELP = (
    "algbw = size / time (GB = 1e9 bytes); busbw = algbw * factor, with factor "
    "allreduce 2(n-1)/n; allgather, reducescatter, alltoall (n-1)/n; broadcast 1 (n = ranks). "
    "time = max over ranks of each rank's mean. For allgather and reducescatter, size is the "
    "full tensor and count is per rank; sizes are rounded down to valid counts as nccl-tests "
    "does (per-rank share a multiple of 16 bytes). torch's all_reduce and broadcast exist only in "
    "place and all-to-all runs out of place only: the other columns read N/A."
)


class _BenchGroup(TyperGroup):
    """Names an unknown collective in one line (exit 2) instead of a usage panel."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            typer.echo(f"error: unknown collective {args[0]!r}: choose from {', '.join(COLLECTIVES)}, all", err=True)
            raise typer.Exit(2)
        return super().resolve_command(ctx, args)


bench_app = typer.Typer(
    cls=_BenchGroup,
    no_args_is_help=True,
    help="Collective benchmarks, nccl-tests style: size, count, type, time, algbw, busbw, #wrong. " + _FORMULAS_HELP,
)
app.add_typer(bench_app, name="bench")

NprocOption = Annotated[Optional[int], typer.Option("--nproc-per-node", help="Processes on this node (default: one per GPU with nccl, else 2).")]
NnodesOption = Annotated[int, typer.Option("--nnodes", help="Number of nodes.")]
NodeRankOption = Annotated[int, typer.Option("--node-rank", help="This node's rank, 0..nnodes-1.")]
RdzvOption = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (needed with --nnodes > 1).")]
BackendOption = Annotated[str, typer.Option("--backend", help="auto|gloo|nccl (auto: nccl with a GPU per process, else gloo).")]
MinBytesOption = Annotated[str, typer.Option("--min-bytes", help="Smallest size: K/M/G = KiB/MiB/GiB (1024), KB/MB/GB (1000).")]
MaxBytesOption = Annotated[str, typer.Option("--max-bytes", help="Largest size, same units.")]
FactorOption = Annotated[int, typer.Option("--factor", help="Multiply the size by this between rows (>= 2).")]
ItersOption = Annotated[int, typer.Option("--iters", help="Timed calls per size and mode.")]
WarmupOption = Annotated[int, typer.Option("--warmup", help="Untimed calls before each timed run.")]
DtypeOption = Annotated[str, typer.Option("--dtype", help="float32|bfloat16|float16.")]
CheckOption = Annotated[bool, typer.Option("--check", help="Verify every result element; wrong ones are counted, and any exits 3.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of the table.")]
CsvOption = Annotated[Optional[Path], typer.Option("--csv", help="Also write one CSV row per collective, size and mode to FILE.")]
VariantOption = Annotated[Optional[str], typer.Option("--variant", help="allgather: flat (all_gather_single, FSDP's; default), list (all_gather into separate tensors); reducescatter: torch (reduce_scatter_single, an all-reduce on gloo; default), fsdpkit (the engine's: all-to-all + local sum on gloo); both: side by side.")]


def _run(collectives: tuple[str, ...], *, variant: str | None, nproc_per_node: int | None, nnodes: int, node_rank: int,
         rdzv_endpoint: str | None, backend: str, min_bytes: str, max_bytes: str, factor: int, iters: int,
         warmup: int, dtype: str, check: bool, json_output: bool, csv_file: Path | None) -> None:
    import torch

    from fsdpkit.bench.options import BenchOptions
    from fsdpkit.bench.report import format_report, report_document, write_csv
    from fsdpkit.bench.runner import raise_if_wrong, run_bench
    from fsdpkit.launch import LaunchOptions

    options = BenchOptions(
        collectives=collectives, variant=variant, backend=backend, min_bytes=parse_size(min_bytes),
        max_bytes=parse_size(max_bytes), factor=factor, iters=iters, warmup=warmup, dtype=dtype, check=check,
    )
    if nproc_per_node is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nproc_per_node = gpus if gpus and backend != "gloo" else 2
    launch_options = LaunchOptions(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
    if csv_file is not None and csv_file.is_dir():
        raise UsageError(f"--csv {csv_file} is a directory, expected a file name")
    report = run_bench(options, launch_options=launch_options)
    if json_output:
        print_json(report_document(report))
    else:
        typer.echo(format_report(report))
    if csv_file is not None:
        with open(csv_file, "w", newline="") as stream:
            write_csv(report, stream)
    raise_if_wrong(report)


def _command(collectives: tuple[str, ...], *, with_variant: bool) -> Callable[..., None]:
    """A command function with the shared options (and --variant for a collective that has variants)."""

    def command(
        nproc_per_node: NprocOption = None, nnodes: NnodesOption = 1, node_rank: NodeRankOption = 0,
        rdzv_endpoint: RdzvOption = None, backend: BackendOption = "auto", min_bytes: MinBytesOption = "1K",
        max_bytes: MaxBytesOption = "64M", factor: FactorOption = 2, iters: ItersOption = 20,
        warmup: WarmupOption = 5, dtype: DtypeOption = "float32", check: CheckOption = False,
        json_output: JsonOption = False, csv_file: CsvOption = None, variant: VariantOption = None,
    ) -> None:
        _run(collectives, variant=variant, nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
             rdzv_endpoint=rdzv_endpoint, backend=backend, min_bytes=min_bytes, max_bytes=max_bytes, factor=factor,
             iters=iters, warmup=warmup, dtype=dtype, check=check, json_output=json_output, csv_file=csv_file)

    if not with_variant:
        def command_without_variant(
            nproc_per_node: NprocOption = None, nnodes: NnodesOption = 1, node_rank: NodeRankOption = 0,
            rdzv_endpoint: RdzvOption = None, backend: BackendOption = "auto", min_bytes: MinBytesOption = "1K",
            max_bytes: MaxBytesOption = "64M", factor: FactorOption = 2, iters: ItersOption = 20,
            warmup: WarmupOption = 5, dtype: DtypeOption = "float32", check: CheckOption = False,
            json_output: JsonOption = False, csv_file: CsvOption = None,
        ) -> None:
            command(nproc_per_node, nnodes, node_rank, rdzv_endpoint, backend, min_bytes, max_bytes, factor,
                    iters, warmup, dtype, check, json_output, csv_file)

        return handle_errors(command_without_variant)
    return handle_errors(command)


_DESCRIPTIONS = {
    "allgather": "All-gather: every rank's shard into one full tensor on every rank (FSDP's unshard).",
    "reducescatter": "Reduce-scatter: sum a full tensor over ranks, each keeps its chunk (FSDP's gradient reduction).",
    "allreduce": "All-reduce: sum a tensor over ranks, every rank gets the sum (DDP, HYBRID_SHARD replicas).",
    "broadcast": "Broadcast: rank 0's tensor to every rank.",
    "alltoall": "All-to-all: chunk p of every rank's tensor goes to rank p.",
}

for _name in COLLECTIVES:
    bench_app.command(_name, short_help=f"{_DESCRIPTIONS[_name]} {BUSBW_FORMULAS[_name]}.",
                      help=f"{_DESCRIPTIONS[_name]} {BUSBW_FORMULAS[_name]} (n = ranks). {_FORMULAS_HELP}")(
        _command((_name,), with_variant=_name in VARIANTS)
    )
bench_app.command("all", short_help="Every collective, one table after another (allgather: flat).",
                  help=f"Every collective, one table after another (allgather: flat). {_FORMULAS_HELP}")(
    _command(COLLECTIVES, with_variant=False)
)
