"""`convert --to full` (any checkpoint opened as a tensor table -> a Hugging Face-style
directory of safetensors files and index, `optimizer*` files likewise with `--with-optimizer`):
streamed through the byte engine (memory bounded by `chunk_size`), staged
(`staging.staged_output`), casting floats to `cast_to` on the way out; and a full export's layout
undone (`restore_layout`), for `--to sharded` and `diff`.
A transposed tensor of an export layout is read whole and transposed in memory with numpy
(what that costs: docs/hugging-face.md); every other tensor streams in chunks.
"""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...dtypes import dtype_info
from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..core.any_checkpoint import OPTIMIZER_NOT_CONVERTED
from ..core.bytecopy import ByteEngine, SourceTensor
from ..core.export import CONFIG_NAME, LAYOUT_METADATA_KEY, ExportLayout, HfExport
from ..core.files import read_regular
from ..core.names import MODEL_INDEX, OPTIM_INDEX, TIED_METADATA_KEY, is_optimizer_tensor, nbytes, output_dtype
from ..core.report import WriteReport
from ..core.request import Progress, progress_callback
from ..core.staging import staged_output
from .reader import open_full
from .writer import CacheMode, StreamingWriter

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.request import ConvertRequest


@dataclass(frozen=True)
class FullOutput:
    """What `--to full` will write: each safetensors file with its (name, dtype, shape) entries
    and metadata, where each tensor comes from (and whether it is transposed), and what the
    commit adds (the indexes, config.json and the model directory's side files)."""

    files: list[tuple[str, list[tuple[str, str, tuple[int, ...]]], dict[str, str]]]
    file_groups: list  # [(prefix, [(file name, entries)])]
    by_name: dict[str, tuple[SourceTensor, bool]]
    export: HfExport | None
    cast_to: str | None
    source_bytes: int
    warnings: list[str]

    @property
    def bytes(self) -> int:
        return sum(nbytes(shape, dtype) for _, entries, _ in self.files for _, dtype, shape in entries)

    def write_file(self, path: Path, file: int, copier: ByteEngine) -> None:
        """Output file number `file`, whole, at `path`."""
        name, group, metadata = self.files[file]
        _write_full_file(path, group, self.by_name, copier, metadata)

    def commit_files(self, directory: Path) -> list[str]:
        """The indexes and the Hugging Face files, written into `directory` once every data file
        is there; every file name the output holds, in order."""
        written: list[str] = []
        for prefix, files in self.file_groups:
            written += [file_name for file_name, _ in files]
            if len(files) > 1:
                index_name = MODEL_INDEX if prefix == "model" else OPTIM_INDEX
                (directory / index_name).write_text(json.dumps(index_document(files), indent=2) + "\n")
                written.append(index_name)
        if self.export is not None:
            float_dtypes = [dtype for _, group in self.file_groups[0][1] for _, dtype, _ in group if dtype_info(dtype).castable]
            written += _write_hf_files(directory, self.export, float_dtypes[0] if float_dtypes else None, self.warnings)
        return written

    def report(self, written: list[str], *, src: str, dst: Path) -> WriteReport:
        return WriteReport(src, str(dst), written, len(self.by_name), self.bytes, self.warnings, {"to": "full", "dtype": self.cast_to})


def full_output(opened: AnyCheckpoint, request: ConvertRequest) -> FullOutput:
    """`--to full`: the model tensors under their stored names (a full export's layout when the
    source records one or `--model` names one), and with `--with-optimizer` the optimizer state;
    without it, a source's optimizer state is left out with a warning."""
    from ..core.model_description import describe

    warnings = []
    if opened.transformers_view is not None:  # the model under transformers' names, shaped by --model where given
        opened, request = as_transformers(opened, request, request.model), replace(request, model=None)
    if request.with_optimizer and not opened.optimizer:
        raise DataCheckError(f"{opened.path}: --with-optimizer given but the checkpoint has no optimizer state")
    if opened.optimizer and not request.with_optimizer:
        warnings.append(f"the optimizer state ({len(opened.optimizer)} tensors) is not written: add --with-optimizer")
    export = describe(request.model).export if request.model is not None else opened.export
    cast_to = request.cast_to or opened.full_dtype
    model = [t for name, t in opened.model.items() if name not in opened.aliases]
    if opened.full_dtype is not None:  # as zero_to_fp32.py: in safetensors' own order (wider dtypes first, then by name)
        model.sort(key=lambda s: (-dtype_info(output_dtype(s.dtype, cast_to)).itemsize, s.name))
    layout = export.layout if export is not None else ExportLayout()
    outputs = [("model", model)] + ([("optimizer", list(opened.optimizer.values()))] if request.with_optimizer else [])
    by_name, file_groups = _full_files(outputs, layout, cast_to=cast_to, max_shard_size=request.max_shard_size)
    metadata, model_metadata = _full_metadata(layout, opened.aliases)
    files = [(name, group, model_metadata if prefix == "model" else metadata) for prefix, named in file_groups for name, group in named]
    total = sum(t.nbytes for _, tensors in outputs for t in tensors)
    return FullOutput(files, file_groups, by_name, export, cast_to, total, warnings)


def to_full(opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
    """`--to full` in this process (`full_output` says what it writes)."""
    output = full_output(opened, request)
    with staged_output(dst, src=Path(opened.opened_from), overwrite=request.overwrite, needed_bytes=output.bytes + (1 << 20)) as tmp:
        with closing(ByteEngine(chunk_size=request.chunk_size, progress=progress_callback(progress, output.source_bytes))) as copier:
            for file, (file_name, _, _) in enumerate(output.files):
                output.write_file(tmp / file_name, file, copier)
            copier.finish()
        written = output.commit_files(tmp)
    return output.report(written, src=opened.path, dst=dst)


def as_transformers(opened: AnyCheckpoint, request: ConvertRequest, shape_from: str | None) -> AnyCheckpoint:
    """A checkpoint whose names are not transformers' (Megatron) as its model, and its optimizer
    state, under transformers' names; with --with-optimizer, a UsageError where the source says
    why its optimizer state cannot be converted."""
    assert opened.transformers_view is not None
    refused = opened.facts.get(OPTIMIZER_NOT_CONVERTED)
    if request.with_optimizer and refused:
        raise UsageError(f"--with-optimizer: {refused}")
    return opened.transformers_view(shape_from)


def _full_metadata(layout: ExportLayout, aliases: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The safetensors metadata of the optimizer's files and of the model's (which records a
    layout that is not the identity)."""
    metadata = {"format": "pt"}
    exported_aliases = {layout.exported_name(a): layout.exported_name(t) for a, t in aliases.items()}
    if exported_aliases:
        metadata[TIED_METADATA_KEY] = json.dumps(exported_aliases, sort_keys=True)
    model_metadata = dict(metadata)
    if not layout.is_identity:
        model_metadata[LAYOUT_METADATA_KEY] = json.dumps(layout.to_json(), sort_keys=True)
    return metadata, model_metadata


def _full_files(outputs, layout: ExportLayout, *, cast_to: str | None, max_shard_size: int | None):
    """(output name -> (source, transposed), [(prefix, [(file name, entries)])]) of a full
    checkpoint: model tensors under their exported names and orientation, optimizer state as
    stored, each group split into files of at most `max_shard_size` bytes."""
    by_name: dict[str, tuple[SourceTensor, bool]] = {}
    file_groups = []
    for prefix, tensors in outputs:
        entries = []
        for t in tensors:
            flip = prefix == "model" and layout.is_transposed(t.name, t.shape)
            name = layout.exported_name(t.name) if prefix == "model" else t.name
            by_name[name] = (t, flip)
            entries.append((name, output_dtype(t.dtype, cast_to), tuple(reversed(t.shape)) if flip else t.shape))
        file_groups.append((prefix, split_into_files(entries, prefix=prefix, max_shard_size=max_shard_size)))
    return by_name, file_groups


def _write_full_file(path: Path, group, by_name: dict[str, tuple[SourceTensor, bool]], copier: ByteEngine, metadata: dict) -> None:
    with StreamingWriter(path, group, metadata=metadata, cache=CacheMode.WRITE_BEHIND, sync=False) as writer:  # staged_output syncs
        tensors = [(by_name[name], info.dtype) for name, info in writer.order]
        for index in copier.read_ahead([(source, ElementRange(0, source.numel)) for (source, _), _ in tensors]):
            (source, flip), dtype = tensors[index]
            if flip:
                writer.write(transposed_bytes(copier, source, dtype))
            else:
                copier.copy_or_send(source, ElementRange(0, source.numel), dtype, writer.write, writer.send)


def _write_hf_files(directory: Path, export: HfExport, weight_dtype: str | None, warnings: list[str]) -> list[str]:
    """config.json, and the side files of the directory the model came from that are still there."""
    (directory / CONFIG_NAME).write_text(json.dumps(export.config_for(weight_dtype), indent=2, sort_keys=True) + "\n")
    written = [CONFIG_NAME]
    for name in export.files:
        path = Path(export.files_from or ".") / name
        try:
            data = read_regular(path)
        except DataCheckError as error:
            warnings.append(f"{name} not copied: {error}")
            continue
        (directory / name).write_bytes(data)
        written.append(name)
    return written


def split_into_files(
    tensors: list[tuple[str, str, tuple[int, ...]]], *, prefix: str, max_shard_size: int | None
) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
    """Greedy split of (name, dtype, shape) in order into files of at most `max_shard_size` bytes
    (a tensor larger than that gets a file of its own). One file is `<prefix>.safetensors`."""
    groups: list[list] = [[]]
    size = 0
    for entry in tensors:
        size_bytes = nbytes(entry[2], entry[1])
        if max_shard_size is not None and groups[-1] and size + size_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += size_bytes
    if len(groups) == 1:
        return [(f"{prefix}.safetensors", groups[0])]
    return [(f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors", group) for i, group in enumerate(groups)]


def index_document(files: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]) -> dict:
    total = sum(nbytes(shape, dtype) for _, group in files for _, dtype, shape in group)
    return {"metadata": {"total_size": total}, "weight_map": {name: file for file, group in files for name, _, _ in group}}


_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def transposed_bytes(copier: ByteEngine, source: SourceTensor, out_dtype: str):
    """The 2-D tensor `source`, cast to `out_dtype`, transposed: a C-contiguous numpy array of
    its raw elements (unsigned integers of the element size, whatever the dtype)."""
    import numpy as np

    rows, cols = source.shape
    itemsize = dtype_info(out_dtype).itemsize
    data = bytearray(rows * cols * itemsize)
    filled = 0

    def collect(view: memoryview) -> None:
        nonlocal filled
        data[filled : filled + view.nbytes] = view
        filled += view.nbytes

    copier.copy(source, ElementRange(0, source.numel), out_dtype, collect)
    return np.ascontiguousarray(np.frombuffer(data, dtype=_UNSIGNED[itemsize]).reshape(rows, cols).T)


def restore_layout(
    tensors: list[SourceTensor], aliases: dict[str, str], layout: ExportLayout, where: Path, scratch: Path, *, chunk_size: int
) -> tuple[list[SourceTensor], dict[str, str]]:
    """The tensors of a full checkpoint written with `layout`, under fsdpkit's names and
    orientation, and its aliases likewise. Transposed tensors are transposed back into the
    safetensors file `scratch` (the caller removes it); the others are read where they are."""
    renamed, back = [], []
    for tensor in tensors:
        if is_optimizer_tensor(tensor.name):  # optimizer state keeps fsdpkit's names and orientation
            renamed.append(tensor)
            continue
        original = layout.original_name(tensor.name)
        if original is None:
            raise DataCheckError(
                f"{where}: tensor {tensor.name!r} does not follow the export layout the files record (prefix {layout.prefix!r})"
            )
        if layout.is_transposed(original, tuple(reversed(tensor.shape))):  # square ones too (attn.c_proj)
            back.append((original, tensor))
        else:
            renamed.append(SourceTensor(original, tensor.shape, tensor.dtype, tensor.pieces))
    if back:
        entries = [(name, tensor.dtype, tuple(reversed(tensor.shape))) for name, tensor in back]
        with (
            closing(ByteEngine(chunk_size=chunk_size)) as copier,
            StreamingWriter(scratch, entries, metadata={"format": "pt"}, sync=False) as writer,
        ):
            by_name = dict(back)
            for name, _ in writer.order:
                writer.write(transposed_bytes(copier, by_name[name], by_name[name].dtype))
        restored = {t.name: t for t in open_full(scratch).tensors}
        renamed += [restored[name] for name, _ in back]
    aliases = {layout.original_name(alias) or alias: layout.original_name(target) or target for alias, target in aliases.items()}
    return renamed, aliases
