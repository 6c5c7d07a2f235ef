"""The bandwidth-bound terms of `fsdpkit plan --time` (fsdpkit.plan.kernels) as arithmetic against
hand counts, and the built-in GPU profiles' prediction of a published step."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fsdpkit.models.recipe import Optimizer
from fsdpkit.plan.calibrate.measure import MemoryRates
from fsdpkit.plan.kernels import (
    OptimizerKernel,
    gather_cast_bytes,
    loss_bytes,
    optimizer_bytes_per_element,
    optimizer_kernel_for,
    reduce_cast_bytes,
)
from fsdpkit.plan.predict import model_costs, optimizer_kernel, predict
from fsdpkit.plan.profile import BUILT_IN
from fsdpkit.train.config import ModelConfig, TrainConfig

# gpt2-xl, bf16, 8 x 1024 tokens, one H200 (torch 2.11, CUDA 13): fsdpkit's median step in
# benchmarks/engine.py, as docs/performance.md records it ("The planner against an H200").
MEASURED_H200_GPT2_XL_STEP_S = 0.2619


def test_optimizer_traffic_is_the_kernels_reads_and_writes():
    # eager AdamW, fp32 tensors: decay (r1 w1), lerp (r2 w1), mul (r1 w1), addcmul (r2 w1), sqrt (r1 w1),
    # div (r1 w1), add (r1 w1), addcdiv (r3 w1): 12 reads + 8 writes of 4 bytes
    assert optimizer_bytes_per_element(Optimizer.ADAMW, OptimizerKernel.EAGER) == 20 * 4
    # fused: reads param, grad and both moments once, writes param and both moments
    assert optimizer_bytes_per_element(Optimizer.ADAMW, OptimizerKernel.FUSED) == 7 * 4
    assert optimizer_bytes_per_element(Optimizer.SGD, OptimizerKernel.EAGER) == 3 * 4


def test_casts_of_a_gather_and_a_reduction_by_hand():
    # bf16 over 4 ranks: the rank's 250 of 1,000 elements read in fp32, written in bf16
    assert gather_cast_bytes(1000, 250, shard_factor=4, master=4, compute=2, offload=False) == 250 * 6
    # one rank: the cast (6 bytes), then the copy into the full buffer (2 + 2)
    assert gather_cast_bytes(1000, 1000, shard_factor=1, master=4, compute=2, offload=False) == 1000 * 10
    # fp32 over 4 ranks: the chunk itself is gathered, no cast
    assert gather_cast_bytes(1000, 250, shard_factor=4, master=4, compute=4, offload=False) == 0
    # fp32 on one rank: the full buffer is the shard, nothing moves
    assert gather_cast_bytes(1000, 1000, shard_factor=1, master=4, compute=4, offload=False) == 0
    # bf16 reduced in bf16 on one rank: concatenate (2 + 2), to fp32 (2 + 4), average (4 + 4)
    assert reduce_cast_bytes(1000, 1000, master=4, compute=2, reduce=2, offload=False) == 1000 * 18
    # bf16 reduced in fp32 over 4 ranks: concatenate (4 per element), cast to fp32 (2 + 4), average the quarter (8)
    assert reduce_cast_bytes(1000, 250, master=4, compute=2, reduce=4, offload=False) == 1000 * 4 + 1000 * 6 + 250 * 8
    # under offload the fp32 chunk is made on the host
    assert reduce_cast_bytes(1000, 250, master=4, compute=2, reduce=2, offload=True) == 1000 * 4


def test_loss_bytes_by_hand():
    # bf16 logits: to fp32 (2 + 4), log-softmax (4 + 4); backward: one-hot gradient (4), log-softmax's
    # backward (4 + 4 + 4), back to bf16 (4 + 2): 36 bytes per logit
    assert loss_bytes(8 * 1024, 50257, compute=2) == 36 * 8 * 1024 * 50257
    assert loss_bytes(16, 100, compute=4) == 24 * 16 * 100  # fp32: no casts


def test_memory_efficiency_is_the_elementwise_rate_over_the_copys():
    assert MemoryRates(copy=10e9, elementwise=8e9).efficiency == pytest.approx(0.8)
    assert MemoryRates(copy=10e9, elementwise=12e9).efficiency == 1.0  # a sum faster than a copy: capped


@pytest.fixture(scope="module")
def gpt2_xl():
    values = {"model": {"name": "gpt2-xl"}, "data": {"global_batch_size": 8, "seq_len": 1024}, "sharding": {"mixed_precision": "bf16"}}
    # the measured run's AdamW was torch's default (eager) kernel
    request = dataclasses.replace(TrainConfig.from_values(values).plan_request(1), optimizer_kernel=OptimizerKernel.EAGER)
    return request, model_costs(request)


def test_h200_prediction_of_gpt2_xl_is_within_20_percent_of_the_measured_step(gpt2_xl):
    request, costs = gpt2_xl
    hardware = BUILT_IN["h200-ib400"]
    time = predict(request, hardware, costs).time
    assert time.step_time_s == pytest.approx(MEASURED_H200_GPT2_XL_STEP_S, rel=0.2)
    assert sum(time.terms.values()) == pytest.approx(time.compute_s, rel=1e-9) and time.exposed_comm_s == 0
    numel, rate = 1_557_611_200, 4800e9 * 0.85
    assert time.terms["optimizer_s"] == pytest.approx(numel * 80 / rate, rel=1e-6)
    assert time.terms["loss_s"] == pytest.approx(36 * 8 * 1024 * 50257 / rate, rel=1e-6)
    # every parameter gathered twice (10 bytes each time), but the root's (wte, wpe, ln_f: held through
    # the step) and the last block's (held from its forward into its backward) once; every gradient
    # reduced once (18 bytes)
    root, block = 50257 * 1600 + 1024 * 1600 + 2 * 1600, 12 * 1600**2 + 13 * 1600
    assert time.terms["casts_s"] == pytest.approx(((2 * numel - root - block) * 10 + numel * 18) / rate, rel=1e-9)
    assert time.terms["matmul_s"] == pytest.approx(time.flops / (989e12 * 0.6), rel=1e-9)


def test_h100_prediction_differs_from_the_h200s_by_its_memory_bandwidth_alone(gpt2_xl):
    # no published H100 measurement of this step: the two profiles share the compute, so the
    # bandwidth-bound terms scale by 4.8 / 3.35 TB/s and the rest stays
    request, costs = gpt2_xl
    h200, h100 = (predict(request, BUILT_IN[name], costs).time for name in ("h200-ib400", "h100-ib400"))
    bound = ("elementwise_s", "loss_s", "casts_s", "optimizer_s")
    for term in h200.terms:
        ratio = 4800 / 3350 if term in bound else 1.0
        assert math.isclose(h100.terms[term], h200.terms[term] * ratio, rel_tol=1e-9, abs_tol=1e-15), term
    assert h100.step_time_s > h200.step_time_s


def test_train_and_the_plan_take_the_optimizer_kernel_from_one_rule(gpt2_xl, monkeypatch):
    """One rule: fused AdamW where every parameter is on a GPU. The plan's default asks it
    whether a run's parameters are on a GPU (a GPU per rank, not offloaded); `train` builds its
    AdamW with the kernel it gives (here, on CPU, torch's default; told fused, fused)."""
    import torch

    from fsdpkit.plan import predict as plan_predict
    from fsdpkit.train import loop

    assert optimizer_kernel_for(True) is OptimizerKernel.FUSED and optimizer_kernel_for(False) is OptimizerKernel.EAGER
    assert loop.optimizer_kernel_for is plan_predict.optimizer_kernel_for is optimizer_kernel_for
    request, _ = gpt2_xl
    default = dataclasses.replace(request, optimizer_kernel=None)
    offloaded = dataclasses.replace(default, sharding=dataclasses.replace(default.sharding, cpu_offload=True))
    cpu = next(hardware for name, hardware in BUILT_IN.items() if hardware.compute_slots)
    assert optimizer_kernel(default, BUILT_IN["h200-ib400"]) is OptimizerKernel.FUSED
    assert optimizer_kernel(offloaded, BUILT_IN["h200-ib400"]) is OptimizerKernel.EAGER
    assert optimizer_kernel(default, cpu) is OptimizerKernel.EAGER
    assert optimizer_kernel(request, BUILT_IN["h200-ib400"]) is OptimizerKernel.EAGER  # an explicit kernel is kept
    config = TrainConfig(model=ModelConfig(name="gpt-tiny"))
    assert loop.build_optimizer(torch.nn.Linear(2, 2), config).defaults["fused"] is None
    asked: list[bool] = []
    monkeypatch.setattr(loop, "optimizer_kernel_for", lambda on_gpu: asked.append(on_gpu) or OptimizerKernel.FUSED)
    assert loop.build_optimizer(torch.nn.Linear(2, 2), config).defaults["fused"] is True and asked == [False]
