"""Every sharding strategy at world sizes 2 and 4 against an unsharded reference: losses,
weights and the clipped global gradient norm; and the collectives each strategy issues per
step, counted (N units: forward all-gathers N, backward re-gathers N-1 non-root units
unless parameters stay unsharded, one reduction per unit, one small all-reduce that
agrees which parameters got a gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.distributed import run_distributed

import fsdpkit
from fsdpkit.dist.comm import CommStats
from fsdpkit.models.gpt import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=18)
STEPS = 3


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(100 + step))


def reference_run() -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=3e-3)
    losses, norms = [], []
    for step in range(STEPS):
        tokens = _batch(step)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


def strategies_worker(strategies: list[tuple[str, int | None]]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for strategy, group_size in strategies:
        torch.manual_seed(0)
        stats = CommStats()
        model = fsdpkit.shard(GPT(CONFIG), wrap=(Block,), strategy=strategy, shard_group_size=group_size, comm_stats=stats)
        optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=3e-3)
        losses, norms, counts = [], [], []
        for step in range(STEPS):
            tokens = _batch(step)
            rows = 4 // world
            local = tokens[rank * rows : (rank + 1) * rows]
            stats.reset()
            loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
            loss.backward()
            counts.append(dict(stats.calls))
            norms.append(fsdpkit.clip_grad_norm_(model, 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        results[strategy] = {
            "losses": losses,
            "norms": norms,
            "counts": counts,
            "weights": fsdpkit.full_state_dict(model),
            "units": len(fsdpkit.engine.sharded.get_state(model).units),
        }
    return results


# Per training step, N units. Resharding strategies gather each non-root unit again for
# backward, except (from the second step on, once the forward order is known) the last unit
# of the forward, which backward needs first and which therefore stays gathered.
EXPECTED_CALLS = {
    "full": lambda n, step: {"all_gather": 2 * n - (1 if step == 0 else 2), "reduce_scatter": n, "all_reduce": 1},
    "grad-op": lambda n, step: {"all_gather": n, "reduce_scatter": n, "all_reduce": 1},
    "none": lambda n, step: {"all_reduce": n + 1},
    "hybrid": lambda n, step: {"all_gather": 2 * n - (1 if step == 0 else 2), "reduce_scatter": n, "all_reduce": n + 1},
}


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize(
    "world_size, strategies",
    [
        (2, [("full", None), ("grad-op", None), ("none", None)]),
        (4, [("full", None), ("grad-op", None), ("none", None), ("hybrid", 2)]),
    ],
)
def test_strategies_match_reference_and_issue_the_papers_collectives(world_size, strategies, reference):
    results = run_distributed(strategies_worker, world_size, strategies)[0]
    for strategy, _ in strategies:
        result = results[strategy]
        for mine, ref in zip(result["losses"], reference["losses"], strict=True):
            assert abs(mine - ref) / ref < 1e-5, (strategy, result["losses"], reference["losses"])
        for mine, ref in zip(result["norms"], reference["norms"], strict=True):
            assert abs(mine - ref) / ref < 1e-5, (strategy, "grad norm", result["norms"], reference["norms"])
        for name, ref in reference["weights"].items():
            error = ((result["weights"][name] - ref).norm() / ref.norm()).item()
            assert error < 1e-4, (strategy, name, error)
        expected = [EXPECTED_CALLS[strategy](result["units"], step) for step in range(len(result["counts"]))]
        assert result["counts"] == expected, (strategy, result["counts"], expected)
