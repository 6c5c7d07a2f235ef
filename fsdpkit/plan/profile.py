"""Hardware profiles for the step-time model (fsdpkit.plan.simulate): what one device computes, and
how fast collectives move bytes inside a node and between nodes.

A profile is a TOML file of the fields of `Hardware` (`fsdpkit plan --calibrate OUT.toml`
writes one for this machine); the built-in ones carry the sources of their numbers.
Bandwidths are bus bandwidths as nccl-tests reports them: a ring collective over n ranks
moves (n-1)/n of its buffer (twice that for an all-reduce) through each rank's link. Across
nodes NCCL runs one ring per network card, so a ring that spans nodes gets about the node's
cards together, not one card's rate.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from ..errors import UsageError

DTYPES = ("fp32", "bf16", "fp16")
CALIBRATE_SECONDS = 10.0  # how long `--calibrate` times each part of a profile, at least
MAX_CONTENTION = 4.0


@dataclass(frozen=True)
class FittedTerms:
    """The software's costs on a machine, beside what its datasheet says: fitted to measured
    steps by `--calibrate` (fsdpkit.plan.calibrate.fit), set by hand for the built-in profiles."""

    efficiency: float  # the fraction of peak the model's matrix products achieve
    unit_overhead_s: float  # fixed time per wrapped module per forward or backward (hooks, launches, small ops)
    compute_contention: float = 1.0  # ranks beyond compute_slots: how much slower than its turns on a core a rank computes
    # how much slower a rank computes while the node's ranks keep all compute_slots busy than alone (shared caches, the all-core clock)
    all_cores_slowdown: float = 1.0
    collective_overhead_s: float = 0.0  # fixed time per collective, whatever its ranks (issue, hooks, copies in and out)
    reduce_overhead_s: float = 0.0  # a reduction's fixed time beyond that (the gradient's path: flattening, summing, accumulating)
    op_overhead_s: float = 0.0  # fixed time per operator dispatched (eager dispatch, autograd, kernel launch)
    param_passes: float = 0.0  # times each forward or backward moves its unit's unsharded parameters at memory bandwidth
    optimizer_tensor_s: float = 0.0  # fixed time per parameter tensor of the optimizer step (a per-tensor loop)
    optimizer_passes: float = 1.0  # the optimizer's memory traffic in units of its kernels' (fsdpkit.plan.kernels)


FITTED_KEYS = tuple(f.name for f in fields(FittedTerms))


@dataclass(frozen=True)
class Hardware:
    """A hardware profile: the device and its links (datasheet or measured), and the fitted
    software terms. Its file is one flat table of both (`from_values`, `to_values`)."""

    name: str
    source: str  # where the numbers come from
    peak_tflops: dict[str, float]  # dense peak per compute dtype (fp32, bf16, fp16)
    memory_gb: float  # device memory
    memory_bw_gbs: float  # device memory bandwidth (the optimizer step is bound by it)
    ranks_per_node: int
    intra_bw_gbs: float  # bus bandwidth of a collective inside a node, per rank
    intra_latency_s: float  # per ring step inside a node
    inter_bw_gbs: float  # bus bandwidth of a collective spanning nodes, per rank
    inter_latency_s: float  # per ring step between nodes
    fitted: FittedTerms
    host_bw_gbs: float = 25.0  # host <-> device copies (CPU offload)
    overlap: bool = True  # communication runs beside compute (False: the two share the same cores)
    compute_slots: int = 0  # ranks of a node that compute at once (CPU: its cores); 0: every rank has its own device
    # the fraction of memory_bw_gbs that bandwidth-bound kernels reach (elementwise, norms, the loss, casts, the optimizer)
    memory_efficiency: float = 1.0

    def __post_init__(self) -> None:
        fitted = self.fitted
        for key in ("memory_gb", "memory_bw_gbs", "intra_bw_gbs", "inter_bw_gbs", "host_bw_gbs", "memory_efficiency"):
            _positive(self.name, key, getattr(self, key))
        for key in ("efficiency", "optimizer_passes"):
            _positive(self.name, key, getattr(fitted, key))
        overheads = ("unit_overhead_s", "collective_overhead_s", "reduce_overhead_s", "op_overhead_s", "optimizer_tensor_s")
        for key in ("intra_latency_s", "inter_latency_s", "param_passes", *overheads):
            _at_least_zero(self.name, key, getattr(fitted if key in FITTED_KEYS else self, key))
        for key, value in (("efficiency", fitted.efficiency), ("memory_efficiency", self.memory_efficiency)):
            if value > 1:
                raise UsageError(f"hardware {self.name!r}: {key} must be in (0, 1], got {value}")
        for key in ("compute_contention", "all_cores_slowdown"):
            factor = getattr(fitted, key)
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= MAX_CONTENTION:
                raise UsageError(f"hardware {self.name!r}: {key} must be a number in [1, {MAX_CONTENTION:g}], got {factor!r}")
        if not isinstance(self.compute_slots, int) or self.compute_slots < 0:
            raise UsageError(f"hardware {self.name!r}: compute_slots must be an integer >= 0, got {self.compute_slots!r}")
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise UsageError(f"hardware {self.name!r}: ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")
        if not isinstance(self.peak_tflops, dict) or set(self.peak_tflops) - set(DTYPES) or "fp32" not in self.peak_tflops:
            raise UsageError(f"hardware {self.name!r}: peak_tflops must be a table with fp32 (and bf16, fp16), got {self.peak_tflops!r}")
        for dtype, value in self.peak_tflops.items():
            _positive(self.name, f"peak_tflops.{dtype}", value)

    def with_values(self, **values: Any) -> Hardware:
        """This profile with some of its file's keys (fitted terms among them) set anew."""
        terms = {key: values.pop(key) for key in FITTED_KEYS if key in values}
        return replace(self, fitted=replace(self.fitted, **terms), **values)

    @property
    def memory_rate(self) -> float:
        """Bytes per second that bandwidth-bound kernels move."""
        return self.memory_bw_gbs * 1e9 * self.memory_efficiency

    def peak_flops(self, dtype: str) -> float:
        return self.peak_tflops.get(dtype, self.peak_tflops["fp32"]) * 1e12

    def compute_share(self, ranks_per_node: int) -> float:
        """How many ranks take turns on each core when `ranks_per_node` ranks share the node's
        `compute_slots` cores (1: each has its own)."""
        return max(1.0, ranks_per_node / self.compute_slots) if self.compute_slots else 1.0

    def compute_slowdown(self, ranks_per_node: int) -> float:
        """How many times as long a rank computes when `ranks_per_node` ranks share the node's cores
        than one rank alone on them."""
        return self.busy_cores_slowdown(ranks_per_node) * shared_compute_slowdown(
            self.compute_share(ranks_per_node), self.fitted.compute_contention
        )

    def busy_cores_slowdown(self, ranks_per_node: int) -> float:
        """How many times as long a rank computes while the others compute on the node's other
        cores: all_cores_slowdown where they keep all compute_slots busy, in proportion where they
        keep fewer; 1 for one rank, and where every rank has its own device."""
        if self.compute_slots < 2:
            return 1.0
        busy = min(ranks_per_node, self.compute_slots)
        return 1.0 + (self.fitted.all_cores_slowdown - 1.0) * (busy - 1) / (self.compute_slots - 1)

    def link(self, group_size: int, ranks_per_node: int) -> tuple[float, float]:
        """(bus bandwidth in bytes/s, latency per ring step) of a group of consecutive ranks."""
        if group_size <= ranks_per_node:
            return self.intra_bw_gbs * 1e9, self.intra_latency_s
        return self.inter_bw_gbs * 1e9, self.inter_latency_s

    def to_values(self) -> dict[str, Any]:
        """The flat table of its file: the profile's keys, then the fitted terms'."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "fitted"}
        return {**own, **{key: getattr(self.fitted, key) for key in FITTED_KEYS}}


def shared_compute_slowdown(share: float, contention: float) -> float:
    """How many times as long a rank computes when `share` ranks take turns on each core, each
    `contention` times slower than its turns (switching between them); 1 at a core each."""
    return share * contention if share > 1 else 1.0


def _positive(name: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"hardware {name!r}: {key} must be a number > 0, got {value!r}")


def _at_least_zero(name: str, key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UsageError(f"hardware {name!r}: {key} must be a number >= 0, got {value!r}")


def from_values(values: dict[str, Any], *, name: str) -> Hardware:
    """A profile from its file's flat table (the fitted terms beside the rest)."""
    keys = [f for f in fields(Hardware) if f.name != "fitted"] + list(fields(FittedTerms))
    known = {f.name for f in keys}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"hardware file {name!r}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
    missing = [f.name for f in keys if f.name not in values and f.default is MISSING and f.name != "name"]
    if missing:
        raise UsageError(f"hardware file {name!r}: missing key {missing[0]!r}")
    own = {key: value for key, value in values.items() if key not in FITTED_KEYS}
    try:
        fitted = FittedTerms(**{key: value for key, value in values.items() if key in FITTED_KEYS})
        return Hardware(name=name, fitted=fitted, **own)
    except TypeError as error:
        raise UsageError(f"hardware file {name!r}: {error}") from None


def load(spec: str) -> Hardware:
    """A built-in profile by name, or a TOML file."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    import tomllib

    if not spec.endswith(".toml"):
        raise UsageError(f"unknown hardware {spec!r}: use a .toml file or one of {', '.join(BUILT_IN)}")
    try:
        with open(spec, "rb") as handle:
            values = tomllib.load(handle)
    except OSError as error:
        raise UsageError(f"cannot read hardware file {spec!r}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"hardware file {spec!r} is not valid TOML: {error}") from None
    return from_values(values, name=str(values.pop("name", spec)))


def to_toml(hardware: Hardware, header: str) -> str:
    from ..settings import to_toml as write

    values = hardware.to_values()
    peak = values.pop("peak_tflops")
    return write({**values, "peak_tflops": peak}, header=header)


_NVIDIA_A100 = "NVIDIA A100 datasheet (dense TF32 156 / BF16 312 TFLOPS, HBM 1.6-2.0 TB/s)"
_NVIDIA_H100 = "NVIDIA H100 SXM datasheet (dense BF16 989 TFLOPS, FP32 67, HBM3 3.35 TB/s)"
_TORCHTITAN_H100 = (
    "torchtitan docs/performance.md (Grand Teton hosts: H100 with 96 GB HBM2e at 2.4 TB/s, NVLink, 400 Gb/s RDMA per GPU, "
    "500 W power limit, which the profile does not model); dense BF16 989 TFLOPS as the SXM part"
)
_NVIDIA_H200 = "NVIDIA H200 SXM datasheet (dense BF16 989 TFLOPS, HBM3e 4.8 TB/s, 141 GB)"
# A streaming copy reaches about 90% of a Hopper's or Ampere's datasheet HBM bandwidth; PyTorch's
# eager elementwise, norm and reduction kernels somewhat less. Not fitted to any step's time.
GPU_MEMORY_EFFICIENCY = 0.85
_NCCL = (
    "nccl-tests on DGX: NVLink3 all-gather busbw ~230 GB/s, NVLink4 ~360 GB/s; across nodes NCCL runs one ring per NIC, "
    "so busbw ~90% of the node's 8 NICs together (~180 GB/s with 8x200 Gb/s HDR)"
)


def _gpu(name: str, peak: dict[str, float], memory_gb: float, memory_bw: float, intra_bw: float, ib_gbit: int, source: str) -> Hardware:
    return Hardware(
        name=name,
        source=f"{source}; {_NCCL}; {ib_gbit} Gb/s InfiniBand per GPU; bandwidth-bound kernels at {GPU_MEMORY_EFFICIENCY:.0%} of HBM",
        peak_tflops=peak,
        fitted=FittedTerms(efficiency=0.6, unit_overhead_s=5e-5),
        memory_gb=memory_gb,
        memory_bw_gbs=memory_bw,
        ranks_per_node=8,
        intra_bw_gbs=intra_bw,
        intra_latency_s=5e-6,
        inter_bw_gbs=min(intra_bw, ib_gbit / 8 * 8 * 0.9),  # one NCCL ring per NIC: the node's 8 NICs together
        inter_latency_s=1e-5,
        host_bw_gbs=25.0,
        memory_efficiency=GPU_MEMORY_EFFICIENCY,
    )


def _built_in() -> dict[str, Hardware]:
    profiles = {}
    a100 = {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}
    for memory, bandwidth in ((40, 1555.0), (80, 2039.0)):
        for ib in (100, 200, 400):
            name = f"a100-{memory}gb-ib{ib}"
            profiles[name] = _gpu(name, a100, memory, bandwidth, 230.0, ib, _NVIDIA_A100)
    hopper = {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}
    profiles["h100-ib400"] = _gpu("h100-ib400", hopper, 80, 3350.0, 360.0, 400, _NVIDIA_H100)
    profiles["h100-96gb-ib400"] = _gpu("h100-96gb-ib400", hopper, 96, 2400.0, 360.0, 400, _TORCHTITAN_H100)
    profiles["h200-ib400"] = _gpu("h200-ib400", hopper, 141, 4800.0, 360.0, 400, _NVIDIA_H200)
    profiles["cpu-gloo"] = Hardware(
        name="cpu-gloo",
        source="a generic 2-core x86 host with gloo over loopback TCP; run `fsdpkit plan --calibrate` for this machine",
        peak_tflops={"fp32": 0.1, "bf16": 0.05, "fp16": 0.05},
        fitted=FittedTerms(efficiency=0.5, unit_overhead_s=3e-4),
        memory_gb=16,
        memory_bw_gbs=10.0,
        ranks_per_node=64,
        intra_bw_gbs=1.0,
        intra_latency_s=5e-5,
        inter_bw_gbs=1.0,
        inter_latency_s=5e-5,
        host_bw_gbs=10.0,
        overlap=False,
        compute_slots=2,
    )
    return profiles


BUILT_IN = _built_in()


def ranks_per_node(hardware: Hardware, world_size: int, nodes: int | None) -> int:
    """Ranks per node of `world_size` ranks spread over `nodes` nodes (None: as few nodes as
    the profile's ranks per node allows)."""
    if nodes is None:
        return min(hardware.ranks_per_node, world_size)
    if nodes < 1 or world_size % nodes:
        raise UsageError(f"--nodes {nodes} must be >= 1 and divide the world size {world_size}")
    return world_size // nodes
