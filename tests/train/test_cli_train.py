"""`fsdpkit train` as a user runs it: help, version, completion, usage errors, config files, the
log without a terminal, metrics, TensorBoard events and report pictures.

Launches are few and shared: `flag_run` (flags, stderr to a file) and `file_run` (the same run
replayed from `--print-config` in another directory) each run once per module; each feature
is its own test on their typed results, so one broken feature fails one test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from fsdpkit_cli.app import app
from typer.testing import CliRunner

import fsdpkit
from fsdpkit.train.config import SECTIONS, TOP

runner = CliRunner()
FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
RUN_FLAGS = [
    "--nproc-per-node",
    "2",
    "--steps",
    "6",
    "--seq-len",
    "32",
    "--eval-every",
    "3",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "2",
    "--metrics",
    "metrics.jsonl",
    "--tensorboard",
    "tb",
    "--log-every",
    "2",
]
PANELS = ["Model", "Data", "Sharding", "Precision", "Memory", "Overlap", "Communication", "Optimizer", "Checkpoints", "Launch", "Output"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


@dataclass(frozen=True)
class Run:
    """One `fsdpkit train` process, started as a user would, stderr to a file (not a terminal)."""

    directory: Path
    exit_code: int
    summary: dict | None
    stderr: str

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.directory / "metrics.jsonl").read_text().splitlines()]


def run_train(directory: Path, *args: str) -> Run:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "stderr.txt", "w+b") as stderr:
        done = subprocess.run(
            [FSDPKIT, "train", *args, "--json"],
            cwd=directory,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=300,
        )
        stderr.seek(0)
        text = stderr.read().decode()
    summary = json.loads(done.stdout) if done.returncode == 0 else None
    return Run(directory, done.returncode, summary, text)


@pytest.fixture(scope="module")
def flag_run(tmp_path_factory) -> Run:
    return run_train(tmp_path_factory.mktemp("flags"), *RUN_FLAGS)


@pytest.fixture(scope="module")
def file_run(tmp_path_factory) -> Run:
    """The same run from a config file written by --print-config, in another directory (the
    relative --metrics and --tensorboard paths land there)."""
    directory = tmp_path_factory.mktemp("file")
    printed = invoke("train", *RUN_FLAGS, "--print-config")
    assert printed.exit_code == 0, printed.output
    (directory / "run.toml").write_text(printed.stdout)
    return run_train(directory, "--config", "run.toml")


# --- runs ---


def test_summary_is_one_json_document(flag_run):
    assert flag_run.exit_code == 0, flag_run.stderr
    summary = flag_run.summary
    assert summary["world_size"] == 2 and summary["strategy"] == "full" and summary["steps"] == 6
    assert len(summary["losses"]) == 6 and summary["final_loss"] == summary["losses"][-1]
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["resumed_from_step"] is None and summary["checkpoint"] is None
    assert [e["step"] for e in summary["eval_losses"]] == [3, 6]


def test_summary_gives_the_peak_learning_rate_the_optimizer_used(flag_run):
    from fsdpkit_cli.train_cmd import format_summary

    from fsdpkit.train.summary import TrainSummary

    used = max(record["lr"] for record in flag_run.metrics())  # the warm-up's last step is at the peak
    assert flag_run.summary["lr"] == used
    assert f"learning rate    {used:g} peak" in format_summary(TrainSummary.from_json(flag_run.summary))


def test_summary_names_the_save_stall_only_when_saves_happened(flag_run):
    from fsdpkit_cli.train_cmd import format_summary

    from fsdpkit.train.summary import TrainSummary

    summary = TrainSummary.from_json(flag_run.summary)
    assert summary.save_stall_s == 0 and summary.snapshot_stall_s == 0 and summary.save_timings is None  # no --save-dir
    assert "save stall" not in format_summary(summary)
    assert "checkpoint       not saved (no --save-dir)" in format_summary(summary)
    saved = dataclasses.replace(summary, save_stall_s=1.5, save_timings={"saves": 3}, checkpoint="run/step-00000006")
    text = format_summary(saved)
    assert "save stall       1.50 s in the training thread between steps (3 saves; max over ranks)" in text
    assert "checkpoint       run/step-00000006" in text


def test_metrics_lines_follow_the_steps(flag_run):
    records = flag_run.metrics()
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["loss"] for r in records] == flag_run.summary["losses"]
    assert [r["eval_loss"] for r in records if "eval_loss" in r] == [e["loss"] for e in flag_run.summary["eval_losses"]]
    assert all(r["peak_memory_bytes"] > 0 and r["lr"] > 0 for r in records)


def test_every_steps_own_time_and_the_stalls_fit_in_the_elapsed_time(flag_run):
    step_times = [r["step_time_s"] for r in flag_run.metrics()]
    summary = flag_run.summary
    assert len(step_times) == 6 and min(step_times) > 0
    assert sum(step_times) + summary["save_stall_s"] + summary["snapshot_stall_s"] <= summary["elapsed_seconds"]


def test_log_without_a_terminal_is_plain_lines(flag_run):
    assert "\r" not in flag_run.stderr
    lines = [line for line in flag_run.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    assert all("tokens/s" in line and "loss" in line for line in lines)


def test_launch_and_first_step_each_say_one_line_before_any_progress(flag_run):
    lines = flag_run.stderr.splitlines()
    assert lines[0] == "launching 2 workers on this node (world size 2), backend gloo, device cpu, rendezvous c10d at a local port"
    assert lines[1] == "training: step 1 of 6 starting"
    assert lines[2].startswith("step 2/6")


def test_tensorboard_events_hold_the_metrics_scalars(flag_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(flag_run.directory / "tb"))
    events.Reload()
    assert {"loss", "lr", "tokens_per_second", "peak_memory_bytes", "eval_loss"} <= set(events.Tags()["scalars"])
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in losses] == list(range(1, 7))
    assert [v for _, v in losses] == pytest.approx(flag_run.summary["losses"], rel=1e-6)


def test_report_draws_the_metrics_as_a_png(flag_run, tmp_path):
    import matplotlib.image

    result = invoke("report", str(flag_run.directory / "metrics.jsonl"), "--out", str(tmp_path / "report.png"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(tmp_path / "report.png").shape
    assert width > height > 300


def test_config_file_from_print_config_replays_the_same_run(flag_run, file_run):
    assert file_run.exit_code == 0, file_run.stderr
    timing = {"tokens_per_second", "step_tokens_per_second", "elapsed_seconds", "peak_memory_bytes"}
    assert {k: v for k, v in file_run.summary.items() if k not in timing} == {k: v for k, v in flag_run.summary.items() if k not in timing}
    assert [r["loss"] for r in file_run.metrics()] == [r["loss"] for r in flag_run.metrics()]
    assert (file_run.directory / "tb").is_dir()


def test_print_config_of_a_config_file_is_that_file(file_run):
    written = (file_run.directory / "run.toml").read_text()
    again = invoke("train", "--config", str(file_run.directory / "run.toml"), "--print-config")
    assert again.exit_code == 0 and again.stdout == written
    values = tomllib.loads(written)
    assert values["steps"] == 6 and values["optimizer"]["schedule"] == "cosine" and values["optimizer"]["betas"] == [0.9, 0.95]
    assert values["launch"]["nproc_per_node"] == 2 and values["logging"]["metrics"] == "metrics.jsonl"


def test_text_data_and_user_model_from_current_directory_quietly(tmp_path, monkeypatch, capfd):
    (tmp_path / "usermodel.py").write_text(
        textwrap.dedent("""
        import torch.nn as nn

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(16, 16)
            def forward(self, x):
                return x + self.lin(x).relu()

        class Unused(nn.Module):
            pass

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
    """)
    )
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    monkeypatch.chdir(tmp_path)
    result = invoke(
        "train",
        "--model",
        "usermodel:factory",
        "--wrap",
        "usermodel:Layer",
        "--data",
        "corpus.txt",
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--wrap-every",
        "2",
        "--wrap-min-params",
        "1000",
        "--json",
        "--quiet",
        "--log-every",
        "1",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and summary["world_size"] == 2
    worker_stderr = capfd.readouterr().err  # the workers write to file descriptor 2, not a terminal here
    assert not [line for line in worker_stderr.splitlines() if line.startswith("step ")]  # --quiet: no progress
    result = invoke("train", "--model", "usermodel:not_a_module", "--steps", "2")
    assert result.exit_code == 2 and "returned int" in result.stderr
    result = invoke("train", "--model", "usermodel:factory", "--wrap", "usermodel:Unused")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --wrap 'usermodel:Unused' matches no module of model 'usermodel:factory' "
        "(its module classes: Embedding, Layer, Linear, ModuleList, Tiny)"
    )


def test_failing_worker_exits_1_with_rank_and_reason(tmp_path, monkeypatch):
    (tmp_path / "brokenmodel.py").write_text(
        textwrap.dedent("""
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
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = invoke("train", "--model", "brokenmodel:factory", "--steps", "2", "--seq-len", "8")
    assert result.exit_code == 1
    assert "worker rank 1 failed" in result.stderr and "rank one cannot compute" in result.stderr


# --- no launch: help, version, completion, config, usage errors ---


def _help_text() -> str:
    done = subprocess.run([FSDPKIT, "train", "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_fits_100_columns_in_panels_with_every_flag():
    text = _help_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "…" not in text and "<bool>" not in text
    titles = [line.split("─")[1].strip() for line in lines if line.startswith("╭─")]
    assert titles == ["Options", *PANELS]
    for section in (TOP, *SECTIONS):
        for spec in section.settings:
            assert spec.long_flag in text, spec.long_flag
    for flag in ("--config", "--print-config", "--json", "Throughput (tokens/s)"):
        assert flag in text


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.startswith(f"fsdpkit {fsdpkit.__version__} (torch ")


def test_shell_completion_names_commands_and_flags():
    def complete(words: str, index: int) -> list[str]:
        env = {**os.environ, "_FSDPKIT_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(index)}
        return subprocess.run([FSDPKIT], capture_output=True, text=True, env=env).stdout.split()

    assert complete("fsdpkit tr", 1) == ["train"]
    assert complete("fsdpkit train --nproc", 2) == ["--nproc-per-node"]
    assert "--install-completion" in invoke("--help").stdout


def _print_config(*args: str) -> dict:
    result = invoke("train", *args, "--print-config")
    assert result.exit_code == 0, result.output
    return tomllib.loads(result.stdout)


def test_print_config_shows_the_settings_runs_change_most_first():
    """The step count, the model, the learning rate and its warm-up, the batch, where to save and
    how many processes within the first screen; the file reads back as the same config."""
    printed = invoke("train", "--print-config").stdout
    line_of, section = {}, ""
    for number, line in enumerate(printed.splitlines(), 1):
        if line.startswith("["):
            section = line.strip("[]")
        elif " =" in line:
            line_of[f"{section}.{line.lstrip('# ').split(' =')[0]}".lstrip(".")] = number
    first = ["steps", "model.name", "optimizer.lr", "optimizer.warmup_steps", "data.seq_len", "data.global_batch_size"]
    assert max(line_of[key] for key in first) <= 30 and line_of["checkpoint.save_dir"] <= 45, line_of
    assert line_of["launch.nproc_per_node"] < line_of["sharding.strategy"]
    assert _print_config() == tomllib.loads(printed)


def test_torchrun_launch_spellings():
    launch = _print_config(
        "--nproc_per_node",
        "3",
        "--rdzv_id",
        "job7",
        "--rdzv-backend",
        "static",
        "--master_addr",
        "node0",
        "--master-port",
        "29400",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--max_restarts",
        "3",
    )["launch"]
    assert launch == {
        "nproc_per_node": 3,
        "nnodes": 2,
        "node_rank": 1,
        "rdzv_backend": "static",
        "rdzv_id": "job7",
        "standalone": False,
        "master_addr": "node0",
        "master_port": 29400,
        "max_restarts": 3,
        "timeout": 300.0,
    }
    assert _print_config("--standalone", "--nproc-per-node", "4")["launch"]["standalone"] is True
    assert _print_config("--global_batch_size", "16")["data"]["global_batch_size"] == 16


def test_flags_override_the_config_file(tmp_path):
    (tmp_path / "run.toml").write_text(
        'steps = 50\n[optimizer]\nlr = 0.01\n[sharding]\ncpu_offload = true\nmixed_precision = "bf16"\nreduce_dtype = "fp32"\n'
    )
    values = _print_config("--config", str(tmp_path / "run.toml"), "--steps", "7", "--no-cpu-offload")
    assert values["steps"] == 7 and values["optimizer"]["lr"] == 0.01
    assert values["sharding"]["cpu_offload"] is False
    assert values["sharding"]["mixed_precision"] == "bf16" and values["sharding"]["reduce_dtype"] == "fp32"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt-huge"], "gpt-huge"),
        (["--global-batch-size", "6", "--grad-accum", "2"], "not divisible"),
        (["--steps", "0"], "--steps"),
        (["--data", "/nonexistent/corpus.txt"], "cannot read data file"),
        (["--model", "no_such_module_xyz:factory"], "cannot import"),
        (["--optimizer", "lamb"], "'lamb' is not one of 'adamw', 'sgd'"),
        (["--strategy", "hybrid"], "shard group size"),
        (
            ["--strategy", "hybrid", "--shard-group-size", "3", "--nproc-per-node", "4", "--global-batch-size", "8"],
            "not divisible by shard group size 3",
        ),
        (["--seq-len", "4096"], "block size"),
        (["--betas", "0.9"], "--betas"),
        (["--optimizer", "sgd", "--nesterov"], "--nesterov needs --momentum > 0"),
        (["--optimizer", "sgd", "--momentum", "nan"], "--momentum must be a finite number >= 0, got nan"),
        (["--momentum", "0.9"], "--momentum and --nesterov are settings of --optimizer sgd, not adamw"),
        (["--nproc-per-node", "0"], "--nproc-per-node"),
        (["--nproc-per-node", "many"], "--nproc-per-node 'many': use a number, gpu, cpu or auto"),
        (["--no-sync"], "--grad-accum"),
        (["--backward-prefetch", "early"], "early"),
        (["--limit-all-gathers", "-1"], "-1"),
        (["--mixed-precision", "fp8"], "fp8"),
        (["--reduce-dtype", "fp8"], "fp8"),
        (["--wrap-every", "0"], "--wrap-every must be >= 1, got 0"),
        (["--max-grad-norm", "0"], "--max-grad-norm"),
        (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
        (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
        (["--new-run"], "need --save-dir"),
        (["--shard-group-size", "2"], "only applies to strategy 'hybrid'"),
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
        (["--standalone", "--nnodes", "2"], "--standalone runs on one node"),
        (["--master-addr", "h", "--rdzv-endpoint", "h:1"], "name the same thing"),
        (["--rdzv-endpoint", "nohost"], "must be HOST:PORT"),
        (["--rdzv-backend", "etcd"], "'etcd' is not one of 'c10d', 'static'"),
        (["--metrics", "."], "--metrics '.' is a directory"),
        (["--metrics", "/nonexistent/m.jsonl"], "does not exist"),
        (["--save-dir", "/proc/version"], "exists and is not a directory"),
        (["--save-dir", "/proc/version/run"], "cannot be created: '/proc/version' is a file, not a directory"),
        (["--tensorboard", "/proc/version/tb"], "'/proc/version' is a file, not a directory"),
        (["--metrics", "/proc/version/m.jsonl"], "does not exist"),
        (["--bogus"], "no such option: --bogus (see 'fsdpkit train --help')"),
        (["--steps", "x"], "invalid value for '--steps'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_launch(no_launch, args, message):
    result = invoke("train", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert result.stdout == ""


@pytest.mark.parametrize(
    "text, message",
    [
        ("[optimizer]\nlrr = 0.1\n", "unknown setting 'optimizer.lrr' in "),
        ("stepz = 3\n", "unknown setting 'stepz' in "),
        ("[optimiser]\nlr = 0.1\n", "unknown setting 'optimiser' in "),
        ("model = 'gpt2'\n", "setting 'model' in "),
        ("steps = 'ten'\n", "setting 'steps' must be an integer, got 'ten'"),
        ("[data]\nno_sync = 1\n", "setting 'data.no_sync' must be true or false, got 1"),
        ("steps = \n", "is not valid TOML"),
    ],
)
def test_bad_config_file_is_one_line_and_exit_2(no_launch, tmp_path, text, message):
    (tmp_path / "run.toml").write_text(text)
    result = invoke("train", "--config", str(tmp_path / "run.toml"))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_missing_argument_and_missing_config_file_are_one_line():
    result = invoke("convert")
    assert result.exit_code == 2 and result.stderr.strip() == "error: missing argument 'src' (see 'fsdpkit convert --help')"
    result = invoke("train", "--config", "/nonexistent/run.toml")
    assert (
        result.exit_code == 2
        and result.stderr.strip() == "error: cannot read config file '/nonexistent/run.toml': No such file or directory"
    )


def test_report_bad_input(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    result = invoke("report", str(tmp_path / "notes.txt"))
    assert result.exit_code == 2 and "line 1 is not a metrics record" in result.stderr
    result = invoke("report", str(tmp_path / "missing.jsonl"))
    assert result.exit_code == 2 and "is not a file" in result.stderr


@pytest.mark.parametrize("command", [["convert", "src", "dst", "--to", "full"], ["reshard", "src", "dst", "--world-size", "2"]])
def test_chunk_size_beyond_memory_is_refused_before_reading(command, tmp_path):
    result = invoke(*command, "--chunk-size", "1000T")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --chunk-size '1000T' needs two 1000.0 TiB buffers, more than half the ")
    assert len(result.stderr.strip().splitlines()) == 1
