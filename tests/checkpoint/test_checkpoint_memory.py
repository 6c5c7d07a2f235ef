"""Peak resident memory of convert and reshard stays under 300 MB on a checkpoint larger than
that (bounded by --chunk-size plus a constant, no whole tensor, no whole model), at
the default --chunk-size, and these commands never import torch (which alone costs ~220 MB)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from support.checkpoint_files import save_checkpoint

from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.flat_layout import ElementRange

LIMIT_BYTES = 300 * 1024 * 1024


# VmHWM, the peak RSS of the process's own address space (reset by exec, unlike ru_maxrss,
# which would count the pytest process the child was forked from), and whether torch was loaded
PEAK = """
import sys
try:
    from fsdpkit_cli.app import main
    main()
finally:
    status = open("/proc/self/status").read()
    print("VmHWM", status.split("VmHWM:")[1].split()[0], "torch" in sys.modules, file=sys.stderr)
"""


def _peak_rss(*args: str) -> int:
    """Run `fsdpkit ARGS` in a fresh process; its peak RSS in bytes (asserting torch stayed out)."""
    proc = subprocess.run([sys.executable, "-c", PEAK, *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    last = proc.stderr.strip().splitlines()[-1].split()
    assert last[0] == "VmHWM"
    assert last[2] == "False", f"fsdpkit {args[0]} imported torch"
    return int(last[1]) * 1024


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 352 MiB W=2 checkpoint whose largest tensor (256 MiB) is larger than the whole budget's
    non-torch share, with a unit that spans both ranks."""
    root = tmp_path_factory.mktemp("big")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "big.weight": torch.randn(8192, 8192, generator=g),
        "mid.weight": torch.randn(4096, 6144, generator=g),
        "small.bias": torch.randn(1000, generator=g),
        "ids": torch.arange(1000),
    }
    save_checkpoint(root / "run", 1, tensors, world_size=2, units=[["big.weight"], ["mid.weight", "small.bias"]])
    assert sum(p.stat().st_size for p in (root / "run" / "step-00000001").iterdir()) > 350 * 2**20
    return root, tensors


def test_convert_and_reshard_stay_under_300_mb(big):
    root, tensors = big
    rss = {
        "convert": _peak_rss("convert", root / "run", root / "full", "--to", "full"),
        "reshard": _peak_rss("reshard", root / "run", root / "r3", "--world-size", "3"),
        "convert-bf16": _peak_rss("convert", root / "run", root / "bf16", "--to", "full", "--dtype", "bf16"),
        "convert-sharded": _peak_rss("convert", root / "full", root / "s2", "--to", "sharded", "--world-size", "2"),
        "convert-64M": _peak_rss("convert", root / "run", root / "full64", "--to", "full", "--chunk-size", "64M"),
        "verify": _peak_rss("verify", root / "r3"),
        "inspect": _peak_rss("inspect", root / "run"),
    }
    print({k: f"{v / 2**20:.0f} MiB" for k, v in rss.items()})
    assert all(v < LIMIT_BYTES for v in rss.values()), rss
    with safe_open(root / "full" / "model.safetensors", framework="pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
    with safe_open(root / "bf16" / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_slice("big.weight")[4000:4100], tensors["big.weight"][4000:4100].to(torch.bfloat16))
        assert torch.equal(f.get_tensor("ids"), tensors["ids"])
    reader = CheckpointReader(root / "r3")
    flat = tensors["mid.weight"].reshape(-1)
    piece = ElementRange(10_000_000, 10_100_000)
    assert torch.equal(reader.read_range("mid.weight", piece), flat[piece.start : piece.end])
    assert torch.equal(reader.read_tensor("ids"), tensors["ids"])


def test_deepspeed_output_sums_a_large_storage_without_holding_it(big, tmp_path):
    """`--to deepspeed` sums the CRC-32 of a 256 MiB storage the kernel copied from the source's
    page cache a window at a time: peak RSS stays far below the storage (pages mapped count as
    resident), and zipfile finds every CRC-32 right."""
    import zipfile

    from safetensors.torch import save_file

    _, tensors = big
    source = tmp_path / "src"
    source.mkdir()
    save_file({"big.weight": tensors["big.weight"], "small.bias": tensors["small.bias"]}, source / "model.safetensors")
    moments = {f"optim.{kind}.small.bias": tensors["small.bias"].abs() for kind in ("exp_avg", "exp_avg_sq")}
    save_file(moments, source / "optim.safetensors")  # only small.bias trains: big.weight is a frozen parameter, stored whole
    index = {"metadata": {}, "weight_map": {"big.weight": "model.safetensors", "small.bias": "model.safetensors"}}
    index["weight_map"] |= dict.fromkeys(moments, "optim.safetensors")
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    peak = _peak_rss("convert", source, tmp_path / "ds", "--to", "deepspeed", "--stage", "3", "--world-size", "1")
    assert peak < 128 * 2**20, f"{peak / 2**20:.0f} MiB"
    files = sorted((tmp_path / "ds").glob("*/*.pt"))
    assert max(path.stat().st_size for path in files) > 256 * 2**20
    for path in files:
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path
