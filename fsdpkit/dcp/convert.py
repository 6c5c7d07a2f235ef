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

import json
import os
from pathlib import Path

from ..checkpoint.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..checkpoint.export import LAYOUT_METADATA_KEY, ExportLayout, HfExport
from ..checkpoint.format import MODEL_INDEX, OPTIM_INDEX, nbytes, output_dtype
from ..checkpoint.offline.convert import Progress, _progress_callback, _write_full_file, _write_hf_files, index_document, split_into_files
from ..checkpoint.storage import staged_output
from ..dtypes import dtype_info
from ..errors import DataCheckError
from .layout import DcpLayout, detect_layout, require_model
from .table import DcpCheckpoint, open_dcp


def layout_sources(checkpoint: DcpCheckpoint, layout: DcpLayout) -> tuple[list[SourceTensor], list[SourceTensor]]:
    """(model, optimizer) tensors as sources under fsdpkit's names."""
    model = [checkpoint.source(key, name) for name, key in layout.model.items()]
    optim = [checkpoint.source(key, name) for name, key in layout.optimizer.items()]
    return model, optim


def _plan_files(
    outputs: list[tuple[str, list[SourceTensor]]], export_layout: ExportLayout, *, cast_to: str | None, max_shard_size: int | None
):
    """Output name -> (source, transposed), and the files of each output (model, optimizer)."""
    by_name: dict[str, tuple[SourceTensor, bool]] = {}
    file_groups = []
    for prefix, tensors in outputs:
        entries = []
        for t in tensors:
            flip = prefix == "model" and export_layout.is_transposed(t.name, t.shape)
            name = export_layout.exported_name(t.name) if prefix == "model" else t.name
            by_name[name] = (t, flip)
            entries.append((name, output_dtype(t.dtype, cast_to), tuple(reversed(t.shape)) if flip else t.shape))
        file_groups.append((prefix, split_into_files(entries, prefix=prefix, max_shard_size=max_shard_size)))
    return by_name, file_groups


def dcp_to_full(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    export: HfExport | None = None,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    max_shard_size: int | None = None,
    cast_to: str | None = None,
    with_optimizer: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    with open_dcp(src) as checkpoint:
        layout = detect_layout(checkpoint.metadata, model_key=model_key, optimizer_key=optimizer_key)
        require_model(layout, checkpoint.metadata)
        model, optim = layout_sources(checkpoint, layout)
        if with_optimizer and not optim:
            raise DataCheckError(f"{src}: --with-optimizer given but no optimizer state was found (name it with --dcp-optimizer-key)")
        export_layout = export.layout if export is not None else ExportLayout()
        outputs = [("model", model)] + ([("optimizer", optim)] if with_optimizer else [])
        by_name, file_groups = _plan_files(outputs, export_layout, cast_to=cast_to, max_shard_size=max_shard_size)
        total = sum(t.nbytes for _, tensors in outputs for t in tensors)
        out_total = sum(nbytes(shape, dtype) for _, files in file_groups for _, group in files for _, dtype, shape in group)
        metadata = {"format": "pt"}
        model_metadata = dict(metadata)
        if not export_layout.is_identity:
            model_metadata[LAYOUT_METADATA_KEY] = json.dumps(export_layout.to_json(), sort_keys=True)
        written: list[str] = []
        warnings: list[str] = []
        with staged_output(Path(dst), src=Path(src), overwrite=overwrite, needed_bytes=out_total + (1 << 20)) as tmp:
            copier = ByteEngine(chunk_size=chunk_size, progress=_progress_callback(progress, total))
            try:
                for prefix, files in file_groups:
                    for file_name, group in files:
                        _write_full_file(tmp / file_name, group, by_name, copier, model_metadata if prefix == "model" else metadata)
                        written.append(file_name)
                    if len(files) > 1:
                        index_name = MODEL_INDEX if prefix == "model" else OPTIM_INDEX
                        (tmp / index_name).write_text(json.dumps(index_document(files), indent=2) + "\n")
                        written.append(index_name)
            finally:
                copier.close()
            if export is not None:
                floats = [dtype for _, group in file_groups[0][1] for _, dtype, _ in group if dtype_info(dtype).castable]
                written += _write_hf_files(tmp, export, floats[0] if floats else None, warnings)
    return {
        "src": str(src),
        "dst": str(dst),
        "from": "dcp",
        "to": "full",
        "model_key": layout.model_key,
        "files": written,
        "tensors": len(by_name),
        "bytes": out_total,
        "dtype": cast_to,
        "warnings": warnings,
    }
