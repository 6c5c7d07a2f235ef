"""`convert --to megatron`: a Llama, Qwen2 or GPT-2 model (full, fsdpkit, DCP or DeepSpeed) written as
a Megatron-Core `torch_dist` checkpoint that `dist_checkpointing.load` loads at any tensor and
pipeline parallel size: DCP's files with one chunk per stacked tensor, the common state both as
the bytes item `common_state/shard_0_1` (0.19) and as `common.pt` (what 0.16 to 0.18 load),
`metadata.json`, and the `_extra_state` objects of the linear layers. The model's shape comes from
`--model hf:DIR`, the source's config.json, or the export recipe it records. GPT-2's Conv1D
weights stored (in, out), as transformers saves them, are transposed through a scratch file in the
staging directory; those held (out, in), as fsdpkit's GPT holds them, are read as they are."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.bytecopy import SourceTensor
from ..core.export import CONFIG_NAME
from ..core.files import read_regular
from ..core.report import WriteReport
from ..core.request import ConvertRequest, Progress
from ..core.staging import staged_output
from ..dcp.writer import OutBytes, OutTensor, torch_saved, write_dcp
from .files import BACKEND_CONFIG, COMMON_PT, COMMON_STATE_KEY
from .from_hf import GPT2_PREFIX, embedding_name, extra_state_keys, megatron_tensors
from .shape import LAYERNORM, ModelShape, checked, from_hf_config, megatron_args, shape_of_model
from .transposed import is_conv1d_weight, transposed_sources, write_transposed

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint

SCRATCH_NAME = ".conv1d-transposed"  # in the staging directory, removed before it becomes the output
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


def config_files(opened: AnyCheckpoint) -> list[Path]:
    """Where the source's config.json may be: in the directory it was opened by (read through the
    storage face when that is in an object store; a DeepSpeed save directory's, beside `latest`),
    then, for a local source, in the one holding its tensors (a step or tag directory)."""
    opened_by = opened.opened_at if opened.opened_at is not None else Path(opened.opened_from or opened.path)
    found = [(opened_by if opened_by.is_dir() else opened_by.parent) / CONFIG_NAME]
    if isinstance(opened_by, PurePath) and Path(opened.path) / CONFIG_NAME not in found:
        found.append(Path(opened.path) / CONFIG_NAME)
    return found


def source_shape(opened: AnyCheckpoint, model: str | None) -> ModelShape:
    if model is not None:
        return shape_of_model(model)
    for config_path in config_files(opened):
        if config_path.is_file():
            return from_hf_config(json.loads(read_regular(config_path).decode("utf-8")), str(config_path))
    if opened.export is not None:
        return from_hf_config(opened.export.config, f"{opened.path}: export recipe")
    raise UsageError(f"{opened.path}: no config.json or export recipe says the model's shape: name one with --model hf:DIR")


@dataclass(frozen=True)
class MegatronOutput:
    """What `--to megatron` writes: DCP's tensors and bytes items (one rank file), `common.pt`'s
    bytes, and the model's shape."""

    tensors: list[OutTensor]
    items: list[OutBytes]
    common: bytes
    shape: ModelShape
    flipped: dict[str, SourceTensor]  # Conv1D weights the tensors read transposed from the scratch file

    @property
    def nbytes(self) -> int:
        return sum(t.source.nbytes for t in self.tensors)

    def write_common(self, directory: Path) -> list[str]:
        """`common.pt` and `metadata.json` in `directory`; their names."""
        (directory / COMMON_PT).write_bytes(self.common)
        (directory / BACKEND_CONFIG).write_text(json.dumps(BACKEND))
        return [COMMON_PT, BACKEND_CONFIG]


def transformers_named(opened: AnyCheckpoint) -> dict[str, SourceTensor]:
    """The model's tensors under transformers' names (an export recipe's layout applied)."""
    layout = opened.export.layout if opened.export is not None else None
    return {layout.exported_name(name) if layout else name: tensor for name, tensor in opened.model.items()}


def conv1d_stored(hf: dict[str, SourceTensor], shape: ModelShape) -> list[str]:
    """GPT-2's Conv1D weights when they are stored (in, out), as transformers saves them: the
    first layer's c_attn tells, (hidden, 3 hidden) there; fsdpkit's GPT and a full export read
    back into the model's orientation hold them (out, in), as Megatron does."""
    if shape.norm != LAYERNORM or shape.hidden is None:
        return []
    witness = hf.get(f"{GPT2_PREFIX}h.0.attn.c_attn.weight", hf.get("h.0.attn.c_attn.weight"))
    if witness is None or tuple(witness.shape) != (shape.hidden, 3 * shape.hidden):
        return []
    return sorted(name for name, tensor in hf.items() if is_conv1d_weight(name, tensor.shape))


def megatron_output(opened: AnyCheckpoint, request: ConvertRequest, scratch: Path) -> MegatronOutput:
    """See the module docstring."""
    hf = transformers_named(opened)
    shape = checked(source_shape(opened, request.model), opened.path)
    embedding = hf.get(embedding_name(shape), hf.get(embedding_name(shape).removeprefix(GPT2_PREFIX)))
    shape = shape.completed(ModelShape(vocab=embedding.shape[0] if embedding is not None else None))
    assert shape.layers
    flipped = {name: hf[name] for name in conv1d_stored(hf, shape)}
    tensors = megatron_tensors(hf | transposed_sources(scratch, flipped), shape, opened.path)
    state = {"args": argparse.Namespace(**megatron_args(shape)), "checkpoint_version": 3.0, "iteration": 0}
    common, none = torch_saved(state), torch_saved([None])
    items = [OutBytes((key,), lambda: none) for key in extra_state_keys(shape.layers)]
    items.append(OutBytes((f"{COMMON_STATE_KEY}/shard_0_1",), lambda: torch_saved([state])))
    return MegatronOutput([OutTensor((t.name,), t) for t in tensors], items, common, shape, flipped)


def to_megatron(opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
    """See the module docstring."""
    planned = megatron_output(opened, request, Path(SCRATCH_NAME))  # every name and shape checked before anything is written
    needed = planned.nbytes + sum(t.nbytes for t in planned.flipped.values()) + (1 << 20)
    with staged_output(dst, src=Path(opened.opened_from), overwrite=request.overwrite, needed_bytes=needed) as tmp:
        output = megatron_output(opened, request, tmp / SCRATCH_NAME)
        if output.flipped:
            write_transposed(tmp / SCRATCH_NAME, output.flipped, request.chunk_size)
        files = write_dcp(tmp, output.tensors, output.items, world_size=1, chunk_size=request.chunk_size)
        (tmp / SCRATCH_NAME).unlink(missing_ok=True)
        common = output.write_common(tmp)
    written = [*files, ".metadata", *common]
    return WriteReport(
        opened.path, str(dst), written, len(output.tensors), output.nbytes, [], {"to": "megatron", "shape": output.shape.to_json()}
    )
