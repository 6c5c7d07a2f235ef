"""`fsdpkit plan`: per-rank memory of a sharded run before launching it. Parse, plan, format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fsdpkit.plan.profile import CALIBRATE_SECONDS
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
    comm = plan.comm_per_step
    if comm is not None:
        gather = "int8" if request.sharding.allgather_dtype == "int8" else "compute dtype"
        lines.append(f"# collective bytes per training step (tensor bytes, as comm_stats counts them; all-gather in {gather})")
        for kind, value in comm.as_dict().items():
            row(kind.replace("_", "-"), value, "network")
    return "\n".join(lines)


HELP = """Per-rank memory in bytes of training --model on --world-size ranks: sharded parameters,
gradients, optimizer state, the unsharded units in flight at the peak, and the total. Builds the
model on the meta device only: seconds for any size. Activations are not included.

The model, data, sharding, precision, memory and overlap flags are train's own (same spellings,
defaults and --config file)."""

PANELS = ("Model", "Data", "Sharding", "Precision", "Memory", "Overlap", "Communication", "Optimizer", "Time", "Output")
BUILT_IN_NAMES = ("a100-40gb-ib100|200|400", "a100-80gb-ib100|200|400", "h100-ib400", "h200-ib400", "cpu-gloo")


WorldSize = Annotated[int, typer.Option("--world-size", help="Ranks in the data-parallel group.", rich_help_panel="Sharding")]
TimeFlag = Annotated[
    bool, typer.Option("--time", help="Also predict the step time, MFU, TFLOPS and tokens/s on --hardware.", rich_help_panel="Time")
]
HardwareOption = Annotated[
    str | None,
    typer.Option(
        "--hardware",
        help=f"A built-in profile ({', '.join(BUILT_IN_NAMES)}) or a FILE.toml (--calibrate writes one).",
        rich_help_panel="Time",
        metavar="NAME|FILE",
    ),
]
NodesOption = Annotated[
    int | None,
    typer.Option("--nodes", help="Spread the ranks over K nodes (default: the profile's ranks per node).", rich_help_panel="Time"),
]
RecommendFlag = Annotated[
    bool,
    typer.Option(
        "--recommend",
        help="The fastest configurations that fit (strategy, group, prefetch, limiter, checkpointing, micro-batch).",
        rich_help_panel="Time",
    ),
]
ScalingOption = Annotated[
    str | None,
    typer.Option(
        "--scaling",
        help="Predicted TFLOPS/device at these world sizes (same micro-batch per rank): 8,64,512.",
        rich_help_panel="Time",
        metavar="LIST",
    ),
]
CalibrateOption = Annotated[
    Path | None,
    typer.Option(
        "--calibrate",
        help="Measure this machine (compute with --model on one rank, gloo collectives on --world-size ranks) and write a profile.",
        rich_help_panel="Time",
        metavar="OUT.toml",
    ),
]
CalibrateSecondsOption = Annotated[
    float,
    typer.Option(
        "--calibrate-seconds",
        min=0,
        help="How long --calibrate times compute and the bus bandwidth, at least (the other steps: twice this).",
        rich_help_panel="Time",
        metavar="S",
    ),
]
ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="Read settings from a train --config TOML file first.", rich_help_panel="Output", metavar="FILE"),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of the table.", rich_help_panel="Output")]


def plan(
    ctx: typer.Context,
    world_size: WorldSize,
    time: TimeFlag = False,
    hardware: HardwareOption = None,
    nodes: NodesOption = None,
    recommend: RecommendFlag = False,
    scaling: ScalingOption = None,
    calibrate: CalibrateOption = None,
    calibrate_seconds: CalibrateSecondsOption = CALIBRATE_SECONDS,
    config_file: ConfigOption = None,
    json_output: JsonFlag = False,
    **settings: Any,
) -> None:
    from fsdpkit.plan.memory import plan_memory

    request = _train_config(ctx, config_file, settings).plan_request(world_size)
    if calibrate is not None:
        _calibrate(request, calibrate, calibrate_seconds)
    elif time or recommend or scaling is not None:
        from .plan_time_output import run_time_plan

        run_time_plan(request, hardware=hardware, nodes=nodes, recommend=recommend, scaling=scaling, json_output=json_output)
    elif json_output:
        print_json(plan_memory(request).to_document())
    else:
        typer.echo(format_plan(plan_memory(request)))


def _calibrate(request, out: Path, seconds: float) -> None:
    from fsdpkit.errors import UsageError
    from fsdpkit.plan.calibrate import calibrate
    from fsdpkit.plan.profile import to_toml

    if out.is_dir() or not out.resolve().parent.is_dir():
        raise UsageError(f"--calibrate {str(out)!r} must be a file in an existing directory")
    if request.world_size < 2:
        raise UsageError("--calibrate measures collectives: it needs --world-size >= 2")
    profile = calibrate(request, ranks=request.world_size, seconds=seconds)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(to_toml(profile, header="fsdpkit hardware profile (fsdpkit plan --time --hardware FILE)"))
    partial.replace(out)
    typer.echo(f"wrote {out}")


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
