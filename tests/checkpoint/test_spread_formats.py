"""convert --to sharded and --to dcp from other formats, spread over 1 and 2 processes: the same
bytes as the one-process command, and the tensors the test wrote read back by an independent
reader (safetensors for fsdpkit's rank files via fsdpkit's loader of a full export, torch's
`dcp.load` for DCP)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoint_files import run_cli, save_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    model = {f"layer.{i}.weight": torch.randn(30 + 7 * i, 48, generator=g) for i in range(10)}
    model["ids"] = torch.arange(50, dtype=torch.int64)
    optim = {f"optim.exp_avg.{n}": torch.randn(t.shape, generator=g) for n, t in model.items() if n.startswith("layer")}
    optim |= {f"optim.exp_avg_sq.{n}": torch.rand(t.shape, generator=g) for n, t in model.items() if n.startswith("layer")}
    return {**model, **optim}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("spread-formats")
    tensors = _tensors()
    save_checkpoint(root / "run", 3, tensors, world_size=2, training_state={"step": 3})
    made_with = (("deepspeed", ("--stage", "3", "--world-size", "2")), ("dcp", ("--world-size", "2")), ("full", ("--with-optimizer",)))
    for name, flags in made_with:
        made = run_cli("convert", root / "run", root / name, "--to", name, *flags)
        assert made.exit_code == 0, made.output
    return root, tensors


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _same_as_one_process(src: Path, out: Path, *flags: str) -> dict:
    one = run_cli("convert", src, out / "one", *flags)
    assert one.exit_code == 0, one.output
    for nproc in ("1", "2"):
        spread = run_cli("convert", src, out / f"n{nproc}", *flags, "--nproc-per-node", nproc, "--json")
        assert spread.exit_code == 0, spread.output
        assert _files(out / f"n{nproc}") == _files(out / "one"), (src.name, nproc)
    return json.loads(spread.stdout)


@pytest.mark.parametrize("name", ["deepspeed", "full"])
def test_to_sharded_is_the_one_process_bytes(sources, tmp_path, name):
    root, tensors = sources
    report = _same_as_one_process(root / name, tmp_path, "--to", "sharded", "--world-size", "3", "--with-optimizer", "--dtype", "bf16")
    assert report["spread"]["world_size"] == 2 and report["from"] == name and report["world_size"] == 3
    back = run_cli("convert", tmp_path / "n2", tmp_path / "back", "--to", "full", "--with-optimizer")
    assert back.exit_code == 0, back.output
    loaded = {k: v for path in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(path).items()}
    assert set(tensors) <= set(loaded)  # DeepSpeed's adds each parameter's optimizer step
    assert all(torch.equal(loaded[n], t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in tensors.items())


@pytest.mark.parametrize(("name", "ranks"), [("deepspeed", "3"), ("full", "1")])
def test_to_dcp_is_the_one_process_bytes_and_what_dcp_load_reads(sources, tmp_path, name, ranks):
    """--world-size 1: one rank file larger than a fair share, cut between the two processes."""
    import torch.distributed.checkpoint as dcp

    root, tensors = sources
    report = _same_as_one_process(root / name, tmp_path, "--to", "dcp", "--world-size", ranks)
    assert report["from"] == name and report["world_size"] == int(ranks) and report["spread"]["world_size"] == 2
    model = {n: torch.empty_like(t) for n, t in tensors.items() if not n.startswith("optim.")}
    state = {
        n.removeprefix("optim.exp_avg."): {"exp_avg": torch.empty_like(t)} for n, t in tensors.items() if n.startswith("optim.exp_avg.")
    }
    dcp.load({"model": model, "optimizer": {"state": state}}, checkpoint_id=str(tmp_path / "n2"))
    assert all(torch.equal(model[n], tensors[n]) for n in model)
    assert all(torch.equal(s["exp_avg"], tensors[f"optim.exp_avg.{n}"]) for n, s in state.items())


@pytest.mark.parametrize(
    ("name", "flags"), [("dcp", ("--stage", "3", "--world-size", "3")), ("full", ("--stage", "2", "--world-size", "1"))]
)
def test_to_deepspeed_is_the_one_process_bytes_and_what_zero_to_fp32_reads(sources, tmp_path, name, flags):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, tensors = sources
    report = _same_as_one_process(root / name, tmp_path, "--to", "deepspeed", *flags)
    assert report["from"] == name and report["files"][0] == "latest" and report["spread"]["world_size"] == 2
    weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "n2"))
    assert all(torch.equal(weights[n], t) for n, t in tensors.items() if n.startswith("layer."))


def test_to_megatron_is_the_one_process_bytes(tmp_path):
    """A tiny Llama from transformers; torch's DCP reader (no process group) reads its embedding back."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    embedding = load_file(tmp_path / "hf" / "model.safetensors")["model.embed_tokens.weight"]
    report = _same_as_one_process(tmp_path / "hf", tmp_path, "--to", "megatron")
    assert report["files"] == ["__0_0.distcp", ".metadata", "common.pt", "metadata.json"] and report["spread"]["world_size"] == 2
    state = {"embedding.word_embeddings.weight": torch.empty_like(embedding)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "n2")), no_dist=True)
    assert torch.equal(state["embedding.word_embeddings.weight"], embedding)


@pytest.mark.parametrize("name", ["dcp", "deepspeed"])
def test_reshard_of_dcp_and_deepspeed_is_the_one_process_bytes(sources, tmp_path, name):
    root, tensors = sources
    one = run_cli("reshard", root / name, tmp_path / "one", "--world-size", "3")
    assert one.exit_code == 0, one.output
    spread = run_cli("reshard", root / name, tmp_path / "n2", "--world-size", "3", "--nproc-per-node", "2", "--json")
    assert spread.exit_code == 0, spread.output
    assert _files(tmp_path / "n2") == _files(tmp_path / "one")
    report = json.loads(spread.stdout)
    assert report["world_size"] == 3 and report["spread"]["world_size"] == 2
    back = run_cli("convert", tmp_path / "n2", tmp_path / "back", "--to", "full")  # read by the one-process path
    assert back.exit_code == 0, back.output
    loaded = load_file(tmp_path / "back" / "model.safetensors")
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items() if n.startswith("layer."))
    verify = run_cli("verify", root / name, "--nproc-per-node", "2")
    assert verify.exit_code == 0 and "spread over 2 ranks" in verify.output, verify.output


def test_diff_spread_over_two_processes_prints_the_one_process_diff(sources, tmp_path):
    root, tensors = sources
    changed = dict(tensors)
    changed["layer.3.weight"] = tensors["layer.3.weight"] + 1e-3
    changed["layer.7.weight"] = tensors["layer.7.weight"].flip(0)
    del changed["ids"]
    save_checkpoint(tmp_path / "other", 3, changed, world_size=3, training_state={"step": 3})
    for flags in ((), ("--json", "--atol", "0.01")):
        one = run_cli("diff", root / "full", tmp_path / "other", *flags)
        spread = run_cli("diff", root / "full", tmp_path / "other", *flags, "--nproc-per-node", "2")
        assert one.exit_code == spread.exit_code == 3 and spread.stdout == one.stdout, flags
    report = json.loads(spread.stdout)
    assert {r["name"]: r["status"] for r in report["tensors"] if r["status"] != "equal"} == {
        "ids": "only_a",
        "layer.3.weight": "close",
        "layer.7.weight": "different",
    }


@pytest.mark.parametrize(("target", "flags"), [("dcp", ("--world-size", "1")), ("deepspeed", ("--stage", "3", "--world-size", "3"))])
def test_a_killed_rank_then_the_same_command_continues(sources, tmp_path, target, flags):
    """DCP's one rank file cut into parts; DeepSpeed's files in the tag directory, each whole."""
    from fsdpkit.checkpoint.spread.staging import staging_path
    from fsdpkit.dist.faults import FAULT_ENV

    root, _ = sources
    args = ("convert", root / "full", tmp_path / "out", "--to", target, *flags, "--json")
    one = run_cli("convert", root / "full", tmp_path / "one", "--to", target, *flags)
    assert one.exit_code == 0, one.output
    os.environ[FAULT_ENV] = "kill:1:2:convert"
    try:
        killed = run_cli(*args, "--nproc-per-node", "2")
    finally:
        del os.environ[FAULT_ENV]
    assert killed.exit_code == 1 and "rank 1" in killed.output and "nothing committed" in killed.output, killed.output
    assert not (tmp_path / "out").exists() and staging_path(tmp_path / "out").exists()
    rerun = run_cli(*args, "--nproc-per-node", "2")
    assert rerun.exit_code == 0, rerun.output
    assert json.loads(rerun.stdout)["spread"]["kept_parts"] >= 1
    assert _files(tmp_path / "out") == _files(tmp_path / "one")


def test_a_transformers_export_in_its_own_layout(tmp_path):
    """The built-in GPT (a tied weight) and its export (a prefix added, weights transposed): --to
    dcp of the run writes the tied weight twice from one checksummed piece; diff, which reads the
    export back transposed, spreads to the one-process output; --to sharded and --to dcp of the
    export, which would transpose it back into one scratch file, are one line and exit 2 with a
    launch flag of more than one process, nothing written; its plain --dry-run says it runs in one
    process, and --nproc-per-node 1 writes the one-process bytes."""
    import torch.distributed.checkpoint as dcp

    from fsdpkit.models.source import resolve

    source = resolve("gpt-tiny")
    weights = {k: v for k, v in source.build(seed=0).state_dict().items() if k != "lm_head.weight"}
    state = {"step": 1, "export": source.export.to_json()}
    run = save_checkpoint(tmp_path / "run", 1, weights, world_size=2, aliases={"lm_head.weight": "wte.weight"}, training_state=state)
    assert run_cli("convert", run, tmp_path / "hf", "--to", "full").exit_code == 0
    one = run_cli("diff", run, tmp_path / "hf")
    spread = run_cli("diff", run, tmp_path / "hf", "--nproc-per-node", "2")
    assert one.exit_code == spread.exit_code == 0 and spread.stdout == one.stdout and "8 weights transposed back" in one.stdout
    _same_as_one_process(run, tmp_path / "tied", "--to", "dcp")  # lm_head.weight: wte.weight's checksummed piece read again
    model = {name: torch.empty_like(weights["wte.weight"]) for name in ("wte.weight", "lm_head.weight")}
    dcp.load({"model": model}, checkpoint_id=str(tmp_path / "tied" / "n2"))
    assert all(torch.equal(t, weights["wte.weight"]) for t in model.values())
    for to, flags in (("sharded", ("--world-size", "2")), ("dcp", ())):
        refused = run_cli("convert", tmp_path / "hf", tmp_path / to, "--to", to, *flags, "--nproc-per-node", "2")
        lines = [line for line in refused.output.splitlines() if line.strip()]
        assert refused.exit_code == 2 and len(lines) == 1 and "in one process" in lines[0], refused.output
        assert not (tmp_path / to).exists() and not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
        planned = run_cli("convert", tmp_path / "hf", tmp_path / to, "--to", to, *flags, "--dry-run")
        assert planned.exit_code == 0 and planned.stdout.startswith("dry run: ") and "in one process" in planned.stdout, planned.output
        assert planned.stdout.rstrip().endswith("nothing written") and not (tmp_path / to).exists()
    _under_torchrun_rank_0_converts_it_alone(tmp_path)
    alone = run_cli("convert", tmp_path / "hf", tmp_path / "alone", "--to", "sharded", "--world-size", "2", "--nproc-per-node", "1")
    assert alone.exit_code == 0 and "in one process" in alone.stderr, alone.output
    assert _files(tmp_path / "alone") == _files(tmp_path / "one")


def _under_torchrun_rank_0_converts_it_alone(tmp_path: Path) -> None:
    """The same `--to sharded` of the export under torchrun, no launch flag: rank 0 writes the
    one-process bytes, the other rank leaves, torchrun exits 0."""
    import subprocess
    import sys

    flags = ["--to", "sharded", "--world-size", "2"]
    one = run_cli("convert", tmp_path / "hf", tmp_path / "one", *flags)
    assert one.exit_code == 0, one.output
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fsdpkit_cli"]
    run = subprocess.run([*torchrun, "convert", str(tmp_path / "hf"), str(tmp_path / "torchrun"), *flags], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote {tmp_path / 'torchrun'}: 2 files") and "rank 0 runs it alone" in run.stderr, run
    assert _files(tmp_path / "torchrun") == _files(tmp_path / "one")


def test_to_dcp_under_torchrun_and_on_two_nodes_of_two_is_the_one_process_bytes(sources, tmp_path):
    """`--to dcp` from DeepSpeed: `torchrun --nproc-per-node 2 -m fsdpkit_cli`, and two nodes of two
    processes each on loopback (fsdpkit's --nnodes 2 --node-rank R --master-addr 127.0.0.1), at
    the same time."""
    import socket
    import subprocess
    import sys

    root, _ = sources
    flags = ["--to", "dcp", "--world-size", "3"]
    one = run_cli("convert", root / "deepspeed", tmp_path / "one", *flags)
    assert one.exit_code == 0, one.output
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "fsdpkit_cli", "convert", str(root / "deepspeed")]
    nodes = [
        [*command, str(tmp_path / "nodes"), *flags, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(rank)]
        + ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        for rank in (0, 1)
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fsdpkit_cli"]
    torchrun += ["convert", str(root / "deepspeed"), str(tmp_path / "torchrun"), *flags]
    started = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for args in [*nodes, torchrun]]
    outputs = [process.communicate(timeout=300)[0] for process in started]
    assert [process.returncode for process in started] == [0, 0, 0], outputs
    assert "spread over 4 ranks" in outputs[0] and "spread over 2 ranks" in outputs[2], outputs
    assert _files(tmp_path / "nodes") == _files(tmp_path / "one")
    assert _files(tmp_path / "torchrun") == _files(tmp_path / "one")


def test_gpt2_to_megatron_transposes_by_blocks_of_rows(tmp_path, monkeypatch):
    """transformers' GPT-2 --to megatron, spread in this process with blocks of two rows: the
    one-process bytes (whole weights at once), and torch's DCP reader gives transformers' Conv1D
    weights transposed (Megatron loads the spread output in test_megatron)."""
    import torch.distributed.checkpoint as dcp
    from transformers import GPT2Config, GPT2LMHeadModel

    from fsdpkit.checkpoint.megatron import transposed

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    model.save_pretrained(tmp_path / "hf")
    one = run_cli("convert", tmp_path / "hf", tmp_path / "one", "--to", "megatron")
    assert one.exit_code == 0, one.output
    monkeypatch.setattr(transposed, "TRANSPOSE_BLOCK_BYTES", 2 * 128 * 4)  # two rows of c_fc's (32, 128)
    spread = run_cli("convert", tmp_path / "hf", tmp_path / "n1", "--to", "megatron", "--nproc-per-node", "1")
    assert spread.exit_code == 0, spread.output
    assert _files(tmp_path / "n1") == _files(tmp_path / "one")
    fc1 = torch.empty(2, 128, 32)
    dcp.load({"decoder.layers.mlp.linear_fc1.weight": fc1}, storage_reader=dcp.FileSystemReader(str(tmp_path / "n1")), no_dist=True)
    assert all(torch.equal(fc1[i], model.transformer.h[i].mlp.c_fc.weight.T) for i in range(2))
