"""Format-1 checkpoints (written before format 2) still load, verify, inspect, convert and
reshard; what they become is format 2. The v1 files come from a generator in the tests
(`tests/support/checkpoint_v1.py`), compared with the tensors they were made from."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from support.checkpoint_files import SAMPLE_UNITS, run_cli, sample_buffers, sample_optimizer, sample_tensors
from support.checkpoint_v1 import write_v1

from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.flat_layout import ElementRange


def test_v1_checkpoints_load_verify_convert_and_reshard(tmp_path):
    params = sample_tensors()
    tensors = {**params, **sample_buffers(), **sample_optimizer(params)}
    state = {"step": 4, "per_rank": [1, 2]}
    flat = write_v1(
        tmp_path / "flat" / "step-00000004",
        tensors,
        world_size=2,
        units=SAMPLE_UNITS,
        training_state=state,
        aliases={"lm_head.weight": "wte.weight"},
    )
    even = write_v1(tmp_path / "even" / "step-00000004", tensors, world_size=3, units=None, training_state=state)
    for step_dir in (flat, even):
        reader = CheckpointReader(step_dir)
        assert reader.manifest.version == 1 and reader.manifest.strategy == "full"  # old spelling "full_shard" read as "full"
        for name, tensor in tensors.items():
            assert torch.equal(reader.read_tensor(name), tensor), name
        assert torch.equal(reader.read_range("wte.weight", ElementRange(30, 101)), tensors["wte.weight"].reshape(-1)[30:101])
        assert run_cli("verify", step_dir).exit_code == 0
        summary = json.loads(run_cli("inspect", step_dir, "--json").stdout)
        assert summary["version"] == 1 and len(summary["files"]) == reader.manifest.shard_factor
        out = tmp_path / f"{step_dir.parent.name}-full"
        assert run_cli("convert", step_dir, out, "--to", "full", "--with-optimizer").exit_code == 0
        loaded = {**load_file(out / "model.safetensors"), **load_file(out / "optimizer.safetensors")}
        assert set(loaded) == set(tensors) and all(torch.equal(loaded[n], t) for n, t in tensors.items())
        resharded = tmp_path / f"{step_dir.parent.name}-r5"
        result = run_cli("reshard", step_dir, resharded, "--world-size", "5", "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["warnings"]  # per_rank state dropped
        assert json.loads((resharded / "manifest.json").read_text())["version"] == 2
        assert run_cli("verify", resharded).exit_code == 0
        new = CheckpointReader(resharded)
        assert new.manifest.placement == reader.manifest.placement and new.aliases == reader.aliases
        for name, tensor in tensors.items():
            assert torch.equal(new.read_tensor(name), tensor), name
