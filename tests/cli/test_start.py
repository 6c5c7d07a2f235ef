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


def test_every_option_is_coerced_plainly_and_a_parameter_of_another_layout_by_its_own():
    """Every parameter of every command is laid out as `PlainValues` expects of Typer's (a Typer
    that changed that layout would get its own coercion back, pydantic imported at every start:
    this fails first; every command test coerces through it); a parameter without that layout
    keeps its own coercion."""
    from fsdpkit_cli.app import COMMANDS
    from fsdpkit_cli.group import PlainValues, laid_out_as_known, load_command, pass_plain_values

    seen = 0
    for name, (module, _) in COMMANDS.items():
        command = load_command(module, name)
        for one in [*getattr(command, "commands", {}).values(), command]:  # a group's, and the group
            for param in pass_plain_values(one.get_params(one.context_class(one))):
                if hasattr(param, "_runtime_param"):  # Typer's, not click's --help
                    assert laid_out_as_known(param) and isinstance(param._runtime_param, PlainValues), (name, param.name)
                    seen += 1
    assert seen > 50, seen

    class OtherLayout:
        _runtime_param = None

    other = OtherLayout()
    assert pass_plain_values([other]) == [other] and other._runtime_param is None
