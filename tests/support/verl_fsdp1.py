"""verl's per-rank files under torch FSDP1 (2 gloo ranks, CPU), for the per-rank torch.save
tests: the DeepSpeed tests' Llama (all parameters trainable: FSDP1's flat parameters take one
requires_grad each) wrapped per decoder layer, trained one step with AdamW, saved as verl's
FSDP checkpoint manager does (`model.state_dict()` and `optimizer.state_dict()` under
SHARDED_STATE_DICT: ShardedTensors of whole-row chunks), and FSDP1's own FULL_STATE_DICT.
verl's `offload_to_cpu=True` is left off: the model is on the CPU already, and on CPU with it
FSDP1's next state dict failed (a parameter's storage freed)."""

from __future__ import annotations

import os


def _fsdp1_llama():  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from .deepspeed_worker import llama_config

    torch.manual_seed(0)
    policy = ModuleWrapPolicy({LlamaDecoderLayer})
    return FullyShardedDataParallel(LlamaForCausalLM(llama_config()), auto_wrap_policy=policy, device_id=torch.device("cpu"))


def train_step(model, optimizer) -> None:  # type: ignore[no-untyped-def]
    """One AdamW step on a batch of this rank's own (so the moments are not zero)."""
    import torch
    import torch.distributed as dist

    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def save_verl_fsdp1(directory: str) -> dict:
    """The per-rank files in `directory`; rank 0 gives FSDP1's own full state dict, {} elsewhere."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _fsdp1_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        full = model.state_dict()
    sharded = (ShardedStateDictConfig(offload_to_cpu=False), ShardedOptimStateDictConfig(offload_to_cpu=False))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, *sharded):
        torch.save(model.state_dict(), os.path.join(directory, f"model_world_size_{world}_rank_{rank}.pt"))
        torch.save(optimizer.state_dict(), os.path.join(directory, f"optim_world_size_{world}_rank_{rank}.pt"))
    return {name: tensor.clone() for name, tensor in full.items()} if rank == 0 else {}


def save_column_shards(directory: str) -> None:
    """A ShardedTensor split by columns (rank R holds columns 3R..3R+2 of a 4x6 tensor), which
    is no block of whole rows, saved per rank as verl's files are."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.full((4, 3), float(rank))
    shard = Shard(local, ShardMetadata([0, 3 * rank], [4, 3], f"rank:{rank}/cpu"))
    os.makedirs(directory, exist_ok=True)
    torch.save({"w": init_from_local_shards([shard], [4, 3 * world])}, os.path.join(directory, f"model_world_size_{world}_rank_{rank}.pt"))
