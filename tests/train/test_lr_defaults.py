"""Each built-in model's default peak learning rate and warm-up: resolved from the model's
registry entry into the config (so a checkpoint records what the run used), overridden by
--lr / --warmup-steps; at gpt2-large's width (one block, on CPU) the default learning rate
lowers the loss where the old default, 3e-3, makes it rise."""

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


def _losses(config: TrainConfig) -> list[float]:
    """gpt2-large's width and heads (1,280, 20), one block, the byte vocabulary (the width is what
    decides whether a learning rate diverges; the 50,257-way head would be most of the cost), on
    real text read as bytes, trained by the unsharded reference loop with the config's learning
    rate and warm-up."""
    torch.set_num_threads(1)
    shape = dataclasses.replace(GPT_CONFIGS["gpt2-large"], n_layer=1, vocab_size=256)
    torch.manual_seed(config.seed)
    data = TokenSource(str(TEXT), vocab_size=shape.vocab_size, seq_len=config.data.seq_len, seed=config.seed)
    return train_unsharded(GPT(shape), lambda model, ids: model(ids), data, config)["losses"]


def test_gpt2_large_width_learns_at_its_default_and_diverges_at_the_old_3e_3():
    """The first 8 steps of 4 x 32 tokens: at the default flags (2.5e-4, 10 warm-up steps) the
    loss never rises above its start and falls by more than 1.5; at the old default (3e-3, no
    warm-up) it rises more than 1 above its start, as gpt2-large did on a GPU."""
    data = DataConfig(seq_len=32, global_batch_size=4)
    default = TrainConfig(model=ModelConfig(name="gpt2-large"), data=data, steps=8)
    old = dataclasses.replace(default, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0))
    learns, diverges = _losses(default), _losses(old)
    assert learns[0] == diverges[0]  # the same start
    assert max(learns[1:]) < learns[0] and sum(learns[-3:]) / 3 < learns[0] - 1.5, learns
    assert max(diverges[1:]) > diverges[0] + 1, diverges
