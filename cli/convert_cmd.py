"""`fsdpkit convert SRC DST --to sharded|dcp|deepspeed|megatron|full`: parse the options into one ConvertRequest;
which of them apply is the library's table of formats (fsdpkit/checkpoint/offline/formats.py)."""

from __future__ import annotations

import functools
from typing import Any

import typer

from fsdpkit import log
from fsdpkit.checkpoint.core.request import ConvertRequest
from fsdpkit.checkpoint.offline.formats import READ_LABELS, TARGETS
from fsdpkit.progress import byte_progress
from fsdpkit.sizes import parse_size

from .checkpoint_options import CHUNK_HELP, MODEL_KEY_HELP, OPTIMIZER_KEY_HELP, cast_name, chunk_bytes, print_written
from .spread_options import DryRun, Restart, launch_options, run_spread_command, spread_command, spread_target


def convert(
    ctx: typer.Context,
    src: str = typer.Argument(..., help=f"Source checkpoint: {READ_LABELS} (an fsdpkit run or step directory)."),
    dst: str = typer.Argument(..., help="Destination directory (must not exist, unless --overwrite)."),
    to: str = typer.Option(
        ...,
        "--to",
        help=f"{' | '.join(TARGETS)}: dcp is FSDP2's layout chunked for --world-size ranks, deepspeed ZeRO --stage at N ranks.",
    ),
    world_size: int | None = typer.Option(None, "--world-size", help="Ranks of the sharded output (--to sharded) or of DCP's chunks."),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Lay out by this model's flat-parameter plan (--to sharded; default: even split per tensor);"
        " hf:DIR: the shape of a Megatron model (from or --to megatron) where its checkpoint records none.",
    ),
    max_shard_size: str | None = typer.Option(
        None, "--max-shard-size", help="Split full output into files of at most this size, e.g. 5GB (with model.safetensors.index.json)."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Cast floating tensors: bf16, fp16 or fp32 (ints and bools are kept)."),
    with_optimizer: bool = typer.Option(False, "--with-optimizer", help="Also convert the optimizer state (optimizer*.safetensors)."),
    stage: int | None = typer.Option(None, "--stage", help="DeepSpeed ZeRO stage of --to deepspeed: 1, 2 or 3."),
    chunk_size: str = typer.Option("512K", "--chunk-size", help=CHUNK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing DST."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
    dcp_model_key: str | None = typer.Option(None, "--dcp-model-key", help=MODEL_KEY_HELP),
    dcp_optimizer_key: str | None = typer.Option(None, "--dcp-optimizer-key", help=OPTIMIZER_KEY_HELP),
    dry_run: DryRun = False,
    restart: Restart = False,
    **settings: Any,
) -> None:
    """Convert a checkpoint of any format fsdpkit reads to fsdpkit's sharded one, full safetensors, torch DCP or DeepSpeed ZeRO."""
    request = ConvertRequest(
        to=to,
        world_size=world_size,
        model=model,
        max_shard_size=parse_size(max_shard_size) if max_shard_size is not None else None,
        cast_to=cast_name(dtype),
        with_optimizer=with_optimizer,
        model_key=dcp_model_key,
        optimizer_key=dcp_optimizer_key,
        stage=stage,
        chunk_size=chunk_bytes(chunk_size),
        overwrite=overwrite,
    )
    one_process = functools.partial(convert_in_one_process, src, dst, request)
    options, resumes = launch_options(
        ctx, settings, dry_run=dry_run, restart=restart, spreads=spread_target(to), locations=(src, dst), dst=dst
    )
    if options is not None:
        task = spread_task(src, dst, request, restart=restart, resumes=resumes)
        result = run_spread_command(task, options, dry_run=dry_run, as_json=as_json, early=ctx.obj, one_process=one_process)
        if result is None:
            return
    else:
        result = one_process()
    for line in result.warnings:
        log.warn(line)
    print_written(result, as_json)


def convert_in_one_process(src: str, dst: str, request: ConvertRequest) -> Any:
    from fsdpkit.checkpoint.spread.to_storage import convert_to

    with byte_progress("convert") as progress:
        return convert_to(src, dst, request, progress)


def spread_task(src: str, dst: str, request: ConvertRequest, *, restart: bool, resumes: bool = False) -> Any:
    """The spread run of `convert` (its machinery imported only when a convert is spread)."""
    from fsdpkit.checkpoint.spread.runner import SpreadTask

    chunk_size, overwrite = request.chunk_size, request.overwrite
    return SpreadTask("convert", str(src), str(dst), request, chunk_size=chunk_size, overwrite=overwrite, restart=restart, resumes=resumes)


command_app = spread_command("convert", convert)
