"""`fsdpkit convert DIR OUT --to full`: per-rank `torch.save` state dicts of FSDP2 DTensors
(verl's checkpoint files) -> Hugging Face safetensors, streamed through the byte engine."""

from __future__ import annotations

import os
from pathlib import Path

from ..format.export import HfExport
from ..torchsave.table import FORMAT, open_rank_state_dicts
from .convert import FullOutput, write_full


def torchsave_to_full(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, export: HfExport | None = None, options: FullOutput | None = None
) -> dict:
    """The model files' tensors whole, under their state dict names; the optimizer and extra
    state files are not read."""
    with open_rank_state_dicts(src) as checkpoint:
        report = write_full(checkpoint.model, [], Path(dst), src=Path(src), export=export, aliases={}, options=options or FullOutput())
        ranks, skipped = checkpoint.world_size, checkpoint.other_files
    return {"src": str(src), "dst": str(dst), "from": FORMAT, "to": "full", "world_size": ranks, "not_read": skipped, **report}
