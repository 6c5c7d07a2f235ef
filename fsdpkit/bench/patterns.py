"""Input data and expected results for `--check`. Tensors only, no process group.

Every value is a small integer, exact in float32, float16 and bfloat16, so the expected result
of a data-moving collective is exact, and so is a sum over up to 32 ranks (sums stay <= 256),
a minimum or a maximum; products and averages allow for rounding.
Values depend on the element's position, so a chunk that lands in the wrong place is wrong.

    moved values    (all-gather, all-to-all, broadcast):  ((5 * source + i) % 31) + 1
    reduced values  (all-reduce, reduce-scatter):        (i % 5) + (rank % 3) + 1

`source` is the sending rank (for all-to-all: sender * n + receiver, one per pair).
"""

from __future__ import annotations

import torch

from ..errors import UsageError


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


def reduced_over_ranks(op: str, start: int, count: int, world_size: int, *, device: torch.device) -> torch.Tensor:
    """Exact (float64) reduction by `op` over all ranks of summed_values, for [start, start + count)."""
    if op in ("sum", "avg"):
        total = sum_over_ranks(start, count, world_size, device=device)
        return total / world_size if op == "avg" else total
    result = summed_values(0, start, count, dtype=torch.float64, device=device)
    for rank in range(1, world_size):
        values = summed_values(rank, start, count, dtype=torch.float64, device=device)
        result = {"prod": torch.mul, "min": torch.minimum, "max": torch.maximum}[op](result, values)
    return result


def check_op_range(op: str, world_size: int, dtype_name: str) -> None:
    """A product of the check pattern over many ranks overflows the low-precision dtypes."""
    finite = {"float32": 3.4e38, "float16": 65504.0, "bfloat16": 3.38e38}[dtype_name]
    if op == "prod" and reduced_over_ranks("prod", 4, 1, world_size, device=torch.device("cpu")).item() > finite:
        raise UsageError(f"--op prod --check overflows {dtype_name} on {world_size} ranks: use float32 or no --check")


def gathered_values(world_size: int, count: int, *, device: torch.device) -> torch.Tensor:
    """Expected all-gather output: every rank's moved_values, in rank order (float64)."""
    return torch.cat([moved_values(source, count, dtype=torch.float64, device=device) for source in range(world_size)])


def alltoall_input(rank: int, world_size: int, count: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s send buffer: chunk p goes to rank p."""
    return torch.cat([moved_values(rank * world_size + peer, count, dtype=dtype, device=device) for peer in range(world_size)])


def alltoall_expected(rank: int, world_size: int, count: int, *, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s receive buffer: chunk s came from rank s (float64)."""
    return torch.cat([moved_values(sender * world_size + rank, count, dtype=torch.float64, device=device) for sender in range(world_size)])


def tolerance(dtype: torch.dtype, world_size: int, op: str = "sum") -> float:
    """Relative tolerance: zero while every partial result is exact in `dtype` (an integer no
    larger than 2**mantissa bits), else a few ulps per rank."""
    if op in ("min", "max"):
        return 0.0
    exact_up_to = {torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}[dtype]
    largest = 7.0**world_size if op == "prod" else world_size * 8
    exact = largest <= exact_up_to and op != "avg"
    return 0.0 if exact else world_size * torch.finfo(dtype).eps


def count_wrong(result: torch.Tensor, expected: torch.Tensor, *, rtol: float = 0.0) -> int:
    """Elements of `result` that differ from `expected` (NaN and inf count as wrong)."""
    got = result.reshape(-1).to(torch.float64)
    want = expected.reshape(-1).to(got.device)
    if got.numel() != want.numel():
        raise ValueError(f"result has {got.numel()} elements, expected {want.numel()}")
    close = (got - want).abs() <= rtol * want.abs()
    return int((~close).sum().item())
