"""Malicious Megatron checkpoints for the reader's refusal tests: a copy of a real committed fixture
in which one pickled file is replaced by a pickle that would run code when unpickled (it would
create `sentinel`). A reader must refuse such a checkpoint (exit 3) and the sentinel must not exist
afterwards.

    path = poison(tmp_path / "ckpt", ".metadata", tmp_path / "ran")

Targets:
- ".metadata": DCP's metadata pickle (torch_dist), a plain pickle.
- "common.pt": the common state (torch.save zip; the payload sits where `args` would be).
- "shard": a legacy zarr checkpoint's `<key>/shard_<i>_<n>.pt` ShardedObject file (torch.save zip).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron"
BASE = {".metadata": "mcore_0_16_torch_dist", "common.pt": "mcore_0_16_torch_dist", "shard": "mcore_0_15_zarr"}
PAYLOADS = ("os.system", "builtins.exec")


class _RunsOnLoad:
    """Unpickling this calls `payload` (a shell command or Python source creating the sentinel)."""

    def __init__(self, payload: str, sentinel: Path) -> None:
        self.payload = payload
        self.sentinel = sentinel

    def __reduce__(self):  # type: ignore[no-untyped-def]
        if self.payload == "os.system":
            return (os.system, (f"touch '{self.sentinel}'",))
        if self.payload == "builtins.exec":
            return (exec, (f"open({str(self.sentinel)!r}, 'w').close()",))
        raise ValueError(f"payload {self.payload!r} is not one of {PAYLOADS}")


def poison(destination: Path, target: str, sentinel: Path, payload: str = "os.system") -> Path:
    """Copy the base fixture's checkpoint for `target` to `destination`, replace that file by a
    malicious pickle and return the checkpoint directory (`destination`)."""
    if target not in BASE:
        raise ValueError(f"target {target!r} is not one of {tuple(BASE)}")
    shutil.copytree(FIXTURES / BASE[target] / "checkpoint", destination)
    evil = _RunsOnLoad(payload, sentinel)
    if target == ".metadata":
        (destination / ".metadata").write_bytes(pickle.dumps(evil, protocol=2))
    elif target == "common.pt":
        torch.save({"args": evil, "checkpoint_version": 3.0, "iteration": 1}, destination / "common.pt")
    else:
        shard = sorted(destination.glob("*/shard_*_*.pt"))[0]
        torch.save(evil, shard)
    return destination
