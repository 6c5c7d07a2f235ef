"""Sharded checkpoints in training, through the real CLI: exact resume, resume at another
world size and strategy (load-time resharding), async saves, init-from, mismatches and
corrupt checkpoints (exit 3 before any weight is used), and crashes while saving."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fsdpkit_cli.app import app
from support.processes import kill_run
from typer.testing import CliRunner

from fsdpkit.checkpoint.live.tensors import CheckpointReader

runner = CliRunner()
COMMON = ["--seq-len", "32", "--global-batch-size", "8", "--lr-schedule", "cosine", "--warmup-steps", "2", "--lr-decay-steps", "10"]


def train(*args: str) -> dict:
    result = runner.invoke(app, ["train", *COMMON, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def weights(path: str | Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.read_tensor(name) for name in reader.tensor_names()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    full = train("--steps", "10", "--save-dir", str(root / "full"))
    half = train("--steps", "5", "--save-dir", str(root / "half"), "--async-save")
    return root, full, half


def test_resume_is_bitwise_exact_at_the_same_world_size(runs):
    root, full, half = runs
    resumed = train("--steps", "10", "--resume", str(root / "half"), "--save-dir", str(root / "resumed"))
    assert half["losses"] == full["losses"][:5]
    assert resumed["losses"] == full["losses"][5:]
    assert resumed["resumed_from_step"] == 5 and full["resumed_from_step"] is None
    reference, mine = weights(root / "full"), weights(root / "resumed")
    assert reference.keys() == mine.keys() and all(torch.equal(reference[n], mine[n]) for n in reference)
    assert any(n.startswith("optim.exp_avg.") for n in mine)


def test_sgd_with_momentum_resumes_bitwise(tmp_path):
    sgd = ["--optimizer", "sgd", "--momentum", "0.9", "--nesterov", "--lr", "0.05"]
    full = train(*sgd, "--steps", "6", "--save-every", "3", "--save-dir", str(tmp_path / "full"))
    resumed = train(*sgd, "--steps", "6", "--resume", str(tmp_path / "full" / "step-00000003"), "--save-dir", str(tmp_path / "resumed"))
    assert resumed["losses"] == full["losses"][3:]
    reference, mine = weights(tmp_path / "full"), weights(tmp_path / "resumed")
    assert reference.keys() == mine.keys() and all(torch.equal(reference[n], mine[n]) for n in reference)
    assert any(n.startswith("optim.momentum_buffer.") for n in mine)


@pytest.fixture(scope="module")
def resumed_elsewhere(runs):
    """`train --resume` of the 5-step run to step 10 with extra flags, each launched once and
    shared by the tests that read it (a resume at 1 or 4 ranks is also the reference of the
    offline reshard below)."""
    root, _, _ = runs
    done: dict[tuple[str, ...], object] = {}

    def resume(*extra: str):
        if extra not in done:
            args = ["train", *COMMON, "--steps", "10", "--resume", str(root / "half" / "step-00000005"), *extra, "--json"]
            done[extra] = runner.invoke(app, args)
        return done[extra]

    return resume


@pytest.mark.parametrize(
    "extra",
    [
        ["--nproc-per-node", "1"],
        ["--nproc-per-node", "4"],
        ["--nproc-per-node", "4", "--strategy", "hybrid", "--shard-group-size", "2"],
        ["--strategy", "none"],
    ],
)
def test_resume_at_another_world_size_or_strategy(runs, resumed_elsewhere, extra):
    root, full, _ = runs
    result = resumed_elsewhere(*extra)
    assert result.exit_code == 0, result.output
    resumed = json.loads(result.stdout)
    # Another world size is the feature: no warning; another strategy replaces a saved setting: one line.
    saved_in = f"saved in {root / 'half' / 'step-00000005'}"
    expected = {
        "hybrid": [f"warning: --strategy hybrid replaces full {saved_in}", f"warning: --shard-group-size 2 replaces (not set) {saved_in}"],
        "none": [f"warning: --strategy none replaces full {saved_in}"],
    }
    strategy = extra[extra.index("--strategy") + 1] if "--strategy" in extra else None
    assert [line for line in result.stderr.splitlines() if "warning" in line.lower()] == expected.get(strategy, [])
    for mine, ref in zip(resumed["losses"], full["losses"][5:], strict=True):
        assert abs(mine - ref) / ref < 1e-4


def test_async_save_writes_the_same_checkpoint_as_a_synchronous_one(runs, tmp_path):
    root, _, half = runs
    sync = train("--steps", "5", "--save-dir", str(tmp_path / "sync"))
    assert sync["checkpoint"].endswith("step-00000005") and half["checkpoint"].endswith("step-00000005")
    a, b = weights(tmp_path / "sync"), weights(root / "half")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert runner.invoke(app, ["verify", str(root / "half")]).exit_code == 0


def test_init_from_full_and_sharded_weights_agree(runs, tmp_path):
    root, scratch, _ = runs  # the fixture's first run started from scratch: its first loss is the untrained model's
    converted = runner.invoke(app, ["convert", str(root / "full"), str(tmp_path / "hf"), "--to", "full"])
    assert converted.exit_code == 0, converted.output
    from_full = train("--steps", "2", "--init-from", str(tmp_path / "hf"))
    from_sharded = train("--steps", "2", "--init-from", str(root / "full"))
    assert from_full["losses"] == pytest.approx(from_sharded["losses"], rel=1e-6)
    assert from_full["losses"][0] < scratch["losses"][0] - 0.5


def _invoke_exit(*args: str):
    result = runner.invoke(app, ["train", *COMMON, *args, "--quiet"])  # errors and warnings only, no launch note
    return result.exit_code, result.stderr.strip()


def test_checkpoint_of_another_model_and_missing_optimizer_state(runs, tmp_path):
    root, _, _ = runs
    code, err = _invoke_exit("--model", "gpt-small", "--resume", str(root / "full"), "--steps", "12")
    warning, error = err.splitlines()
    assert warning.startswith("warning: --model gpt-small replaces gpt-tiny saved in "), warning
    assert code == 3 and ("another model" in error or "shapes differ" in error) and "(saved from gpt-tiny, not gpt-small)" in error, err
    weights_only = tmp_path / "weights_only"
    assert runner.invoke(app, ["convert", str(root / "full"), str(tmp_path / "hf"), "--to", "full"]).exit_code == 0
    assert runner.invoke(app, ["convert", str(tmp_path / "hf"), str(weights_only), "--to", "sharded", "--world-size", "2"]).exit_code == 0
    code, err = _invoke_exit("--resume", str(weights_only), "--steps", "12")
    assert code == 3 and "optimizer state" in err
    resumed = train("--resume", str(weights_only), "--no-strict", "--steps", "2")
    assert resumed["steps"] == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "empty"])
def test_corrupt_checkpoint_is_exit_3_naming_the_file(runs, tmp_path, damage):
    import shutil

    root, _, _ = runs
    broken = tmp_path / "broken"
    shutil.copytree(root / "full", broken)
    step = broken / "step-00000010"
    rank_file = step / "rank-00001-of-00002.safetensors"
    if damage == "flip":
        data = bytearray(rank_file.read_bytes())
        data[-100] ^= 0xFF
        rank_file.write_bytes(bytes(data))
    elif damage == "truncate":
        rank_file.write_bytes(rank_file.read_bytes()[:-10])
    elif damage == "missing":
        rank_file.unlink()
    else:
        broken = tmp_path / "empty"
        broken.mkdir()
    code, err = _invoke_exit("--resume", str(broken), "--steps", "12")
    assert code == (2 if damage == "empty" else 3), err  # no checkpoint at all is bad input, not a failed check
    assert len(err.splitlines()) == 1 and ("not a checkpoint fsdpkit reads" if damage == "empty" else "rank-00001-of-00002") in err, err


def test_killed_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path):
    exe = Path(sys.executable).with_name("fsdpkit")
    run_dir = tmp_path / "run"
    for delay in (0.0, 0.15, 0.4):
        process = subprocess.Popen(
            [
                str(exe),
                "train",
                "--model",
                "gpt-small",
                "--steps",
                "200",
                "--save-every",
                "1",
                "--keep-last",
                "2",
                "--seq-len",
                "32",
                "--save-dir",
                str(run_dir),
            ]
            + (["--resume", str(run_dir)] if (run_dir / "latest").exists() else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.time() + 120
        start_latest = (run_dir / "latest").read_text() if (run_dir / "latest").exists() else None
        # until this process has saved a checkpoint (--keep-last spans the run and its resumes: count steps no more)
        while time.time() < deadline and (not (run_dir / "latest").exists() or (run_dir / "latest").read_text() == start_latest):
            time.sleep(0.05)
        time.sleep(delay)
        kill_run(process.pid)
        process.wait()
        verified = runner.invoke(app, ["verify", str(run_dir), "--json"])
        assert verified.exit_code == 0, verified.output
    latest_step = int((run_dir / "latest").read_text().strip().split("-")[1])
    resumed = train(
        "--model",
        "gpt-small",
        "--resume",
        str(run_dir),
        "--steps",
        str(latest_step + 2),
        "--nproc-per-node",
        "1",
        "--global-batch-size",
        "2",
    )
    assert resumed["steps"] == latest_step + 2 and len(resumed["losses"]) == 2  # continued from the latest step


@pytest.mark.parametrize("world", [1, 4])  # fewer and more ranks than the checkpoint's 2
def test_offline_reshard_then_resume_matches_resuming_the_original(runs, resumed_elsewhere, tmp_path, world):
    root, _, _ = runs
    resharded = tmp_path / f"w{world}"
    result = runner.invoke(app, ["reshard", str(root / "half"), str(resharded), "--world-size", str(world)])
    assert result.exit_code == 0, result.output
    with CheckpointReader(resharded) as reader:
        assert reader.manifest.shard_factor == world
    from_original = json.loads(resumed_elsewhere("--nproc-per-node", str(world)).stdout)
    from_resharded = train("--steps", "10", "--resume", str(resharded), "--nproc-per-node", str(world))
    assert from_resharded["losses"] == from_original["losses"]
