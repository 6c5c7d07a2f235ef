"""`fsdpkit inspect CKPT`: a checkpoint's summary, in any format fsdpkit reads, as text or JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from fsdpkit.checkpoint.core.request import Keys
from fsdpkit.checkpoint.core.summary import FullSummary, ShardedSummary, Summary
from fsdpkit.checkpoint.offline.formats import DCP, DEEPSPEED, MEGATRON, READ_LABELS, TORCH_SAVE
from fsdpkit.sizes import format_size

from .checkpoint_options import MODEL_KEY_HELP, OPTIMIZER_KEY_HELP
from .common import handle_errors, print_json

if TYPE_CHECKING:
    from fsdpkit.checkpoint.dcp.inspect import DcpSummary
    from fsdpkit.checkpoint.megatron.inspect import MegatronSummary

command_app = typer.Typer(add_completion=False)


@command_app.command("inspect")
@handle_errors
def inspect(
    ckpt: str = typer.Argument(
        ..., help=f"A checkpoint: {READ_LABELS} (an fsdpkit run or step directory); fsdpkit's and DCP also at s3://, gs://, az://."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON document."),
    dcp_model_key: str | None = typer.Option(None, "--dcp-model-key", help=MODEL_KEY_HELP),
    dcp_optimizer_key: str | None = typer.Option(None, "--dcp-optimizer-key", help=OPTIMIZER_KEY_HELP),
) -> None:
    """Summarize a checkpoint: format, world size, step, tensors and bytes, dtypes, largest tensors, files."""
    from fsdpkit.checkpoint.offline.locations import inspect_at

    from .deepspeed_cmd import inspect_lines, torchsave_lines

    name, summary = inspect_at(ckpt, Keys(dcp_model_key, dcp_optimizer_key))
    text = {DCP: _dcp_lines, MEGATRON: _megatron_lines, DEEPSPEED: inspect_lines, TORCH_SAVE: torchsave_lines}.get(name, _lines)
    if as_json:
        print_json(summary.to_json())
    else:
        typer.echo("\n".join(text(summary)))


def _lines(summary: FullSummary) -> list[str]:
    sharded = summary if isinstance(summary, ShardedSummary) else None
    lines = [f"path        {summary.path}", f"format      {summary.format}" + (f" v{sharded.version}" if sharded else "")]
    if sharded:
        lines += [
            f"world size  {sharded.world_size}  strategy {sharded.strategy}  placement {sharded.placement} ({sharded.units} units)",
            f"step        {'unknown' if sharded.step is None else sharded.step}"
            + (f"  samples {sharded.samples}" if sharded.samples is not None else ""),  # a converted checkpoint counts none
        ]
        if sharded.config:
            lines.append(f"run         {_run_settings(sharded.config)}")
        if sharded.data_position:
            lines.append(f"data        {_data_position(sharded.data_position)}")
    lines += [
        f"model       {summary.model.tensors} tensors, {summary.model.elements:,} elements, {format_size(summary.model.bytes)}",
        f"optimizer   {summary.optimizer.tensors} tensors, {format_size(summary.optimizer.bytes)}",
        *tensor_lines(summary),
    ]
    if summary.aliases:
        lines.append("tied        " + ", ".join(f"{a} -> {t}" for a, t in summary.aliases.items()))
    return lines


def _data_position(position: dict) -> str:
    def at(p: dict) -> str:
        return f"epoch {p.get('epoch')}, shard {p.get('shard_name', p.get('shard'))} row {p.get('row')} token {p.get('token')}"

    if position.get("kind") == "streamed":
        return "streamed, next: " + "; ".join(f"rank {r}: {at(p)}" for r, p in enumerate(position.get("ranks") or []))
    return f"packed, next: window {position.get('window')} of {position.get('windows')}, {at(position)}"


def _run_settings(config: dict) -> str:
    """The main settings of the training run that saved a checkpoint, in one line."""
    model, data = config.get("model") or {}, config.get("data") or {}
    optimizer, sharding = config.get("optimizer") or {}, config.get("sharding") or {}
    accum = f" (grad-accum {data['grad_accum']})" if data.get("grad_accum", 1) != 1 else ""
    return (
        f"{model.get('name')}: {data.get('seq_len')} tokens x {data.get('global_batch_size')} sequences{accum}, "
        f"{optimizer.get('name')} lr {optimizer.get('lr')} {optimizer.get('schedule')}, precision {sharding.get('mixed_precision')}, "
        f"data {data.get('source')}, seed {config.get('seed')}"
    )


def _dcp_lines(summary: DcpSummary) -> list[str]:
    lines = [
        f"path        {summary.path}",
        f"format      dcp v{summary.version} ({', '.join(summary.serialization) or 'no tensors'})",
        f"layout      model key {summary.model_key!r}, optimizer key {summary.optimizer_key!r}",
        f"model       {summary.model.tensors} tensors, {summary.model.elements:,} elements, {format_size(summary.model.bytes)}",
        f"optimizer   {summary.optimizer.tensors} tensors, {format_size(summary.optimizer.bytes)}",
        f"chunks      {summary.chunks} in {len(summary.tensors)} tensors",
        *tensor_lines(summary),
    ]
    if summary.other_tensors:
        lines.append("other       " + ", ".join(summary.other_tensors[:8]) + (" ..." if len(summary.other_tensors) > 8 else ""))
    if summary.bytes_items:
        size = format_size(sum(b.bytes for b in summary.bytes_items))
        lines.append(f"bytes items {len(summary.bytes_items)}, {size} (never unpickled), by key:")
        lines += item_lines(summary.items)
    return lines


def _megatron_lines(summary: MegatronSummary) -> list[str]:
    parallel = ", ".join(f"{name} {size}" for name, size in summary.parallel.items()) or "not recorded"
    shape = ", ".join(f"{k} {v}" for k, v in summary.model_shape.items() if k != "recorded_by")
    recorded = summary.model_shape.get("recorded_by") or "heads and query groups not recorded (convert takes --model hf:DIR)"
    return [
        f"path        {summary.path}",
        f"format      megatron {summary.generation}" + (", NeMo 2 (context/ + weights/)" if summary.nemo else ""),
        f"parallel    {parallel}",
        f"shape       {shape}",
        f"recorded by {recorded}",
        f"model       {summary.model.tensors} stored tensors, {summary.model.elements:,} elements, {format_size(summary.model.bytes)}",
        f"optimizer   {summary.optimizer_kind or 'none'}: {summary.optimizer.tensors} tensors, {format_size(summary.optimizer.bytes)}",
        f"stored      {summary.stored_keys} tensor keys, {summary.bytes_items} bytes items (never unpickled)",
        "common      " + (", ".join(summary.common_keys) or "empty"),
        *tensor_lines(summary),
    ]


def tensor_lines(summary: Summary, *, files_read: str = "") -> list[str]:
    """The dtypes, the largest tensors (each by its `label`) and the files, in any format's summary."""
    files = summary.files
    return [
        "dtypes      " + ", ".join(f"{k}: {v}" for k, v in summary.dtypes.items()),
        "largest     " + "; ".join(f"{t.label} {t.dtype}{t.shape} {format_size(t.bytes)}" for t in summary.largest),
        f"files       {len(files)}{files_read}, {format_size(sum(f.size for f in files))}",
    ]


def item_lines(groups: dict[str, int]) -> list[str]:
    """The non-tensor items, one line per top-level key with its count."""
    return [f"  {key} ({count} item{'s' if count != 1 else ''})" for key, count in groups.items()]
