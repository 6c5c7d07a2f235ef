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
from ..format.bytecopy import SourceTensor
from ..format.export import HfExport
from ..offline.convert import FullOutput, write_full
from .layout import DcpLayout, detect_layout, require_model
from .table import DcpCheckpoint, open_dcp


def layout_sources(checkpoint: DcpCheckpoint, layout: DcpLayout) -> tuple[list[SourceTensor], list[SourceTensor]]:
    """(model, optimizer) tensors as sources under fsdpkit's names."""
    model = [checkpoint.source(key, name) for name, key in layout.model.items()]
    optim = [checkpoint.source(key, name) for name, key in layout.optimizer.items()]
    return model, optim


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
        layout = detect_layout(checkpoint.metadata, model_key=model_key, optimizer_key=optimizer_key)
        require_model(layout, checkpoint.metadata)
        model, optim = layout_sources(checkpoint, layout)
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
