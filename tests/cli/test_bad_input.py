"""Bad input across every command, as one table: each row is one line on stderr
starting `error: `, nothing on stdout, the documented exit code (2 bad input, 3 a data check),
nothing written anywhere under the working directory, and no process launched.

More rows per command live beside each command's tests (test_cli_train, test_bench_cli,
test_plan, test_checkpoint_bad_input); this table is the cross-command contract. No launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsdpkit_cli.app import app
from support.checkpoint_files import save_checkpoint, tree_snapshot
from typer.testing import CliRunner

from fsdpkit.checkpoint.format.lock import RunLock

TRAIN = ("train", "--steps", "2")
NODES = ("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1")  # a spread run on two nodes
CASES = [
    # train: flags, files, checkpoints, the run directory's lock
    (TRAIN + ("--steps", "0"), 2, "--steps must be >= 1, got 0"),
    (TRAIN + ("--max-restarts", "-1"), 2, "--max-restarts must be >= 0, got -1"),
    (TRAIN + ("--timeout", "0"), 2, "--timeout must be at least 1 second, got 0"),
    (TRAIN + ("--timeout", "nan"), 2, "--timeout must be at least 1 second, got nan"),
    (TRAIN + ("--timeout", "soon"), 2, "invalid value for '--timeout'"),
    (TRAIN + ("--save-dir", "locked"), 2, "locked is in use by another run: pid"),
    (TRAIN + ("--save-dir", "notes.txt"), 2, "--save-dir 'notes.txt' exists and is not a directory"),
    (TRAIN + ("--metrics", "."), 2, "--metrics '.' is a directory"),
    (TRAIN + ("--model", "gpt-huge"), 2, "gpt-huge"),
    (TRAIN + ("--wrap", "torch.nn:Conv2d"), 2, "--wrap 'torch.nn:Conv2d' matches no module"),
    (TRAIN + ("--resume", "missing"), 2, "missing: does not exist"),
    (TRAIN + ("--resume", "corrupt"), 3, "rank-00001-of-00002.safetensors"),
    (TRAIN + ("--init-from", "corrupt"), 3, "rank-00001-of-00002.safetensors"),
    (TRAIN + ("--resume", "good", "--init-from", "good"), 2, "--resume and --init-from exclude each other"),
    (TRAIN + ("--resume", "dcp"), 2, "--resume dcp is a dcp checkpoint, which records no fsdpkit settings: name its model with --model"),
    (TRAIN + ("--resume", "broken.safetensors"), 3, "broken.safetensors: truncated safetensors file"),  # read before --model is asked for
    (TRAIN + ("--resume", "broken-dcp"), 3, "broken-dcp/.metadata: not a readable pickle"),
    (TRAIN + ("--init-from", "broken-dcp"), 3, "broken-dcp/.metadata: not a readable pickle"),
    (TRAIN + ("--init-from", "dcp"), 2, "--init-from dcp is a dcp checkpoint, which records no fsdpkit settings: name its model"),
    (TRAIN + ("--keep-last", "2"), 2, "need --save-dir"),
    (TRAIN + ("--global-batch-size", "3"), 2, "--global-batch-size 3 is not divisible by world size 2"),
    (TRAIN + ("--nproc-per-node", "65"), 2, "--nproc-per-node 65 is more than this launcher allows"),
    (TRAIN + ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "99999"), 2, "--master-port 99999 is outside 1..65535"),
    (TRAIN + ("--nnodes", "2", "--rdzv-endpoint", "node0:0"), 2, "--rdzv-endpoint 'node0:0': port 0 is outside 1..65535"),
    (TRAIN + ("--config", "missing.toml"), 2, "cannot read config file 'missing.toml'"),
    (TRAIN + ("--config", "notes.txt"), 2, "config file 'notes.txt' is not valid TOML"),
    (TRAIN + ("--bogus",), 2, "no such option: --bogus"),
    (TRAIN + ("--world-size", "2"), 2, "no such option: --world-size: did you mean --nproc-per-node?"),
    (TRAIN + ("--model", "gpt2-tiny"), 2, "--model 'gpt2-tiny' is not a built-in model (gpt-tiny, "),
    # convert
    (("convert",), 2, "missing argument 'src'"),
    (("convert", "good", "out", "--to", "fuller"), 2, "unknown --to 'fuller'"),
    (("convert", "missing", "out", "--to", "full"), 2, "missing: does not exist"),
    (("convert", "good", "good/inner", "--to", "full"), 2, "is inside the source"),
    (("convert", "good", "existing", "--to", "full"), 2, "destination existing already exists; pass --overwrite"),
    (("convert", "good", "out", "--to", "full", "--chunk-size", "12Q"), 2, "unknown size unit 'Q'"),
    (("convert", "good", "out", "--to", "full", "--chunk-size", "1000T"), 2, "needs two 1000.0 TiB buffers"),
    (("convert", "good", "out", "--to", "full", "--chunk-size", "1"), 2, "--chunk-size '1' is 1 byte; use at least 1K"),
    (("convert", "good", "out", "--to", "full", "--dtype", "fp8"), 2, "unknown --dtype 'fp8'"),
    (("convert", "corrupt", "out", "--to", "full"), 3, "rank-00001-of-00002.safetensors"),
    (("convert", "good", "out", "--to", "sharded", "--world-size", "2"), 2, "`fsdpkit reshard` lays it out for another world size"),
    # convert: which options apply to which source format and target (the library's route table)
    (("convert", "good", "out", "--to", "full", "--world-size", "2"), 2, "--world-size does not apply to --to full from a sharded"),
    (("convert", "good", "out", "--to", "dcp", "--dtype", "bf16"), 2, "--dtype does not apply to --to dcp from a sharded checkpoint"),
    (("convert", "good", "out", "--to", "full", "--dcp-model-key", "m"), 2, "--dcp-model-key does not apply to --to full"),
    (("convert", "good", "out", "--to", "deepspeed"), 2, "--to deepspeed from a sharded checkpoint needs --stage"),
    (("convert", "good", "out", "--to", "full", "--max-shard-size", "0"), 2, "--max-shard-size must be >= 1, got 0"),
    (("convert", "good", "out", "--to", "full", *NODES, "--master-port", "99999"), 2, "--master-port 99999 is outside 1..65535"),
    # reshard
    (("reshard", "good", "out"), 2, "--world-size is required"),
    (("reshard", "good", "out", "--world-size", "2", *NODES, "--master-port", "-1"), 2, "--master-port -1 is outside 1..65535"),
    (("reshard", "good", "out", "--world-size", "0"), 2, "--world-size must be >= 1, got 0"),
    (("reshard", "missing", "out", "--world-size", "2"), 2, "missing: does not exist"),
    (("reshard", "corrupt", "out", "--world-size", "3"), 3, "rank-00001-of-00002.safetensors"),
    (("reshard", "broken.safetensors", "out", "--world-size", "2"), 3, "broken.safetensors: truncated safetensors file"),
    # inspect, verify
    (("inspect",), 2, "missing argument 'ckpt'"),
    (("inspect", "missing"), 2, "missing: does not exist"),
    (("inspect", "corrupt"), 3, "rank-00001-of-00002.safetensors"),
    (("inspect", "empty"), 2, "empty: not a checkpoint fsdpkit reads (fsdpkit, Megatron, DCP, DeepSpeed, verl, full safetensors)"),
    (("verify", "missing"), 2, "missing: does not exist"),
    (("verify", "corrupt"), 3, "rank-00001-of-00002.safetensors"),
    (("verify", "good", *NODES, "--master-port", "65536"), 2, "--master-port 65536 is outside 1..65535"),
    (("verify", "good", "--bogus"), 2, "no such option: --bogus"),
    (("diff", "good", "good", *NODES, "--master-port", "0"), 2, "--master-port 0 is outside 1..65535"),
    # plan
    (("plan", "--world-size", "2"), 2, "missing option '--model'"),
    (("plan", "--model", "gpt2", "--world-size", "0"), 2, "world size must be >= 1, got 0"),
    (("plan", "--model", "gpt-nope", "--world-size", "2"), 2, "'gpt-nope'"),
    (("plan", "--model", "gpt2", "--world-size", "2", "--strategy", "zero3"), 2, "'zero3'"),
    # bench
    (("bench", "gather"), 2, "unknown collective 'gather'"),
    (("bench", "allgather", "--iters", "0"), 2, "--iters must be >= 1, got 0"),
    (("bench", "allgather", "--max-bytes", "1000T", "--backend", "gloo"), 2, "--max-bytes 1099511627776000"),
    (("bench", "allgather", "--timeout", "0.5"), 2, "--timeout must be at least 1 second, got 0.5"),
    (("bench", "allgather", "--max-restarts", "-2"), 2, "--max-restarts must be >= 0, got -2"),
    (("bench", "allgather", "--master-port", "70000"), 2, "--master-port 70000 is outside 1..65535"),
    # report
    (("report",), 2, "missing argument 'FILE'"),
    (("report", "notes.txt"), 2, "line 1 is not a metrics record"),
    (("report", "missing.jsonl"), 2, "'missing.jsonl' is not a file"),
    (("report", "notes.txt", "--out", "nodir/r.png"), 2, "--out 'nodir/r.png' must be a file in an existing directory"),
    # the command itself (no command at all: test_no_arguments_print_the_help_once_and_exit_2)
    (("frobnicate",), 2, "no such command 'frobnicate' (see 'fsdpkit --help')"),  # nothing close: no suggestion
    (("trian",), 2, "no such command 'trian'; did you mean 'train'? (see 'fsdpkit --help')"),
    (("convrt", "good", "out", "--to", "full"), 2, "no such command 'convrt'; did you mean 'convert'?"),
    (("--bogus",), 2, "no such option: --bogus"),
]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with a good and a corrupt checkpoint, a DCP checkpoint (torch's) and a broken one,
    a full safetensors file holding `{}`, an empty directory, a text file, an existing destination, and a
    run directory whose lock this process holds."""
    root = tmp_path_factory.mktemp("scratch")
    tensors = {"w": torch.arange(40, dtype=torch.float32), "b": torch.ones(3)}
    save_checkpoint(root / "good", 1, tensors, world_size=2)
    save_checkpoint(root / "corrupt", 1, tensors, world_size=2)
    rank_file = root / "corrupt" / "step-00000001" / "rank-00001-of-00002.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-4])
    (root / "empty").mkdir()
    (root / "existing").mkdir()
    with warnings.catch_warnings():  # torch says it assumes a single process: it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": tensors["w"]}, checkpoint_id=root / "dcp", no_dist=True)
    (root / "broken-dcp").mkdir()
    (root / "broken-dcp" / ".metadata").write_bytes(b"")  # a DCP directory as far as telling its format goes
    (root / "broken.safetensors").write_text("{}")
    (root / "notes.txt").write_text("hello\n")
    with RunLock.acquire(root / "locked"):
        yield root


@pytest.mark.parametrize("args, code, message", CASES, ids=[" ".join(args) for args, _, _ in CASES])
def test_bad_input_is_one_line_the_right_exit_code_and_nothing_written(scratch, no_launch, monkeypatch, args, code, message):
    monkeypatch.chdir(scratch)
    before = tree_snapshot(scratch)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert "Traceback" not in result.output
    assert result.stdout == ""
    assert tree_snapshot(scratch) == before
    assert sorted(os.listdir(scratch)) == [
        "broken-dcp",
        "broken.safetensors",
        "corrupt",
        "dcp",
        "empty",
        "existing",
        "good",
        "locked",
        "notes.txt",
    ]


def test_the_table_spans_every_command():
    assert len(CASES) >= 40
    commands = {args[0] for args, _, _ in CASES}
    assert {"train", "convert", "reshard", "inspect", "verify", "plan", "bench", "report"} <= commands
    assert {code for _, code, _ in CASES} == {2, 3}


def test_a_near_miss_names_what_exists():
    """`--model gpt2-tiny` points to hf:gpt2-tiny, which is one of the Hugging Face presets."""
    from fsdpkit.models.hf import PRESETS

    result = CliRunner().invoke(app, [*TRAIN, "--model", "gpt2-tiny"])
    assert result.exit_code == 2 and "did you mean hf:gpt2-tiny?" in result.stderr
    assert "gpt2-tiny" in PRESETS


@pytest.mark.parametrize("args", [(), ("bench",)], ids=["fsdpkit", "fsdpkit bench"])
def test_no_arguments_print_the_help_once_and_exit_2(args):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2  # a missing argument, as the README says
    assert result.stdout.count("Usage:") == 1 and result.stdout.count("Commands") == 1, result.stdout
    assert result.stderr == ""


FLAG_ERRORS = [
    ["train", "--steps", "0"],
    ["train", "--bogus"],
    ["train", "--world-size", "2"],
    ["train", "--timeout", "soon"],
    ["train", "--log-every", "0"],
    ["train", "--lr", "-1"],
    ["train", "--keep-last", "2"],
    ["train", "--mixed-precision", "bf16", "--bucket-bytes", "-5"],
    ["train", "--limit-all-gathers", "-1"],
    ["train", "--quant-block", "0"],
    ["train", "--strategy", "hybrid"],
    ["bench", "allgather", "--iters", "0"],
    ["bench", "--nproc-per-node", "2"],
    ["convert", "a", "b", "--to", "fuller"],
]
FLAG_SCRIPT = """
import json, sys
from fsdpkit_cli.app import app
codes = [app(args, standalone_mode=False) for args in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""


def test_a_flag_error_comes_before_torch_is_imported():
    """Flags are parsed and checked first: none of these imports torch (seconds), in one process."""
    done = subprocess.run(
        [sys.executable, "-c", FLAG_SCRIPT, json.dumps(FLAG_ERRORS)], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"codes": [2] * len(FLAG_ERRORS), "torch": False}, done.stderr
    assert len(done.stderr.splitlines()) == len(FLAG_ERRORS) and all(line.startswith("error: ") for line in done.stderr.splitlines())
