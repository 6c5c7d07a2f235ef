"""The pure parts of DCP support against torch computing the same thing: chunk boxes as flat
runs, coverage, FSDP2's dim-0 chunks; and the allow-list unpickler on hostile pickles."""

from __future__ import annotations

import itertools
import os
import pickle

import pytest
import torch

from fsdpkit.dcp import unpickler
from fsdpkit.dcp.boxes import coverage_problem, flat_runs, run_count
from fsdpkit.dcp.writer import dim0_chunks
from fsdpkit.errors import DataCheckError


@pytest.mark.parametrize("shape", [(7,), (5, 6), (4, 3, 5), (2, 3, 4, 2)])
def test_flat_runs_match_torch_indexing(shape):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for offsets in itertools.product(*(range(0, d, max(1, d // 2)) for d in shape)):
        sizes = tuple(max(1, (d - o) // 2 + (i % 2)) for i, (o, d) in enumerate(zip(offsets, shape, strict=True)))
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].contiguous().reshape(-1)
        runs = list(flat_runs(shape, offsets, sizes))
        assert len(runs) == run_count(shape, offsets, sizes)
        gathered = torch.cat([full.reshape(-1)[first : first + count] for first, count, _ in runs])
        assert torch.equal(gathered, box)
        assert [within for _, _, within in runs] == [sum(c for _, c, _ in runs[:i]) for i in range(len(runs))]


def test_coverage():
    shape = (6, 4)
    halves = [((0, 0), (3, 4)), ((3, 0), (3, 4))]
    columns = [((0, 0), (6, 2)), ((0, 2), (6, 2))]
    assert coverage_problem(shape, halves) is None and coverage_problem(shape, columns) is None
    assert "overlap" in coverage_problem(shape, [((0, 0), (4, 4)), ((3, 0), (3, 4))])
    assert "gap" in coverage_problem(shape, [((0, 0), (3, 4))])
    assert coverage_problem((), [((), ())]) is None


@pytest.mark.parametrize("rows,world", [(7, 2), (7, 3), (3, 8), (0, 2), (64, 64)])
def test_dim0_chunks_are_torch_chunk(rows, world):
    pieces = torch.arange(rows).chunk(world) if rows else ()
    expected = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
    assert [c for c in dim0_chunks(rows, world) if c[0] < c[1]] == expected


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unpickler_refuses_everything_else(tmp_path):
    marker = tmp_path / "marker"
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(DataCheckError, match="not allowed"):
            unpickler.restricted_loads(pickle.dumps(_Payload(marker), protocol=protocol), allowed=unpickler.METADATA_GLOBALS, where="x")
    with pytest.raises(DataCheckError, match="not allowed"):
        unpickler.restricted_loads(pickle.dumps(torch.nn.Linear(2, 2)), allowed=unpickler.METADATA_GLOBALS, where="x")
    with pytest.raises(DataCheckError, match="persistent id"):
        unpickler.restricted_loads(b"\x80\x02X\x01\x00\x00\x00aQ.", allowed=unpickler.METADATA_GLOBALS, where="x")
    assert not marker.exists()
    assert unpickler.restricted_loads(pickle.dumps(torch.Size([2, 3])), allowed=unpickler.METADATA_GLOBALS, where="x") == (2, 3)
    assert unpickler.restricted_loads(pickle.dumps(torch.bfloat16), allowed=unpickler.METADATA_GLOBALS, where="x") == unpickler.Dtype(
        "BF16"
    )
