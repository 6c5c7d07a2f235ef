"""The malicious Megatron checkpoints are armed: loading each poisoned file with an unrestricted
unpickler runs its payload (creates the sentinel), so a reader's refusal test that finds no
sentinel proves the reader refused, not that the kit was harmless."""

import pickle

import pytest
import torch
from support.megatron_malicious import PAYLOADS, poison


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("target", [".metadata", "common.pt", "shard"])
def test_poisoned_file_runs_code_when_unpickled_unsafely(tmp_path, target, payload):
    sentinel = tmp_path / "ran"
    checkpoint = poison(tmp_path / "ckpt", target, sentinel, payload)
    if target == ".metadata":
        poisoned = checkpoint / ".metadata"
        assert not sentinel.exists()
        pickle.loads(poisoned.read_bytes())
    else:
        poisoned = checkpoint / "common.pt" if target == "common.pt" else sorted(checkpoint.glob("*/shard_*_*.pt"))[0]
        assert not sentinel.exists()
        torch.load(poisoned, weights_only=False)
    assert sentinel.exists()
    assert (checkpoint / "metadata.json").exists()
