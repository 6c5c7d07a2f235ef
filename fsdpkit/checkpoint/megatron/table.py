"""A Megatron `torch_dist` checkpoint as a table of tensors (no torch): DCP's reading with
Megatron's metadata classes allowed, its common state read through the allow-list, the model's
shape from what it records, and its generation:
- 0.15: `.metadata` pickles Megatron's own `MCoreMetadata`;
- 0.16 to 0.18: the common state is `common.pt` (torch.save; Megatron-LM's `args` in it);
- 0.19: the common state is the bytes item `common_state/shard_0_1`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from ..core.files import read_regular
from ..dcp.metadata import METADATA_GLOBALS, METADATA_NAME, RECORDS
from ..dcp.table import DcpCheckpoint, open_dcp
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile, torch_save_pickle
from .files import COMMON_PT, COMMON_STATE_KEY, NEMO_MODEL_YAML, TORCH_DIST, MegatronFiles, find_files
from .layers import OPTIMIZER_PREFIX, stacked_layers, unstacked
from .shape import GELU, LAYERNORM, LEARNED, RMSNORM, ROPE, SWIGLU, ModelShape, checked, from_megatron_args
from .unpickler import loads_common
from .zarr import zarr_tensors

MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"
PLANNER_MODULE = "torch.distributed.checkpoint.planner"
# 0.15 pickles its metadata as MCoreMetadata (a DCP Metadata with Megatron's additions)
MEGATRON_METADATA_GLOBALS = METADATA_GLOBALS | {
    (MCORE_MODULE, "MCoreMetadata"): type("MCoreMetadata", (RECORDS["Metadata"],), {}),
    (MCORE_MODULE, "MCoreSavePlan"): type("MCoreSavePlan", (u.Record,), {}),
    # Megatron keeps every rank's save plan in the metadata (`all_local_plans`): inert records
    **{(PLANNER_MODULE, name): type(name, (u.Record,), {}) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
}
GEN_ZARR = "zarr (before 0.16)"
GEN_015, GEN_016, GEN_019 = "torch_dist 0.15 (MCoreMetadata)", "torch_dist 0.16-0.18 (common.pt)", "torch_dist 0.19 (common_state)"
MAX_YAML_BYTES = 1 << 22


@dataclass
class MegatronCheckpoint:
    files: MegatronFiles
    dcp: DcpCheckpoint | None  # None: a zarr checkpoint
    generation: str
    common: dict[str, Any]  # the common state, records made plain
    shape: ModelShape  # recorded and read off the tensors
    stored: dict[str, SourceTensor]  # every tensor by its stored key
    model: dict[str, SourceTensor] = field(default_factory=dict)  # the model's names, layers unstacked
    optimizer: dict[str, SourceTensor] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)  # the non-tensor items' keys (never unpickled)

    def close(self) -> None:
        if self.dcp is not None:
            self.dcp.close()

    def data_files(self) -> list[tuple[str, int]]:
        """(name inside the weights directory, size) of every file holding tensor data."""
        if self.dcp is not None:
            return [(name, self.dcp.file(name)[1]) for name in self.dcp.metadata.files]
        paths = {piece.path for t in self.stored.values() for piece in t.pieces}
        return [(str(p.relative_to(self.files.weights)), p.stat().st_size) for p in sorted(paths)]

    def __enter__(self) -> MegatronCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _generation(weights: Path, dcp: DcpCheckpoint) -> str:
    if b"MCoreMetadata" in read_regular(weights / METADATA_NAME):
        return GEN_015
    if any(key.startswith(f"{COMMON_STATE_KEY}/") for key in dcp.metadata.bytes_items):
        return GEN_019
    return GEN_016


def read_common(weights: Path, dcp: DcpCheckpoint | None) -> Any:
    """The common state (tensors as records), {} when there is none."""
    if (weights / COMMON_PT).exists():
        saved = SaveFile(weights / COMMON_PT, loads_common)
        saved.close()
        return saved.state
    found = read_object(weights, dcp, COMMON_STATE_KEY) if dcp is not None else None
    return {} if found is None else found


def read_object(weights: Path, dcp: DcpCheckpoint, key: str) -> Any:
    """A `ShardedObject` saved as the bytes item `key/shard_...` (its first shard), through the
    allow-list (tensors as records); None without one."""
    keys = [item for item in dcp.metadata.bytes_items if item.startswith(f"{key}/")]
    if not keys:
        return None
    location = dcp.metadata.bytes_items[keys[0]].location
    fd, _ = dcp.file(location.file)
    where = f"{weights / location.file}: {keys[0]}"
    _, _, raw = torch_save_pickle(fd, weights / location.file, location.offset, location.length, where)
    found = loads_common(raw, where=where)
    return found[0] if isinstance(found, list) and len(found) == 1 else found


def _plain_common(common: Any) -> dict[str, Any]:
    if not isinstance(common, dict):
        return {"common": u.plain(common)}
    return {str(key): u.plain(value) for key, value in common.items()}


def nemo_config(context: Path) -> dict:
    """NeMo 2's model config (context/model.yaml's `config`), read as plain YAML (its `_target_`s are only text)."""
    import yaml  # type: ignore[import-untyped]

    path = context / NEMO_MODEL_YAML
    if not path.exists():
        return {}
    try:
        document = yaml.safe_load(read_regular(path, MAX_YAML_BYTES))
    except yaml.YAMLError as error:
        raise DataCheckError(f"{path}: not YAML ({str(error).splitlines()[0][:80]})") from None
    config = document.get("config", document) if isinstance(document, dict) else None
    return config if isinstance(config, dict) else {}


def recorded_shape(files: MegatronFiles, common: dict[str, Any]) -> ModelShape:
    if files.context is not None:
        return from_megatron_args(_targets_named(nemo_config(files.context)), f"{files.context / NEMO_MODEL_YAML}")
    args = common.get("args")
    return from_megatron_args(args, f"{files.weights}: args") if isinstance(args, dict) else ModelShape()


def _targets_named(config: dict) -> dict:
    """A NeMo config with each `{_target_: X}` value replaced by X (activation functions)."""
    return {k: (v.get("_target_") if isinstance(v, dict) and "_target_" in v else v) for k, v in config.items()}


def tensor_shape(model: dict[str, SourceTensor], stored: dict[str, SourceTensor]) -> ModelShape:
    """What the tensors' shapes say of the model."""
    embedding = model.get("embedding.word_embeddings.weight")
    fc2 = next((t for k, t in model.items() if k.endswith("mlp.linear_fc2.weight")), None)
    bias = any(k.endswith("self_attention.linear_proj.bias") for k in model)
    fc1 = next((t for k, t in model.items() if k.endswith("mlp.linear_fc1.weight")), None)
    gated = fc1 is not None and fc2 is not None and fc1.shape[-2] == 2 * fc2.shape[-1]
    return ModelShape(
        norm=LAYERNORM if "decoder.final_layernorm.bias" in model else RMSNORM,
        activation=SWIGLU if gated else GELU,
        position_embedding=LEARNED if "embedding.position_embeddings.weight" in model else ROPE,
        layers=stacked_layers(stored),
        hidden=embedding.shape[1] if embedding is not None else None,
        vocab=embedding.shape[0] if embedding is not None else None,
        ffn=fc2.shape[-1] if fc2 is not None else None,
        qkv_bias=any(k.endswith("self_attention.linear_qkv.bias") for k in model),
        linear_bias=bias,
        tied="output_layer.weight" not in model,
        max_positions=model["embedding.position_embeddings.weight"].shape[0] if "embedding.position_embeddings.weight" in model else None,
        experts=1 if any(".mlp.experts." in k or ".mlp.router." in k for k in model) else None,
    )


NEMO_MODULE_PREFIX = "module."  # NeMo 2 stores the model under its Lightning module's attribute


def _model_names(tensors: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """The model's tensors under Megatron's own names: NeMo's `module.` taken away where every key has it."""
    if tensors and all(key.startswith(NEMO_MODULE_PREFIX) for key in tensors):
        return {key.removeprefix(NEMO_MODULE_PREFIX): tensor for key, tensor in tensors.items()}
    return tensors


def open_megatron(path: str | os.PathLike[str]) -> MegatronCheckpoint:
    """The checkpoint at `path` with its metadata, files and common state checked (DataCheckError)."""
    files = find_files(path)
    if files is None:
        raise DataCheckError(f"{path}: not a Megatron checkpoint (no metadata.json)")
    dcp = open_dcp(files.weights, MEGATRON_METADATA_GLOBALS) if files.backend == TORCH_DIST else None
    try:
        if dcp is not None:
            stored = {key: dcp.source(key) for key in dcp.metadata.tensors}
            objects, generation = list(dcp.metadata.bytes_items), _generation(files.weights, dcp)
        else:
            stored, objects = zarr_tensors(files.weights)
            generation = GEN_ZARR
        common = _plain_common(read_common(files.weights, dcp))
        model = unstacked(_model_names({k: t for k, t in stored.items() if not k.startswith(OPTIMIZER_PREFIX)}))
        optimizer = {k: t for k, t in stored.items() if k.startswith(OPTIMIZER_PREFIX)}
        shape = checked(recorded_shape(files, common).completed(tensor_shape(model, stored)), str(files.root))
        return MegatronCheckpoint(files, dcp, generation, common, shape, stored, model, optimizer, objects)
    except BaseException:
        if dcp is not None:
            dcp.close()
        raise
