"""`fsdpkit train`: build the config from a file and the flags, run the library, print the summary.

Every training flag is made from a field of fsdpkit.train.config (see settings_options); this
module only adds --config, --print-config and --json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fsdpkit import log
from fsdpkit.settings import merge, read_toml, to_toml
from fsdpkit.sizes import count, format_size
from fsdpkit.train.config import SECTIONS, TOP
from fsdpkit.train.summary import TrainSummary

from .common import FsdpkitCommand, handle_errors, print_json
from .settings_options import given_values, setting_parameters, with_parameters

ALL_SECTIONS = (TOP, *SECTIONS)
# --print-config shows first the sections, and in each the keys, that runs change most (TOML's order is free).
SHOWN_FIRST: dict[str, tuple[str, ...]] = {
    "model": ("name",),
    "optimizer": ("lr", "warmup_steps", "schedule", "decay_steps"),
    "data": ("source", "seq_len", "global_batch_size", "grad_accum"),
    "checkpoint": ("save_dir", "save_every", "keep_last", "resume"),
    "launch": ("nproc_per_node", "nnodes"),
}
PANELS = ("Model", "Data", "Sharding", "Precision", "Memory", "Overlap", "Communication", "Optimizer", "Checkpoints", "Launch", "Output")

HELP = """Train a model with fsdpkit's sharded engine across several processes.

Settings come from the flags below, over --config FILE (TOML, the same settings nested in
tables: steps = 100, [optimizer] lr = 0.001, ...), over the defaults. torchrun's underscore
spellings (--nproc_per_node) are accepted for every flag, and every on/off flag --x has a
--no-x that turns off what a config file turned on.

Throughput (tokens/s) = global batch size x sequence length per training step, divided by the
training steps' time (no evaluation or saving), over every step but the first."""


def train(
    ctx: typer.Context,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config", help="Read settings from this TOML file first (flags override it).", rich_help_panel="Output", metavar="FILE"
        ),
    ] = None,
    print_config: Annotated[
        bool,
        typer.Option(
            "--print-config",
            help="Print the effective config as TOML and exit (save it, replay it with --config).",
            rich_help_panel="Output",
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON document on stdout.", rich_help_panel="Output")
    ] = False,
    **settings: Any,
) -> None:
    from fsdpkit.train.resume import train_config  # no torch: every flag is checked before torch is imported

    values = read_toml(str(config_file)) if config_file is not None else {}
    where = f" in {config_file}" if config_file is not None else ""  # only a file can hold an unknown key
    config, overrides = train_config(merge(values, given_values(ALL_SECTIONS, ctx, settings)), where=where)
    log.setup(quiet=config.logging.quiet)
    for line in overrides:
        log.warn(line)
    if print_config:
        typer.echo(
            to_toml(most_changed_first(config.to_values()), header="fsdpkit train config (fsdpkit train --config FILE replays it)"),
            nl=False,
        )
        return
    from fsdpkit.train.launcher import run_training

    summary = run_training(config)
    if summary is None:
        return
    if json_output:
        print_json(summary.to_json())
    else:
        typer.echo(format_summary(summary))


def most_changed_first(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (the top-level keys, then one table per section) reordered by SHOWN_FIRST."""
    tables = [name for name in SHOWN_FIRST if name in values] + [name for name in values if name not in SHOWN_FIRST]
    ordered = {}
    for name in tables:
        table = values[name]
        if isinstance(table, dict):
            first = [key for key in SHOWN_FIRST.get(name, ()) if key in table]
            table = {key: table[key] for key in [*first, *(key for key in table if key not in first)]}
        ordered[name] = table
    return ordered


def format_summary(summary: TrainSummary) -> str:
    losses, step_rate = summary.losses, summary.step_tokens_per_second
    lines = [
        f"model            {summary.model} ({summary.num_params:,} parameters)",
        f"world size       {summary.world_size} ({summary.strategy} sharding, {summary.device}, mixed precision {summary.mixed_precision})",
        f"steps            {summary.steps} x {summary.global_batch_size} sequences x {summary.seq_len} tokens",
        f"resumed from     step {summary.resumed_from_step}" if summary.resumed_from_step is not None else "",
        f"learning rate    {summary.lr:g} peak" if summary.lr is not None else "",
        f"loss             {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "loss             (no steps run)",
        f"throughput       {summary.tokens_per_second:,.0f} tokens/s over {summary.elapsed_seconds:.1f} s of wall time (saves included)",
        f"step throughput  {step_rate:,.0f} tokens/s in the steps alone (steps after the first)" if step_rate else "",
        f"peak memory      {format_size(summary.peak_memory_bytes)} per rank (max over ranks)",
    ]
    for entry in summary.eval_losses:
        lines.append(f"eval loss        {entry['loss']:.4f} at step {entry['step']}")
    if summary.restarts:
        redone = summary.steps_redone
        lines.append(f"restarts         {summary.restarts}" + (f" ({redone} steps run again)" if redone is not None else ""))
    for entry in summary.recoveries:
        lines.append(f"recovered        {recovery_line(entry)}")
    if summary.preempted:
        lines.append(
            f"preempted        stopped after step {summary.steps} (SIGTERM)" + ("; continue with --resume" if summary.checkpoint else "")
        )
    lines.append(f"checkpoint       {summary.checkpoint or 'not saved (no --save-dir)'}")
    saves = (summary.save_timings or {}).get("saves")
    if saves:
        stall = f"{summary.save_stall_s:.2f} s in the training thread between steps"
        lines.append(f"save stall       {stall} ({count(saves, 'save')}; max over ranks)")
    if summary.snapshot_stall_s:
        lines.append(f"snapshot stall   {summary.snapshot_stall_s:.2f} s in the training thread (max over ranks)")
    return "\n".join(line for line in lines if line)


def recovery_line(entry: dict) -> str:
    """One restart: where from, its step, steps redone, and the seconds it took, split."""
    line = f"from {entry['source']} at step {entry['step']}, {entry['steps_redone']} steps run again"
    if entry.get("recovery_s") is not None:
        line += (
            f", {entry['recovery_s']:.1f} s to the next step (relaunch {entry['relaunch_s']:.1f}, "
            f"rendezvous {entry['rendezvous_s']:.1f}, restore {entry['restore_s']:.1f})"
        )
    return line


def _command_parameters() -> list:
    import inspect

    own = [p for name, p in inspect.signature(train, eval_str=True).parameters.items() if name != "settings"]
    return setting_parameters(ALL_SECTIONS, panel_order=PANELS) + own


command_app = typer.Typer(add_completion=False)
command_app.command("train", cls=FsdpkitCommand, help=HELP)(handle_errors(with_parameters(train, _command_parameters())))
