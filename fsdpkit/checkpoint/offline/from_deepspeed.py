"""`fsdpkit convert DS OUT --to full|sharded|dcp`: a DeepSpeed ZeRO checkpoint -> Hugging Face
safetensors, an fsdpkit checkpoint or DCP, streamed through the byte engine (no deepspeed).

The tensors are what DeepSpeed's `zero_to_fp32.py` writes: buffers, frozen parameters and the
fp32 master weights, under the model's own names; a tied name is recorded as an alias of the
one DeepSpeed kept. With an export recipe (`--model`), config.json and the side files too.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ...dtypes import dtype_info
from ..dcp.export import DcpOutput, sources_to_dcp
from ..deepspeed.table import FORMAT, open_deepspeed
from ..format.export import HfExport
from ..format.names import output_dtype
from .convert import FullOutput, write_full
from .dcp_to_sharded import ShardedTarget, sources_to_sharded


def deepspeed_to_full(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    export: HfExport | None = None,
    with_optimizer: bool = False,
    options: FullOutput | None = None,
) -> dict:
    with open_deepspeed(src) as checkpoint:
        optim = checkpoint.optimizer if with_optimizer else []
        # as zero_to_fp32.py: floating tensors as fp32 unless a --dtype is asked for, in
        # safetensors' own order (wider dtypes first, then by name)
        options = replace(options or FullOutput(), cast_to=(options.cast_to if options else None) or "F32")
        model = sorted(checkpoint.model, key=lambda s: (-dtype_info(output_dtype(s.dtype, options.cast_to)).itemsize, s.name))
        report = write_full(model, optim, Path(dst), src=Path(src), export=export, aliases=checkpoint.aliases, options=options)
        stage, ranks = checkpoint.stage, checkpoint.world_size
    return {"src": str(src), "dst": str(dst), "from": FORMAT, "to": "full", "stage": stage, "world_size": ranks, **report}


def deepspeed_to_sharded(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: ShardedTarget) -> dict:
    """An fsdpkit sharded checkpoint of the fp32 masters and Adam's state, laid out for
    `target.world_size` ranks by the model's placement (`fsdpkit train --resume` continues)."""
    with open_deepspeed(src) as checkpoint:
        aliases = {**checkpoint.aliases, **target.aliases}
        report = sources_to_sharded(
            checkpoint.sources, Path(src), Path(dst), replace(target, aliases=aliases), param_groups=checkpoint.groups()
        )
    return {"src": str(src), "dst": str(dst), "from": FORMAT, **report}


def deepspeed_to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], output: DcpOutput) -> dict:
    """FSDP2's `{"model", "optimizer"}` DCP layout chunked for `output.world_size` ranks: the
    tensors `--to full` writes (tied names included, as FSDP2's state dict holds them), Adam's
    moments and step, and the param groups in both of `get_state_dict`'s layouts."""
    with open_deepspeed(src) as checkpoint:
        report = sources_to_dcp(
            checkpoint.sources, Path(src), Path(dst), aliases=checkpoint.aliases, groups=checkpoint.groups(), output=output
        )
        stage, ranks = checkpoint.stage, checkpoint.world_size
    return {**report, "from": FORMAT, "stage": stage, "from_world_size": ranks}
