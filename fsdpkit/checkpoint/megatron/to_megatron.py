"""`convert --to megatron`: a Llama or Qwen2 model (full, fsdpkit, DCP or DeepSpeed) written as
a Megatron-Core `torch_dist` checkpoint that `dist_checkpointing.load` loads at any tensor and
pipeline parallel size: DCP's files with one chunk per stacked tensor, the common state both as
the bytes item `common_state/shard_0_1` (0.19) and as `common.pt` (what 0.16 to 0.18 load),
`metadata.json`, and the `_extra_state` objects of the linear layers. The model's shape comes from
`--model hf:DIR`, the source's config.json, or the export recipe it records."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.export import CONFIG_NAME
from ..core.files import read_regular
from ..core.report import WriteReport
from ..core.request import ConvertRequest, Progress
from ..core.staging import staged_output
from ..dcp.writer import OutBytes, OutTensor, torch_saved, write_dcp
from .files import BACKEND_CONFIG, COMMON_PT, COMMON_STATE_KEY
from .from_hf import extra_state_keys, megatron_tensors
from .shape import ModelShape, checked, from_hf_config, megatron_args, shape_of_model

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


def source_shape(opened: AnyCheckpoint, model: str | None) -> ModelShape:
    if model is not None:
        return shape_of_model(model)
    config_path = Path(opened.path) / CONFIG_NAME
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

    @property
    def nbytes(self) -> int:
        return sum(t.source.nbytes for t in self.tensors)

    def write_common(self, directory: Path) -> list[str]:
        """`common.pt` and `metadata.json` in `directory`; their names."""
        (directory / COMMON_PT).write_bytes(self.common)
        (directory / BACKEND_CONFIG).write_text(json.dumps(BACKEND))
        return [COMMON_PT, BACKEND_CONFIG]


def megatron_output(opened: AnyCheckpoint, request: ConvertRequest) -> MegatronOutput:
    """See the module docstring."""
    layout = opened.export.layout if opened.export is not None else None
    hf = {layout.exported_name(n) if layout else n: t for n, t in opened.model.items()}
    embedding = hf.get("model.embed_tokens.weight")
    shape = source_shape(opened, request.model).completed(ModelShape(vocab=embedding.shape[0] if embedding is not None else None))
    shape = checked(shape, opened.path)
    tensors = megatron_tensors(hf, shape, opened.path)
    assert shape.layers
    state = {"args": argparse.Namespace(**megatron_args(shape)), "checkpoint_version": 3.0, "iteration": 0}
    common, none = torch_saved(state), torch_saved([None])
    items = [OutBytes((key,), lambda: none) for key in extra_state_keys(shape.layers)]
    items.append(OutBytes((f"{COMMON_STATE_KEY}/shard_0_1",), lambda: torch_saved([state])))
    return MegatronOutput([OutTensor((t.name,), t) for t in tensors], items, common, shape)


def to_megatron(opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
    """See the module docstring."""
    output = megatron_output(opened, request)
    total = output.nbytes
    with staged_output(dst, src=Path(opened.opened_from), overwrite=request.overwrite, needed_bytes=total + (1 << 20)) as tmp:
        files = write_dcp(tmp, output.tensors, output.items, world_size=1, chunk_size=request.chunk_size)
        common = output.write_common(tmp)
    written = [*files, ".metadata", *common]
    return WriteReport(opened.path, str(dst), written, len(output.tensors), total, [], {"to": "megatron", "shape": output.shape.to_json()})
