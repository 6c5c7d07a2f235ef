"""`fsdpkit plan`: per-rank memory of a sharded run before launching it. Parse, plan, format."""

from __future__ import annotations

from typing import Annotated

import typer

from fsdpkit.sizes import format_size

from .app import app
from .common import handle_errors, print_json


def _units(names: tuple[str, ...]) -> str:
    shown = [name or "<root>" for name in names]
    return ", ".join(shown) if len(shown) <= 4 else f"{', '.join(shown[:3])}, ... ({len(shown)} units)"


def format_plan(plan) -> str:
    """The plan as a table: one row per component, bytes exact and human-readable."""
    request = plan.request
    where = "host" if request.cpu_offload else "device"
    replicas = request.world_size // plan.shard_factor
    lines = [
        f"# fsdpkit plan: {request.model}, {plan.num_params:,} parameters in {len(plan.units)} units; world size "
        f"{request.world_size}, {request.strategy} (shard factor {plan.shard_factor}, {replicas} replica{'s' * (replicas > 1)}); "
        f"mixed precision {request.mixed_precision}; {request.optimizer}"
        + ("; cpu offload" if request.cpu_offload else "")
        + ("; no_sync" if request.no_sync else ""),
        "# per-rank bytes (rank 0 of a shard group holds the most: padding sits at the end)",
        f"  {'component':<42} {'bytes':>17} {'size':>11}  where",
    ]

    def row(label: str, value: int, place: str, detail: str = "") -> None:
        lines.append(f"  {label:<42} {value:>17,} {format_size(value):>11}  {place}{'  ' + detail if detail else ''}")

    row("sharded parameters (fp32)", plan.sharded_params, where)
    row("sharded gradients (fp32)", plan.sharded_grads, where)
    row(f"optimizer state ({request.optimizer})", plan.optimizer_state, where)
    if request.no_sync:
        row("no_sync gradients (unsharded)", plan.no_sync_grads, "device")
    largest = plan.largest_unit
    row(f"largest unit unsharded ({largest.name or '<root>'})", largest.param_bytes, "device", "(part of the next row)")
    peak = plan.peak
    row(
        f"unsharded in flight at peak ({peak.phase})",
        peak.bytes,
        "device",
        f"params: {_units(peak.params) or '-'}; grads: {_units(peak.grads) or '-'}",
    )
    if request.cpu_offload:
        row("device total", plan.device_total, "device")
        row("host total", plan.host_total, "host")
    row("total", plan.total, "device+host" if request.cpu_offload else "device")
    lines += [f"# {note}" for note in plan.notes]
    comm = plan.comm_per_step
    if comm is not None:
        gather = "int8" if request.allgather_dtype == "int8" else "compute dtype"
        lines.append(f"# collective bytes per training step (tensor bytes, as comm_stats counts them; all-gather in {gather})")
        for kind, value in comm.as_dict().items():
            row(kind.replace("_", "-"), value, "network")
    return "\n".join(lines)


@app.command("plan", short_help="Per-rank memory of a sharded run before launching it (meta device, no GPU needed).")
@handle_errors
def plan_command(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="A built-in model (gpt-tiny, gpt-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl), hf:PRESET|DIR or package.module:factory.",
        ),
    ],
    world_size: Annotated[int, typer.Option("--world-size", help="Ranks in the data-parallel group.")],
    strategy: Annotated[str, typer.Option("--strategy", help="full | grad-op | hybrid | none.")] = "full",
    shard_group_size: Annotated[
        int | None, typer.Option("--shard-group-size", help="Ranks a parameter is sharded over (hybrid only).")
    ] = None,
    mixed_precision: Annotated[
        str, typer.Option("--mixed-precision", help="bf16 | fp16 | none: the dtype of unsharded parameters and gradients.")
    ] = "none",
    cpu_offload: Annotated[
        bool, typer.Option("--cpu-offload", help="Sharded parameters, gradients and optimizer state in host memory.")
    ] = False,
    optimizer: Annotated[str, typer.Option("--optimizer", help="adamw (2 fp32 states per element) | sgd (none).")] = "adamw",
    no_sync: Annotated[
        bool, typer.Option("--no-sync", help="Count the full gradient per unit that gradient accumulation under no_sync() keeps.")
    ] = False,
    backward_prefetch: Annotated[
        str, typer.Option("--backward-prefetch", help="pre | post | none: gather the next unit while this one's gradient exists.")
    ] = "pre",
    forward_prefetch: Annotated[bool, typer.Option("--forward-prefetch", help="Gather the next unit before this one's forward.")] = False,
    allgather_dtype: Annotated[
        str, typer.Option("--allgather-dtype", help="compute | int8: what the weight all-gather moves (int8: blocks of --quant-block).")
    ] = "compute",
    quant_block: Annotated[int, typer.Option("--quant-block", help="Elements per int8 quantization block.")] = 256,
    bucket_bytes: Annotated[
        int, typer.Option("--bucket-bytes", help="Merge consecutive units smaller than this many bytes (0: never).")
    ] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of the table.")] = False,
) -> None:
    """Per-rank memory in bytes of training MODEL on WORLD_SIZE ranks: sharded parameters,
    gradients, optimizer state, the unsharded units in flight at the peak, and the total.
    Builds the model on the meta device only: seconds for any size. Activations are not included."""
    from fsdpkit.memory_plan import PlanRequest, plan_memory

    request = PlanRequest(
        model=model,
        world_size=world_size,
        strategy=strategy,
        shard_group_size=shard_group_size,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        optimizer=optimizer,
        no_sync=no_sync,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        allgather_dtype=allgather_dtype,
        quant_block=quant_block,
        bucket_bytes=bucket_bytes,
    )
    plan = plan_memory(request)
    if json_output:
        print_json(plan.to_document())
    else:
        typer.echo(format_plan(plan))
