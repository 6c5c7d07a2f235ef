"""Input data and expected results for `--check`. Tensors only, no process group.

Every value is a small integer, exact in float32, float16 and bfloat16, so the expected result
of a data-moving collective is exact, and so is a sum over up to 32 ranks (sums stay <= 256).
Values depend on the element's position, so a chunk that lands in the wrong place is wrong.

    moved values    (all-gather, all-to-all, broadcast):  ((5 * source + i) % 31) + 1
    summed values   (all-reduce, reduce-scatter):        (i % 5) + (rank % 3) + 1

`source` is the sending rank (for all-to-all: sender * n + receiver, one per pair).
"""

from __future__ import annotations

import torch


def moved_values(source: int, count: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    index = torch.arange(count, device=device, dtype=torch.int64)
    return ((5 * source + index) % 31 + 1).to(dtype)


def summed_values(rank: int, start: int, count: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s input for elements [start, start + count) of a summed buffer."""
    index = torch.arange(start, start + count, device=device, dtype=torch.int64)
    return (index % 5 + rank % 3 + 1).to(dtype)


def sum_over_ranks(start: int, count: int, world_size: int, *, device: torch.device) -> torch.Tensor:
    """Exact (float64) sum over all ranks of summed_values, for elements [start, start + count)."""
    index = torch.arange(start, start + count, device=device, dtype=torch.float64)
    rank_part = sum(rank % 3 for rank in range(world_size))
    return world_size * (index % 5 + 1) + rank_part


def gathered_values(world_size: int, count: int, *, device: torch.device) -> torch.Tensor:
    """Expected all-gather output: every rank's moved_values, in rank order (float64)."""
    return torch.cat([moved_values(source, count, dtype=torch.float64, device=device) for source in range(world_size)])


def alltoall_input(rank: int, world_size: int, count: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s send buffer: chunk p goes to rank p."""
    return torch.cat([moved_values(rank * world_size + peer, count, dtype=dtype, device=device) for peer in range(world_size)])


def alltoall_expected(rank: int, world_size: int, count: int, *, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s receive buffer: chunk s came from rank s (float64)."""
    return torch.cat([moved_values(sender * world_size + rank, count, dtype=torch.float64, device=device) for sender in range(world_size)])


def tolerance(dtype: torch.dtype, world_size: int) -> float:
    """Relative tolerance for sums: zero while the result is exact in `dtype`, else a few ulps."""
    exact_up_to = {torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}[dtype]
    largest_sum = world_size * 8
    return 0.0 if largest_sum <= exact_up_to else world_size * torch.finfo(dtype).eps


def count_wrong(result: torch.Tensor, expected: torch.Tensor, *, rtol: float = 0.0) -> int:
    """Elements of `result` that differ from `expected` (NaN and inf count as wrong)."""
    got = result.reshape(-1).to(torch.float64)
    want = expected.reshape(-1).to(got.device)
    if got.numel() != want.numel():
        raise ValueError(f"result has {got.numel()} elements, expected {want.numel()}")
    close = (got - want).abs() <= rtol * want.abs()
    return int((~close).sum().item())
