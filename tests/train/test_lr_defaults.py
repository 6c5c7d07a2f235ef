"""Each built-in model's default peak learning rate and warm-up: resolved from the model's
registry entry into the config (so a checkpoint records what the run used), overridden by
--lr / --warmup-steps, and, for every GPT-2 size at reduced width and depth on CPU, a loss
that falls over the first 20 steps at the default flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.reference import train_unsharded

from fsdpkit.models.gpt import GPT
from fsdpkit.models.registry import GPT_CONFIGS
from fsdpkit.train.config import DataConfig, ModelConfig, OptimizerConfig, TrainConfig
from fsdpkit.train.data import TokenSource
from fsdpkit.train.resume import train_config

# The GPT-3 paper's peak learning rates (table 2.1) for the GPT-2 sizes; the small ones keep 3e-3 / 1e-3.
PAPER_LR = {"gpt2": 6e-4, "gpt2-medium": 3e-4, "gpt2-large": 2.5e-4, "gpt2-xl": 2e-4}
TEXT = Path(__file__).resolve().parents[2] / "fsdpkit" / "models" / "gpt.py"  # real text, read as bytes


@pytest.mark.parametrize("name, lr, warmup", [*((n, lr, 10) for n, lr in PAPER_LR.items()), ("gpt-tiny", 3e-3, 0), ("gpt-small", 1e-3, 0)])
def test_defaults_resolve_per_model_and_flags_override_them(name, lr, warmup):
    config = TrainConfig(model=ModelConfig(name=name))
    assert (config.optimizer.lr, config.optimizer.warmup_steps) == (config.peak_lr, config.warmup_steps) == (lr, warmup)
    assert TrainConfig.from_values(config.to_values()) == config  # the config records the values used
    given = TrainConfig(model=ModelConfig(name=name), optimizer=OptimizerConfig(lr=0.01, warmup_steps=3))
    assert (given.peak_lr, given.warmup_steps) == (0.01, 3)
    flags, _ = train_config({"model": {"name": name}, "optimizer": {"lr": 0.0}})
    assert (flags.peak_lr, flags.warmup_steps) == (0.0, warmup)


def test_models_without_an_entry_take_3e_3_without_warm_up():
    config = TrainConfig(model=ModelConfig(name="hf:llama-tiny"))
    assert (config.peak_lr, config.warmup_steps) == (3e-3, 0)


def test_every_gpt2_size_loss_falls_over_20_steps_at_default_flags():
    """Each size at head dimension 4 and a twelfth of its depth, its vocabulary as it is, on
    sequences of 32 tokens (half the default: the 50,257-way output head is most of the cost),
    trained by the unsharded reference loop with the config's learning rate and warm-up. At
    this width 3e-3 trains too: the divergence it causes at full width shows on a GPU."""
    torch.set_num_threads(1)
    for name in PAPER_LR:
        config = TrainConfig(model=ModelConfig(name=name), data=DataConfig(seq_len=32))
        shape = GPT_CONFIGS[name]
        small = dataclasses.replace(shape, n_embd=4 * shape.n_head, n_layer=max(1, shape.n_layer // 12))
        torch.manual_seed(config.seed)
        data = TokenSource(str(TEXT), vocab_size=small.vocab_size, seq_len=config.data.seq_len, seed=config.seed)
        losses = train_unsharded(GPT(small), lambda model, ids: model(ids), data, config)["losses"]
        assert config.steps == 20 and len(losses) == 20
        assert sum(losses[-5:]) / 5 < losses[0] - 0.3, (name, losses)
        assert max(losses[1:]) <= losses[0] + 0.05, (name, losses)
