"""fsdpkit's engine against an unsharded single-process reference computed in the same
worker: gradients after one backward, weights after several AdamW steps, at world sizes
1, 2 and 4, on models built to hit every case the engine handles."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.distributed import run_distributed
from support.models import EdgeCaseNet

import fsdpkit
from fsdpkit.engine.sharded import get_state
from fsdpkit.models.gpt import GPT, Block, GPTConfig

TOL = 1e-5


def _relative_errors(sharded, reference, *, grads: bool) -> dict[str, float]:
    """Norm of (sharded - reference) over norm of reference, per tensor, fragments
    summed across ranks. grads=True compares .grad, else the weights."""
    ref_params = dict(reference.named_parameters())
    names, sums = [], []
    for unit in get_state(sharded).units:
        for fragment, param in zip(unit.fragments, unit.params, strict=True):
            ref = ref_params[fragment.name]
            ref_tensor = ref.detach() if not grads else (ref.grad if ref.grad is not None else torch.zeros_like(ref))
            ref_flat = ref_tensor.reshape(-1)
            ref_piece = ref_flat[fragment.param_range.start : fragment.param_range.end]
            mine = param.grad if grads else param.detach()
            mine = torch.zeros_like(ref_piece) if mine is None else mine
            names.append(fragment.name)
            sums += [float((mine - ref_piece).pow(2).sum()), float(ref_piece.pow(2).sum())]
    totals = torch.tensor(sums, dtype=torch.float64)
    dist.all_reduce(totals)
    return {name: (totals[2 * i].sqrt() / totals[2 * i + 1].sqrt().clamp_min(1e-30)).item() for i, name in enumerate(names)}


def _full_weight_errors(sharded, reference) -> dict[str, float]:
    full = fsdpkit.full_state_dict(sharded)
    return {name: ((full[name] - tensor).norm() / tensor.norm().clamp_min(1e-30)).item() for name, tensor in reference.state_dict().items()}


def edge_case_worker(steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = EdgeCaseNet()
    sharded = fsdpkit.shard(copy.deepcopy(reference), bucket_bytes=0)  # one unit per module: the one-element unit stays unmerged
    out: dict = {
        "names": [n for n, _ in sharded.named_parameters()] == [n for n, _ in reference.named_parameters()],
        "keys": list(sharded.state_dict()) == list(reference.state_dict()),
        "fragment_dims": sorted({p.dim() for p in sharded.parameters()}),
        "shapes_ok": all(fsdpkit.original_shape(p) == r.shape for p, r in zip(sharded.parameters(), reference.parameters(), strict=True)),
        "chunk_sizes": [unit.layout.chunk_numel for unit in get_state(sharded).units],
        "unit_numels": [unit.layout.numel for unit in get_state(sharded).units],
    }
    ref_opt = torch.optim.AdamW(fsdpkit.param_groups(reference, weight_decay=0.1), lr=1e-2)
    opt = torch.optim.AdamW(fsdpkit.param_groups(sharded, weight_decay=0.1), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    grad_errors, branch_grad_none, eval_diffs = [], [], []
    micro_batches, micro_size = 2, 4
    for step in range(steps):
        use_branch = step % 2 == 0
        reference.use_branch = sharded.use_branch = use_branch
        x = torch.randn(micro_batches * micro_size, 5, generator=generator)
        y = torch.randn(micro_batches * micro_size, 2, generator=generator)
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        per_rank = micro_size // world
        for micro in range(micro_batches):
            xs, ys = x[micro * micro_size : (micro + 1) * micro_size], y[micro * micro_size : (micro + 1) * micro_size]
            (F.mse_loss(reference(xs), ys) / micro_batches).backward()
            local = slice(rank * per_rank, (rank + 1) * per_rank)
            (F.mse_loss(sharded(xs[local]), ys[local]) / micro_batches).backward()
        grad_errors.append(_relative_errors(sharded, reference, grads=True))
        branch_grad_none.append([p.grad is None for n, p in sharded.named_parameters() if n.startswith("branch.")])
        ref_opt.step()
        opt.step()
        with torch.no_grad():
            probe = torch.randn(3, 5, generator=generator)
            eval_diffs.append((sharded(probe) - reference(probe)).abs().max().item())
    out.update(grad_errors=grad_errors, branch_grad_none=branch_grad_none, eval_diffs=eval_diffs)
    out["weight_errors"] = _full_weight_errors(sharded, reference)
    with fsdpkit.full_params(sharded):
        out["full_shapes_ok"] = all(p.shape == r.shape for p, r in zip(sharded.parameters(), reference.parameters(), strict=True))
    out["after_full_params_dims"] = sorted({p.dim() for p in sharded.parameters()})
    return out


def gpt_worker(steps: int) -> dict[str, dict]:
    """The GPT trained with one unit per block, and with the default bucket (its blocks, a few
    KB each, are far under it), each beside its own reference."""
    return {"per_block": _gpt_run(steps, bucket_bytes=0), "default": _gpt_run(steps)}


def _gpt_run(steps: int, **options) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=18)
    reference = GPT(config)
    sharded = fsdpkit.shard(copy.deepcopy(reference), wrap=(Block,), **options)
    out = {"unit_names": [unit.name for unit in get_state(sharded).units], "names": [n for n, _ in sharded.named_parameters()]}
    ref_opt = torch.optim.AdamW(fsdpkit.param_groups(reference, weight_decay=0.1), lr=3e-3)
    opt = torch.optim.AdamW(fsdpkit.param_groups(sharded, weight_decay=0.1), lr=3e-3)
    generator = torch.Generator().manual_seed(2)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, config.vocab_size, (4, 17), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        per_rank = 4 // world
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = F.cross_entropy(sharded(inputs[local]).flatten(0, 1), targets[local].flatten())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((ref_loss.item(), total.item() / world))
        if step == 0:
            out["grad_errors"] = _relative_errors(sharded, reference, grads=True)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    out["losses"] = losses
    out["weight_errors"] = _full_weight_errors(sharded, reference)
    with fsdpkit.full_params(sharded):
        out["tied"] = sharded.lm_head.weight is sharded.wte.weight
    return out


def equivalence_worker(edge_steps: int, gpt_steps: int) -> tuple[dict, dict[str, dict]]:
    """The edge cases and the GPT runs in one launch."""
    return edge_case_worker(edge_steps), gpt_worker(gpt_steps)


@pytest.fixture(scope="module", params=[1, 2, 4])
def world_results(request):
    world = request.param
    results = run_distributed(equivalence_worker, world, 4, 3)
    edge = {rank: result[0] for rank, result in results.items()}
    gpt = {rank: result[1] for rank, result in results.items()}
    return world, edge, gpt


def test_edge_cases_match_reference(world_results):
    world, edge, _ = world_results
    result = edge[0]
    assert result["names"] and result["keys"] and result["shapes_ok"]
    assert result["fragment_dims"] == [1]
    if world == 4:
        # the one-element unit pads to 4: ranks 1..3 hold only padding
        assert 1 in result["unit_numels"] and min(result["chunk_sizes"]) == 1
        assert any(n % world for n in result["unit_numels"])
    for step, errors in enumerate(result["grad_errors"]):
        bad = {name: e for name, e in errors.items() if e > TOL and not (name.startswith("branch.") and step % 2)}
        assert not bad, f"world {world} step {step}: gradient mismatch {bad}"
    for step, flags in enumerate(result["branch_grad_none"]):
        assert all(flags) == (step % 2 == 1), f"step {step}: branch grads None flags {flags}"
    assert max(result["eval_diffs"]) < 1e-5
    assert max(result["weight_errors"].values()) < 1e-4, result["weight_errors"]
    assert result["full_shapes_ok"] and result["after_full_params_dims"] == [1]
    assert all(edge[rank]["weight_errors"] == result["weight_errors"] for rank in edge)


def test_gpt_with_tied_weights_matches_reference(world_results):
    _, _, gpt = world_results
    result = gpt[0]["per_block"]
    assert result["unit_names"] == ["", "h.0", "h.1"]
    _assert_gpt_matches_reference(result)


def test_gpt_by_default_merges_its_small_blocks_and_matches_reference(world_results):
    _, _, gpt = world_results
    result = gpt[0]["default"]
    assert result["unit_names"] == ["", "h.0+h.1"]  # both blocks in one bucket, the root never merged
    _assert_gpt_matches_reference(result)


def _assert_gpt_matches_reference(result: dict) -> None:
    assert "lm_head.weight" not in result["names"] and "wte.weight" in result["names"]
    assert max(result["grad_errors"].values()) < TOL, result["grad_errors"]
    for ref_loss, loss in result["losses"]:
        assert abs(ref_loss - loss) / ref_loss < 1e-5
    assert max(result["weight_errors"].values()) < 1e-4, result["weight_errors"]
    assert result["tied"]
