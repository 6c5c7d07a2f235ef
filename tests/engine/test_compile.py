"""`compile`: each block through torch.compile, the engine's hooks outside it. In one launch
(world size 2): torch compiled a graph and ran compiled code for every block in each forward
and backward (its profiler's "Torch-Compiled Region" and "CompiledFunction" records, which an
eager forward never makes), inductor wrote its code only under TORCHINDUCTOR_CACHE_DIR; the
same 20 steps eager and compiled give losses within 1e-3 relative, and their checkpoints hold
the same tensors under the same names and layout, each loading into the other's model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.distributed import run_distributed

import fsdpkit
from fsdpkit.models.gpt import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 20


def _step(model, optimizer, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))[rank * 2 : (rank + 1) * 2]
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _compiled_runs(model, optimizer) -> dict[str, int]:
    """How many times one training step ran compiled code, by the profiler's record names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _step(model, optimizer, STEPS)
    names = [event.name for event in profile.events()]
    return {
        "forward": sum(name.startswith("Torch-Compiled Region") for name in names),
        "backward": sum(name == "CompiledFunctionBackward" for name in names),
    }


def _train(compile: bool, directory: Path) -> dict:
    torch.manual_seed(0)
    model = fsdpkit.shard(GPT(CONFIG), wrap=(Block,), compile=compile, bucket_bytes=0)
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=3e-3)
    losses = [_step(model, optimizer, step) for step in range(STEPS)]
    fsdpkit.Checkpointer(model, optimizer).save(directory, step=STEPS)
    return {"losses": losses, "model": model, "optimizer": optimizer, "state": fsdpkit.full_state_dict(model)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _worker(root: str) -> dict:
    from torch._dynamo.utils import counters

    eager = _train(False, Path(root) / "eager")
    graphs_after_eager = counters["stats"]["unique_graphs"]
    compiled = _train(True, Path(root) / "compiled")
    # each checkpoint loads into the other run's model
    fsdpkit.Checkpointer(compiled["model"], compiled["optimizer"]).load(Path(root) / "eager")
    fsdpkit.Checkpointer(eager["model"], eager["optimizer"]).load(Path(root) / "compiled")
    return {
        "eager": eager["losses"],
        "compiled": compiled["losses"],
        "runs_differ": not _equal(eager["state"], compiled["state"]),
        "compiled_reads_eager": _equal(fsdpkit.full_state_dict(compiled["model"]), eager["state"]),
        "eager_reads_compiled": _equal(fsdpkit.full_state_dict(eager["model"]), compiled["state"]),
        "graphs": {"eager": graphs_after_eager, "compiled": counters["stats"]["unique_graphs"] - graphs_after_eager},
        "eager_runs": _compiled_runs(eager["model"], eager["optimizer"]),
        "compiled_runs": _compiled_runs(compiled["model"], compiled["optimizer"]),
    }


def _tensors_and_placement(directory: Path) -> tuple[list, dict]:
    step_dir = next(p for p in directory.iterdir() if p.name.startswith("step-"))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return manifest["tensors"], manifest["placement"]


def test_compiled_blocks_train_as_eager_and_save_the_same_checkpoint(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    result = run_distributed(_worker, 2, str(tmp_path / "runs"))[0]
    assert result["graphs"]["eager"] == 0 and result["graphs"]["compiled"] >= 1, result["graphs"]
    assert result["eager_runs"] == {"forward": 0, "backward": 0}
    assert result["compiled_runs"] == {"forward": CONFIG.n_layer, "backward": CONFIG.n_layer}, result["compiled_runs"]
    assert any(path.suffix == ".py" for path in cache.rglob("*")), "inductor wrote no code under TORCHINDUCTOR_CACHE_DIR"
    for eager, compiled in zip(result["eager"], result["compiled"], strict=True):
        assert abs(compiled - eager) <= 1e-3 * abs(eager), (result["eager"], result["compiled"])
    assert result["eager"][-1] < result["eager"][0]
    assert result["runs_differ"]  # else a load that did nothing would pass the two below
    assert result["compiled_reads_eager"]
    assert result["eager_reads_compiled"]
    assert _tensors_and_placement(tmp_path / "runs" / "eager") == _tensors_and_placement(tmp_path / "runs" / "compiled")
