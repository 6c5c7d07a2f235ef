"""`fsdpkit plan`: per-rank memory of a sharded run before launching it. Parse, plan, format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fsdpkit.settings import merge, read_toml
from fsdpkit.sizes import format_size

from .common import FsdpkitCommand, handle_errors, print_json
from .settings_options import given_values, setting_parameters, with_parameters


def _units(names: tuple[str, ...]) -> str:
    shown = [name or "<root>" for name in names]
    return ", ".join(shown) if len(shown) <= 4 else f"{', '.join(shown[:3])}, ... ({len(shown)} units)"


def format_plan(plan) -> str:
    """The plan as a table: one row per component, bytes exact and human-readable."""
    request, document = plan.request, plan.to_document()
    where = "host" if request.cpu_offload else "device"
    replicas = document["replicas"]
    lines = [
        f"# fsdpkit plan: {request.model}, {plan.num_params:,} parameters in {len(plan.units)} units; world size "
        f"{request.world_size}, {document['strategy']} (shard factor {plan.shard_factor}, {replicas} replica{'s' * (replicas > 1)}); "
        f"mixed precision {document['mixed_precision']}; {request.optimizer}"
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
    return "\n".join(lines)


HELP = """Per-rank memory in bytes of training --model on --world-size ranks: sharded parameters,
gradients, optimizer state, the unsharded units in flight at the peak, and the total. Builds the
model on the meta device only: seconds for any size. Activations are not included.

The model, data, sharding, precision, memory and overlap flags are train's own (same spellings,
defaults and --config file)."""

PANELS = ("Model", "Data", "Sharding", "Precision", "Memory", "Overlap", "Optimizer", "Output")


def plan(
    ctx: typer.Context,
    world_size: Annotated[int, typer.Option("--world-size", help="Ranks in the data-parallel group.", rich_help_panel="Sharding")],
    config_file: Annotated[
        Path | None,
        typer.Option("--config", help="Read settings from a train --config TOML file first.", rich_help_panel="Output", metavar="FILE"),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document on stdout instead of the table.", rich_help_panel="Output")
    ] = False,
    **settings: Any,
) -> None:
    from fsdpkit.memory_plan import PlanRequest, plan_memory

    request = PlanRequest(_train_config(ctx, config_file, settings), world_size)
    memory = plan_memory(request)
    if json_output:
        print_json(memory.to_document())
    else:
        typer.echo(format_plan(memory))


def _train_config(ctx: typer.Context, config_file: Path | None, settings: dict[str, Any]):
    from fsdpkit.errors import UsageError
    from fsdpkit.train.config import TrainConfig

    values = merge(read_toml(str(config_file)) if config_file is not None else {}, given_values(PLAN_SECTIONS, ctx, settings))
    if "name" not in values.get("model", {}):
        raise UsageError("missing option '--model'")
    return TrainConfig.from_values(values, where=f" in {config_file}" if config_file is not None else "")


def _plan_sections() -> tuple:
    """train's sections, with the settings that change what a step holds or costs."""
    from dataclasses import replace

    from fsdpkit.train.config import SECTIONS

    keep = {
        "model": None,
        "data": ("seq_len", "global_batch_size", "grad_accum", "no_sync"),
        "sharding": None,
        "optimizer": ("name",),
    }
    return tuple(
        replace(section, settings=tuple(s for s in section.settings if keep[section.name] is None or s.key in keep[section.name]))
        for section in SECTIONS
        if section.name in keep
    )


PLAN_SECTIONS = _plan_sections()


def _command_parameters() -> list:
    import inspect

    own = [p for name, p in inspect.signature(plan, eval_str=True).parameters.items() if name != "settings"]
    return setting_parameters(PLAN_SECTIONS, panel_order=PANELS) + own


command_app = typer.Typer(add_completion=False)
command_app.command("plan", cls=FsdpkitCommand, help=HELP)(handle_errors(with_parameters(plan, _command_parameters())))
