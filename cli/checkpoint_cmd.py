"""`fsdpkit convert`, `reshard`, `inspect`, `verify`: offline checkpoint commands.

None of these imports torch: they are byte-level copies over fragments (fsdpkit/checkpoint/format),
so peak memory stays bounded by --chunk-size plus a constant. Results go to stdout (a short
text summary, or one JSON document with --json); the progress bar (bytes) goes to stderr.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from fsdpkit import log
from fsdpkit.checkpoint.dcp.metadata import is_dcp_checkpoint
from fsdpkit.checkpoint.deepspeed.files import is_deepspeed_checkpoint
from fsdpkit.dtypes import from_spelling
from fsdpkit.errors import UsageError
from fsdpkit.host import available_memory_bytes
from fsdpkit.sizes import format_size, parse_size

from . import dcp_cmd, deepspeed_cmd
from .app import app
from .common import byte_progress, handle_errors, print_json

CHUNK_HELP = (
    "Bytes read, checked and written at a time; bounds memory. The default (512K) stays in the CPU cache, "
    "which is fastest on local disks (K/M/G = powers of 1024, KB/MB/GB = powers of 1000)."
)


def _progress_bar(desc: str, enabled: bool) -> contextlib.AbstractContextManager:
    """A bar when stderr is a terminal, else a plain line now and then (common.byte_progress)."""
    return byte_progress(desc) if enabled else contextlib.nullcontext()


def _cast(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    found = from_spelling(dtype)
    if found is None:
        raise UsageError(f"unknown --dtype {dtype!r}: use bf16, fp16 or fp32")
    return found.name


def _chunk(text: str) -> int:
    size = parse_size(text)
    if size < 1024:
        raise UsageError(f"--chunk-size {text!r} is {size} bytes; use at least 1K")
    available = available_memory_bytes()
    if 2 * size > available // 2:  # a chunk read ahead while one is written: two buffers
        raise UsageError(
            f"--chunk-size {text!r} needs two {format_size(size)} buffers, more than half the "
            f"{format_size(available)} of memory available: use at most {format_size(available // 4)}"
        )
    return size


def _world(world_size: int | None) -> int:
    if world_size is None:
        raise UsageError("--world-size is required")
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    return world_size


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print_json(result)
        return
    typer.echo(f"wrote {result['dst']}: {len(result['files'])} files, {result['tensors']} tensors, {format_size(result['bytes'])}")


@app.command("convert")
@handle_errors
def convert(
    src: Path = typer.Argument(..., help="Source checkpoint: sharded (run or step dir) for --to full; full safetensors for --to sharded."),
    dst: Path = typer.Argument(..., help="Destination directory (must not exist, unless --overwrite)."),
    to: str = typer.Option(..., "--to", help="full, sharded or dcp (torch DCP in FSDP2's layout, chunked for --world-size ranks)."),
    world_size: int | None = typer.Option(None, "--world-size", help="Ranks of the sharded output (--to sharded)."),
    model: str | None = typer.Option(
        None, "--model", help="Lay out by this model's flat-parameter plan (--to sharded); default: even split per tensor."
    ),
    max_shard_size: str | None = typer.Option(
        None, "--max-shard-size", help="Split full output into files of at most this size, e.g. 5GB (with model.safetensors.index.json)."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Cast floating tensors: bf16, fp16 or fp32 (ints and bools are kept)."),
    with_optimizer: bool = typer.Option(False, "--with-optimizer", help="Also convert the optimizer state (optimizer*.safetensors)."),
    chunk_size: str = typer.Option("512K", "--chunk-size", help=CHUNK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
    dcp_model_key: str | None = typer.Option(None, "--dcp-model-key", help=dcp_cmd.MODEL_KEY_HELP),
    dcp_optimizer_key: str | None = typer.Option(None, "--dcp-optimizer-key", help=dcp_cmd.OPTIMIZER_KEY_HELP),
) -> None:
    """Convert between sharded fsdpkit checkpoints, full Hugging Face-style safetensors and torch DCP."""
    from fsdpkit.checkpoint.offline.convert import FullOutput, convert_to_full, convert_to_sharded

    cast_to, chunk = _cast(dtype), _chunk(chunk_size)
    if is_dcp_checkpoint(src):
        options = dcp_cmd.ConvertOptions(
            to=to,
            world_size=world_size,
            model=model,
            max_shard_size=parse_size(max_shard_size) if max_shard_size is not None else None,
            cast_to=cast_to,
            with_optimizer=with_optimizer,
            chunk_size=chunk,
            overwrite=overwrite,
            model_key=dcp_model_key,
            optimizer_key=dcp_optimizer_key,
        )
        with _progress_bar("convert", True) as progress:
            result = dcp_cmd.convert_dcp(src, dst, options, progress)
    elif is_deepspeed_checkpoint(src) and dcp_model_key is None and dcp_optimizer_key is None:
        limit = parse_size(max_shard_size) if max_shard_size is not None else None
        with _progress_bar("convert", True) as progress:
            full = FullOutput(max_shard_size=limit, cast_to=cast_to, chunk_size=chunk, overwrite=overwrite, progress=progress)
            result = deepspeed_cmd.convert_deepspeed(
                src, dst, to=to, model=model, world_size=world_size, with_optimizer=with_optimizer, options=full
            )
    elif dcp_model_key is not None or dcp_optimizer_key is not None:
        raise UsageError(f"--dcp-model-key and --dcp-optimizer-key apply to DCP input; {src} is not a DCP checkpoint")
    elif to == "dcp":
        from fsdpkit.checkpoint.dcp.export import to_dcp

        if model is not None or max_shard_size is not None or cast_to is not None or with_optimizer:
            raise UsageError(
                "--model, --max-shard-size, --dtype and --with-optimizer do not apply to --to dcp (the optimizer state goes with it)"
            )

        result = to_dcp(src, dst, world_size=world_size or 1, chunk_size=chunk, overwrite=overwrite)
    elif to == "full":
        if world_size is not None or model is not None:
            raise UsageError("--world-size and --model apply to --to sharded only")
        limit = parse_size(max_shard_size) if max_shard_size is not None else None
        if limit is not None and limit < 1:
            raise UsageError(f"--max-shard-size must be positive, got {max_shard_size!r}")
        with _progress_bar("convert", True) as progress:
            options = FullOutput(max_shard_size=limit, cast_to=cast_to, chunk_size=chunk, overwrite=overwrite, progress=progress)
            result = convert_to_full(src, dst, with_optimizer=with_optimizer, options=options)
    elif to == "sharded":
        if max_shard_size is not None:
            raise UsageError("--max-shard-size applies to --to full only")
        ranks = _world(world_size)
        placement, aliases = None, {}
        if model is not None:
            from fsdpkit.checkpoint.offline.model_description import describe

            description = describe(model)
            placement, aliases = description.placement, description.aliases
        with _progress_bar("convert", True) as progress:
            result = convert_to_sharded(
                src,
                dst,
                world_size=ranks,
                placement=placement,
                placement_source=f"model {model!r}",
                aliases=aliases,
                cast_to=cast_to,
                with_optimizer=with_optimizer,
                chunk_size=chunk,
                overwrite=overwrite,
                progress=progress,
            )
    else:
        raise UsageError(f"unknown --to {to!r}: use full, sharded or dcp")
    for line in result.get("warnings", []):
        log.warn(line)
    _print_result(result, as_json)


@app.command("reshard")
@handle_errors
def reshard(
    src: Path = typer.Argument(..., help="Sharded checkpoint (run or step directory)."),
    dst: Path = typer.Argument(..., help="Destination directory (must not exist, unless --overwrite)."),
    world_size: int | None = typer.Option(None, "--world-size", help="Number of ranks of the new layout."),
    chunk_size: str = typer.Option("512K", "--chunk-size", help=CHUNK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
) -> None:
    """Lay a sharded checkpoint out for another world size, offline (model and optimizer state)."""
    from fsdpkit.checkpoint.offline.convert import reshard as reshard_checkpoint

    ranks, chunk = _world(world_size), _chunk(chunk_size)
    if is_dcp_checkpoint(src):
        from fsdpkit.checkpoint.dcp.export import reshard_dcp

        _print_result(reshard_dcp(src, dst, world_size=ranks, chunk_size=chunk, overwrite=overwrite), as_json)
        return
    with _progress_bar("reshard", True) as progress:
        result = reshard_checkpoint(
            src,
            dst,
            world_size=ranks,
            chunk_size=chunk,
            overwrite=overwrite,
            progress=progress,
            warn=log.warn,
        )
    _print_result(result, as_json)


@app.command("inspect")
@handle_errors
def inspect(
    ckpt: Path = typer.Argument(..., help="A checkpoint: sharded (run or step dir) or full safetensors."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON document."),
    dcp_model_key: str | None = typer.Option(None, "--dcp-model-key", help=dcp_cmd.MODEL_KEY_HELP),
    dcp_optimizer_key: str | None = typer.Option(None, "--dcp-optimizer-key", help=dcp_cmd.OPTIMIZER_KEY_HELP),
) -> None:
    """Summarize a checkpoint: format, world size, step, tensors and bytes, dtypes, largest tensors, files."""
    from fsdpkit.checkpoint.offline.verify import summarize

    if is_dcp_checkpoint(ckpt):
        dcp_cmd.inspect_dcp(ckpt, as_json=as_json, model_key=dcp_model_key, optimizer_key=dcp_optimizer_key)
        return
    if is_deepspeed_checkpoint(ckpt):
        deepspeed_cmd.inspect_deepspeed(ckpt, as_json=as_json)
        return
    summary = summarize(ckpt)
    if as_json:
        print_json(summary)
        return
    lines = [
        f"path        {summary['path']}",
        f"format      {summary['format']}" + (f" v{summary['version']}" if "version" in summary else ""),
    ]
    if "world_size" in summary:
        lines += [
            f"world size  {summary['world_size']}  strategy {summary['strategy']}  "
            f"placement {summary['placement']} ({summary['units']} units)",
            f"step        {summary['step']}  samples {summary['samples']}",
        ]
    if summary.get("config"):
        lines.append(f"run         {_run_settings(summary['config'])}")
    lines += [
        f"model       {summary['model']['tensors']} tensors, {summary['model']['elements']:,} elements, "
        f"{format_size(summary['model']['bytes'])}",
        f"optimizer   {summary['optimizer']['tensors']} tensors, {format_size(summary['optimizer']['bytes'])}",
        "dtypes      " + ", ".join(f"{k}: {v}" for k, v in summary["dtypes"].items()),
        "largest     " + "; ".join(f"{t['name']} {t['dtype']}{t['shape']} {format_size(t['bytes'])}" for t in summary["largest"]),
        f"files       {len(summary['files'])}, {format_size(sum(f['size'] for f in summary['files']))}",
    ]
    if summary["aliases"]:
        lines.append("tied        " + ", ".join(f"{a} -> {t}" for a, t in summary["aliases"].items()))
    typer.echo("\n".join(lines))


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


@app.command("verify")
@handle_errors
def verify(
    ckpt: Path = typer.Argument(..., help="A checkpoint: sharded (run or step dir) or full safetensors."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> None:
    """Check every checksum, file size, header, fragment coverage and path; exit 3 when anything is wrong."""
    from fsdpkit.checkpoint.offline.verify import verify_checkpoint

    if is_dcp_checkpoint(ckpt):
        report = dcp_cmd.verify_dcp(ckpt, as_json=as_json)
    elif is_deepspeed_checkpoint(ckpt):
        report = deepspeed_cmd.verify_deepspeed(ckpt, as_json=as_json)
    else:
        with _progress_bar("verify", True) as progress:
            report = verify_checkpoint(ckpt, progress=progress)
        _print_verify(report, as_json)
    if not report["ok"]:
        more = len(report["problems"]) - 1
        typer.echo(f"error: {report['problems'][0]}" + (f" (+{more} more problems, listed by --json)" if more else ""), err=True)
        raise typer.Exit(3)


def _print_verify(report: dict, as_json: bool) -> None:
    if as_json:
        print_json(report)
    elif report["ok"]:
        typer.echo(f"ok {report['path']}: {_what_verify_checked(report)}")


def _what_verify_checked(report: dict) -> str:
    size = format_size(report["bytes"])
    if report["kind"] == "full":
        return (
            f"full safetensors, {report['tensors']} tensors in {report['files']} files, {size}: headers, file sizes and the index "
            "checked (this format has no checksums)"
        )
    return (
        f"sharded, {report['tensors']} tensors, {size}: the crc32 of all {report['fragments']} fragments, file sizes, "
        "headers, fragment coverage and file names checked"
    )
