"""DeepSpeed input of the offline commands: the text forms of `inspect` and `verify` of a
DeepSpeed ZeRO checkpoint, and `convert --to full` (checkpoint_cmd dispatches here when the
path is a DeepSpeed save or tag directory)."""

from __future__ import annotations

from pathlib import Path

import typer

from fsdpkit.errors import UsageError
from fsdpkit.sizes import format_size

from .common import print_json


def inspect_deepspeed(path: Path, *, as_json: bool) -> None:
    from fsdpkit.checkpoint.deepspeed.inspect import summarize_deepspeed

    s = summarize_deepspeed(path)
    if as_json:
        print_json(s)
        return
    model, optim = s["model"], s["optimizer"]
    tied = ", ".join(f"{a} -> {t}" for a, t in model["tied"].items()) or "none"
    lines = [
        f"path        {s['path']} (tag {s['tag']})",
        f"format      deepspeed ZeRO-{s['stage']}, {s['precision']}, {s['world_size']} ranks, ds_version {s['ds_version']}",
        f"step        {s['global_steps']}",
        f"model       {model['tensors']} tensors ({model['trainable']} trainable as fp32 masters, {len(model['frozen'])} frozen, "
        f"{len(model['buffers'])} buffers), {model['elements']:,} elements, {format_size(model['bytes'])}; tied: {tied}",
        f"optimizer   {optim['tensors']} tensors ({', '.join(optim['states']) or 'none'}), {format_size(optim['bytes'])}, "
        f"{len(optim['param_groups'])} param groups",
        "dtypes      " + ", ".join(f"{k}: {v}" for k, v in s["dtypes"].items()),
        "largest     " + "; ".join(f"{t['name']} {t['dtype']}{t['shape']} {format_size(t['bytes'])}" for t in s["largest"]),
        f"files       {len(s['files'])}, {format_size(sum(f['size'] for f in s['files']))}",
        "items       " + ", ".join(f"{key} ({count})" for key, count in s["items"].items()),
    ]
    typer.echo("\n".join(lines))


def verify_deepspeed(path: Path, *, as_json: bool) -> dict:
    from fsdpkit.checkpoint.deepspeed.inspect import verify_deepspeed as verify

    report = verify(path)
    if as_json:
        print_json(report)
    elif report["ok"]:
        typer.echo(
            f"ok {report['path']}: deepspeed, {report['tensors']} tensors, {report['files']} files, {format_size(report['bytes'])}; "
            f"checked: {'; '.join(report['checked'])}"
        )
    return report


def convert_deepspeed(src: Path, dst: Path, *, to: str, model: str | None, world_size: int | None, with_optimizer: bool, options) -> dict:  # type: ignore[no-untyped-def]
    """`convert` of a DeepSpeed checkpoint: --to full (--model adds config.json), --to sharded."""
    if to == "sharded":
        return _to_sharded(src, dst, model=model, world_size=world_size, options=options)
    if to != "full":
        raise UsageError(f"--to {to} of a DeepSpeed checkpoint is not supported yet: use --to full or --to sharded")
    if world_size is not None:
        raise UsageError("--world-size applies to --to sharded only")
    from fsdpkit.checkpoint.deepspeed.convert import deepspeed_to_full

    export = None
    if model is not None:
        from fsdpkit.checkpoint.offline.model_description import describe

        export = describe(model).export
    return deepspeed_to_full(src, dst, export=export, with_optimizer=with_optimizer, options=options)


def _to_sharded(src: Path, dst: Path, *, model: str | None, world_size: int | None, options) -> dict:  # type: ignore[no-untyped-def]
    if world_size is None or model is None:
        raise UsageError("--to sharded from DeepSpeed needs --world-size and --model (the model whose flat-parameter layout to write)")
    if options.max_shard_size is not None or options.cast_to is not None:
        raise UsageError("--max-shard-size and --dtype do not apply to --to sharded from DeepSpeed")
    from fsdpkit.checkpoint.dcp.to_sharded import ShardedTarget
    from fsdpkit.checkpoint.deepspeed.convert import deepspeed_to_sharded
    from fsdpkit.checkpoint.offline.model_description import describe

    description = describe(model)
    target = ShardedTarget(
        world_size,
        description.placement,
        f"model {model!r}",
        description.aliases,
        description.export,
        options.chunk_size,
        options.overwrite,
        options.progress,
    )
    return deepspeed_to_sharded(src, dst, target)
