"""The Megatron oracle works: megatron-core writes a `torch_dist` checkpoint of a tiny model at
TP=2 PP=2 on CPU and its own `dist_checkpointing.load` of it, into a model built from another
seed, gives the same logits as the model that was saved (the save and the load in one launch)."""

import os

import torch


def test_megatron_saves_and_loads_its_own_checkpoint(tmp_path):
    from support import megatron_oracle

    model_shape = megatron_oracle.shape("qwen2", num_layers=2)
    tokens = torch.randint(0, model_shape.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    saved, loaded = megatron_oracle.save_then_load_logits(str(tmp_path), model_shape, tokens, seed=3)
    names = os.listdir(tmp_path)
    assert {".metadata", "metadata.json", "common.pt"} <= set(names)
    assert sorted(n for n in names if n.endswith(".distcp")) == [f"__{r}_{i}.distcp" for r in range(4) for i in range(2)]
    assert saved is not None and saved.shape == (2, 8, model_shape.vocab_size)
    assert torch.equal(loaded, saved)
