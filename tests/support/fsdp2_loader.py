"""FSDP2 (2 gloo ranks, CPU) on the DeepSpeed tests' Llama, in one launch: loads DCP
checkpoints with torch's own `dcp.load` and `set_state_dict` in both of `get_state_dict`'s
optimizer layouts and gives back what it holds, and saves per-rank `torch.save` state dicts
of DTensors as verl's FSDP checkpoint manager writes them (FSDP1's too, in the same launch)."""

from __future__ import annotations

import os

SETTINGS = ("lr", "betas", "eps", "weight_decay")


def sharded_llama(tied: bool):  # type: ignore[no-untyped-def]
    """The DeepSpeed worker's Llama (frozen final norm) under fully_shard, with AdamW over its
    two groups at settings a checkpoint must replace."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from .deepspeed_worker import _model

    model = _model(tied)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" in n]
    groups = [{"params": decay, "weight_decay": 0.3}, {"params": no_decay, "weight_decay": 0.3}]
    return model, torch.optim.AdamW(groups, lr=0.5, betas=(0.5, 0.5), eps=0.5)


def _full(model, optimizer) -> dict:  # type: ignore[no-untyped-def]
    """The whole model and optimizer state (rank 0; {} elsewhere): `optim.<state>.<fqn>` tensors, the groups' settings."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not optim_sd:  # only rank 0 holds the whole state
        return {}
    tensors = {name: t.clone() for name, t in model_sd.items()}
    for fqn, values in optim_sd["state"].items():
        tensors.update({f"optim.{key}.{fqn}": value.clone() for key, value in values.items()})
    return {"tensors": tensors, "param_groups": [{k: group[k] for k in SETTINGS} for group in optimizer.param_groups]}


def load_dcp(checkpoints: dict[str, tuple[str, bool]]) -> dict:
    """{name: (DCP directory, tied)} -> {name: {flatten: what the loaded model and optimizer hold}}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    out: dict = {}
    for name, (directory, tied) in checkpoints.items():
        for flatten in (False, True):
            model, optimizer = sharded_llama(tied)
            options = StateDictOptions(flatten_optimizer_state_dict=flatten)
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            state = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(state, checkpoint_id=directory)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
            out.setdefault(name, {})[flatten] = _full(model, optimizer)
    return out


def save_verl(directory: str, dcp_directory: str) -> dict:
    """The Llama's weights loaded from `dcp_directory`, trained one step by AdamW over
    `model.parameters()` in one group (verl's optimizer), saved as verl does: per rank,
    torch.save of the model's and the optimizer's state dicts (DTensors) and an extra state;
    what was saved, whole (FSDP2's own full state dicts)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from .verl_fsdp1 import train_step

    model, _ = sharded_llama(False)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=dcp_directory)
    set_model_state_dict(model, state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer)
    write_verl(directory, model, optimizer)
    return _full(model, optimizer)


def write_verl(directory: str, model, optimizer) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(directory, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(optimizer.state_dict(), os.path.join(directory, f"optim_world_size_{world}_rank_{rank}.pt"))
    import random

    import numpy as np

    # verl's: the LR scheduler's state dict and the RNG states (a GPU's too, where there is one)
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    extra = {"lr_scheduler": {"last_epoch": 3, "base_lrs": [1e-2], "_step_count": 4}, "rng": rng}
    torch.save(extra, os.path.join(directory, f"extra_state_world_size_{world}_rank_{rank}.pt"))


def fsdp2_checks(dcp_checkpoints: dict[str, tuple[str, bool]], verl_root: str) -> dict:
    """Every FSDP2 check of the DeepSpeed tests, and verl's files under FSDP2 (`verl_root/fsdp2`)
    and FSDP1 (`verl_root/fsdp1`, and a ShardedTensor split by columns in `verl_root/columns`),
    in one launch."""
    from .verl_fsdp1 import save_column_shards, save_verl_fsdp1

    first = next(iter(dcp_checkpoints.values()))[0]
    out = {"dcp": load_dcp(dcp_checkpoints), "verl": save_verl(os.path.join(verl_root, "fsdp2"), first)}
    out["verl_fsdp1"] = save_verl_fsdp1(os.path.join(verl_root, "fsdp1"))
    save_column_shards(os.path.join(verl_root, "columns"))
    return out
