"""The text form of `inspect` of a DeepSpeed ZeRO checkpoint and of per-rank torch.save state
dicts (inspect_cmd dispatches here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpkit.sizes import format_size

from .inspect_cmd import item_lines, tensor_lines

if TYPE_CHECKING:
    from fsdpkit.checkpoint.deepspeed.inspect import DeepSpeedSummary
    from fsdpkit.checkpoint.torchsave.inspect import TorchSaveSummary


def inspect_lines(s: DeepSpeedSummary) -> list[str]:
    model, optim = s.model, s.optimizer
    tied = ", ".join(f"{a} -> {t}" for a, t in model.tied.items()) or "none"
    return [
        f"path        {s.path} (tag {s.tag})",
        f"format      deepspeed ZeRO-{s.stage}, {s.precision}, {s.world_size} ranks, ds_version {s.ds_version}",
        f"step        {s.global_steps}",
        f"model       {model.tensors} tensors ({model.trainable} trainable as fp32 masters, {len(model.frozen)} frozen, "
        f"{len(model.buffers)} buffers), {model.elements:,} elements, {format_size(model.bytes)}; tied: {tied}",
        f"optimizer   {optim.tensors} tensors ({', '.join(optim.states) or 'none'}), {format_size(optim.bytes)}, "
        f"{len(optim.param_groups)} param groups",
        *tensor_lines(s),
        "items       by key:",
        *item_lines(s.items),
    ]


def torchsave_lines(s: TorchSaveSummary) -> list[str]:
    model, optim = s.model, s.optimizer
    if optim.tensors:
        optimizer = f"{optim.tensors} tensors ({', '.join(optim.states)}), {format_size(optim.bytes)}, 1 param group"
    else:
        optimizer = f"not read: {optim.not_read}" if optim.not_read else "none"
    return [
        f"path        {s.path}",
        f"format      torch-save-ranks (per-rank torch.save state dicts of {s.sharding}), {s.world_size} ranks",
        f"model       {model.tensors} tensors, {model.elements:,} elements, {format_size(model.bytes)}",
        f"optimizer   {optimizer}",
        *tensor_lines(s, files_read=" read"),
        f"not read    {', '.join(s.not_read) or 'nothing'}",
        *(["items       rank 0's extra state, by key:", *item_lines(s.items)] if s.items else []),
    ]
