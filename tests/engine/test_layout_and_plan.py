"""Pure arithmetic and unit planning, no process group."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn as nn

from fsdpkit.engine.config import ShardingConfig
from fsdpkit.engine.wrapping import WrapPolicy, split_units
from fsdpkit.errors import UsageError
from fsdpkit.flat_layout import ElementRange, FlatLayout, even_split_ranges, padded_size
from fsdpkit.models.gpt import GPT, Block, GPTConfig
from fsdpkit.models.units import unit_specs_for_model


def test_padding_and_chunks_cover_the_flat_parameter_exactly_once():
    for shapes in ([(4, 3), (3,), (1,)], [(5,)], [(1,)], [(7, 7), (7,), (1,)]):
        for factor in (1, 2, 3, 4, 16):
            layout = FlatLayout.from_shapes([(f"p{i}", s) for i, s in enumerate(shapes)], factor)
            assert layout.padded_numel % factor == 0 and 0 <= layout.padding < factor
            assert layout.padded_numel == padded_size(layout.numel, factor)
            covered = {name: [] for name, _ in [(f"p{i}", s) for i, s in enumerate(shapes)]}
            for rank in range(factor):
                chunk = layout.chunk_range(rank)
                assert chunk.size == layout.chunk_numel
                for fragment in layout.fragments(rank):
                    assert 0 <= fragment.local_offset <= layout.chunk_numel - fragment.param_range.size
                    if fragment.param_range.size:
                        covered[fragment.name].append((fragment.param_range.start, fragment.param_range.end))
            for slot in layout.slots:
                pieces = sorted(covered[slot.name])
                assert pieces[0][0] == 0 and pieces[-1][1] == slot.numel
                assert all(a[1] == b[0] for a, b in pairwise(pieces))


def test_paper_figure_3_example_one_element_per_rank_last_ranks_padding():
    layout = FlatLayout.from_shapes([("weight", (4, 3)), ("bias", (3,))], 16)
    assert layout.padded_numel == 16 and layout.chunk_numel == 1 and layout.padding == 1
    assert [f.param_range.size for f in layout.fragments(15)] == [0, 0]
    assert layout.fragments(13)[1].param_range == ElementRange(1, 2)


def test_fragments_reassemble_a_tensor_through_views():
    weight, bias = torch.randn(4, 3), torch.randn(3)
    layout = FlatLayout.from_shapes([("w", (4, 3)), ("b", (3,))], 4)
    flat = torch.cat([weight.reshape(-1), bias, torch.zeros(layout.padding)])
    rebuilt = {"w": torch.empty(12), "b": torch.empty(3)}
    for rank in range(4):
        chunk = flat[layout.chunk_range(rank).start : layout.chunk_range(rank).end]
        for fragment in layout.fragments(rank):
            piece = chunk[fragment.local_offset : fragment.local_offset + fragment.param_range.size]
            rebuilt[fragment.name][fragment.param_range.start : fragment.param_range.end] = piece
    assert torch.equal(rebuilt["w"].view(4, 3), weight) and torch.equal(rebuilt["b"], bias)
    pieces = torch.split(flat, layout.split_sizes())
    assert torch.equal(pieces[0].view(4, 3), weight)


def test_even_split_and_intersections():
    assert [r.size for r in even_split_ranges(10, 4)] == [3, 3, 3, 1]
    assert [r.size for r in even_split_ranges(2, 4)] == [1, 1, 0, 0]
    old = [(r, i) for i, r in enumerate(even_split_ranges(10, 3))]
    pieces = [(r.intersect(ElementRange(3, 9)), s) for r, s in old]
    assert [(p.start, p.end, s) for p, s in pieces if p.size] == [(3, 4, 0), (4, 8, 1), (8, 9, 2)]
    with pytest.raises(UsageError):
        even_split_ranges(10, 0)


def test_sharding_config_validation_names_the_numbers():
    with pytest.raises(UsageError, match="world size 6 is not divisible by shard group size 4"):
        ShardingConfig(strategy="hybrid", shard_group_size=4).shard_factor(6)
    with pytest.raises(UsageError, match="needs a shard group size"):
        ShardingConfig(strategy="hybrid")
    with pytest.raises(UsageError, match="zero"):
        ShardingConfig(strategy="zero")
    assert ShardingConfig(strategy="hybrid", shard_group_size=2).shard_factor(8) == 2
    assert ShardingConfig(strategy="none").shard_factor(8) == 1


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.b = nn.Sequential(nn.Linear(4, 4))
        self.b[0].weight = self.a[1].weight  # shared between two units


def test_shared_parameter_goes_to_lowest_common_ancestor_unit():
    model = Shared()
    plans = split_units(model, WrapPolicy(module_classes=(nn.Sequential,)))
    owners = {p.name: plan.name for plan in plans for p in plan.params}
    assert owners["a.1.weight"] == ""  # a and b are units; their common ancestor is the root
    assert owners["a.0.weight"] == "a" and owners["b.0.bias"] == "b"
    nested = split_units(model, WrapPolicy(module_classes=(nn.Sequential, nn.Linear)))
    assert {plan.name for plan in nested} >= {"a.0", "a.1", "b.0", ""}


def test_wrap_rules_class_size_predicate_every():
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=4, n_head=2, n_embd=16))
    assert [u.name for u in split_units(model, WrapPolicy(module_classes=(Block,)))] == ["", "h.0", "h.1", "h.2", "h.3"]
    assert [u.name for u in split_units(model, WrapPolicy())] == ["", "h.0", "h.1", "h.2", "h.3"]  # ModuleList rule
    assert [u.name for u in split_units(model, WrapPolicy(module_classes=(Block,), every=3))] == ["", "h.0+h.1+h.2", "h.3"]
    by_size = split_units(model, WrapPolicy(min_params=16 * 64))
    assert all(sum(torch.Size(p.shape).numel() for p in u.params) >= 16 * 64 for u in by_size if u.name)
    assert "h.0.mlp.c_fc" in [u.name for u in by_size]
    pred = split_units(model, WrapPolicy(predicate=lambda name, m: name in ("h.1", "h.3")))
    assert [u.name for u in pred] == ["", "h.1", "h.3"]
    total = sum(p.numel() for p in model.parameters())
    assert sum(torch.Size(p.shape).numel() for u in by_size for p in u.params) == total


def test_unit_plan_for_model_is_built_on_meta():
    units = unit_specs_for_model("gpt2-xl")
    assert len(units) == 49 and units[1][0][0] == "h.0.ln_1.weight"
    assert sum(torch.Size(shape).numel() for unit in units for _, shape in unit) == 1_557_611_200


def test_shard_options_override_the_config_and_unknown_ones_are_named():
    from fsdpkit.engine.api import with_options
    from fsdpkit.engine.config import MixedPrecision, ShardingConfig
    from fsdpkit.errors import UsageError

    base = ShardingConfig(strategy="grad-op", limit_all_gathers=3)
    merged = with_options(base, {"mixed_precision": "bf16", "strategy": "full"})
    assert merged.strategy == "full" and merged.limit_all_gathers == 3
    assert merged.mixed_precision == MixedPrecision.from_name("bf16")
    assert with_options(base, {}) is base
    with pytest.raises(UsageError, match="'stratgy'"):
        with_options(base, {"stratgy": "full"})
