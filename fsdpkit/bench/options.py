"""What a benchmark run was asked to do, validated before any process starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from .busbw import COLLECTIVES, VARIANTS, check_collective, size_sweep

DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("auto", "gloo", "nccl")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(f"unknown --dtype {name!r}: choose from {', '.join(DTYPES)}")
    return getattr(torch, name)


def element_size(dtype_name: str) -> int:
    return torch.empty(0, dtype=torch_dtype(dtype_name)).element_size()


@dataclass(frozen=True)
class BenchOptions:
    collectives: tuple[str, ...]
    min_bytes: int = 1024
    max_bytes: int = 64 * 1024**2
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    backend: str = "auto"
    variant: str | None = None  # for the collectives in VARIANTS: one of theirs or "both"; None: the first
    check: bool = False

    def __post_init__(self) -> None:
        if not self.collectives:
            raise UsageError(f"no collective given: choose from {', '.join(COLLECTIVES)}")
        for collective in self.collectives:
            check_collective(collective)
        torch_dtype(self.dtype)
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown --backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        if self.variant is not None:
            with_variants = [c for c in self.collectives if c in VARIANTS]
            if not with_variants:
                raise UsageError(f"--variant only applies to {', '.join(VARIANTS)}")
            for collective in with_variants:
                if self.variant not in (*VARIANTS[collective], "both"):
                    raise UsageError(f"unknown --variant {self.variant!r}: choose from {', '.join(VARIANTS[collective])}, both")
        if self.iters < 1:
            raise UsageError(f"--iters must be >= 1, got {self.iters}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")
        size_sweep(self.min_bytes, self.max_bytes, self.factor)  # raises on a bad range or factor

    def requested_sizes(self) -> list[int]:
        return size_sweep(self.min_bytes, self.max_bytes, self.factor)

    def entries(self) -> list[tuple[str, str]]:
        """(collective, variant) pairs to run, in order; variant is '' for collectives without variants."""
        pairs: list[tuple[str, str]] = []
        for collective in self.collectives:
            variants = VARIANTS.get(collective)
            if variants is None:
                pairs.append((collective, ""))
            elif self.variant == "both":
                pairs += [(collective, variant) for variant in variants]
            else:
                pairs.append((collective, self.variant or variants[0]))
        return pairs


def resolve_backend(requested: str, *, nproc_per_node: int) -> str:
    """auto -> nccl when this node has a GPU for every local process, else gloo."""
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if cuda_devices >= nproc_per_node else "gloo"
    if requested == "nccl":
        if cuda_devices == 0:
            raise UsageError("--backend nccl needs CUDA, but torch sees no CUDA device here: use --backend gloo")
        if nproc_per_node > cuda_devices:
            raise UsageError(
                f"--nproc-per-node {nproc_per_node} is more than nccl can run here: one process per GPU and this node has {cuda_devices}"
            )
    return requested
