"""What a process of a conversion holds of a DeepSpeed ZeRO-3 source: every parameter is cut over
every rank that saved it, yet its table grows with the tensors, not with tensors x ranks (each
tensor's pieces are worked out from its slot as a reader asks for them, never listed); the pieces
worked out cover each tensor exactly once, where the rank files hold them; and a flat array too
short for its parameters is still found when the checkpoint is opened."""

from __future__ import annotations

import gc
import math
import tracemalloc
from pathlib import Path

import pytest

from fsdpkit.checkpoint.deepspeed.table import DeepSpeedCheckpoint, add_sources
from fsdpkit.checkpoint.torchfile.savefile import TensorRange
from fsdpkit.checkpoint.torchfile.unpickler import StorageRef, TensorRecord
from fsdpkit.errors import DataCheckError
from fsdpkit.flat_layout import ElementRange

HEADER = 64  # where each fake rank file's flat arrays start


class RankFile:
    """What the table reads of one rank file: its path, its unpickled state and where a tensor lies."""

    def __init__(self, path: Path, state: dict):
        self.path, self.state = path, state

    def tensor_range(self, record: TensorRecord, what: str) -> TensorRange:
        return TensorRange(self.path, HEADER + record.storage_offset * 4, math.prod(record.shape), "F32")


def _flat(numel: int, at: int = 0) -> TensorRecord:
    return TensorRecord(StorageRef(None, "0", numel), at, (numel,), (1,), "F32")  # type: ignore[arg-type]


def zero3_files(shapes: dict[str, tuple[int, ...]], ranks: int, short_by: int = 0) -> tuple[list[RankFile], list[RankFile], list[dict]]:
    """(model files, optimizer files, their optimizer states) of a ZeRO-3 run of `ranks` ranks:
    an fp32 flat group and Adam's two moments per rank (these `short_by` elements short)."""
    per_rank = sum(math.ceil(math.prod(shape) / ranks) for shape in shapes.values())
    moment = per_rank - short_by
    model_state = {"module": {}, "buffer_names": [], "param_shapes": [shapes], "shared_params": {}}
    models = [RankFile(Path(f"/ckpt/zero_pp_rank_{r}_mp_rank_00_model_states.pt"), model_state) for r in range(ranks)]
    states = [
        {
            "zero_stage": 3,
            "partition_count": ranks,
            "fp32_flat_groups": [_flat(per_rank)],
            "base_optimizer_state": [{"exp_avg": _flat(moment, per_rank), "exp_avg_sq": _flat(moment, 2 * per_rank)}],
        }
        for _ in range(ranks)
    ]
    optims = [RankFile(Path(f"/ckpt/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), {}) for r in range(ranks)]
    return models, optims, states


def table(shapes: dict[str, tuple[int, ...]], ranks: int, short_by: int = 0) -> DeepSpeedCheckpoint:
    models, optims, states = zero3_files(shapes, ranks, short_by)
    checkpoint = DeepSpeedCheckpoint(None, 3, ranks, "F32", "0.16.0", None)  # type: ignore[arg-type]
    add_sources(checkpoint, models, optims, states)  # type: ignore[arg-type]
    return checkpoint


def traced_bytes(shapes: dict[str, tuple[int, ...]], ranks: int) -> int:
    """Python bytes the table of a checkpoint of `ranks` ranks holds once built (its files not counted)."""
    models, optims, states = zero3_files(shapes, ranks)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        checkpoint = DeepSpeedCheckpoint(None, 3, ranks, "F32", "0.16.0", None)  # type: ignore[arg-type]
        add_sources(checkpoint, models, optims, states)  # type: ignore[arg-type]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_zero3_table_grows_with_the_tensors_not_with_the_ranks_that_saved_them():
    shapes = {f"layers.{i}.weight": (96, 80 + i) for i in range(60)}
    few, many = traced_bytes(shapes, 8), traced_bytes(shapes, 1024)
    tensors = 3 * len(shapes)  # the weights and Adam's two moments
    per_tensor_and_rank = (many - few) / (tensors * (1024 - 8))
    # A listed table holds a piece (a tuple, its range, offsets: ~300 bytes) per tensor and rank.
    assert per_tensor_and_rank < 16, (few, many)


def test_the_pieces_worked_out_cover_each_tensor_once_where_its_ranks_hold_it():
    shapes = {"a": (7, 5), "b": (3,), "c": (11, 4)}
    ranks = 4
    checkpoint = table(shapes, ranks)
    per_rank = sum(math.ceil(math.prod(shape) / ranks) for shape in shapes.values())
    offset = 0
    for name, shape in shapes.items():
        numel, part = math.prod(shape), math.ceil(math.prod(shape) / ranks)
        for moment, base in (("", 0), ("optim.exp_avg.", per_rank), ("optim.exp_avg_sq.", 2 * per_rank)):
            source = next(s for s in checkpoint.sources if s.name == moment + name)
            pieces = source.pieces_in(ElementRange(0, numel))
            assert [(p.range.start, p.range.end) for p in pieces] == [
                (r * part, min(numel, (r + 1) * part)) for r in range(ranks) if r * part < numel
            ]
            for piece in pieces:  # rank r holds elements [r * part, ...) at the parameter's running offset
                rank = piece.range.start // part
                assert piece.path.name.startswith(f"bf16_zero_pp_rank_{rank}_") and piece.offset == HEADER + 4 * (base + offset)
            middle = source.pieces_in(ElementRange(part, part + 1))  # rank 1's first element only
            assert [p.range.start for p in middle] == [part]
        offset += part


def test_a_flat_array_too_short_for_its_parameters_is_named_when_opened():
    with pytest.raises(DataCheckError, match="'b': elements up to 11 of a flat buffer of 10"):
        table({"a": (7, 5), "b": (8,)}, 4, short_by=1)
