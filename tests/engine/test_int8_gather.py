"""The int8 block-quantized weight all-gather: the codec's round trip, its bytes, and training
at 1, 2 and 4 ranks under every sharding strategy against an unsharded reference that
quantizes its weights in forward exactly as the gather does (each unit's padded flat
parameter, chunk by chunk of the shard factor, in blocks). SGD: AdamW divides by the
gradient's own magnitude, which turns the float noise of a sharded reduction of a gradient
near zero into differences far above the 1e-6 compared here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.distributed import run_distributed

import fsdpkit
from fsdpkit.dist.comm import CommStats
from fsdpkit.engine.config import MixedPrecision, ShardingConfig
from fsdpkit.engine.quant import Int8BlockCodec, all_gather_bytes, block_count, dequantize, quantize, round_trip_sharded
from fsdpkit.engine.sharded import get_state
from fsdpkit.engine.wrapping import WrapPolicy, bucket_units, split_units
from fsdpkit.errors import UsageError
from fsdpkit.flat_layout import padded_size
from fsdpkit.models.gpt import GPT, MLP, Block, GPTConfig
from fsdpkit.plan.memory import plan_memory
from fsdpkit.plan.traffic import UnitComm, step_bytes
from fsdpkit.train.config import TrainConfig

CONFIG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=18)
STEPS = 3
BATCH = 4
# 7: blocks cut across parameters and chunks, a short last block in every chunk;
# 100000: every unit smaller than one block.
BLOCKS = (7, 100000)
BUCKET_BYTES = 40000  # the two blocks (16 KB each) become one unit; the root is never merged


@pytest.mark.parametrize("numel, block", [(1000, 256), (1000, 7), (5, 256), (256, 256), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_a_step_of_each_blocks_scale(numel, block, dtype):
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 1, numel)).to(dtype)
    if numel > block:
        x[:block] = 0  # an all-zero block comes back as zeros
    values, scales = quantize(x, block)
    assert values.dtype is torch.int8 and scales.numel() == block_count(numel, block)
    back = dequantize(values, scales, block)
    step = scales.repeat_interleave(block)[:numel]
    assert torch.all((back - x.float()).abs() <= step / 2 * (1 + 1e-6))
    assert torch.all(values.abs() <= 127)
    if numel > block:
        assert torch.all(back[:block] == 0)


def test_codec_rows_have_the_bytes_the_accounting_counts():
    for chunk, block, factor in [(1000, 256, 2), (13, 7, 4), (5, 256, 3)]:
        codec = Int8BlockCodec(chunk, block)
        flat = torch.randn(chunk * factor)
        rows = torch.cat([codec.encode(piece) for piece in flat.view(factor, -1)])
        assert rows.numel() == all_gather_bytes(chunk, factor, element_bytes=4, block=block)
        out = torch.empty_like(flat)
        codec.decode(rows, out)
        assert torch.equal(out, round_trip_sharded(flat, factor, block))
    assert all_gather_bytes(1000, 2, element_bytes=2, block=None) == 4000


def test_int8_needs_a_sharded_strategy_and_a_positive_block():
    with pytest.raises(UsageError, match="int8"):
        ShardingConfig(strategy="none", allgather_dtype="int8")
    with pytest.raises(UsageError, match="block"):
        ShardingConfig(allgather_dtype="int8", quant_block=0)
    with pytest.raises(UsageError, match="all-gather dtype"):
        ShardingConfig(allgather_dtype="int4")


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (BATCH, 17), generator=torch.Generator().manual_seed(100 + step))


def _quantize_weights(model: torch.nn.Module, shard_factor: int, block: int, bucket_bytes: int) -> list[torch.Tensor]:
    """Replace every weight by what the int8 gather gives the unit; return the masters."""
    masters = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for plan in bucket_units(model, split_units(model, WrapPolicy(module_classes=(Block,))), bucket_bytes):
            params = [model.get_parameter(p.name) for p in plan.params]
            flat = torch.cat([p.reshape(-1) for p in params])
            numel = flat.numel()
            flat = F.pad(flat, (0, padded_size(numel, shard_factor) - numel))
            pieces = round_trip_sharded(flat, shard_factor, block)[:numel].split([p.numel() for p in params])
            for param, piece in zip(params, pieces, strict=True):
                param.copy_(piece.view_as(param))
    return masters


def quantized_reference_run(shard_factor: int, block: int | None, bucket_bytes: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        tokens = _batch(step)
        masters = _quantize_weights(model, shard_factor, block, bucket_bytes) if block is not None else []
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()  # the gradient at the quantized weights updates the masters
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters, strict=False):
                param.copy_(master)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": model.state_dict()}


def int8_worker(variants: list[dict]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for index, options in enumerate(variants):
        torch.manual_seed(0)
        stats = CommStats()
        model = fsdpkit.shard(GPT(CONFIG), wrap=(Block,), comm_stats=stats, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        state = get_state(model)
        with torch.no_grad():  # one gather per unit, nothing else
            model(_batch(0)[:1, :-1])
        factor = state.mesh.shard_factor
        expected_bytes = sum(
            all_gather_bytes(unit.chunk_numel, factor, element_bytes=unit.full_flat.element_size(), block=state.config.gather_block)
            for unit in state.units
        )
        gathered = stats.bytes.get("all_gather", 0)
        losses = []
        for step in range(STEPS):
            stats.reset()  # the last step's bytes are returned: the forward order is known by then
            rows = BATCH // world
            local = _batch(step)[rank * rows : (rank + 1) * rows]
            loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        step_bytes = dict(stats.bytes)
        results[index] = {
            "losses": losses,
            "weights": fsdpkit.full_state_dict(model),
            "factor": factor,
            "gathered": gathered,
            "expected_bytes": expected_bytes if factor > 1 else 0,
            "step_bytes": step_bytes,
            "units": len(state.units),
        }
    return results


def _variants(world_size: int) -> list[dict]:
    int8 = {"allgather_dtype": "int8", "quant_block": 7}
    variants = [{"strategy": "full", "allgather_dtype": "int8", "quant_block": block} for block in BLOCKS]
    variants += [
        {"strategy": "grad-op", **int8},
        {"strategy": "full", **int8, "forward_prefetch": True, "limit_all_gathers": 1, "backward_prefetch": "post"},
        {"strategy": "full", **int8, "activation_checkpointing": True},
        {"strategy": "full", **int8, "cpu_offload": True},
        {"strategy": "full", **int8, "bucket_bytes": BUCKET_BYTES},
        {"strategy": "full", "bucket_bytes": BUCKET_BYTES},
    ]
    if world_size == 2:  # bf16 compute: compared with the fp32 reference at bf16's precision
        variants.append({"strategy": "full", **int8, "mixed_precision": "bf16", "activation_checkpointing": True})
    if world_size == 4:
        variants.append({"strategy": "hybrid", "shard_group_size": 2, **int8})
    # one unit per block unless the variant buckets (the default bucket would merge the blocks)
    return [{"bucket_bytes": 0, **options} for options in variants]


def _planned_step_bytes(options: dict, world_size: int) -> dict[str, int]:
    """What `fsdpkit plan` computes for one step of this run, as the counters name it."""
    precision = MixedPrecision.from_name(options.get("mixed_precision", "none"))
    config = ShardingConfig(**{**options, "mixed_precision": precision})
    model = GPT(CONFIG)
    plans = bucket_units(model, split_units(model, WrapPolicy(module_classes=(Block,))), config.bucket_bytes)
    factor = config.shard_factor(world_size)
    units = [
        UnitComm(plan.name, plan.layout(factor).padded_numel, plan.layout(factor).chunk_numel, True, len(plan.params)) for plan in plans
    ]
    return {kind: count for kind, count in step_bytes(units, config, world_size).as_dict().items() if count and kind != "total"}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_int8_training_equals_a_reference_that_quantizes_its_weights(world_size):
    variants = _variants(world_size)
    results = run_distributed(int8_worker, world_size, variants)[0]
    references: dict[tuple[int, int | None, int], dict] = {}
    for index, options in enumerate(variants):
        result = results[index]
        block = options.get("quant_block") if options.get("allgather_dtype") == "int8" else None
        key = (result["factor"], block, options["bucket_bytes"])
        if key not in references:
            references[key] = quantized_reference_run(*key)
        reference = references[key]
        tolerance = 2e-2 if "mixed_precision" in options else 1e-6
        for mine, ref in zip(result["losses"], reference["losses"], strict=True):
            assert abs(mine - ref) / ref < tolerance, (options, result["losses"], reference["losses"])
        for name, ref in reference["weights"].items():
            error = (result["weights"][name] - ref).abs().max().item()
            assert error < tolerance, (options, name, error)
        assert result["gathered"] == result["expected_bytes"], options
        assert result["step_bytes"] == _planned_step_bytes(options, world_size), options
        assert result["units"] == (2 if options["bucket_bytes"] else 3), options


def test_bucketing_merges_consecutive_small_units_but_never_the_root_or_nested_ones():
    model = GPT(CONFIG)
    blocks = split_units(model, WrapPolicy(module_classes=(Block,)))
    assert [p.name for p in bucket_units(model, blocks, BUCKET_BYTES)] == ["", "h.0+h.1"]
    assert bucket_units(model, blocks, 0) == blocks
    assert [p.name for p in bucket_units(model, blocks, 20000)] == ["", "h.0", "h.1"]  # two blocks would pass 20000
    nested = split_units(model, WrapPolicy(module_classes=(Block, MLP)))
    merged = bucket_units(model, nested, 10**9)
    assert [p.name for p in merged] == ["", "h.0", "h.0.mlp+h.1", "h.1.mlp"]
    assert sorted(p.name for plan in merged for p in plan.params) == sorted(p.name for plan in nested for p in plan.params)


def test_plan_counts_int8_and_bucketed_bytes():
    def planned(**sharding):
        return plan_memory(TrainConfig.from_values({"model": {"name": "gpt-tiny"}, "sharding": sharding}).plan_request(2))

    plain, int8 = planned(bucket_bytes=0), planned(allgather_dtype="int8", bucket_bytes=0)
    assert plain.comm_per_step is not None and int8.comm_per_step is not None
    assert int8.comm_per_step.reduce_scatter == plain.comm_per_step.reduce_scatter
    assert 0.25 < int8.comm_per_step.all_gather / plain.comm_per_step.all_gather < 0.27
    assert len(planned(bucket_bytes=10**9).units) == 2  # the root, and every block in one unit
    assert planned(bucket_bytes=10**9).comm_per_step.all_gather < plain.comm_per_step.all_gather  # no re-gather in backward
