"""`fsdpkit train` through typer's test runner: help, a 2-process --json run, bad inputs."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from fsdpkit_cli.app import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_lists_every_command_and_train_flags():
    result = invoke("--help")
    assert result.exit_code == 0 and "train" in result.stdout
    result = invoke("train", "--help")
    assert result.exit_code == 0
    for flag in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--global-batch-size", "--lr-schedule", "--json"):
        assert flag in result.stdout


def test_two_process_json_run_prints_exactly_one_document(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = invoke("train", "--nproc-per-node", "2", "--steps", "6", "--seq-len", "32", "--eval-every", "3",
                    "--metrics", str(metrics), "--json")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["world_size"] == 2 and summary["strategy"] == "full" and summary["steps"] == 6
    assert len(summary["losses"]) == 6 and summary["final_loss"] == summary["losses"][-1]
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["tokens_per_second"] > 0 and summary["peak_memory_bytes"] > 0
    assert summary["checkpoint"] is None
    assert [e["step"] for e in summary["eval_losses"]] == [3, 6]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["loss"] for r in records] == summary["losses"]


def test_text_data_and_user_model_from_current_directory(tmp_path, monkeypatch):
    (tmp_path / "usermodel.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(16, 16)
            def forward(self, x):
                return x + self.lin(x).relu()

        class Tiny(nn.Module):
            vocab_size = 256
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(256, 16)
                self.layers = nn.ModuleList([Layer(), Layer()])
                self.out = nn.Linear(16, 256)
            def forward(self, idx):
                x = self.emb(idx)
                for layer in self.layers:
                    x = layer(x)
                return self.out(x)

        def factory():
            return Tiny()

        def not_a_module():
            return 42
    """))
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    monkeypatch.chdir(tmp_path)
    result = invoke("train", "--model", "usermodel:factory", "--wrap", "usermodel:Layer", "--data", "corpus.txt",
                    "--steps", "3", "--seq-len", "16", "--wrap-every", "2", "--wrap-min-params", "1000", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and summary["world_size"] == 2
    result = invoke("train", "--model", "usermodel:not_a_module", "--steps", "2")
    assert result.exit_code == 2 and "returned int" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt-huge"], "gpt-huge"),
        (["--global-batch-size", "6", "--grad-accum", "2"], "not divisible"),
        (["--steps", "0"], "--steps"),
        (["--data", "/nonexistent/corpus.txt"], "cannot read data file"),
        (["--model", "no_such_module_xyz:factory"], "cannot import"),
        (["--optimizer", "lamb"], "lamb"),
        (["--strategy", "hybrid"], "shard group size"),
        (["--strategy", "hybrid", "--shard-group-size", "3", "--nproc-per-node", "4", "--global-batch-size", "8"], "not divisible by shard group size 3"),
        (["--seq-len", "4096"], "block size"),
        (["--betas", "0.9"], "--betas"),
        (["--nproc-per-node", "0"], "--nproc-per-node"),
        (["--no-sync"], "--grad-accum"),
        (["--backward-prefetch", "early"], "early"),
        (["--limit-all-gathers", "-1"], "-1"),
        (["--mixed-precision", "fp8"], "fp8"),
        (["--wrap-every", "0"], "every"),
        (["--max-grad-norm", "0"], "--max-grad-norm"),
        (["--shard-group-size", "2"], "only applies to strategy 'hybrid'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke("train", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output


def test_failing_worker_exits_1_with_rank_and_reason(tmp_path, monkeypatch):
    (tmp_path / "brokenmodel.py").write_text(textwrap.dedent("""
        import os
        import torch.nn as nn

        class Broken(nn.Module):
            vocab_size = 256
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(256, 256)
            def forward(self, idx):
                if os.environ.get("RANK") == "1":
                    raise RuntimeError("rank one cannot compute")
                return self.emb(idx)

        def factory():
            return Broken()
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = invoke("train", "--model", "brokenmodel:factory", "--steps", "2", "--seq-len", "8")
    assert result.exit_code == 1
    assert "worker rank 1 failed" in result.stderr and "rank one cannot compute" in result.stderr
