"""`fsdpkit convert DCP OUT --to full`: a DCP checkpoint -> Hugging Face safetensors, streamed
(no torch).

The model tensors (found by `layout.detect_layout`) are written under their model names,
chunk by chunk through the byte copier into the streamed safetensors writer: memory is the
copier's buffers, whatever the checkpoint's size. With an export recipe (`--model`), the
names and orientation transformers expects and config.json plus the side files, as for
fsdpkit checkpoints; with `with_optimizer`, `optimizer*.safetensors` under fsdpkit's names
(`optim.<state>.<fqn>`). Written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import DataCheckError
from ..dcp.layout import model_and_optimizer
from ..dcp.table import open_dcp
from ..format.export import HfExport
from .convert import FullOutput, write_full


def dcp_to_full(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    export: HfExport | None = None,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    with_optimizer: bool = False,
    options: FullOutput | None = None,
) -> dict:
    with open_dcp(src) as checkpoint:
        layout, model, optim = model_and_optimizer(checkpoint, model_key=model_key, optimizer_key=optimizer_key)
        if with_optimizer and not optim:
            raise DataCheckError(f"{src}: --with-optimizer given but no optimizer state was found (name it with --dcp-optimizer-key)")
        optim = optim if with_optimizer else []
        report = write_full(model, optim, Path(dst), src=Path(src), export=export, aliases={}, options=options or FullOutput())
    return {
        "src": str(src),
        "dst": str(dst),
        "from": "dcp",
        "to": "full",
        "model_key": layout.model_key,
        **report,
    }
