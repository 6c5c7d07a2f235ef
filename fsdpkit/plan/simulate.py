"""The time of one training step, by simulating the engine's step policy
(fsdpkit.engine.step_policy) on two streams: compute and communication. Pure arithmetic.

    compute     a unit's forward or backward: its FLOPs at the device's achievable rate
                (peak x efficiency), the bytes its other operators move and `param_passes`
                times its unsharded parameters at the memory rate (memory bandwidth x
                memory_efficiency), a fixed cost per operator it dispatches and a fixed cost
                per unit and pass (hooks); checkpointing recomputes the forward in backward;
                each all-gather's casts and each reduction's gradient copies, the loss and the
                optimizer step (`optimizer_passes` times its kernels' traffic,
                fsdpkit.plan.kernels) at the memory rate, plus a fixed cost per parameter
                tensor; CPU offload adds host<->device copies of the shard. StepTime.terms
                splits the compute stream's busy time into these parts
    network     alpha-beta: a ring collective over n ranks takes (n-1) latency steps plus
                the bytes each rank moves, (n-1)/n of the buffer (twice for an all-reduce),
                over the bus bandwidth of the group's link (inside a node or between nodes),
                plus a fixed cost per collective and a further one per reduction
    schedule    the events of the step policy: an all-gather starts when it is issued and
                the communication stream is free; a unit computes once its all-gather has
                arrived; completing a reduction waits for it; the all-gather limiter waits
                for the oldest gather in flight. Without overlap (hardware.overlap False:
                gloo shares the cores with compute) every collective holds the compute stream.

The step time is when both streams are done; exposed communication is what the compute
stream waited for.

    shared cores  while a node's ranks keep its cores (hardware.compute_slots) busy, a rank
                computes more slowly than alone on them (shared caches and memory bandwidth,
                the all-core clock): hardware.fitted.all_cores_slowdown, k, where every core
                computes, in proportion to the other cores kept busy where fewer. Where the
                ranks outnumber the cores by s, the step above (`alone`) is what a rank would
                take with a core of its own. Its compute takes turns on the core, s times as
                long, and longer still by what the switching between ranks costs (their
                caches, the scheduler: hardware.fitted.compute_contention, c). The collectives take
                as long as with a core each (charging their copies or their waiting s times
                over-predicts the bandwidth-bound steps):
                step = alone + (k x s x c - 1) x compute.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.step_policy import Op, StepPolicy, step_events
from ..engine.traffic import Collective, UnitTraffic
from .profile import Hardware


class Recompute(enum.Enum):
    """What the backward computes again of the forward (activation checkpointing)."""

    NONE = "none"
    FULL = "full"  # the whole forward: the engine's activation checkpointing
    SELECTIVE = "selective"  # torchtitan's op-level policy: every operator but attention and every second matrix product

    def of_forward(self, flops: float, attention_flops: float) -> tuple[float, float]:
        """(fraction of the forward's operator bytes and count, FLOPs) recomputed."""
        if self is Recompute.FULL:
            return 1.0, flops
        if self is Recompute.SELECTIVE:
            return 1.0, (flops - attention_flops) / 2
        return 0.0, 0.0


@dataclass(frozen=True)
class UnitCost:
    name: str
    trainable: bool
    forward_flops: float  # one micro-batch on one rank
    backward_flops: float
    forward_attention_flops: float  # the part of forward_flops in attention kernels
    forward_bytes: float  # memory the other operators move (bound by memory bandwidth)
    backward_bytes: float
    forward_ops: int  # operators dispatched
    backward_ops: int
    traffic: UnitTraffic
    param_bytes: int  # the unsharded parameters in the compute dtype
    shard_bytes: int  # the rank's chunk in the master dtype (copied to and from the host under offload)
    members: int = 1  # wrapped modules in the unit (several when small ones are bucketed): each has its hooks
    gather_cast_bytes: int = 0  # device memory each all-gather's casts move (kernels.gather_cast_bytes)
    reduce_cast_bytes: int = 0  # device memory each reduction's gradient copies move (kernels.reduce_cast_bytes)


@dataclass(frozen=True)
class StepSetup:
    policy: StepPolicy
    hardware: Hardware
    world_size: int
    ranks_per_node: int
    micro_batches: int = 1
    no_sync: bool = False
    compute_dtype: str = "fp32"
    optimizer_bytes: int = 0  # bytes the optimizer step reads and writes on this rank
    loss_bytes: int = 0  # bytes the loss moves per micro-batch on this rank (kernels.loss_bytes)
    optimizer_tensors: int = 0  # parameter tensors the optimizer steps over on this rank
    flags: Collective | None = None  # the used-parameter flags of a synced backward
    tokens_per_step: int = 0  # over every rank
    recompute: Recompute | None = None  # None: as the policy checkpoints (FULL or NONE)

    @property
    def recomputes(self) -> Recompute:
        if self.recompute is not None:
            return self.recompute
        return Recompute.FULL if self.policy.activation_checkpointing else Recompute.NONE


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float  # the communication stream's busy time
    flops: float  # model FLOPs per step on one rank (checkpointing's recompute not counted)
    hardware_flops: float  # with the recompute
    comm_bytes: dict[str, int]  # per collective kind, as the engine's comm_stats counts them on one rank
    tflops_per_device: float
    hardware_tflops_per_device: float  # with checkpointing's recompute
    mfu: float
    tokens_per_s: float
    terms: dict[str, float]  # the compute stream's busy time by part (TERMS), summing to compute_s
    compute_dtype: str = "fp32"


# The parts of the compute stream's time (StepTime.terms).
TERMS = {
    "matmul_s": "matrix products and attention (FLOPs at peak x efficiency)",
    "elementwise_s": "elementwise, norm and other operators (bytes at the memory rate)",
    "loss_s": "cross-entropy on fp32 logits (bytes at the memory rate)",
    "casts_s": "all-gather casts and gradient copies (bytes at the memory rate)",
    "optimizer_s": "optimizer step (bytes at the memory rate, fixed cost per tensor)",
    "overhead_s": "fixed costs per unit and per operator",
    "host_copies_s": "host <-> device copies (CPU offload)",
}


def collective_seconds(collective: Collective, hardware: Hardware, ranks_per_node: int, world_size: int) -> tuple[float, float]:
    """(waiting on the ring's latency steps, moving the bytes) of one collective."""
    n = collective.group_size
    if n <= 1:
        return 0.0, 0.0
    bandwidth, latency = hardware.link(world_size if collective.spans_world else n, ranks_per_node)
    steps = 2 * (n - 1) if collective.kind == "all_reduce" else n - 1
    fixed = hardware.fitted.collective_overhead_s + (hardware.fitted.reduce_overhead_s if collective.kind != "all_gather" else 0.0)
    return fixed + steps * latency, collective.bytes * steps / n / bandwidth


class _Streams:
    def __init__(self, setup: StepSetup) -> None:
        self.setup = setup
        self.compute = 0.0  # when the compute stream is free
        self.comm = 0.0  # when the communication stream is free
        self.busy_compute = 0.0
        self.busy_comm = 0.0
        self.bytes: dict[str, int] = {}
        self.terms = dict.fromkeys(TERMS, 0.0)

    def run(self, **seconds: float) -> None:
        """Compute for the sum of `seconds`, each keyed by its part (TERMS)."""
        for term, value in seconds.items():
            self.terms[term] += value
        self.compute += sum(seconds.values())
        self.busy_compute += sum(seconds.values())

    def issue(self, collective: Collective | None) -> float:
        """Start `collective` when issued and the stream is free; when it ends."""
        if collective is None:
            return self.compute
        setup = self.setup
        self.bytes[collective.kind] = self.bytes.get(collective.kind, 0) + collective.bytes
        waiting, copying = collective_seconds(collective, setup.hardware, setup.ranks_per_node, setup.world_size)
        self.comm = max(self.comm, self.compute) + waiting + copying
        self.busy_comm += waiting + copying
        if not setup.hardware.overlap:
            self.compute = self.comm
        return self.comm

    def wait(self, until: float) -> None:
        self.compute = max(self.compute, until)


def _pass_seconds(flops: float, moved: float, ops: float, param_bytes: float, members: int, setup: StepSetup) -> dict[str, float]:
    """One forward or backward of a unit by part (`param_bytes`: its parameters, once per pass it
    makes; `members`: its wrapped modules, each paying the fixed overhead of a module with hooks)."""
    hardware = setup.hardware
    moved += hardware.fitted.param_passes * param_bytes
    return {
        "matmul_s": flops / (hardware.peak_flops(setup.compute_dtype) * hardware.fitted.efficiency),
        "elementwise_s": moved / hardware.memory_rate,
        "overhead_s": members * hardware.fitted.unit_overhead_s + ops * hardware.fitted.op_overhead_s,
    }


def _micro_batch(streams: _Streams, units: dict[str, UnitCost], setup: StepSetup, *, reduce: bool) -> None:
    policy, host_bw, memory_rate = setup.policy, setup.hardware.host_bw_gbs * 1e9, setup.hardware.memory_rate
    gathered: dict[str, float] = {}
    in_flight: list[str] = []
    reduced: dict[str, float] = {}
    loss_due = True
    events = step_events([(unit.name, unit.trainable) for unit in units.values()], policy, reduce=reduce)
    for event in events:
        unit = units.get(event.unit)
        if event.op is Op.GATHER and unit is not None:
            while policy.waits_before_gather(len(in_flight)):
                streams.wait(gathered[in_flight.pop(0)])
            if policy.cpu_offload:
                streams.run(host_copies_s=unit.shard_bytes / host_bw)
            streams.run(casts_s=unit.gather_cast_bytes / memory_rate)
            gathered[event.unit] = streams.issue(unit.traffic.gather)
            in_flight.append(event.unit)
        elif event.op is Op.WAIT:
            streams.wait(gathered.get(event.unit, 0.0))
            in_flight = [name for name in in_flight if name != event.unit]
        elif event.op is Op.RESHARD:
            in_flight = [name for name in in_flight if name != event.unit]
        elif event.op is Op.FORWARD and unit is not None:
            streams.run(**_pass_seconds(unit.forward_flops, unit.forward_bytes, unit.forward_ops, unit.param_bytes, unit.members, setup))
        elif event.op is Op.BACKWARD and unit is not None:
            if loss_due:  # the loss's forward and backward come between the last forward and the first backward
                streams.run(loss_s=setup.loss_bytes / memory_rate)
                loss_due = False
            again, flops = setup.recomputes.of_forward(unit.forward_flops, unit.forward_attention_flops)
            streams.run(
                **_pass_seconds(
                    unit.backward_flops + flops,
                    unit.backward_bytes + again * unit.forward_bytes,
                    unit.backward_ops + again * unit.forward_ops,
                    (1 + again) * unit.param_bytes,
                    unit.members,
                    setup,
                )
            )
        elif event.op is Op.REDUCE and unit is not None:
            reduced[event.unit] = streams.issue(unit.traffic.reduce)
        elif event.op is Op.COMPLETE and unit is not None:
            streams.wait(reduced.pop(event.unit, 0.0))
            streams.wait(streams.issue(unit.traffic.replica_reduce))
            streams.run(casts_s=unit.reduce_cast_bytes / memory_rate)
            if policy.cpu_offload:
                streams.run(host_copies_s=unit.shard_bytes / host_bw)
        elif event.op is Op.END and reduce:
            streams.issue(setup.flags)


def shared_cores_seconds(alone: float, compute: float, slowdown: float) -> float:
    """A step of `alone` seconds with a core per rank, `compute` of them computing, when its
    compute takes `slowdown` times as long (Hardware.compute_slowdown)."""
    return alone + (slowdown - 1) * compute


def simulate(units: Sequence[UnitCost], setup: StepSetup) -> StepTime:
    """One optimizer step: `micro_batches` forwards and backwards (under no_sync only the
    last reduces), then the optimizer. `units[0]` is the root; the rest in forward order."""
    by_name = {unit.name: unit for unit in units}
    streams = _Streams(setup)
    for index in range(setup.micro_batches):
        _micro_batch(streams, by_name, setup, reduce=not setup.no_sync or index == setup.micro_batches - 1)
    hardware = setup.hardware
    moved = setup.optimizer_bytes * hardware.fitted.optimizer_passes
    streams.run(optimizer_s=moved / hardware.memory_rate + setup.optimizer_tensors * hardware.fitted.optimizer_tensor_s)
    slowdown = hardware.compute_slowdown(setup.ranks_per_node)
    step = shared_cores_seconds(max(streams.compute, streams.comm), streams.busy_compute, slowdown)
    compute_s = streams.busy_compute * slowdown
    flops = setup.micro_batches * sum(unit.forward_flops + unit.backward_flops for unit in units)
    recomputed = setup.micro_batches * sum(setup.recomputes.of_forward(u.forward_flops, u.forward_attention_flops)[1] for u in units)
    peak = hardware.peak_flops(setup.compute_dtype)
    return StepTime(
        step_time_s=step,
        compute_s=compute_s,
        exposed_comm_s=max(step - compute_s, 0.0),
        comm_s=streams.busy_comm,
        flops=flops,
        hardware_flops=flops + recomputed,
        comm_bytes=dict(streams.bytes),
        tflops_per_device=flops / step / 1e12 if step else 0.0,
        hardware_tflops_per_device=(flops + recomputed) / step / 1e12 if step else 0.0,
        mfu=flops / step / peak if step else 0.0,
        tokens_per_s=setup.tokens_per_step / step if step else 0.0,
        terms={term: seconds * slowdown for term, seconds in streams.terms.items()},
        compute_dtype=setup.compute_dtype,
    )
