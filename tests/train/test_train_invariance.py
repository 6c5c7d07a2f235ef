"""World-size invariance of `fsdpkit train`'s loop: the same seed, global batch and data give
the same per-step losses and final weights at world sizes 1, 2 and 4, and both equal an
unsharded single-process reference computed in this test; on synthetic tokens, and on
documents (a jsonl file, packed) at 1 and 4."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
import torch.distributed as dist
from support.distributed import run_distributed
from support.reference import train_unsharded

import fsdpkit
from fsdpkit.models.source import build_model
from fsdpkit.train.config import DataConfig, LrSchedule, OptimizerConfig, TrainConfig
from fsdpkit.train.data import TokenSource
from fsdpkit.train.loop import Trainer

CONFIG = TrainConfig(
    steps=10,
    data=DataConfig(global_batch_size=8, grad_accum=2, seq_len=32),
    optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2, schedule=LrSchedule.COSINE, weight_decay=0.1),
)


def training_worker(config: TrainConfig) -> dict | None:
    trainer = Trainer(config)
    losses = [trainer.train_step() for _ in range(config.steps)]
    weights = fsdpkit.full_state_dict(trainer.model)
    eval_loss = trainer.evaluate()
    return {"losses": losses, "weights": weights, "eval": eval_loss} if dist.get_rank() == 0 else None


def reference_run(config: TrainConfig) -> dict:
    torch.manual_seed(config.seed)
    model = build_model(config.model.name)
    data = TokenSource(config.data.source, vocab_size=model.vocab_size, seq_len=config.data.seq_len, seed=config.seed)
    return train_unsharded(model, lambda model, ids: model(ids), data, config)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Synthetic tokens, and documents: a jsonl file of 300 short texts."""
    path = tmp_path_factory.mktemp("documents") / "corpus.jsonl"
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta"]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 25)))}) + "\n" for _ in range(300)))
    return {"synthetic": CONFIG, "documents": dataclasses.replace(CONFIG, data=dataclasses.replace(CONFIG.data, source=str(path)))}


@pytest.fixture(scope="module")
def references(configs):
    return {data: reference_run(config) for data, config in configs.items()}


@pytest.mark.parametrize(("data", "world_size"), [("synthetic", 1), ("synthetic", 2), ("synthetic", 4), ("documents", 1), ("documents", 4)])
def test_losses_and_weights_match_reference(data, world_size, configs, references):
    reference = references[data]
    result = run_distributed(training_worker, world_size, configs[data])[0]
    for step, (mine, ref) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert abs(mine - ref) / abs(ref) <= 1e-4, f"world {world_size} step {step}: loss {mine} vs reference {ref}"
    assert result["losses"][-1] < result["losses"][0]
    squared_diff = squared_ref = 0.0
    for name, ref in reference["weights"].items():
        mine = result["weights"][name]
        squared_diff += float((mine - ref).pow(2).sum())
        squared_ref += float(ref.pow(2).sum())
        if name.endswith("attn.c_attn.bias"):
            # The key bias's true gradient is exactly zero (softmax is shift-invariant), so
            # AdamW turns its rounding noise into full-size steps: compare the query and
            # value thirds per tensor; the key third counts in the whole-model check below.
            third = ref.numel() // 3
            mine, ref = torch.cat([mine[:third], mine[2 * third :]]), torch.cat([ref[:third], ref[2 * third :]])
        error = ((mine - ref).norm() / ref.norm()).item()
        assert error <= 1e-4, f"world {world_size}: {name} differs by {error:.2e}"
    assert (squared_diff / squared_ref) ** 0.5 <= 1e-4
    assert result["eval"] > 0
