"""`fsdpkit convert DIR OUT --to full`: per-rank `torch.save` state dicts of FSDP2 DTensors or
FSDP1 ShardedTensors (verl's checkpoint files) -> Hugging Face safetensors, streamed through the
byte engine."""

from __future__ import annotations

import os
from pathlib import Path

from ..format.export import HfExport
from ..torchsave.table import FORMAT, open_rank_state_dicts
from .convert import FullOutput, write_full


def torchsave_to_full(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    export: HfExport | None = None,
    with_optimizer: bool = False,
    options: FullOutput | None = None,
) -> dict:
    """The model files' tensors whole, under their state dict names, and with `with_optimizer`
    the optimizer state the optimizer files hold (`optim.<state>.<name>`, where they are read);
    the extra state (the LR scheduler's, the RNG states) is not written."""
    with open_rank_state_dicts(src) as checkpoint:
        optim = checkpoint.optimizer if with_optimizer else []
        report = write_full(checkpoint.model, optim, Path(dst), src=Path(src), export=export, aliases={}, options=options or FullOutput())
        ranks, skipped = checkpoint.world_size, checkpoint.other_files
    return {"src": str(src), "dst": str(dst), "from": FORMAT, "to": "full", "world_size": ranks, "not_read": skipped, **report}
