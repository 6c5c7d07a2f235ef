"""fsdpkit.save / fsdpkit.load from Python: an optimizer that never stepped some parameters
(or any), saved at one world size and loaded strictly at another, restores exactly the
state it had: compared with the unsharded reference's own AdamW state. In the same launches,
async saves: taken before save() returns, into host buffers the next save reuses, bitwise
equal to a synchronous save."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.distributed import run_distributed
from support.models import EdgeCaseNet

import fsdpkit
from fsdpkit.checkpoint.format.verify import summarize
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.engine.view import describe
from fsdpkit.errors import RunError


def _step(model, optimizer, x, y) -> None:
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def save_worker(directory: str) -> str:
    torch.manual_seed(0)
    model = EdgeCaseNet()
    model.use_branch = False  # the branch never gets a gradient: AdamW keeps no state for it
    model = fsdpkit.shard(model)
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-2)
    fsdpkit.save(model, optimizer, directory + "/never-stepped", step=0)
    generator = torch.Generator().manual_seed(3)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(2):
        x, y = torch.randn(4, 5, generator=generator), torch.randn(4, 2, generator=generator)
        rows = 4 // world
        _step(model, optimizer, x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
    fsdpkit.save(model, optimizer, directory + "/stepped", step=2)
    reused = async_saves(model, optimizer, directory + "/async")
    # disk full on the last rank while saving step 3: every rank gets the error, step 2 stays
    original = os.write
    if rank == world - 1:
        os.write = lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    try:
        fsdpkit.save(model, optimizer, directory + "/stepped", step=3)
        return {"failure": "saved", "reused": reused}
    except RunError as error:
        return {"failure": str(error), "reused": reused}
    finally:
        os.write = original


def async_saves(model, optimizer, run_dir: str) -> bool:
    """Step 2 as it is, then step 3 with every weight + 1: each save's weights change at once
    after save() returns (the snapshot must not see that), and step 3's save is asked for with
    step 2's maybe still in flight (save() must wait for it before reusing the buffers). True
    when both saves used the host buffers the Checkpointer allocated when it was made, and a
    third, whose write fails in the background, is the error of the next wait()."""
    saver = fsdpkit.Checkpointer(model, optimizer, async_save=True)
    shards = [param.tensor for unit in describe(model).units for param in unit.params]
    pointers = [{dtype: buffer.data_ptr() for dtype, buffer in saver.host_buffers.buffers.items()}]
    for step in (2, 3):
        saver.save(run_dir, step=step)
        with torch.no_grad():
            for shard in shards:
                shard.add_(1.0)
        pointers.append({dtype: buffer.data_ptr() for dtype, buffer in saver.host_buffers.buffers.items()})
    saver.wait()
    reused = bool(pointers[0]) and pointers[0] == pointers[1] == pointers[2] and saver.timings.saves == 2 and saver.stall_seconds > 0
    # the disk fills while step 4 is written in the background: wait() raises it on every rank
    original = os.write
    if dist.get_rank() == dist.get_world_size() - 1:
        os.write = lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    try:
        saver.save(run_dir, step=4)
        saver.wait()
        return False
    except RunError as error:
        return reused and str(error).startswith("checkpoint step 4 not saved, previous checkpoint kept: ")
    finally:
        os.write = original


def load_worker(directory: str) -> dict:
    torch.manual_seed(1)
    model = EdgeCaseNet()
    model.use_branch = False
    model = fsdpkit.shard(model)
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-2)
    fsdpkit.load(model, optimizer, directory + "/never-stepped")
    empty_after_first = len(optimizer.state) == 0
    resumed = fsdpkit.load(model, optimizer, directory + "/stepped")
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for unit in describe(model).units:
        for param in unit.params:
            if param.tensor in optimizer.state:
                st = optimizer.state[param.tensor]
                state[names[id(param.tensor)]] = (param.fragment.param_range.start, st["exp_avg"].clone(), float(st["step"]))
    return {"empty": empty_after_first, "resumed_step": resumed.get("step"), "weights": fsdpkit.full_state_dict(model), "state": state}


def reference() -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = EdgeCaseNet()
    model.use_branch = False
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        _step(model, optimizer, torch.randn(4, 5, generator=generator), torch.randn(4, 2, generator=generator))
    names = {id(p): n for n, p in model.named_parameters()}
    return model.state_dict(), {names[id(p)]: s for p, s in optimizer.state.items()}


@pytest.mark.parametrize("save_world, load_world", [(2, 4), (4, 1)])
def test_save_at_one_world_size_load_strictly_at_another(tmp_path, save_world, load_world):
    saved = run_distributed(save_worker, save_world, str(tmp_path))
    last = f"rank-{save_world - 1:05d}-of-{save_world:05d}.safetensors"
    assert all(result["reused"] for result in saved.values())
    for rank, message in ((rank, result["failure"]) for rank, result in saved.items()):
        # one line on every rank; the failing one names its file and errno
        assert message.startswith("checkpoint step 3 not saved, previous checkpoint kept: ") and "\n" not in message, message
        assert (last in message and "(ENOSPC)" in message) if rank == save_world - 1 else "another rank" in message
    run = Path(tmp_path) / "stepped"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-00000002"]  # no temporary directory left
    results = run_distributed(load_worker, load_world, str(tmp_path))  # loads step 2: compared with the reference below
    ref_weights, ref_state = reference()
    assert results[0]["empty"]
    # save(..., step=S) records S: a resumed run continues from it, inspect shows it
    assert {result["resumed_step"] for result in results.values()} == {2}
    assert [summarize(Path(tmp_path) / "async" / f"step-0000000{s}").step for s in (2, 3)] == [2, 3]
    assert sorted(p.name for p in (Path(tmp_path) / "async").iterdir()) == ["latest", "step-00000002", "step-00000003"]
    for name, tensor in ref_weights.items():
        assert ((results[0]["weights"][name] - tensor).norm() / tensor.norm()).item() < 1e-5, name
    assert not any(name.startswith("branch.") for name in ref_state)
    seen = set()
    for result in results.values():
        for name, (start, exp_avg, step) in result["state"].items():
            assert not name.startswith("branch.")
            flat = ref_state[name]["exp_avg"].reshape(-1)[start : start + exp_avg.numel()]
            assert torch.allclose(exp_avg, flat, rtol=1e-4, atol=1e-7) and step == 2.0, name
            seen.add(name)
    assert seen == set(ref_state)
    synchronous = tensors(run / "step-00000002")
    first, second = tensors(Path(tmp_path) / "async" / "step-00000002"), tensors(Path(tmp_path) / "async" / "step-00000003")
    params = {name for name, _ in EdgeCaseNet().named_parameters()}
    assert synchronous.keys() == first.keys() == second.keys() and params < synchronous.keys()
    for name, tensor in synchronous.items():
        assert torch.equal(first[name], tensor), name
        assert torch.equal(second[name], tensor + 1.0 if name in params else tensor), name


def tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(step_dir) as reader:
        return {name: reader.read_tensor(name) for name in reader.tensor_names()}
