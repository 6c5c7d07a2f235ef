"""`convert` through the route table (routes.py): tell the source format, check the options
against its route, run the route's function. One function per route below, each taking
(src, dst, request, progress) and returning the JSON-able result; none imports torch (`--model`
is described by a child process, model_description.py)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from .convert import FullOutput, Progress
from .formats import detect_format
from .routes import ConvertRequest, route_for

if TYPE_CHECKING:
    from ..dcp.export import DcpOutput
    from .dcp_to_sharded import ShardedTarget


def _resolve(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def convert(src: str | Path, dst: str | Path, request: ConvertRequest, progress: Progress | None = None) -> dict:
    route = route_for(detect_format(src).name, request)
    return _resolve(route.converter)(Path(src), Path(dst), request, progress)


def _full_output(request: ConvertRequest, progress: Progress | None) -> FullOutput:
    return FullOutput(
        max_shard_size=request.max_shard_size,
        cast_to=request.cast_to,
        chunk_size=request.chunk_size,
        overwrite=request.overwrite,
        progress=progress,
    )


def sharded_to_full(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .convert import convert_to_full

    return convert_to_full(src, dst, with_optimizer=request.with_optimizer, options=_full_output(request, progress))


def full_to_sharded(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .convert import convert_to_sharded
    from .model_description import describe

    assert request.world_size is not None  # required by the route
    description = describe(request.model) if request.model is not None else None
    return convert_to_sharded(
        src,
        dst,
        world_size=request.world_size,
        placement=description.placement if description is not None else None,
        placement_source=f"model {request.model!r}",
        aliases=description.aliases if description is not None else {},
        cast_to=request.cast_to,
        with_optimizer=request.with_optimizer,
        chunk_size=request.chunk_size,
        overwrite=request.overwrite,
        progress=progress,
    )


def sharded_to_dcp(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from ..dcp.export import sharded_to_dcp as convert_sharded

    return convert_sharded(src, dst, _dcp_output(request))


def full_to_dcp(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from ..dcp.export import full_to_dcp as convert_full

    return convert_full(src, dst, _dcp_output(request))


def _dcp_output(request: ConvertRequest) -> DcpOutput:
    from ..dcp.export import DcpOutput

    return DcpOutput(world_size=request.world_size or 1, chunk_size=request.chunk_size, overwrite=request.overwrite)


def safetensors_to_deepspeed(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .to_deepspeed import to_deepspeed

    assert request.stage is not None  # the route requires it
    return to_deepspeed(src, dst, stage=request.stage, world_size=request.world_size, overwrite=request.overwrite, progress=progress)


def dcp_to_deepspeed(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .dcp_to_deepspeed import dcp_to_deepspeed as convert_dcp

    assert request.stage is not None and request.world_size is not None  # the route requires them
    return convert_dcp(
        src,
        dst,
        stage=request.stage,
        world_size=request.world_size,
        model_key=request.model_key,
        optimizer_key=request.optimizer_key,
        overwrite=request.overwrite,
        progress=progress,
    )


def dcp_to_full(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .dcp_to_full import dcp_to_full as convert_dcp
    from .model_description import describe

    return convert_dcp(
        src,
        dst,
        export=describe(request.model).export if request.model is not None else None,
        model_key=request.model_key,
        optimizer_key=request.optimizer_key,
        with_optimizer=request.with_optimizer,
        options=_full_output(request, progress),
    )


def dcp_to_sharded(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .dcp_to_sharded import dcp_to_sharded as convert_dcp
    from .model_description import describe

    assert request.world_size is not None and request.model is not None  # required by the route
    description = describe(request.model)
    return convert_dcp(
        src,
        dst,
        world_size=request.world_size,
        placement=description.placement,
        placement_source=f"model {request.model!r}",
        aliases=description.aliases,
        export=description.export,
        model_key=request.model_key,
        optimizer_key=request.optimizer_key,
        chunk_size=request.chunk_size,
        overwrite=request.overwrite,
        progress=progress,
    )


def dcp_to_dcp(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from ..dcp.export import reshard_dcp

    return reshard_dcp(src, dst, world_size=request.world_size or 1, chunk_size=request.chunk_size, overwrite=request.overwrite)


def deepspeed_to_full(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_deepspeed import deepspeed_to_full as convert_deepspeed
    from .model_description import describe

    export = describe(request.model).export if request.model is not None else None
    return convert_deepspeed(src, dst, export=export, with_optimizer=request.with_optimizer, options=_full_output(request, progress))


def _sharded_target(request: ConvertRequest, progress: Progress | None) -> ShardedTarget:
    """The fsdpkit checkpoint of `--world-size` ranks laid out by `--model`'s placement."""
    from .dcp_to_sharded import ShardedTarget
    from .model_description import describe

    assert request.world_size is not None and request.model is not None  # required by the route
    description = describe(request.model)
    return ShardedTarget(
        request.world_size,
        description.placement,
        f"model {request.model!r}",
        description.aliases,
        description.export,
        request.chunk_size,
        request.overwrite,
        progress,
    )


def deepspeed_to_sharded(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_deepspeed import deepspeed_to_sharded as convert_deepspeed

    return convert_deepspeed(src, dst, _sharded_target(request, progress))


def torchsave_to_sharded(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_torchsave import torchsave_to_sharded as convert_torchsave

    return convert_torchsave(src, dst, _sharded_target(request, progress))


def deepspeed_to_dcp(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_deepspeed import deepspeed_to_dcp as convert_deepspeed

    return convert_deepspeed(src, dst, _dcp_output(request))


def torchsave_to_full(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_torchsave import torchsave_to_full as convert_torchsave
    from .model_description import describe

    export = describe(request.model).export if request.model is not None else None
    return convert_torchsave(src, dst, export=export, with_optimizer=request.with_optimizer, options=_full_output(request, progress))


def torchsave_to_dcp(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_torchsave import torchsave_to_dcp as convert_torchsave

    return convert_torchsave(src, dst, _dcp_output(request))


def torchsave_to_deepspeed(src: Path, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    from .from_torchsave import torchsave_to_deepspeed as convert_torchsave

    assert request.stage is not None  # the route requires it
    return convert_torchsave(src, dst, stage=request.stage, world_size=request.world_size, overwrite=request.overwrite, progress=progress)
