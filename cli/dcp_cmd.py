"""DCP input and output of the offline commands: the text forms of `inspect` and `verify` of a
DCP checkpoint (checkpoint_cmd dispatches here when the path holds DCP's `.metadata`), and the
`--dcp-model-key` / `--dcp-optimizer-key` options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from fsdpkit.errors import UsageError
from fsdpkit.sizes import format_size

from .common import print_json

MODEL_KEY_HELP = "DCP input: the top-level key of the model state ('' = the top level); found by itself by default."
OPTIMIZER_KEY_HELP = "DCP input: the top-level key of the optimizer state; found by itself by default."


def inspect_dcp(path, *, as_json: bool, model_key: str | None, optimizer_key: str | None) -> None:
    from fsdpkit.checkpoint.dcp.inspect import summarize_dcp

    summary = summarize_dcp(path, model_key=model_key, optimizer_key=optimizer_key)
    if as_json:
        print_json(summary)
        return
    lines = [
        f"path        {summary['path']}",
        f"format      dcp v{summary['version']} ({', '.join(summary['serialization']) or 'no tensors'})",
        f"layout      model key {summary['model_key']!r}, optimizer key {summary['optimizer_key']!r}",
        f"model       {summary['model']['tensors']} tensors, {summary['model']['elements']:,} elements, "
        f"{format_size(summary['model']['bytes'])}",
        f"optimizer   {summary['optimizer']['tensors']} tensors, {format_size(summary['optimizer']['bytes'])}",
        f"chunks      {summary['chunks']} in {len(summary['tensors'])} tensors",
        "dtypes      " + ", ".join(f"{k}: {v}" for k, v in summary["dtypes"].items()),
        "largest     " + "; ".join(f"{t['key']} {t['dtype']}{t['shape']} {format_size(t['bytes'])}" for t in summary["largest"]),
        f"files       {len(summary['files'])}, {format_size(sum(f['size'] for f in summary['files']))}",
    ]
    if summary["other_tensors"]:
        lines.append("other       " + ", ".join(summary["other_tensors"][:8]) + (" ..." if len(summary["other_tensors"]) > 8 else ""))
    if summary["bytes_items"]:
        items = summary["bytes_items"]
        lines.append(
            f"bytes items {len(items)} (never unpickled): "
            + ", ".join(f"{b['key']} {format_size(b['bytes'])}" for b in items[:6])
            + (" ..." if len(items) > 6 else "")
        )
    typer.echo("\n".join(lines))


def verify_dcp(path, *, as_json: bool) -> dict:
    from fsdpkit.checkpoint.dcp.inspect import verify_dcp as verify

    report = verify(path)
    if as_json:
        print_json(report)
    elif report["ok"]:
        typer.echo(
            f"ok {report['path']}: dcp, {report['tensors']} tensors, {report['chunks']} chunks, {report['bytes_items']} bytes items, "
            f"{format_size(report['bytes'])}; checked: {'; '.join(report['checked'])}; not checked: {'; '.join(report['not_checked'])}"
        )
    return report


@dataclass(frozen=True)
class ConvertOptions:
    to: str
    world_size: int | None
    model: str | None
    max_shard_size: int | None
    cast_to: str | None
    with_optimizer: bool
    chunk_size: int
    overwrite: bool
    model_key: str | None
    optimizer_key: str | None


def convert_dcp(src: Path, dst: Path, options: ConvertOptions, progress) -> dict:
    """`convert` of a DCP checkpoint: --to full (--model adds config.json and transformers' names)."""
    if options.to == "full":
        from fsdpkit.checkpoint.dcp.convert import dcp_to_full
        from fsdpkit.checkpoint.offline.convert import FullOutput

        if options.world_size is not None:
            raise UsageError("--world-size applies to --to sharded only")
        export = None
        if options.model is not None:
            from fsdpkit.checkpoint.offline.model_description import describe

            export = describe(options.model).export
        return dcp_to_full(
            src,
            dst,
            export=export,
            model_key=options.model_key,
            optimizer_key=options.optimizer_key,
            with_optimizer=options.with_optimizer,
            options=FullOutput(
                max_shard_size=options.max_shard_size,
                cast_to=options.cast_to,
                chunk_size=options.chunk_size,
                overwrite=options.overwrite,
                progress=progress,
            ),
        )
    if options.to == "sharded":
        return _to_sharded(src, dst, options, progress)
    if options.to == "dcp":
        from fsdpkit.checkpoint.dcp.export import reshard_dcp

        return reshard_dcp(src, dst, world_size=options.world_size or 1, chunk_size=options.chunk_size, overwrite=options.overwrite)
    raise UsageError(f"unknown --to {options.to!r} for DCP input: use full, sharded or dcp")


def _to_sharded(src: Path, dst: Path, options: ConvertOptions, progress) -> dict:
    from fsdpkit.checkpoint.dcp.to_sharded import dcp_to_sharded

    if options.world_size is None or options.model is None:
        raise UsageError("--to sharded from DCP needs --world-size and --model (the model whose flat-parameter layout to write)")
    if options.max_shard_size is not None or options.cast_to is not None:
        raise UsageError("--max-shard-size and --dtype do not apply to --to sharded from DCP")
    from fsdpkit.checkpoint.offline.model_description import describe

    description = describe(options.model)
    return dcp_to_sharded(
        src,
        dst,
        world_size=options.world_size,
        placement=description.placement,
        placement_source=f"model {options.model!r}",
        aliases=description.aliases,
        export=description.export,
        model_key=options.model_key,
        optimizer_key=options.optimizer_key,
        chunk_size=options.chunk_size,
        overwrite=options.overwrite,
        progress=progress,
    )
