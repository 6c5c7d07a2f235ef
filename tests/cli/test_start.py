"""What a plain command imports: `fsdpkit inspect` and `verify` of a DCP checkpoint, and
`fsdpkit --help`, import neither torch nor pydantic (Typer's coercion of values no option
needs), nor rich but for help, no spread machinery, no object-store signing, and of the other formats only their table
entries and the files their detection reads; the command's output is the one torch's own
checkpoint calls for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

SCRIPT = """
import json, sys
from fsdpkit_cli.entry import main
sys.argv = ["fsdpkit", *sys.argv[1:]]
try:
    main()
finally:
    sys.stderr.write(json.dumps(sorted(sys.modules)) + "\\n")
"""
NEVER = ("torch", "pydantic", "fsdpkit.checkpoint.spread", "fsdpkit.checkpoint.storage.sigv4")  # packages and modules
OTHER_FORMATS = tuple(f"fsdpkit.checkpoint.{package}." for package in ("megatron", "deepspeed", "torchsave", "format"))
# their table entries, and what detecting a DCP checkpoint reads before DCP's own detection says yes
TABLE_AND_DETECTION = {
    "fsdpkit.checkpoint.megatron.format",
    "fsdpkit.checkpoint.megatron.files",
    "fsdpkit.checkpoint.deepspeed.format",
    "fsdpkit.checkpoint.torchsave.format",
    "fsdpkit.checkpoint.format.format",
    "fsdpkit.checkpoint.format.full_format",
    "fsdpkit.checkpoint.format.names",
}


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("start") / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save without a process group says it assumes one process
        dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(3)}}, checkpoint_id=str(path))
    return path


def _run(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    return done, set(json.loads(done.stderr.splitlines()[-1]))


@pytest.mark.parametrize("command", ["inspect", "verify", "--help"])
def test_a_plain_command_imports_only_what_it_runs(command, dcp_checkpoint):
    done, imported = _run(command, *([str(dcp_checkpoint)] if command != "--help" else []))
    assert done.returncode == 0, done.stderr
    expected = {
        "inspect": "model       2 tensors, 15 elements, 60 B",
        "verify": f"ok {dcp_checkpoint}: dcp, 2 tensors, 2 chunks",
        "--help": "convert",
    }[command]
    assert expected in done.stdout, done.stdout
    never = NEVER + (("rich",) if command != "--help" else ())
    assert not [name for name in imported if any(name == n or name.startswith(n + ".") for n in never)], done.stderr
    assert {name for name in imported if name.startswith(OTHER_FORMATS)} <= TABLE_AND_DETECTION
