"""Where each parameter lies in the flat buffers of Megatron's distributed optimizer (pure
arithmetic, nothing read). A `dp_reshardable` checkpoint stores, per tensor- and pipeline-parallel
rank, one flat tensor per bucket and state, and no parameter names; megatron-core lays a rank's
parameters out in the reverse of its module's `parameters()` order, each start padded to a
multiple of 64 elements, a new bucket once a bucket reaches its recorded size, and the tied
embedding of a pipelined model in a bucket of its own (megatron/core/distributed/
param_and_grad_buffer.py). So the order is rebuilt from the model's shape, for the local layer
spec (GPTModel with `transformer_impl` "local") and uniform pipeline stages; anything else is
refused in one line, as is a rebuilt layout whose bucket sizes differ from the recorded ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import UsageError
from ..core.names import numel

PARAM_ALIGNMENT = 64  # elements: each parameter's start in the buffer
REPLICATED, ROWS, COLUMNS, GATED_ROWS = "replicated", "rows", "columns", "gated rows"
# a layer's parameters in the local spec's `parameters()` order, by checkpoint key, and how
# tensor parallelism splits each (gated fc1: each rank holds its gate rows then its up rows)
LAYER_PARAMS = (
    ("self_attention.linear_qkv.layer_norm_weight", REPLICATED),
    ("self_attention.linear_qkv.layer_norm_bias", REPLICATED),
    ("self_attention.linear_proj.weight", COLUMNS),
    ("self_attention.linear_proj.bias", REPLICATED),
    ("self_attention.linear_qkv.weight", ROWS),
    ("self_attention.linear_qkv.bias", ROWS),
    ("mlp.linear_fc1.layer_norm_weight", REPLICATED),
    ("mlp.linear_fc1.layer_norm_bias", REPLICATED),
    ("mlp.linear_fc1.weight", ROWS),
    ("mlp.linear_fc1.bias", ROWS),
    ("mlp.linear_fc2.weight", COLUMNS),
    ("mlp.linear_fc2.bias", REPLICATED),
)
FIRST_STAGE = (("embedding.word_embeddings.weight", ROWS), ("embedding.position_embeddings.weight", REPLICATED))
LAST_STAGE = (("decoder.final_layernorm.weight", REPLICATED), ("decoder.final_layernorm.bias", REPLICATED), ("output_layer.weight", ROWS))
TIED_COPY = "output_layer.weight"  # the last stage's copy of a tied embedding: in the buffer, not in the checkpoint's model
# Megatron-LM arguments that make the layout other than the one rebuilt here, and what they mean
UNSUPPORTED_ARGS = {
    "num_experts": "a mixture-of-experts model",
    "qk_layernorm": "query/key layer norms",
    "mtp_num_layers": "multi-token prediction layers",
    "virtual_pipeline_model_parallel_size": "an interleaved (virtual) pipeline",
    "num_layers_per_virtual_pipeline_stage": "an interleaved (virtual) pipeline",
    "decoder_first_pipeline_num_layers": "uneven pipeline stages",
    "decoder_last_pipeline_num_layers": "uneven pipeline stages",
    "pipeline_model_parallel_layout": "a custom pipeline layout",
    "account_for_embedding_in_pipeline_split": "uneven pipeline stages",
    "account_for_loss_in_pipeline_split": "uneven pipeline stages",
}


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    layers: int


@dataclass(frozen=True)
class Slot:
    """One parameter of one (tp, pp) rank in its buffer."""

    key: str  # the checkpoint's model name (layers unstacked, global index); TIED_COPY for the tied copy
    split: str
    numel: int  # of this rank's slice
    bucket: int
    start: int  # its first element in the bucket's tensor


def parallelism(args: dict[str, Any], where: str) -> Parallelism:
    """TP, PP and layers from Megatron-LM's args; a UsageError for what the rebuilt layout does not cover."""
    for name, what in UNSUPPORTED_ARGS.items():
        value = args.get(name)
        if value is not None and value is not False and value != 0 and not (name.startswith("virtual") and value == 1):
            raise UsageError(f"{where}: {what} ({name}={args[name]!r}): the distributed optimizer's parameter order is not rebuilt for it")
    impl = args.get("transformer_impl")
    if impl != "local":
        raise UsageError(
            f"{where}: transformer_impl {impl!r}: the distributed optimizer's parameter order is rebuilt for the local layer spec only"
        )
    tp, pp, layers = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size"), args.get("num_layers")
    if not all(isinstance(v, int) and v > 0 for v in (tp, pp, layers)):
        raise UsageError(f"{where}: the args record no tensor/pipeline parallel size or layer count ({tp}, {pp}, {layers})")
    assert isinstance(tp, int) and isinstance(pp, int) and isinstance(layers, int)
    if layers % pp:
        raise UsageError(f"{where}: {layers} layers on {pp} pipeline stages do not divide evenly")
    return Parallelism(tp, pp, layers)


def stage_params(model: dict[str, tuple[int, ...]], par: Parallelism, pp_rank: int, tied: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, split, global shape) of a pipeline stage's parameters in `parameters()` order;
    `model`: the checkpoint's model tensors' shapes by name (layers unstacked)."""
    found: list[tuple[str, str, tuple[int, ...]]] = []
    per_stage = par.layers // par.pp
    if pp_rank == 0:
        found += [(key, split, model[key]) for key, split in FIRST_STAGE if key in model]
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        prefix = f"decoder.layers.{layer}."
        found += [(prefix + key, split, model[prefix + key]) for key, split in LAYER_PARAMS if prefix + key in model]
    if pp_rank == par.pp - 1:
        for key, split in LAST_STAGE:
            if key in model:
                found.append((key, split, model[key]))
            elif key == TIED_COPY and tied and par.pp > 1:
                found.append((key, split, model["embedding.word_embeddings.weight"]))
    return found


def unknown_params(model: dict[str, tuple[int, ...]]) -> list[str]:
    """The model's tensors that the rebuilt parameter order has no place for."""
    known = {key for key, _ in FIRST_STAGE + LAST_STAGE}
    layer_keys = {key for key, _ in LAYER_PARAMS}
    return [key for key in model if key not in known and not (key.startswith("decoder.layers.") and key.split(".", 3)[-1] in layer_keys)]


def local_numel(shape: tuple[int, ...], split: str, tp: int) -> int:
    return numel(shape) if split == REPLICATED else numel(shape) // tp


def buffer_slots(
    params: list[tuple[str, str, tuple[int, ...]]], tp: int, tied_pipelined: bool, buckets: list[int], where: str
) -> list[Slot]:
    """Each parameter's bucket and start, laid out as megatron-core does (reverse order, starts
    padded to 64, a pipelined tied embedding alone), the buckets closed where the recorded sizes
    `buckets` (unpadded elements per bucket) say; a UsageError when they cannot be. A bucket
    starts at a multiple of lcm(DP, 128) of the whole buffer, so starts within it pad alike."""
    slots: list[Slot] = []
    bucket, cursor, filled = 0, 0, False  # cursor: elements into the current bucket

    def close(end: int) -> None:
        nonlocal bucket, cursor, filled
        if bucket >= len(buckets) or end != buckets[bucket]:
            recorded = buckets[bucket] if bucket < len(buckets) else "none"
            raise UsageError(f"{where}: the rebuilt parameter order puts {end} elements in bucket {bucket}, the checkpoint {recorded}")
        bucket, cursor, filled = bucket + 1, 0, False

    for key, split, shape in reversed(params):
        size = local_numel(shape, split, tp)
        alone = tied_pipelined and key in ("embedding.word_embeddings.weight", TIED_COPY)
        start = _padded(cursor)
        if alone and filled:
            close(start)
            start = 0
        slots.append(Slot(key, split, size, bucket, start))
        cursor, filled = start + size, True
        if alone or (bucket < len(buckets) and cursor == buckets[bucket]):
            close(cursor)
    if filled:
        close(cursor)
    if bucket != len(buckets):
        raise UsageError(f"{where}: the rebuilt parameter order fills {bucket} buckets, the checkpoint records {len(buckets)}")
    return slots


def _padded(index: int) -> int:
    return -(-index // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
