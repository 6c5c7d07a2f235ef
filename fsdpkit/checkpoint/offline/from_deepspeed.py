"""`fsdpkit convert DS OUT --to full`: a DeepSpeed ZeRO checkpoint -> Hugging Face safetensors,
streamed through the byte engine (no torch, no deepspeed).

The tensors are what DeepSpeed's `zero_to_fp32.py` writes: buffers, frozen parameters and the
fp32 master weights, under the model's own names; a tied name is recorded as an alias of the
one DeepSpeed kept. With an export recipe (`--model`), config.json and the side files too.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ...dtypes import dtype_info
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
        report = sources_to_sharded(checkpoint.sources, Path(src), Path(dst), replace(target, aliases=aliases))
    warning = "DeepSpeed's param groups are not carried: the resuming run's optimizer settings apply"
    return {"src": str(src), "dst": str(dst), "from": FORMAT, **report, "warnings": [warning]}
