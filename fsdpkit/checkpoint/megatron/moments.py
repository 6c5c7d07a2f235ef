"""Adam's moments of a Megatron checkpoint by the model's own names (`optim.exp_avg.<name>`,
`optim.exp_avg_sq.<name>`, layers unstacked; pure range arithmetic, nothing read but the
optimizer's small param-group record):
- `fully_reshardable`: one tensor per parameter and state, `optimizer.state.<state>.<model key>`,
  stacked as the model's tensor is (one recorded as `fully_sharded_model_space` is refused);
- `dp_reshardable` (Megatron-LM's default): flat buckets per (tensor, pipeline) parallel rank,
  each parameter found where `buffers` lays it out and joined over the tensor-parallel ranks as
  the model's tensor is split (rows, columns, gated fc1's two halves, or replicated).
Where the layout cannot be rebuilt, `Moments.refused` says why in one line."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..core.any_checkpoint import OPTIMIZER_NOT_CONVERTED
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.names import numel, optim_tensor_name
from . import buffers as b
from .hf import renamed
from .joined import JoinedSource, Part, clipped_pieces
from .layers import unstacked
from .shape import SWIGLU, ModelShape
from .table import MegatronCheckpoint, read_object
from .to_hf import hf_model

MOMENTS = ("exp_avg", "exp_avg_sq")
MODEL_SPACE_PREFIX = "optimizer.state."
BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")
GROUP_SETTINGS = ("betas", "eps", "amsgrad")  # carried into fsdpkit's groups with weight_decay (times wd_mult)


DP_RESHARDABLE, MODEL_SPACE = "dp_reshardable", "by parameter (fully_reshardable or fully_sharded_model_space)"
FULLY_SHARDED_MODEL_SPACE = "fully_sharded_model_space"  # refused: untested (see `recorded_sharding`)
DP_GROUP_RECORD = "optimizer.distributed.dp_group_idx_0.optimizer"  # param groups with the step, a ShardedObject


@dataclass
class Moments:
    tensors: dict[str, SourceTensor] = field(default_factory=dict)  # optim.<state>.<model name>
    sharding: str | None = None  # DP_RESHARDABLE, MODEL_SPACE or FULLY_SHARDED_MODEL_SPACE; None without optimizer state
    refused: str | None = None  # why the moments are not given, in one line
    steps: int = 0
    groups: list[dict] = field(default_factory=list)  # fsdpkit's form: [{"settings", "params"}]


def moments_of(checkpoint: MegatronCheckpoint) -> Moments:
    """The checkpoint's Adam moments by the model's names, its step and param groups."""
    optimizer, where = checkpoint.optimizer, str(checkpoint.files.root)
    if not optimizer:
        return Moments()
    dp = any(BUCKET_KEY.match(key) for key in optimizer)
    untested = not dp and recorded_sharding(checkpoint.common) == FULLY_SHARDED_MODEL_SPACE
    sharding = DP_RESHARDABLE if dp else FULLY_SHARDED_MODEL_SPACE if untested else MODEL_SPACE
    try:
        if untested:
            raise UsageError(
                f"{where}: optimizer state in Megatron's deprecated {FULLY_SHARDED_MODEL_SPACE} sharding is not converted (untested: "
                "megatron-core 0.16.1 cannot write one to test against); save it as dp_reshardable or fully_reshardable"
            )
        if dp:
            args = checkpoint.common.get("args")
            if not isinstance(args, dict):
                raise UsageError(f"{where}: records no Megatron-LM args, so the distributed optimizer's parameter order cannot be rebuilt")
            tensors = dp_reshardable_moments(optimizer, checkpoint.model, args, checkpoint.shape.activation == SWIGLU, where)
            record = read_object(checkpoint.files.weights, checkpoint.dcp, DP_GROUP_RECORD) if checkpoint.dcp is not None else None
        elif any(key.startswith(MODEL_SPACE_PREFIX) for key in optimizer):
            tensors = model_space_moments(optimizer, checkpoint.model, where)
            common_optimizer = checkpoint.common.get("optimizer")
            record = common_optimizer.get("optimizer") if isinstance(common_optimizer, dict) else None
        else:
            raise UsageError(f"{where}: optimizer state {next(iter(optimizer))!r} is neither Megatron's flat buffers nor per parameter")
    except UsageError as refused:
        return Moments(sharding=sharding, refused=str(refused))
    steps, groups = optimizer_groups(record)
    return Moments(tensors, sharding, None, steps, groups)


def recorded_sharding(common: dict[str, Any]) -> str | None:
    """The distributed optimizer's sharding type as the common state records it (megatron-core
    0.16: `optimizer.param_state_sharding_type`, else the save's `content_metadata`); None where
    it records none. `fully_sharded_model_space` stores flattened per-rank slices of each
    parameter, which megatron-core 0.16.1's ShardedTensor refuses to save ("flattened_range is
    not supported"), so no checkpoint of it could be tested here."""
    for record, key in (
        (common.get("optimizer"), "param_state_sharding_type"),
        (common.get("content_metadata"), "distrib_optim_sharding_type"),
    ):
        if isinstance(record, dict) and isinstance(record.get(key), str):
            return record[key]
    return None


class ColumnBlocks(SourceTensor):
    """A 2-D tensor whose column blocks are the tensor-parallel ranks' slices, each a flat
    range of some source (a row-parallel layer's weight); pieces computed per row asked for."""

    parts: tuple[Part, ...]  # set through object.__setattr__: SourceTensor is frozen

    def __init__(self, name: str, shape: tuple[int, ...], parts: list[Part]):
        super().__init__(name, shape, parts[0][0].dtype)
        object.__setattr__(self, "parts", tuple(parts))

    def pieces_in(self, wanted: ElementRange) -> list[SourcePiece]:
        if wanted.start >= wanted.end:
            return []
        columns = numel(self.shape[1:])
        width = columns // len(self.parts)
        row_parts: list[Part] = []
        starts: list[int] = []
        for row in range(wanted.start // columns, (wanted.end - 1) // columns + 1):
            for rank, (source, taken) in enumerate(self.parts):
                row_parts.append((source, ElementRange(taken.start + row * width, taken.start + (row + 1) * width)))
                starts.append(row * columns + rank * width)
        return clipped_pieces(row_parts, starts, wanted, dtype_info(self.dtype).itemsize)


def model_space_moments(optimizer: dict[str, SourceTensor], model: dict[str, SourceTensor], where: str) -> dict[str, SourceTensor]:
    """`optimizer.state.<state>.[module.]<key>` as `optim.<state>.<name>`, layers unstacked and
    each shaped as the model's tensor of that name."""
    found: dict[str, SourceTensor] = {}
    for state in MOMENTS:
        prefix = f"{MODEL_SPACE_PREFIX}{state}."
        stacked = {key[len(prefix) :].removeprefix("module."): t for key, t in optimizer.items() if key.startswith(prefix)}
        for name, source in unstacked(stacked).items():
            target = model.get(name)
            if target is None or tuple(target.shape) != tuple(source.shape):
                shape = list(target.shape) if target is not None else "no model tensor"
                raise UsageError(
                    f"{where}: optimizer state {prefix}{name} is stored as {list(source.shape)}, the model's as {shape} (not rebuilt)"
                )
            full = ElementRange(0, numel(source.shape))
            found[optim_tensor_name(state, name)] = JoinedSource(optim_tensor_name(state, name), tuple(target.shape), [(source, full)])
    return found


def bucket_sources(optimizer: dict[str, SourceTensor], where: str) -> dict[int, dict[int, dict[str, SourceTensor]]]:
    """{dp group (a tensor/pipeline rank): {bucket: {state: its flat tensor}}}; one grad buffer only."""
    found: dict[int, dict[int, dict[str, SourceTensor]]] = {}
    for key, source in optimizer.items():
        match = BUCKET_KEY.match(key)
        if match is None:
            continue
        group, gbuf, _, bucket, state = match.groups()
        if gbuf != "0":
            raise UsageError(f"{where}: {key}: more than one grad buffer (parameters of several dtypes); not rebuilt here")
        found.setdefault(int(group), {}).setdefault(int(bucket), {})[state] = source
    return found


def dp_reshardable_moments(
    optimizer: dict[str, SourceTensor], model: dict[str, SourceTensor], args: dict[str, Any], gated: bool, where: str
) -> dict[str, SourceTensor]:
    """The moments of a `dp_reshardable` checkpoint (see the module docstring)."""
    par = b.parallelism(args, where)
    shapes = {name: tuple(t.shape) for name, t in model.items()}
    unknown = b.unknown_params(shapes)
    if unknown:
        raise UsageError(f"{where}: {unknown[0]} has no place in the local layer spec's parameter order (not rebuilt)")
    groups = bucket_sources(optimizer, where)
    if sorted(groups) != list(range(par.tp * par.pp)):
        raise UsageError(
            f"{where}: optimizer buffers of dp groups {sorted(groups)}; TP {par.tp} x PP {par.pp} ranks need 0..{par.tp * par.pp - 1}"
        )
    tied = "output_layer.weight" not in model
    per_rank: dict[str, dict[int, tuple[b.Slot, dict[str, SourceTensor]]]] = {}
    for group, buckets in groups.items():
        pp_rank, tp_rank = divmod(group, par.tp)
        if sorted(buckets) != list(range(len(buckets))) or any(set(MOMENTS) - set(states) for states in buckets.values()):
            raise UsageError(f"{where}: dp group {group}: buckets {sorted(buckets)} without both of {', '.join(MOMENTS)}")
        sizes = [buckets[i][MOMENTS[0]].shape[0] for i in range(len(buckets))]
        params = b.stage_params(shapes, par, pp_rank, tied)
        for slot in b.buffer_slots(params, par.tp, tied and par.pp > 1, sizes, f"{where}: dp group {group}"):
            per_rank.setdefault(slot.key, {})[tp_rank] = (slot, buckets[slot.bucket])
    found: dict[str, SourceTensor] = {}
    for name, target in model.items():
        ranks = per_rank.get(name, {})
        if sorted(ranks) != list(range(par.tp)):
            raise UsageError(f"{where}: {name} is held by tensor-parallel ranks {sorted(ranks)} of {par.tp} in the rebuilt layout")
        for state in MOMENTS:
            parts = [(ranks[r][1][state], ElementRange(ranks[r][0].start, ranks[r][0].start + ranks[r][0].numel)) for r in range(par.tp)]
            split = ranks[0][0].split
            gated_rows = gated and split == b.ROWS and ".mlp.linear_fc1." in name
            found[optim_tensor_name(state, name)] = joined(optim_tensor_name(state, name), tuple(target.shape), split, parts, gated_rows)
    return found


def joined(name: str, shape: tuple[int, ...], split: str, parts: list[Part], gated_rows: bool) -> SourceTensor:
    """The whole tensor from the tensor-parallel ranks' flat slices `parts`, as `split` splits it."""
    if split == b.REPLICATED:
        return JoinedSource(name, shape, parts[:1])
    if split == b.COLUMNS:
        return ColumnBlocks(name, shape, parts)
    if not gated_rows:
        return JoinedSource(name, shape, parts)
    halves = [(source, ElementRange(taken.start, taken.start + taken.size // 2)) for source, taken in parts]
    halves += [(source, ElementRange(taken.start + taken.size // 2, taken.end)) for source, taken in parts]
    return JoinedSource(name, shape, halves)


def optimizer_groups(record: Any) -> tuple[int, list[dict]]:
    """(steps taken, fsdpkit's param groups: settings only) from Megatron's optimizer record
    (`{"param_groups": [{..., "step": n}]}`); (0, []) where it holds none."""
    groups = record.get("param_groups") if isinstance(record, dict) else None
    if not isinstance(groups, list):
        return 0, []
    steps = {g.get("step") for g in groups if isinstance(g, dict) and isinstance(g.get("step"), (int, float))}
    settings = []
    for group in groups:
        if isinstance(group, dict):
            kept = {key: group[key] for key in GROUP_SETTINGS if key in group}
            if isinstance(group.get("weight_decay"), (int, float)):
                kept["weight_decay"] = group["weight_decay"] * float(group.get("wd_mult", 1.0) or 0.0)
            settings.append({"settings": kept, "params": []})
    return (int(max(s for s in steps if s is not None)) if steps else 0), settings


def hf_moments(moments: dict[str, SourceTensor], model: dict[str, SourceTensor], shape: ModelShape, where: str) -> dict[str, SourceTensor]:
    """The moments under transformers' names (`optim.<state>.<transformers name>`): each state's
    tensors laid out as `to_hf` lays out the model's (QKV split per group, fc1 into gate and up)."""
    found: dict[str, SourceTensor] = {}
    for state in MOMENTS:
        by_model_name = {name: moments[optim_tensor_name(state, name)] for name in model if optim_tensor_name(state, name) in moments}
        if len(by_model_name) != len(model):
            continue
        for tensor in hf_model(by_model_name, shape, where).tensors:
            found[optim_tensor_name(state, tensor.name)] = renamed(tensor, optim_tensor_name(state, tensor.name))
    return found


def optimizer_facts(moments: Moments) -> dict[str, str]:
    """What a convert report says of the source's optimizer state."""
    if moments.sharding is None:
        return {}
    if moments.refused is not None:
        return {"optimizer": moments.sharding, OPTIMIZER_NOT_CONVERTED: moments.refused}
    return {"optimizer": moments.sharding}
