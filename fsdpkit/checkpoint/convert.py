"""`fsdpkit convert`: sharded <-> full safetensors checkpoints, streaming, no torch.

`convert_to_full(src, dst, ...)`: a sharded checkpoint (run or step directory) -> a Hugging
Face-style directory (`model.safetensors` or `model-0000k-of-0000N.safetensors` + index;
with `with_optimizer`, `optimizer*` files likewise). `convert_to_sharded(src, dst, ...)`: a
full checkpoint -> an fsdpkit sharded checkpoint for `world_size` ranks, laid out by the
flat-parameter plan of `model` (from `fsdpkit.engine.plan.unit_plan_for_model`) or, without
one, an even split per tensor. Both validate SRC completely first, check free disk, write
under a temporary name and rename (see `output.py`), copy through a `ByteCopier` (memory
bounded by `chunk_size`), verify source checksums as they read, and cast floats to
`cast_to` ("F32", "F16", "BF16") on the way out. They return a JSON-able summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..errors import DataCheckError, UsageError
from ..layout import ElementRange
from .format import MODEL_INDEX, OPTIM_INDEX, TIED_METADATA_KEY, dtype_info, nbytes, output_dtype
from .full import index_document, model_and_optimizer, open_full, split_into_files
from .output import staged_output
from .plan import Plan
from .safetensors_io import StreamingWriter
from .sharded import open_sharded
from .sharded_out import write_sharded
from .streamcopy import DEFAULT_CHUNK_SIZE, ByteCopier, SourceTensor

Progress = Callable[[int, int], None]  # (bytes just done, total bytes)


def _progress_callback(progress: Progress | None, total: int):
    if progress is None:
        return None
    progress(0, total)
    return lambda done: progress(done, total)


def convert_to_full(src: str | Path, dst: str | Path, *, max_shard_size: int | None = None, cast_to: str | None = None,
                    with_optimizer: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, overwrite: bool = False,
                    progress: Progress | None = None) -> dict:
    checkpoint = open_sharded(src)
    model, optim = model_and_optimizer(checkpoint.sources())
    if with_optimizer and not optim:
        raise DataCheckError(f"{checkpoint.step_dir}: --with-optimizer given but the checkpoint has no optimizer state")
    outputs = [("model", model)] + ([("optimizer", optim)] if with_optimizer else [])
    plans = []
    for prefix, tensors in outputs:
        entries = [(t.name, output_dtype(t.dtype, cast_to), t.shape) for t in tensors]
        plans.append((prefix, split_into_files(entries, prefix=prefix, max_shard_size=max_shard_size)))
    total = sum(t.nbytes for _, tensors in outputs for t in tensors)
    out_total = sum(nbytes(shape, dtype) for _, files in plans for _, group in files for _, dtype, shape in group)
    metadata = {"format": "pt"}
    if checkpoint.manifest.aliases:
        metadata[TIED_METADATA_KEY] = json.dumps(checkpoint.manifest.aliases, sort_keys=True)
    by_name = {t.name: t for _, tensors in outputs for t in tensors}
    written = []
    with staged_output(dst, src=Path(src), overwrite=overwrite, needed_bytes=out_total + (1 << 20)) as tmp:
        copier = ByteCopier(chunk_size=chunk_size, progress=_progress_callback(progress, total))
        for prefix, files in plans:
            for file_name, group in files:
                _write_full_file(tmp / file_name, group, by_name, copier, metadata)
                written.append(file_name)
            if len(files) > 1:
                index_name = MODEL_INDEX if prefix == "model" else OPTIM_INDEX
                (tmp / index_name).write_text(json.dumps(index_document(files), indent=2) + "\n")
                written.append(index_name)
        copier.finish()
    return {"src": str(checkpoint.step_dir), "dst": str(dst), "to": "full", "files": written,
            "tensors": len(by_name), "bytes": out_total, "dtype": cast_to}


def _write_full_file(path: Path, group, by_name: dict[str, SourceTensor], copier: ByteCopier, metadata: dict) -> None:
    with StreamingWriter(path, group, metadata=metadata, write_behind=True) as writer:
        for name, info in writer.order:
            source = by_name[name]
            copier.copy(source, ElementRange(0, source.numel), info.dtype, writer.write)


def load_unit_plan(model: str, world_size: int) -> list:
    """The flat-parameter plan of a named model, from the engine."""
    try:
        from ..engine.plan import unit_plan_for_model
    except ImportError as error:
        raise UsageError(f"--model {model}: this fsdpkit has no model plans ({error})") from None
    return unit_plan_for_model(model, world_size)


def check_plan_matches(plan: Plan, sources: list[SourceTensor], *, model: str, where: Path) -> None:
    shapes = {s.name: s.shape for s in sources}
    missing = [name for name in plan.param_shapes() if name not in shapes]
    wrong = [f"{name} {list(shapes[name])} (model: {list(shape)})"
             for name, shape in plan.param_shapes().items() if name in shapes and shapes[name] != shape]
    if missing or wrong:
        detail = f"missing {missing[:3]}" if missing else f"different shapes {wrong[:3]}"
        raise DataCheckError(f"{where}: does not match model {model!r}: {detail}")


def convert_to_sharded(src: str | Path, dst: str | Path, *, world_size: int, model: str | None = None,
                       cast_to: str | None = None, with_optimizer: bool = False, strategy: str = "full_shard",
                       chunk_size: int = DEFAULT_CHUNK_SIZE, overwrite: bool = False, progress: Progress | None = None) -> dict:
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    full = open_full(src, with_optimizer=with_optimizer)
    sources = list(full.tensors)
    if model is not None:
        plan = Plan.flat(load_unit_plan(model, world_size))
        check_plan_matches(plan, sources, model=model, where=Path(src))
    else:
        plan = Plan.even()
    total = sum(s.nbytes for s in sources)
    out_total = sum(s.numel * dtype_info(output_dtype(s.dtype, cast_to)).itemsize for s in sources)
    with staged_output(dst, src=Path(src), overwrite=overwrite, needed_bytes=out_total + world_size * 65536) as tmp:
        copier = ByteCopier(chunk_size=chunk_size, progress=_progress_callback(progress, total))
        manifest = write_sharded(tmp, sources=sources, plan=plan, world_size=world_size, strategy=strategy,
                                 training_state={}, aliases=full.aliases, cast_to=cast_to, copier=copier)
    return {"src": str(src), "dst": str(dst), "to": "sharded", "world_size": world_size, "plan": plan.kind,
            "files": [f.name for f in manifest.files], "tensors": len(manifest.tensors),
            "bytes": sum(f.size for f in manifest.files), "dtype": cast_to}
