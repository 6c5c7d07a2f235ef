"""`fsdpkit plan`: the memory arithmetic against numbers computed by hand, the CLI (table,
--json, bad input), and one 2-process run in which the engine's own byte counters
(fsdpkit.memory_stats) must equal the plan."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdpkit_cli.app import app
from support.distributed import run_distributed
from typer.testing import CliRunner

import fsdpkit
from fsdpkit.engine.config import ShardingConfig
from fsdpkit.engine.step_policy import StepPolicy
from fsdpkit.errors import UsageError
from fsdpkit.plan.memory import plan_memory
from fsdpkit.plan.request import PlanRequest
from fsdpkit.plan.timeline import UnitFootprint, peak_unsharded
from fsdpkit.train.config import TrainConfig

# tests/support/models.py EdgeCaseNet under the ModuleList rule: root (inp 5x7+7, branch 3x3+3,
# head 3x2+2) = 62 elements in 6 tensors; layers.0 = 7x7+7+1 = 57 (3 tensors);
# layers.1 = 7x3+3+1 = 25 (3 tensors); layers.2 = 1 (1 tensor). 13 tensors, 145 elements.
EDGE = "support.models:EdgeCaseNet"
EDGE_TENSORS = 13
# gpt-tiny: root wte 256x64 + wpe 128x64 + ln_f 2x64 = 24704 (4 tensors); each of 2 blocks
# 49984 (12 tensors): 124672 elements, 28 tensors.
GPT_ROOT, GPT_BLOCK, GPT_TENSORS = 24704, 49984, 28
# The counts by hand are per block: one unit each, bucketing off (both models' blocks are
# far under the default bucket, which would merge them).
PER_BLOCK = {"bucket_bytes": 0}


def _request(model: str, world_size: int, *, optimizer: str = "adamw", no_sync: bool = False, **sharding) -> PlanRequest:
    """The request `fsdpkit plan` builds from train's settings (sharding flags as train spells them)."""
    data = {"no_sync": True, "grad_accum": 2} if no_sync else {}
    values = {"model": {"name": model}, "data": data, "optimizer": {"name": optimizer}, "sharding": sharding}
    return TrainConfig.from_values(values).plan_request(world_size)


def _bytes(model: str, world_size: int, **options) -> dict:
    return plan_memory(_request(model, world_size, **options)).to_document()["bytes"]


def test_edge_case_model_by_hand_at_world_sizes_1_2_4():
    # The peak counts unsharded parameters, full gradients still reducing, and the sharded
    # gradients produced so far (a reduce-scatter's output exists from its issue on; the
    # engine frees sharded gradients when the optimizer clears .grad, before the next forward).
    # W=1: nothing to gather (the full parameter is the shard) and reductions work in place:
    # in the root's backward, layers.0's and the root's gradients (57 + 62) are full, layers.2
    # and layers.1 (1 + 25) are already reduced.
    one = _bytes(EDGE, 1, **PER_BLOCK)
    assert one["sharded_params"] == one["sharded_grads"] == 145 * 4
    assert one["optimizer_state"] == 2 * 145 * 4 + 4 * EDGE_TENSORS
    assert one["largest_unit_unsharded"] == 0 and one["peak_unsharded"] == (57 + 62 + 1 + 25) * 4
    assert one["total"] == 145 * 4 + one["optimizer_state"] + one["peak_unsharded"]

    # W=2: padded 62, 58, 26, 2 -> chunks 31, 29, 13, 1; rank 0 holds 74 real elements, rank 1 holds 71.
    two = _bytes(EDGE, 2, **PER_BLOCK)
    assert two["sharded_params"] == two["sharded_grads"] == 74 * 4
    assert two["optimizer_state"] == 2 * 74 * 4 + 4 * EDGE_TENSORS
    rank1 = plan_memory(_request(EDGE, 2, **PER_BLOCK), shard_rank=1)
    assert rank1.optimizer_state == 2 * (31 + 28 + 12 + 0) * 4 + 4 * EDGE_TENSORS
    # Peak as the root's gradient arrives: root parameters (62), layers.0's and the root's full
    # gradients (58 + 62), the outputs of layers.2, layers.1 and layers.0 (1 + 13 + 29).
    assert two["largest_unit_unsharded"] == 62 * 4
    assert two["peak_unsharded"] == (62 + 58 + 62 + 1 + 13 + 29) * 4
    assert two["total"] == 74 * 4 + two["optimizer_state"] + two["peak_unsharded"]

    # W=4: padded 64, 60, 28, 4 -> chunks 16, 15, 7, 1 (rank 0: all real). Peak as layers.0's
    # gradient arrives: root and layers.0 parameters, layers.1's and layers.0's full gradients,
    # the outputs of layers.2 and layers.1.
    four = _bytes(EDGE, 4, **PER_BLOCK)
    assert four["sharded_params"] == (16 + 15 + 7 + 1) * 4
    assert four["optimizer_state"] == 2 * 39 * 4 + 4 * EDGE_TENSORS
    assert four["peak_unsharded"] == (64 + 60 + 28 + 60 + 1 + 7) * 4
    assert four["total"] == 39 * 4 + four["optimizer_state"] + four["peak_unsharded"]


def test_gpt_tiny_by_hand_at_world_sizes_1_2_4():
    total = GPT_ROOT + 2 * GPT_BLOCK
    assert plan_memory(_request("gpt-tiny", 1)).num_params == total
    for world in (1, 2, 4):
        got = _bytes("gpt-tiny", world, **PER_BLOCK)
        shard = total // world  # every unit divides by 4: no padding
        assert got["sharded_params"] == got["sharded_grads"] == shard * 4, world
        assert got["optimizer_state"] == 2 * shard * 4 + 4 * GPT_TENSORS, world
        if world == 1:
            assert got["peak_unsharded"] == total * 4  # h.0 and root full, h.1 reduced in place: everything once
        else:
            # h.1's backward with h.0 prefetched: root, h.1, h.0 parameters, h.1's gradient and its output
            assert got["peak_unsharded"] == (GPT_ROOT + 3 * GPT_BLOCK + GPT_BLOCK // world) * 4, world
        assert got["total"] == shard * 4 + got["optimizer_state"] + got["peak_unsharded"]


def test_strategies_precision_offload_and_no_sync():
    full4 = _bytes("gpt-tiny", 4, **PER_BLOCK)
    # none = F 1 at any world size; hybrid shards like full over its group
    assert _bytes("gpt-tiny", 4, strategy="none", **PER_BLOCK) == _bytes("gpt-tiny", 1, **PER_BLOCK)
    hybrid = _bytes("gpt-tiny", 8, strategy="hybrid", shard_group_size=4, **PER_BLOCK)
    assert hybrid == full4
    # grad-op keeps every unit gathered from forward to its backward: the peak is h.1's
    # backward with everything gathered (with full, h.0 is there only as h.1's prefetch)
    grad_op = plan_memory(_request("gpt-tiny", 4, strategy="grad-op", **PER_BLOCK)).peak
    assert grad_op.bytes == (GPT_ROOT + 3 * GPT_BLOCK + GPT_BLOCK // 4) * 4 and grad_op.params == ("", "h.0", "h.1")
    # no prefetch: h.0 is gathered only after h.1 is freed; h.0's gradient arriving while h.1's
    # still reduces (with its output) is the peak
    no_prefetch = plan_memory(_request("gpt-tiny", 2, backward_prefetch="none", **PER_BLOCK)).peak
    assert no_prefetch.bytes == (GPT_ROOT + 3 * GPT_BLOCK + GPT_BLOCK // 2) * 4 and no_prefetch.params == ("", "h.0")
    assert no_prefetch.grads == ("h.1", "h.0")
    # bf16: parameters, full gradients and the reduce-scatter output in flight take 2 bytes
    bf16 = _bytes("gpt-tiny", 2, mixed_precision="bf16", **PER_BLOCK)
    assert (
        bf16["peak_unsharded"] == (GPT_ROOT + 3 * GPT_BLOCK + GPT_BLOCK // 2) * 2 and bf16["sharded_params"] == full4["sharded_params"] * 2
    )
    # fp16 as h.0's gradient arrives: root and h.0 parameters (2 bytes), h.1's and h.0's
    # gradients in fp16 + fp32 (6 bytes), h.1's output (fp32)
    assert (
        _bytes("gpt-tiny", 2, mixed_precision="fp16", **PER_BLOCK)["peak_unsharded"]
        == (GPT_ROOT + GPT_BLOCK) * 2 + 2 * GPT_BLOCK * 6 + GPT_BLOCK // 2 * 4
    )
    # sgd keeps no state; cpu offload moves the sharded state to the host
    assert _bytes("gpt-tiny", 2, optimizer="sgd", **PER_BLOCK)["optimizer_state"] == 0
    offload = _bytes("gpt-tiny", 2, cpu_offload=True, **PER_BLOCK)
    plain = _bytes("gpt-tiny", 2, **PER_BLOCK)
    # the device keeps what is in flight, less the sharded gradient outputs (host memory, counted there)
    assert offload["device_total"] == plain["peak_unsharded"] - GPT_BLOCK // 2 * 4
    assert offload["host_total"] == plain["sharded_params"] + plain["sharded_grads"] + plain["optimizer_state"]
    assert plain["host_total"] == 0
    # with offload, F = 1 no longer aliases: the device holds a gathered copy
    assert _bytes("gpt-tiny", 1, cpu_offload=True, **PER_BLOCK)["largest_unit_unsharded"] == GPT_BLOCK * 4
    no_sync = _bytes("gpt-tiny", 2, no_sync=True, **PER_BLOCK)
    assert no_sync["no_sync_grads"] == (GPT_ROOT + 2 * GPT_BLOCK) * 4
    assert no_sync["total"] == plain["total"] + no_sync["no_sync_grads"]


def test_gpt2_xl_at_64_ranks_builds_nothing_real():
    plan = plan_memory(_request("gpt2-xl", 64, mixed_precision="bf16"))
    assert plan.num_params == 1_557_611_200 and len(plan.units) == 49
    assert plan.num_params * 4 / 64 <= plan.sharded_params <= (plan.num_params + 49 * 63) * 4 / 64
    assert plan.largest_unit.name == "" and plan.largest_unit.param_bytes == plan.units[0].padded_numel * 2


def test_timeline_pending_reductions_and_forward_prefetch():
    units = [UnitFootprint("", 10, 10), UnitFootprint("a", 100, 100), UnitFootprint("b", 100, 100), UnitFootprint("c", 100, 100)]
    held = peak_unsharded(units, StepPolicy(pending_reductions=None))  # b's backward: root, b, a (prefetched); grads of c and b
    assert held.bytes == 10 + 200 + 200 and held.params == ("", "b", "a") and held.grads == ("c", "b")
    last = peak_unsharded(units[:1] + [UnitFootprint("a", 1, 1000)], StepPolicy(pending_reductions=None))  # end of backward: all grads
    assert last.bytes == 10 + 1000 + 10 and last.grads == ("a", "")
    freed = peak_unsharded(units, StepPolicy())
    assert freed.bytes == 10 + 200 + 200  # b computing, a prefetched, grads of c and b
    forward = peak_unsharded(units, StepPolicy(forward_prefetch=True, backward_prefetch="none"))
    assert forward.bytes == 10 + 100 + 200 and forward.phase == "backward"
    grad_op = peak_unsharded(units, StepPolicy(reshard_after_forward=False))
    assert grad_op.bytes == 10 + 300 + 100 and set(grad_op.params) == {"", "a", "b", "c"}


def test_request_rejects_bad_values_with_the_value():
    with pytest.raises(UsageError, match="world size must be >= 1, got 0"):
        _request("gpt2", 0)
    with pytest.raises(UsageError, match="world size 6 is not divisible by shard group size 4"):
        _request("gpt2", 6, strategy="hybrid", shard_group_size=4)
    with pytest.raises(UsageError, match="'adam'"):
        _request("gpt2", 2, optimizer="adam")


def _invoke(args):
    return CliRunner().invoke(app, ["plan", *args])


def test_cli_table_and_json():
    table = _invoke(["--model", "gpt-tiny", "--world-size", "2", "--bucket-bytes", "0"])
    assert table.exit_code == 0, table.output
    for label in (
        "sharded parameters",
        "sharded gradients",
        "optimizer state (adamw)",
        "largest unit unsharded",
        "unsharded in flight",
        "total",
    ):
        assert label in table.stdout
    assert "1,546,736" in table.stdout  # the total computed by hand above: 249344 + 498800 + 798592

    result = _invoke(
        ["--model", "gpt2-xl", "--world-size", "64", "--strategy", "full", "--mixed-precision", "bf16", "--cpu-offload", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1
    document = json.loads(result.stdout)
    assert document["model"] == "gpt2-xl" and document["shard_factor"] == 64 and document["cpu_offload"] is True
    parts = document["bytes"]
    assert parts["host_total"] == parts["sharded_params"] + parts["sharded_grads"] + parts["optimizer_state"]
    assert parts["device_total"] == parts["peak_unsharded"] and parts["total"] == parts["host_total"] + parts["device_total"]


def test_gpt_tiny_blocks_share_one_unit_by_default_and_get_one_each_with_bucket_bytes_0():
    # each block is 49984 x 4 bytes, under the default bucket: both go into one unit
    default = json.loads(_invoke(["--model", "gpt-tiny", "--world-size", "2", "--json"]).stdout)
    assert default["bucket_bytes"] == ShardingConfig().bucket_bytes > 2 * GPT_BLOCK * 4
    assert default["units"] == 2 and default["largest_unit"] == "h.0+h.1"
    assert default["bytes"]["largest_unit_unsharded"] == 2 * GPT_BLOCK * 4
    per_block = json.loads(_invoke(["--model", "gpt-tiny", "--world-size", "2", "--bucket-bytes", "0", "--json"]).stdout)
    assert per_block["bucket_bytes"] == 0 and per_block["units"] == 3 and per_block["largest_unit"] in ("h.0", "h.1")
    assert per_block["bytes"]["largest_unit_unsharded"] == GPT_BLOCK * 4
    assert per_block["bytes"]["sharded_params"] == default["bytes"]["sharded_params"]  # no padding either way


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt2", "--world-size", "0"], "world size must be >= 1, got 0"),
        (
            ["--model", "gpt2", "--world-size", "6", "--strategy", "hybrid", "--shard-group-size", "4"],
            "world size 6 is not divisible by shard group size 4",
        ),
        (["--model", "gpt-nope", "--world-size", "2"], "'gpt-nope'"),
        (["--model", "gpt2", "--world-size", "2", "--strategy", "zero3"], "'zero3'"),
        (["--model", "gpt2", "--world-size", "2", "--mixed-precision", "fp8"], "'fp8'"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, message):
    result = _invoke(args)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.output


CONFIGS = [{}, {"strategy": "grad-op"}, {"mixed_precision": "bf16"}]


def engine_memory_worker(steps: int) -> list[dict]:
    """Train gpt-tiny for `steps` AdamW steps under each config; the engine's counters after them."""
    from fsdpkit.models.gpt import Block
    from fsdpkit.models.source import build_model
    from fsdpkit.train.data import TokenSource, local_rows

    rank, world = dist.get_rank(), dist.get_world_size()
    data = TokenSource("synthetic", vocab_size=256, seq_len=32, seed=0)
    results = []
    for config in CONFIGS:
        torch.manual_seed(0)
        model = fsdpkit.shard(build_model("gpt-tiny"), wrap=(Block,), **config)
        optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-3)
        for step in range(steps):
            batch = local_rows(data.global_batch(step, 4), rank, world)
            loss = F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append(fsdpkit.memory_stats(model, optimizer))
    return results


def test_plan_matches_the_engine_counters_at_world_size_2():
    results = run_distributed(engine_memory_worker, 2, 2)
    for rank, stats_per_config in results.items():
        for config, stats in zip(CONFIGS, stats_per_config, strict=True):
            plan = plan_memory(_request("gpt-tiny", 2, **config), shard_rank=rank)
            where = f"rank {rank} {config}"
            assert stats["sharded_params"] == plan.sharded_params, where
            assert stats["sharded_grads"] == plan.sharded_grads, where
            assert stats["optimizer_state"] == plan.optimizer_state, where
            assert stats["unsharded_params"] == stats["unsharded_grads"] == 0, where  # all freed after the step
            assert abs(stats["peak_total"] - plan.device_total) <= 0.15 * plan.device_total, (where, stats["peak_total"], plan.device_total)
            in_flight = stats["peak_total"] - stats["sharded_params"] - stats["optimizer_state"]  # unsharded + sharded grads
            assert abs(in_flight - plan.peak.bytes) <= 0.15 * plan.peak.bytes, (where, in_flight, plan.peak.bytes)
