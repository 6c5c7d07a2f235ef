"""What a benchmark run was asked to do, validated before any process starts. Every field is a
setting (fsdpkit.settings): its long flag and nccl-tests' short one (-b -e -f -n -w -c -d -o).
No torch here: `fsdpkit bench --help` stays fast."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import SHORT_NAMES, Dtype, from_short, from_spelling
from ..errors import UsageError
from ..settings import setting
from ..sizes import format_size, parse_size
from .busbw import COLLECTIVES, VARIANTS, check_collective, size_sweep

DTYPES = tuple(from_short(name).torch_name for name in SHORT_NAMES)  # type: ignore[union-attr]
BACKENDS = ("auto", "gloo", "nccl")
OPS = ("sum", "prod", "min", "max", "avg")  # all-reduce and reduce-scatter only
REDUCING = ("allreduce", "reducescatter")
NCCL_TESTS_BINARIES = {
    "allgather": "all_gather_perf",
    "reducescatter": "reduce_scatter_perf",
    "allreduce": "all_reduce_perf",
    "broadcast": "broadcast_perf",
    "alltoall": "alltoall_perf",
}


def _bench_dtype(text: str) -> Dtype:
    """The dtype a --dtype names, by its torch name or its nccl-tests name."""
    found = from_spelling(text)
    if found is None or text not in (found.torch_name, found.nccl_tests):
        raise UsageError(f"unknown --dtype {text!r}: choose from {', '.join(DTYPES)} (nccl-tests: float, half, bfloat16)")
    return found


def parse_dtype(text: str) -> str:
    return _bench_dtype(text).torch_name


def torch_dtype(name: str):  # -> torch.dtype
    return _bench_dtype(name).torch


def element_size(dtype_name: str) -> int:
    return _bench_dtype(dtype_name).itemsize


@dataclass(frozen=True)
class BenchOptions:
    collectives: tuple[str, ...]
    min_bytes: int = setting(
        1024,
        "Smallest size: K/M/G = KiB/MiB/GiB (1024), KB/MB/GB (1000).",
        short="-b",
        parse=parse_size,
        metavar="SIZE",
        shown_default="1K",
    )
    max_bytes: int = setting(64 * 1024**2, "Largest size, same units.", short="-e", parse=parse_size, metavar="SIZE", shown_default="64M")
    factor: int = setting(2, "Multiply the size by this between rows (>= 2).", short="-f")
    iters: int = setting(20, "Timed calls per size and mode.", short="-n")
    warmup: int = setting(5, "Untimed calls before each timed run.", short="-w")
    check: int = setting(
        0,
        "Verify every result element of N more runs on fresh inputs; wrong ones are counted, and any exits 3 (0: no check).",
        short="-c",
        metavar="N",
    )
    dtype: str = setting("float32", "float32 (float), bfloat16 or float16 (half).", short="-d", parse=parse_dtype, metavar="TYPE")
    op: str = setting("sum", "Reduction of allreduce and reducescatter (avg: nccl only).", short="-o", choices=OPS)
    backend: str = setting("auto", "auto: nccl with a GPU per process, else gloo.", choices=BACKENDS)
    variant: str | None = setting(
        None,
        "allgather: flat (all_gather_single, FSDP's; default), list (all_gather into separate "
        "tensors) or fsdpkit (the engine's: point-to-point sends into place on gloo); reducescatter: "
        "torch (reduce_scatter_single, an all-reduce on gloo; default) or fsdpkit (the engine's: "
        "point-to-point sends summed in place on gloo); all: side by side.",
        metavar="NAME",
    )

    def __post_init__(self) -> None:
        if not self.collectives:
            raise UsageError(f"no collective given: choose from {', '.join(COLLECTIVES)}")
        for collective in self.collectives:
            check_collective(collective)
        parse_dtype(self.dtype)
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown --backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        if self.variant is not None:
            with_variants = [c for c in self.collectives if c in VARIANTS]
            if not with_variants:
                raise UsageError(f"--variant only applies to {', '.join(VARIANTS)}")
            for collective in with_variants:
                if self.variant not in (*VARIANTS[collective], "all"):
                    raise UsageError(f"unknown --variant {self.variant!r}: choose from {', '.join(VARIANTS[collective])}, all")
            if self.variant in ("fsdpkit", "all") and "reducescatter" in with_variants and self.op != "sum":
                raise UsageError(f"--variant {self.variant} of reducescatter sums only (the engine reduces gradients); got --op {self.op}")
        if self.op not in OPS:
            raise UsageError(f"unknown --op {self.op!r}: choose from {', '.join(OPS)}")
        if self.iters < 1:
            raise UsageError(f"--iters must be >= 1, got {self.iters}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")
        if self.check < 0:
            raise UsageError(f"--check must be >= 0, got {self.check}")
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
            elif self.variant == "all":
                pairs += [(collective, variant) for variant in variants]
            else:
                pairs.append((collective, self.variant or variants[0]))
        return pairs

    def nccl_tests_command(self, collective: str, *, nproc_per_node: int, nnodes: int) -> str:
        """The nccl-tests command line that measures the same thing (one process per GPU)."""
        flags = (
            f"-b {self.min_bytes} -e {self.max_bytes} -f {self.factor} -n {self.iters} -w {self.warmup} "
            f"-c {self.check} -d {_bench_dtype(self.dtype).nccl_tests}"
        )
        if collective in REDUCING:
            flags += f" -o {self.op}"
        return f"mpirun -np {nproc_per_node * nnodes} {NCCL_TESTS_BINARIES[collective]} {flags} -g 1"


def check_memory(options: BenchOptions, *, processes: int, available_bytes: int, where: str) -> None:
    """The largest size's buffers must fit in the memory `processes` share: about twice the
    size per process (send and receive), and with --check its expected and received values
    in float64 (16 bytes per element)."""
    elements = options.max_bytes // element_size(options.dtype)
    needed = processes * (2 * options.max_bytes + (16 * elements if options.check else 0))
    if needed > available_bytes:
        raise UsageError(
            f"--max-bytes {options.max_bytes} ({format_size(options.max_bytes)}) needs about {format_size(needed)} of "
            f"{where} for {processes} process{'es' * (processes > 1)}, more than the {format_size(available_bytes)} available"
        )


def resolve_backend(requested: str, *, nproc_per_node: int) -> str:
    """auto -> nccl when this node has a GPU for every local process, else gloo."""
    import torch

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
