"""`fsdpkit convert`: sharded <-> full safetensors checkpoints, streaming, no torch.

`convert_to_full(src, dst, ...)`: a sharded checkpoint (run or step directory) -> a Hugging
Face-style directory (`model.safetensors` or `model-0000k-of-0000N.safetensors` + index;
with `with_optimizer`, `optimizer*` files likewise). `convert_to_sharded(src, dst, ...)`: a
full checkpoint -> an fsdpkit sharded checkpoint for `world_size` ranks, laid out by the
placement given (a model's flat-parameter units: `fsdpkit.models.units.placement_for_model`) or,
without one, an even split per tensor. Both validate SRC completely first, check free disk, write
under a temporary name and rename (see `storage.staged_output`), copy through a `ByteCopier` (memory
bounded by `chunk_size`), verify source checksums as they read, and cast floats to
`cast_to` ("F32", "F16", "BF16") on the way out. They return a JSON-able summary.

Models from elsewhere: when the checkpoint's training state holds an export recipe
(`checkpoint/export.py`: a Hugging Face model, or the built-in GPT in GPT-2's layout),
`convert_to_full` writes what transformers needs beside the weights (config.json, the
generation config and tokenizer files of the directory the model came from) and the weights
under transformers' names and orientation (`checkpoint/transpose.py`: a transposed tensor is
held whole, twice, one at a time). `convert_to_sharded` undoes a recorded layout unless the
`--model` placement names the exported tensors as they are.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from ...errors import DataCheckError, UsageError
from ...layout import ElementRange
from ..bytecopy import DEFAULT_CHUNK_SIZE, ByteCopier, SourceTensor
from ..export import CONFIG_NAME, LAYOUT_METADATA_KEY, HfExport, Layout, export_of
from ..format import MODEL_INDEX, OPTIM_INDEX, TIED_METADATA_KEY, dtype_info, is_optimizer_tensor, nbytes, output_dtype
from ..placement import Placement
from ..reader import open_full, open_regular, open_sharded
from ..storage import staged_output
from ..transpose import restore_layout, transposed_bytes
from ..writer import StreamingWriter, write_sharded

SCRATCH_NAME = ".fsdpkit-transposed.safetensors"  # tensors transposed back, removed before the output is renamed

Progress = Callable[[int, int], None]  # (bytes just done, total bytes)


def _progress_callback(progress: Progress | None, total: int):
    if progress is None:
        return None
    progress(0, total)
    return lambda done: progress(done, total)


def convert_to_full(
    src: str | Path,
    dst: str | Path,
    *,
    max_shard_size: int | None = None,
    cast_to: str | None = None,
    with_optimizer: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    checkpoint = open_sharded(src)
    export = export_of(checkpoint.manifest.training_state, where=str(checkpoint.step_dir))
    layout = export.layout if export is not None else Layout()
    sources = checkpoint.sources()
    model = [t for t in sources if not is_optimizer_tensor(t.name)]
    optim = [t for t in sources if is_optimizer_tensor(t.name)]
    if with_optimizer and not optim:
        raise DataCheckError(f"{checkpoint.step_dir}: --with-optimizer given but the checkpoint has no optimizer state")
    outputs = [("model", model)] + ([("optimizer", optim)] if with_optimizer else [])
    by_name: dict[str, tuple[SourceTensor, bool]] = {}  # output name -> (source, transposed)
    file_groups = []
    for prefix, tensors in outputs:
        entries = []
        for t in tensors:
            flip = prefix == "model" and layout.is_transposed(t.name, t.shape)
            name = layout.exported_name(t.name) if prefix == "model" else t.name
            by_name[name] = (t, flip)
            entries.append((name, output_dtype(t.dtype, cast_to), tuple(reversed(t.shape)) if flip else t.shape))
        file_groups.append((prefix, split_into_files(entries, prefix=prefix, max_shard_size=max_shard_size)))
    total = sum(t.nbytes for _, tensors in outputs for t in tensors)
    out_total = sum(nbytes(shape, dtype) for _, files in file_groups for _, group in files for _, dtype, shape in group)
    metadata = {"format": "pt"}
    aliases = {layout.exported_name(a): layout.exported_name(t) for a, t in checkpoint.manifest.aliases.items()}
    if aliases:
        metadata[TIED_METADATA_KEY] = json.dumps(aliases, sort_keys=True)
    model_metadata = dict(metadata)
    if not layout.is_identity:
        model_metadata[LAYOUT_METADATA_KEY] = json.dumps(layout.to_json(), sort_keys=True)
    written: list[str] = []
    warnings: list[str] = []
    with staged_output(dst, src=Path(src), overwrite=overwrite, needed_bytes=out_total + (1 << 20)) as tmp:
        copier = ByteCopier(chunk_size=chunk_size, progress=_progress_callback(progress, total))
        for prefix, files in file_groups:
            for file_name, group in files:
                _write_full_file(tmp / file_name, group, by_name, copier, model_metadata if prefix == "model" else metadata)
                written.append(file_name)
            if len(files) > 1:
                index_name = MODEL_INDEX if prefix == "model" else OPTIM_INDEX
                (tmp / index_name).write_text(json.dumps(index_document(files), indent=2) + "\n")
                written.append(index_name)
        copier.finish()
        if export is not None:
            float_dtypes = [dtype for _, group in file_groups[0][1] for _, dtype, _ in group if dtype_info(dtype).castable]
            written += _write_hf_files(tmp, export, float_dtypes[0] if float_dtypes else None, warnings)
    return {
        "src": str(checkpoint.step_dir),
        "dst": str(dst),
        "to": "full",
        "files": written,
        "tensors": len(by_name),
        "bytes": out_total,
        "dtype": cast_to,
        "warnings": warnings,
    }


def _write_full_file(path: Path, group, by_name: dict[str, tuple[SourceTensor, bool]], copier: ByteCopier, metadata: dict) -> None:
    with StreamingWriter(path, group, metadata=metadata, write_behind=True, sync=False) as writer:  # staged_output syncs
        for name, info in writer.order:
            source, flip = by_name[name]
            if flip:
                writer.write(transposed_bytes(copier, source, info.dtype))
            else:
                copier.copy(source, ElementRange(0, source.numel), info.dtype, writer.write)


def _write_hf_files(directory: Path, export: HfExport, weight_dtype: str | None, warnings: list[str]) -> list[str]:
    """config.json, and the side files of the directory the model came from that are still there."""
    (directory / CONFIG_NAME).write_text(json.dumps(export.config_for(weight_dtype), indent=2, sort_keys=True) + "\n")
    written = [CONFIG_NAME]
    for name in export.files:
        path = Path(export.files_from or ".") / name
        try:
            fd, _ = open_regular(path)
        except DataCheckError as error:
            warnings.append(f"{name} not copied: {error}")
            continue
        with open(fd, "rb") as source, open(directory / name, "wb") as target:
            shutil.copyfileobj(source, target)
        written.append(name)
    return written


def check_placement_matches(placement: Placement, sources: list[SourceTensor], *, where: Path, source: str) -> None:
    shapes = {s.name: s.shape for s in sources}
    missing = [name for name in placement.param_shapes() if name not in shapes]
    wrong = [
        f"{name} {list(shapes[name])} (model: {list(shape)})"
        for name, shape in placement.param_shapes().items()
        if name in shapes and shapes[name] != shape
    ]
    if missing or wrong:
        detail = f"missing {missing[:3]}" if missing else f"different shapes {wrong[:3]}"
        raise DataCheckError(f"{where}: does not match {source}: {detail}")


def convert_to_sharded(
    src: str | Path,
    dst: str | Path,
    *,
    world_size: int,
    placement: Placement | None = None,
    placement_source: str = "the placement",
    aliases: dict[str, str] | None = None,
    cast_to: str | None = None,
    with_optimizer: bool = False,
    strategy: str = "full",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    """`aliases`: the model's tied names ({alias: stored name}), for files that store a tied
    weight once without saying so (transformers' save_pretrained)."""
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    full = open_full(src, with_optimizer=with_optimizer)
    sources = list(full.tensors)
    # the export layout to undo (None: the names already are the model's, or match the placement)
    restore = None if placement is not None and _names_match(placement, sources) else full.layout
    total = sum(s.nbytes for s in sources)
    out_total = sum(s.numel * dtype_info(output_dtype(s.dtype, cast_to)).itemsize for s in sources)
    needed_for = f" for {world_size} rank files (--world-size {world_size})"
    with staged_output(
        dst, src=Path(src), overwrite=overwrite, needed_bytes=2 * out_total + world_size * 65536, needed_for=needed_for
    ) as tmp:
        stored = full.aliases
        if restore is not None:
            sources, stored = restore_layout(full, restore, tmp / SCRATCH_NAME, chunk_size=chunk_size)
        names = {s.name for s in sources}
        aliases = {**{a: t for a, t in (aliases or {}).items() if a not in names and t in names}, **stored}
        if placement is None:
            placement = Placement.even()
        else:
            check_placement_matches(placement, sources, where=Path(src), source=placement_source)
        written = write_sharded(
            tmp,
            sources=sources,
            placement=placement,
            world_size=world_size,
            strategy=strategy,
            training_state={},
            aliases=aliases,
            cast_to=cast_to,
            chunk_size=chunk_size,
            progress=_progress_callback(progress, total),
        )
        (tmp / SCRATCH_NAME).unlink(missing_ok=True)
    return {
        "src": str(src),
        "dst": str(dst),
        "to": "sharded",
        "world_size": world_size,
        "placement": placement.kind,
        "files": written.files,
        "tensors": len(written.manifest.tensors),
        "bytes": written.bytes,
        "dtype": cast_to,
    }


def _names_match(placement: Placement, sources: list[SourceTensor]) -> bool:
    names = {s.name for s in sources}
    return all(name in names for name in placement.param_shapes())


def split_into_files(
    tensors: list[tuple[str, str, tuple[int, ...]]], *, prefix: str, max_shard_size: int | None
) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
    """Greedy split of (name, dtype, shape) in order into files of at most `max_shard_size` bytes
    (a tensor larger than that gets a file of its own). One file is `<prefix>.safetensors`."""
    groups: list[list] = [[]]
    size = 0
    for entry in tensors:
        tensor_bytes = nbytes(entry[2], entry[1])
        if max_shard_size is not None and groups[-1] and size + tensor_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += tensor_bytes
    if len(groups) == 1:
        return [(f"{prefix}.safetensors", groups[0])]
    count = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors", group) for i, group in enumerate(groups)]


def index_document(files: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]) -> dict:
    total = sum(nbytes(shape, dtype) for _, group in files for _, dtype, shape in group)
    return {"metadata": {"total_size": total}, "weight_map": {name: file for file, group in files for name, _, _ in group}}
