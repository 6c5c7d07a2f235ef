"""`fsdpkit plan --time`: the predicted collective bytes against the engine's own comm_stats at
1, 2 and 4 ranks for every strategy, the step without communication against the compute time
computed by hand, the FLOPs against torch's counter on the unsharded model, the step policy's
event order against the engine's, and bad hardware files / impossible configurations."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdpkit_cli.app import app
from support.distributed import run_distributed
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

import fsdpkit
from fsdpkit.engine.step_policy import Op, StepPolicy, step_events
from fsdpkit.engine.traffic import Collective
from fsdpkit.models.source import resolve
from fsdpkit.plan.calibrate.fit import (
    BANDWIDTH_RANGE,
    MAX_LATENCY_S,
    SharedStep,
    all_cores_slowdown,
    best_contention,
    compute_terms,
    fit_collectives,
    fit_nonnegative,
    root_of_nondecreasing,
    with_bandwidth,
    with_latency,
)
from fsdpkit.plan.calibrate.measure import Measured, StepSample, on_first_ranks
from fsdpkit.plan.calibrate.runs import TimedStep, all_cores_runs, link_runs, more_ranks_runs
from fsdpkit.plan.kernels import OptimizerKernel
from fsdpkit.plan.predict import activation_peak, model_costs, predict
from fsdpkit.plan.profile import BUILT_IN, MAX_CONTENTION, FittedTerms, Hardware, load, to_toml
from fsdpkit.plan.request import PlanRequest
from fsdpkit.plan.search import recommend
from fsdpkit.plan.simulate import Recompute, collective_seconds
from fsdpkit.train.config import TrainConfig


def _configs(world: int) -> list[dict]:
    """Every strategy, both prefetch directions and none, forward prefetch, bf16, and no_sync
    gradient accumulation (sharding values as train's flags spell them)."""
    return [
        {"sharding": {"strategy": "full"}},
        {"sharding": {"strategy": "grad-op"}},
        {"sharding": {"strategy": "hybrid", "shard_group_size": max(1, world // 2)}},
        {"sharding": {"strategy": "none"}},
        {"sharding": {"strategy": "full", "backward_prefetch": "post", "forward_prefetch": True}},
        {"sharding": {"strategy": "full", "backward_prefetch": "none", "mixed_precision": "bf16"}},
        {"sharding": {"strategy": "grad-op"}, "data": {"grad_accum": 2, "no_sync": True}},
    ]


def _request(world: int, values: dict) -> PlanRequest:
    data = {"global_batch_size": 8, "seq_len": 16, **values.get("data", {})}
    model = values.get("model", {"name": "gpt-tiny"})
    request = TrainConfig.from_values({"model": model, "data": data, "sharding": values["sharding"]}).plan_request(world)
    # the hand counts here charge torch's default AdamW kernel, whatever device the profile is
    return dataclasses.replace(request, optimizer_kernel=OptimizerKernel.EAGER)


def comm_bytes_worker() -> list[dict]:
    """The engine's comm_stats bytes of the second optimizer step (the first has no forward
    order to prefetch by) under each config, and the order of its collectives."""
    from fsdpkit.models.gpt import Block
    from fsdpkit.models.source import build_model

    world = dist.get_world_size()
    results = []
    for values in _configs(world):
        request = _request(world, values)
        torch.manual_seed(0)
        model = fsdpkit.shard(build_model("gpt-tiny"), request.sharding, wrap=(Block,), record_events=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        micro = request.micro_batch
        for step in range(2):
            if step == 1:
                fsdpkit.comm_stats(model).reset()
            for index in range(request.grad_accum):
                tokens = torch.randint(0, 256, (micro, request.seq_len + 1))
                last = index == request.grad_accum - 1
                with fsdpkit.no_sync(model) if request.no_sync and not last else _nothing():
                    logits = model(tokens[:, :-1])
                    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        stats = fsdpkit.comm_stats(model)
        order = [(kind, label) for kind, label in stats.events or [] if kind in ("all_gather", "reduce_scatter", "all_reduce")]
        results.append({"bytes": dict(stats.bytes), "order": order})
    return results


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _predicted_order(request: PlanRequest, costs) -> list[tuple[str, str]]:
    """The collectives the step policy's events issue, in order, as comm_stats labels them."""
    factor = request.sharding.shard_factor(request.world_size)
    replicas = request.world_size // factor
    names = [plan.name for plan in costs.plans]
    order: list[tuple[str, str]] = []
    for index in range(request.grad_accum):
        reduce = not request.no_sync or index == request.grad_accum - 1
        for event in step_events([(name, True) for name in names], StepPolicy.of(request.sharding), reduce=reduce):
            if event.op is Op.GATHER and factor > 1:
                order.append(("all_gather", event.unit))
            elif event.op is Op.REDUCE and (factor > 1 or replicas > 1):
                order.append(("reduce_scatter" if factor > 1 else "all_reduce", event.unit))
            elif event.op is Op.COMPLETE and factor > 1 and replicas > 1:
                order.append(("all_reduce", event.unit))
            elif event.op is Op.END and reduce and request.world_size > 1:
                order.append(("all_reduce", "grad-flags"))
    return order


@pytest.mark.parametrize("world", [1, 2, 4])
def test_predicted_collective_bytes_and_order_equal_the_engines(world):
    results = run_distributed(comm_bytes_worker, world)
    for values, measured in zip(_configs(world), results[0], strict=True):
        request = _request(world, values)
        costs = model_costs(request)
        predicted = predict(request, BUILT_IN["cpu-gloo"], costs).time.comm_bytes
        engine = {kind: n for kind, n in measured["bytes"].items() if n}
        assert predicted == engine, (world, values, predicted, engine)
        assert _predicted_order(request, costs) == [tuple(pair) for pair in measured["order"]], (world, values)
    for rank in results:
        assert [r["bytes"] for r in results[rank]] == [r["bytes"] for r in results[0]]


def _hardware_by_hand(name: str, *, ranks_per_node: int, bus_gbs: float) -> Hardware:
    """1 TFLOP/s achieved (2 peak x 0.5), 3 GB/s of memory, 1e-4 s per unit and pass, no latency."""
    return Hardware(
        name=name,
        source="test",
        peak_tflops={"fp32": 2.0},
        fitted=FittedTerms(efficiency=0.5, unit_overhead_s=1e-4),
        memory_gb=1,
        memory_bw_gbs=3.0,
        ranks_per_node=ranks_per_node,
        intra_bw_gbs=bus_gbs,
        intra_latency_s=0.0,
        inter_bw_gbs=bus_gbs,
        inter_latency_s=0.0,
    )


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20])
def test_without_communication_the_step_is_the_compute_time(bucket_bytes):
    # one unit per block, or (the default bucket) the two blocks merged into one unit: the
    # overhead is per wrapped module either way, 3 of them
    request = _request(4, {"sharding": {"strategy": "full", "bucket_bytes": bucket_bytes}, "data": {"grad_accum": 2}})
    assert len(model_costs(request).plans) == (3 if bucket_bytes == 0 else 2)
    costs = model_costs(request)
    free = _hardware_by_hand("free network", ranks_per_node=4, bus_gbs=1e15)
    time = predict(request, free, costs).time
    # by hand: the unsharded model's FLOPs on one rank's micro-batch (1 sequence of 16) from
    # torch's counter on the meta device, plus the attention scores the fused kernel's backward
    # computes again (2 x 4 heads x 16 x 16 x 16 per layer), twice (grad accum 2)
    source = resolve("gpt-tiny")
    model = source.build(device="meta", seed=0)
    tokens = torch.zeros((1, 17), dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        logits = source.logits(model, tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    flops = 2 * (counter.get_total_flops() + 2 * 2 * 4 * 16 * 16 * 16)
    assert time.flops == flops
    # every pass at 1 TFLOP/s and 3 GB/s for the bytes the other operators move, plus the
    # overhead (2 passes x 3 wrapped modules x 2 micro-batches); AdamW's 8 passes, 80 bytes per element
    # of the rank's quarter of the parameters, at 3 GB/s; per micro-batch the loss on 16 rows of fp32
    # logits (log-softmax read+write, the one-hot gradient, log-softmax's backward: 6 x 4 bytes each);
    # in fp32 over 4 ranks an all-gather sends the rank's quarter as it is (no cast), and each
    # reduction concatenates the full gradient (8 bytes) and averages the quarter it gets (8 bytes):
    # 2.5 x the bytes reduced
    moved = 2 * sum(work.forward_bytes + work.backward_bytes for work in costs.work_per_sequence)
    loss = 2 * 16 * logits.shape[-1] * 6 * 4
    casts = 2.5 * time.comm_bytes["reduce_scatter"]
    expected = flops / 1e12 + (moved + loss + casts) / 3e9 + 2 * 3 * 2 * 1e-4 + 124672 // 4 * 80 / 3e9
    assert moved > 0 and time.terms["loss_s"] == pytest.approx(loss / 3e9) and time.terms["casts_s"] == pytest.approx(casts / 3e9)
    assert time.step_time_s == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert time.compute_s == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert time.exposed_comm_s == pytest.approx(0.0, abs=1e-9)
    assert time.comm_bytes["all_gather"] > 0  # the bytes are still counted


def test_per_operator_parameter_and_optimizer_terms_add_what_they_say():
    request = _request(1, {"sharding": {"strategy": "full"}})
    costs = model_costs(request)
    base = _hardware_by_hand("base", ranks_per_node=1, bus_gbs=1.0)
    terms = base.with_values(op_overhead_s=2e-6, param_passes=3.0, optimizer_tensor_s=5e-6, optimizer_passes=2.5)
    before, after = predict(request, base, costs).time, predict(request, terms, costs).time
    # one rank, 8 sequences: every unit's forward and backward once, its full fp32 parameters
    # 3 times per pass at 3 GB/s; the optimizer 1.5 more times its 80 bytes per element
    numel = sum(p.numel() for p in resolve("gpt-tiny").build(device="meta").parameters())
    ops = sum(work.forward_ops + work.backward_ops for work in costs.work_per_sequence)
    tensors = sum(len(plan.params) for plan in costs.plans)
    assert ops > 0 and tensors == len(list(resolve("gpt-tiny").build(device="meta").parameters()))
    added = ops * 2e-6 + 2 * 3.0 * numel * 4 / 3e9 + tensors * 5e-6 + 1.5 * numel * 80 / 3e9
    assert after.step_time_s - before.step_time_s == pytest.approx(added, rel=1e-6)


def test_selective_recompute_charges_the_forward_operators_and_half_its_matrix_products():
    request = _request(1, {"sharding": {"strategy": "full"}})
    costs = model_costs(request)
    hardware = BUILT_IN["cpu-gloo"].with_values(unit_overhead_s=0.0, op_overhead_s=1e-6, compute_slots=0)
    plain = predict(request, hardware, costs).time
    selective = predict(request, hardware, costs, recompute=Recompute.SELECTIVE).time
    full = predict(_request(1, {"sharding": {"strategy": "full", "activation_checkpointing": True}}), hardware, costs).time
    work = costs.work_per_sequence
    attention = sum(w.forward_attention_flops for w in work)
    forward = sum(w.forward_flops for w in work)
    assert 0 < attention < forward
    # 8 sequences on the one rank; the forward's operators again, and half its non-attention FLOPs
    rate = hardware.peak_flops("fp32") * hardware.fitted.efficiency
    again = (
        sum(8 * w.forward_bytes / (hardware.memory_bw_gbs * 1e9) + w.forward_ops * 1e-6 for w in work)
        + 8 * (forward - attention) / 2 / rate
    )
    assert selective.step_time_s - plain.step_time_s == pytest.approx(again, rel=1e-6)
    assert selective.hardware_flops - plain.hardware_flops == 8 * (forward - attention) / 2
    assert full.hardware_flops - plain.hardware_flops == 8 * forward and full.step_time_s > selective.step_time_s


def test_ranks_beyond_the_cores_slow_their_compute_and_not_their_collectives():
    request = _request(4, {"sharding": {"strategy": "full"}})
    costs = model_costs(request)
    cpu = BUILT_IN["cpu-gloo"].with_values(
        compute_slots=4, op_overhead_s=1e-6, param_passes=2.0, optimizer_tensor_s=1e-5, intra_latency_s=1e-3
    )
    enough = predict(request, cpu, costs, per_node=4).time
    assert not cpu.overlap and enough.comm_s > 0 and enough.step_time_s == pytest.approx(enough.compute_s + enough.comm_s, rel=1e-9)
    # 4 ranks per core take turns: their compute 4 times as long, and `contention` times more
    steps = {}
    for contention in (1.0, 1.25, 2.0):
        shared = predict(request, cpu.with_values(compute_slots=1, compute_contention=contention), costs, per_node=4).time
        assert shared.comm_s == pytest.approx(enough.comm_s, rel=1e-9)
        assert shared.compute_s == pytest.approx(4 * contention * enough.compute_s, rel=1e-9)
        assert shared.step_time_s == pytest.approx(enough.step_time_s + (4 * contention - 1) * enough.compute_s, rel=1e-9)
        steps[contention] = shared.step_time_s
    # contention does not touch ranks that have a core each
    assert predict(request, cpu.with_values(compute_contention=2.0), costs, per_node=4).time.step_time_s == enough.step_time_s

    def step_at(contention: float) -> float:
        shared = cpu.with_values(compute_slots=1, compute_contention=contention)
        return predict(request, shared, costs, per_node=4).time.step_time_s

    # calibration finds the contention back from a measured step, and keeps it in [1, MAX_CONTENTION]
    assert root_of_nondecreasing(steps[1.25], step_at, 1.0, MAX_CONTENTION) == pytest.approx(1.25, rel=1e-6)
    assert root_of_nondecreasing(0.5 * steps[1.0], step_at, 1.0, MAX_CONTENTION) == 1.0
    assert root_of_nondecreasing(100 * steps[2.0], step_at, 1.0, MAX_CONTENTION) == MAX_CONTENTION
    # with overlap (a GPU's own copy engines) the collectives do not slow either
    overlapping = dataclasses.replace(cpu, overlap=True)
    alone = predict(request, overlapping, costs, per_node=4).time
    crowded = predict(request, dataclasses.replace(overlapping, compute_slots=2), costs, per_node=4).time
    assert crowded.comm_s == pytest.approx(alone.comm_s, rel=1e-9) and crowded.compute_s == pytest.approx(2 * alone.compute_s, rel=1e-9)


def test_ranks_that_keep_every_core_busy_compute_slower_by_the_all_cores_slowdown():
    costs = model_costs(_request(4, {"sharding": {"strategy": "full"}}))
    cpu = BUILT_IN["cpu-gloo"].with_values(compute_slots=4, op_overhead_s=1e-6, intra_latency_s=1e-3, all_cores_slowdown=1.3)
    for ranks, slowdown in ((1, 1.0), (2, 1.1), (4, 1.3)):  # in proportion to the other cores kept busy
        request = _request(ranks, {"sharding": {"strategy": "full"}})
        alone = predict(request, cpu.with_values(all_cores_slowdown=1.0), costs, per_node=ranks).time
        busy = predict(request, cpu, costs, per_node=ranks).time
        assert busy.compute_s == pytest.approx(slowdown * alone.compute_s, rel=1e-9) and busy.comm_s == pytest.approx(
            alone.comm_s, rel=1e-9
        )
        assert busy.step_time_s == pytest.approx(alone.step_time_s + (slowdown - 1) * alone.compute_s, rel=1e-9)
    # beyond the cores, the ranks take turns on busy cores; a device per rank shares nothing
    assert cpu.with_values(compute_slots=2, compute_contention=1.25).compute_slowdown(8) == pytest.approx(1.3 * 4 * 1.25)
    assert dataclasses.replace(cpu, compute_slots=0).compute_slowdown(8) == 1.0
    # the profile's value: the ratio of the step on every core at once to the step alone, in range
    assert all_cores_slowdown(0.05, 0.06) == pytest.approx(1.2) and all_cores_slowdown(0.06, 0.05) == 1.0
    assert all_cores_slowdown(0.01, 1.0) == MAX_CONTENTION


def all_cores_worker(request: PlanRequest) -> dict:
    """The groups and models on_first_ranks gives each rank for the all-cores pair and a 2-rank step."""
    from fsdpkit.engine.sharded import get_state

    alone, at_once = all_cores_runs(request, 2)
    placed = {}
    for name, placement in (
        ("alone", alone),
        ("at_once", at_once),
        ("two_ranks", TimedStep(_request(2, {"sharding": {"strategy": "full"}}))),
    ):
        group, model = on_first_ranks(placement)
        mesh = get_state(model.model).mesh if model else None
        placed[name] = (group is None, mesh.world_size if mesh else None, model.step(1)[0] > 0 if model else None)
    return placed


def test_all_cores_pair_runs_one_rank_alone_and_a_copy_on_each_core_without_collectives():
    alone, at_once = all_cores_runs(_request(2, {"sharding": {"strategy": "full"}}), 2)
    assert alone.run == at_once.run and alone.run.world_size == 1 and (alone.ranks, at_once.ranks) == (1, 2)
    results = run_distributed(all_cores_worker, 2, _request(2, {"sharding": {"strategy": "full"}}))
    # alone: rank 0 in a group of its own; at once: both ranks (the whole launch), each copy on
    # a group of one; a 2-rank step: one model sharded over both
    assert results[0] == {"alone": (False, 1, True), "at_once": (True, 1, True), "two_ranks": (True, 2, True)}
    assert results[1] == {"alone": (False, None, None), "at_once": (True, 1, True), "two_ranks": (True, 2, True)}


def test_calibration_fits_the_compute_contention_over_several_measured_steps():
    request = _request(4, {"sharding": {"strategy": "full"}})
    costs = model_costs(request)
    cpu = BUILT_IN["cpu-gloo"].with_values(compute_slots=4, op_overhead_s=1e-6, intra_latency_s=1e-3)
    alone = predict(request, cpu, costs, per_node=4).time
    step = SharedStep(0.0, alone.step_time_s, alone.compute_s)
    shared = cpu.with_values(compute_slots=2, compute_contention=1.3)
    assert predict(request, shared, costs, per_node=4).time.step_time_s == pytest.approx(step.predicted(2 * 1.3), rel=1e-9)
    # a compute-bound and a collective-bound step: the contention that fits both best, on top of
    # the slowdown of ranks that keep every core busy
    busy = cpu.with_values(compute_slots=2, all_cores_slowdown=1.1)
    steps = [SharedStep(0.0, 1.0, 0.8), SharedStep(0.0, 1.0, 0.1)]
    measured = [dataclasses.replace(s, measured_s=s.predicted(1.1 * 2 * 1.3)) for s in steps]
    assert best_contention(measured, busy, 4) == pytest.approx(1.3)
    # noise on one step moves the fit less than it moves that step alone
    noisy = [dataclasses.replace(measured[0], measured_s=1.1 * measured[0].measured_s), measured[1]]
    assert 1.3 < best_contention(noisy, busy, 4) < best_contention(noisy[:1], busy, 4)
    # a step faster than taking turns allows fits 1, one far slower MAX_CONTENTION
    assert best_contention([dataclasses.replace(s, measured_s=0.5) for s in steps], busy, 4) == 1.0
    assert best_contention([dataclasses.replace(s, measured_s=50.0) for s in steps], busy, 4) == MAX_CONTENTION
    # ranks that do not outnumber the cores do not take turns
    assert best_contention(measured, busy, 2) == 1.0


def test_calibration_fits_the_latency_its_share_per_ring_step_and_the_contention_together():
    # a fixed cost per collective whatever its ranks; a cost per ring step grows with them
    gather = Collective("all_gather", 0, 4, spans_world=False)
    fixed = BUILT_IN["cpu-gloo"].with_values(intra_latency_s=0.0, collective_overhead_s=1e-3)
    ring = dataclasses.replace(BUILT_IN["cpu-gloo"], intra_latency_s=1e-3)
    assert collective_seconds(gather, fixed, 4, 4)[0] == pytest.approx(1e-3) and collective_seconds(gather, ring, 4, 4)[0] == pytest.approx(
        3e-3
    )
    # a reduction's extra fixed cost: on reduce-scatters and all-reduces, not on all-gathers
    reducing = fixed.with_values(reduce_overhead_s=5e-4)
    assert collective_seconds(gather, reducing, 4, 4)[0] == pytest.approx(1e-3)
    for kind in ("reduce_scatter", "all_reduce"):
        assert collective_seconds(Collective(kind, 0, 4, spans_world=False), reducing, 4, 4)[0] == pytest.approx(1.5e-3)
    # measured steps made by a known profile: the fit finds its five terms back (gpt-small: its
    # collectives move more bytes each than the latency model's)
    request = _request(2, {"sharding": {"strategy": "full"}, "model": {"name": "gpt-small"}})
    # the all-cores slowdown is measured, not fitted: the profile comes with it; the bandwidth
    # fsdpkit bench measured (the profile's) is a start, the steps' is fitted
    base = BUILT_IN["cpu-gloo"].with_values(compute_slots=2, op_overhead_s=1e-6, all_cores_slowdown=1.2)
    truth = with_bandwidth(with_latency(base, 1.2e-3, 0.4).with_values(compute_contention=1.5, reduce_overhead_s=7e-4), 1e-9 / 0.7)
    runs = [*link_runs(request), *more_ranks_runs(request, 2)]
    assert [run.world_size for run in runs] == [2, 2, 2, 4, 4, 4]
    assert [run.sharding.strategy.value for run in runs] == ["full", "grad-op", "full", "full", "full", "grad-op"]
    assert runs[0].model == runs[1].model == runs[4].model != request.model == runs[2].model == runs[3].model == runs[5].model
    steps = [Measured(run, predict(run, truth, model_costs(run), per_node=run.world_size).time.step_time_s) for run in runs]
    fitted = fit_collectives(dataclasses.replace(base, intra_latency_s=5e-3), steps[:3], steps[3:])
    assert fitted.intra_bw_gbs == fitted.inter_bw_gbs == pytest.approx(0.7, rel=1e-6)
    assert fitted.intra_latency_s + fitted.fitted.collective_overhead_s == pytest.approx(1.2e-3, rel=1e-6)
    assert fitted.fitted.reduce_overhead_s == pytest.approx(7e-4, rel=1e-6)
    assert fitted.intra_latency_s == pytest.approx(0.4 * 1.2e-3, rel=1e-6) and fitted.fitted.compute_contention == pytest.approx(1.5)
    # without steps on more ranks: the ring's alpha-beta model, fitted to the three steps
    alone = fit_collectives(base, steps[:3], [])
    assert alone.fitted.collective_overhead_s == 0 and alone.fitted.compute_contention == 1.0
    assert alone.fitted.reduce_overhead_s > 0  # not 7e-4: a flag all-reduce's two ring steps cost less than twice a collective
    for step in steps[:3]:
        assert predict(step.run, alone, model_costs(step.run), per_node=2).time.step_time_s == pytest.approx(step.measured_s, rel=1e-6)
    # the bandwidth stays within BANDWIDTH_RANGE of fsdpkit bench's
    slow = [dataclasses.replace(step, measured_s=10 * step.measured_s) if step.run is runs[2] else step for step in steps[:3]]
    assert fit_collectives(base, slow, []).intra_bw_gbs == pytest.approx(base.intra_bw_gbs / BANDWIDTH_RANGE)
    # a third step whose collectives move fewer bytes each than the latency model's cannot tell it
    few_bytes = [*steps[:2], steps[0]]
    assert fit_collectives(base, few_bytes, []).intra_bw_gbs == base.intra_bw_gbs


def test_calibration_models_run_one_unit_per_block_and_the_fit_charges_the_engines_units():
    """The many-unit model is measured and predicted with one unit per block whatever the
    bucket; `--model` runs with its own, and the fit counts the units the engine made."""
    from fsdpkit.engine.sharded import get_state
    from fsdpkit.plan.calibrate.measure import ModelRun
    from fsdpkit.plan.calibrate.runs import LATENCY_MODEL, on_ranks

    request = _request(2, {"sharding": {"strategy": "full"}})  # gpt-tiny, the default bucket
    run = on_ranks(request, 2, model=LATENCY_MODEL)
    assert run.sharding.bucket_bytes == 0 and len(model_costs(run).plans) == 17  # the root and 16 blocks
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        narrow, tiny = ModelRun(request, LATENCY_MODEL), ModelRun(request, request.model)
        narrow_units, tiny_units = ([unit.name for unit in get_state(r.model).units] for r in (narrow, tiny))
    finally:
        dist.destroy_process_group()
    assert narrow_units == [plan.name for plan in narrow.plans] and len(narrow_units) == 17
    assert tiny_units == [plan.name for plan in tiny.plans] == ["", "h.0+h.1"]


def test_calibration_fit_recovers_known_coefficients():
    per_flop, per_unit, per_byte, per_tensor, passes = 2e-11, 4e-4, 5e-10, 2e-5, 2.5
    samples = []
    # three models (flops per sequence, units, parameter bytes, tensors) at two batch sizes
    for flops, units, params, tensors in ((1e9, 5, 1.3e7, 52), (5e8, 17, 5e6, 196), (3e9, 3, 2.6e7, 28)):
        for batch in (1, 4):
            optimizer_memory = params / 4 * 28 / 2e10
            samples.append(
                StepSample(
                    flops=flops * batch,
                    memory_s=1e-3 * batch,
                    unit_passes=2 * units,
                    param_bytes=2 * params,
                    forward_backward_s=1e-3 * batch + flops * batch * per_flop + 2 * units * per_unit + 2 * params * per_byte,
                    tensors=tensors,
                    optimizer_memory_s=optimizer_memory,
                    optimizer_s=optimizer_memory * passes + tensors * per_tensor,
                )
            )
    terms = compute_terms(samples)
    assert terms.seconds_per_flop == pytest.approx(per_flop, rel=1e-6)
    assert terms.unit_overhead_s == pytest.approx(per_unit, rel=1e-6)
    assert terms.seconds_per_param_byte == pytest.approx(per_byte, rel=1e-6)
    assert terms.optimizer_tensor_s == pytest.approx(per_tensor, rel=1e-6)
    assert terms.optimizer_passes == pytest.approx(passes, rel=1e-6)
    # a term the timings do not contain comes out zero, not negative
    flat = [dataclasses.replace(s, forward_backward_s=s.memory_s + s.flops * per_flop) for s in samples]
    assert compute_terms(flat).unit_overhead_s == pytest.approx(0.0, abs=1e-12)
    assert min(fit_nonnegative([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)], [1.0, 0.0, -1.0])) >= 0


def test_calibration_fit_weighs_each_step_by_its_own_time():
    per_flop, per_unit, per_byte = 2e-11, 4e-4, 5e-10
    samples = []
    for flops, units, params in ((1e9, 5, 1.3e7), (5e8, 17, 5e6), (3e9, 3, 2.6e7)):
        for batch in (1, 4):
            exact = flops * batch * per_flop + 2 * units * per_unit + 2 * params * per_byte
            samples.append(StepSample(flops * batch, 0.0, 2 * units, 2 * params, exact, 1, 0.0, 1e-3))
    # the longest step measured 30% slow (a drifting machine): the short steps must not pay for it
    longest = max(range(len(samples)), key=lambda i: samples[i].forward_backward_s)
    samples[longest] = dataclasses.replace(samples[longest], forward_backward_s=samples[longest].forward_backward_s * 1.3)

    def worst_error_of_the_others(per_flop_fit: float, per_unit_fit: float, per_byte_fit: float) -> float:
        errors = []
        for index, s in enumerate(samples):
            if index != longest:
                predicted = s.flops * per_flop_fit + s.unit_passes * per_unit_fit + s.param_bytes * per_byte_fit
                errors.append(abs(predicted / s.forward_backward_s - 1))
        return max(errors)

    terms = compute_terms(samples)
    relative = worst_error_of_the_others(terms.seconds_per_flop, terms.unit_overhead_s, terms.seconds_per_param_byte)
    absolute = worst_error_of_the_others(
        *fit_nonnegative([(s.flops, s.unit_passes, s.param_bytes) for s in samples], [s.forward_backward_s for s in samples])
    )
    assert relative < 0.1 < absolute


def test_activation_estimate_bounds_what_autograd_saves_and_recommend_counts_it():
    request = _request(1, {"sharding": {"strategy": "full"}})
    costs = model_costs(request)
    estimate = activation_peak(costs.work_per_sequence, checkpointing=False) * 8  # 8 sequences on the one rank
    # what autograd really keeps: the saved tensors of the unsharded model's forward, each storage once
    source = resolve("gpt-tiny")
    torch.manual_seed(0)
    model = source.build(device="cpu", seed=0)
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = source.logits(model, torch.randint(0, 256, (8, 16)))
    saved = sum(n for pointer, n in storages.items() if pointer not in parameters)
    del logits
    assert saved <= estimate <= 4 * saved, (saved, estimate)
    checkpointed = activation_peak(costs.work_per_sequence, checkpointing=True)
    assert 0 < checkpointed < estimate / 8
    # a device that holds the state and the checkpointed activations but not the full ones
    plain = predict(request, BUILT_IN["a100-80gb-ib200"], costs)
    assert plain.activation_bytes == estimate
    room = plain.memory.device_total + (checkpointed * 8 + estimate) / 2
    small = dataclasses.replace(BUILT_IN["a100-80gb-ib200"], memory_gb=room / 1e9)
    chosen = recommend(request, small, costs)
    assert chosen and all(p.request.sharding.activation_checkpointing or p.micro_batch < 8 for p in chosen)
    assert not predict(request, small, costs).fits


def test_prefetch_hides_communication_and_hybrid_wins_across_nodes():
    request = _request(16, {"sharding": {"strategy": "full"}, "data": {"global_batch_size": 64}})
    costs = model_costs(request)
    hardware = BUILT_IN["a100-80gb-ib100"]
    with_prefetch = predict(request, hardware, costs).time
    no_prefetch = predict(
        _request(16, {"sharding": {"strategy": "full", "backward_prefetch": "none"}, "data": {"global_batch_size": 64}}), hardware, costs
    ).time
    assert with_prefetch.step_time_s <= no_prefetch.step_time_s
    assert with_prefetch.comm_bytes == no_prefetch.comm_bytes
    hybrid = predict(
        _request(16, {"sharding": {"strategy": "hybrid", "shard_group_size": 8}, "data": {"global_batch_size": 64}}), hardware, costs
    )
    assert hybrid.time.comm_s < with_prefetch.comm_s


def _invoke(args):
    return CliRunner().invoke(app, ["plan", *args])


def test_cli_time_json_scaling_and_report(tmp_path):
    result = _invoke(["--model", "gpt-tiny", "--world-size", "8", "--time", "--hardware", "h100-ib400", "--scaling", "8,64", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["step_time_s"] > 0 and [p["world_size"] for p in document["scaling"]] == [8, 64]
    path = tmp_path / "scaling.json"
    path.write_text(result.stdout)
    drawn = CliRunner().invoke(app, ["report", str(path)])
    assert drawn.exit_code == 0, drawn.output
    assert (tmp_path / "scaling.png").stat().st_size > 0
    table = _invoke(["--model", "gpt-tiny", "--world-size", "8", "--time", "--hardware", "h100-ib400", "--recommend"])
    assert table.exit_code == 0, table.output
    assert "step time" in table.stdout and "--strategy" in table.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        ("efficiency = 0.5\n", "missing key"),
        ("peak_tflops = {fp32 = 1.0}\nbogus = 1\n", "unknown key 'bogus'"),
        ("this is not toml", "not valid TOML"),
        (("intra_bw_gbs = 1.0", "intra_bw_gbs = -1"), "intra_bw_gbs must be a number > 0, got -1"),
        (("compute_contention = 1.0", "compute_contention = 0.5"), "compute_contention must be a number in [1, 4], got 0.5"),
        (("reduce_overhead_s = 0.0", "reduce_overhead_s = -1"), "reduce_overhead_s must be a number >= 0, got -1"),
        (("all_cores_slowdown = 1.0", "all_cores_slowdown = 5"), "all_cores_slowdown must be a number in [1, 4], got 5"),
    ],
)
def test_bad_hardware_file_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "hw.toml"
    if isinstance(content, tuple):  # a complete profile with one value made bad
        content = to_toml(BUILT_IN["cpu-gloo"], header="").replace(*content)
    path.write_text(content)
    result = _invoke(["--model", "gpt-tiny", "--world-size", "2", "--time", "--hardware", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--time"], "needs --hardware"),
        (["--time", "--hardware", "tpu"], "unknown hardware 'tpu'"),
        (["--time", "--hardware", "h100-ib400", "--nodes", "3"], "--nodes 3"),
        (["--time", "--hardware", "h100-ib400", "--scaling", "8,x"], "--scaling '8,x'"),
        (["--time", "--hardware", "h100-ib400", "--global-batch-size", "6"], "not divisible"),
        (["--calibrate", "cal.toml", "--calibrate-seconds", "-1"], "--calibrate-seconds"),
        (
            ["--time", "--hardware", "h100-ib400", "--strategy", "hybrid", "--shard-group-size", "2", "--scaling", "8,3"],
            "world size 3 is not divisible by shard group size 2",
        ),
    ],
)
def test_impossible_configuration_is_one_line_exit_2(args, message):
    result = _invoke(["--model", "gpt-tiny", "--world-size", "4", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.output


def test_calibrate_measures_this_machine_into_a_profile_that_plan_reads(tmp_path):
    out = tmp_path / "here.toml"
    args = ["--model", "gpt-tiny", "--world-size", "2", "--seq-len", "16", "--global-batch-size", "2"]
    result = _invoke([*args, "--calibrate", str(out), "--calibrate-seconds", "0"])
    assert result.exit_code == 0, result.output
    profile = load(str(out))
    assert profile.compute_slots == len(os.sched_getaffinity(0)) and not profile.overlap
    # The structure of the fit, not its figures: a latency or an overhead fitted from a difference
    # near this machine's noise may be 0 on a loaded machine (benchmarks/plan_time.py reports them).
    gather = profile.intra_latency_s + profile.fitted.collective_overhead_s
    assert 0 <= gather <= MAX_LATENCY_S and 0 <= profile.fitted.reduce_overhead_s <= MAX_LATENCY_S
    assert profile.intra_bw_gbs > 0 and 0 < profile.fitted.efficiency <= 1
    # the copy gives the bandwidth, the elementwise sum the share of it such kernels reach
    assert profile.memory_bw_gbs > 0 and 0 < profile.memory_efficiency <= 1
    assert profile.host_bw_gbs == profile.memory_bw_gbs
    assert 1 <= profile.fitted.compute_contention <= MAX_CONTENTION and 1 <= profile.fitted.all_cores_slowdown <= MAX_CONTENTION
    timed = _invoke([*args, "--time", "--hardware", str(out), "--json"])
    assert timed.exit_code == 0, timed.output
    assert json.loads(timed.stdout)["step_time_s"] > 0


def test_profile_file_round_trips_and_drives_the_prediction(tmp_path):
    path = tmp_path / "a100.toml"
    path.write_text(to_toml(BUILT_IN["a100-80gb-ib200"], header="a written profile"))
    result = _invoke(
        ["--model", "gpt-tiny", "--world-size", "16", "--global-batch-size", "32", "--time", "--hardware", str(path), "--json"]
    )
    builtin = _invoke(
        ["--model", "gpt-tiny", "--world-size", "16", "--global-batch-size", "32", "--time", "--hardware", "a100-80gb-ib200", "--json"]
    )
    assert result.exit_code == builtin.exit_code == 0, result.output
    from_file, from_name = json.loads(result.stdout), json.loads(builtin.stdout)
    assert from_file["step_time_s"] == from_name["step_time_s"] and from_file["hardware"] == "a100-80gb-ib200"
    # two nodes of 8: the all-gathers cross nodes, at the inter-node bandwidth
    two_nodes = json.loads(
        _invoke(
            [
                "--model",
                "gpt-tiny",
                "--world-size",
                "16",
                "--global-batch-size",
                "32",
                "--time",
                "--hardware",
                str(path),
                "--nodes",
                "2",
                "--json",
            ]
        ).stdout
    )
    one_node = json.loads(
        _invoke(
            [
                "--model",
                "gpt-tiny",
                "--world-size",
                "16",
                "--global-batch-size",
                "32",
                "--time",
                "--hardware",
                str(path),
                "--nodes",
                "1",
                "--json",
            ]
        ).stdout
    )
    assert two_nodes["ranks_per_node"] == 8 and one_node["ranks_per_node"] == 16
    assert two_nodes["comm_s"] > one_node["comm_s"] and two_nodes["comm_bytes"] == one_node["comm_bytes"]


def test_network_line_leaves_out_launches_whose_time_does_not_grow_with_bytes(monkeypatch):
    import importlib

    from fsdpkit.errors import UsageError

    measure = importlib.import_module("fsdpkit.plan.calibrate.measure")  # the package exports a function of that name
    lines = iter([(1e-4, float("inf")), (2e-4, 2e9), (1e-4, float("inf")), (3e-4, 1e9), (1e-4, 3e9)])
    monkeypatch.setattr(measure, "_bench_line", lambda ranks: next(lines))
    assert measure.network_line(2, 0.0) == (2e-4, 2e9)  # the medians of the three finite lines
    monkeypatch.setattr(measure, "_bench_line", lambda ranks: (1e-4, float("inf")))
    with pytest.raises(UsageError, match="did not grow with their bytes"):
        measure.network_line(2, 0.0)
