"""benchmarks/gpu_check.sh without a GPU: its dry run prints every part's command, each fsdpkit
command parses against the real command-line app and the engine benchmark's against its parser;
and its report (benchmarks/plan_gpu_check.py) gathers parts that ran and parts that failed."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run() -> list[tuple[str, list[str]]]:
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": "/nonexistent/results"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh")], env=env, capture_output=True, text=True, check=True)
    return [(line.split("\t")[0], shlex.split(line.split("\t")[1])) for line in done.stdout.splitlines()]


def test_dry_run_commands_parse_against_the_real_cli(monkeypatch, capsys):
    docs = _module(ROOT / "tests/cli/test_docs.py", "gpu_check_docs")
    parts = _dry_run()
    names = [name for name, _ in parts]
    assert names == [
        *("compat_straight", "compat_save", "compat_resume", "engine", "plan"),
        *("plain", "snapshot", "async_save", "compile", "snapshot_check", "report"),
    ]
    assert not os.path.exists("/nonexistent/results")  # a dry run writes nothing
    checked = 0
    for name, words in parts:
        arguments = docs.fsdpkit_arguments(shlex.join(words))
        if arguments is None:
            continue
        docs.check_command(arguments, monkeypatch)
        assert "error:" not in capsys.readouterr().err, name
        checked += 1
    assert checked == 8
    engine_words = dict(parts)["engine"]
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", engine_words[1:])
    args = _module(ROOT / "benchmarks/engine.py", "gpu_check_engine").parse_args()
    assert (args.model, args.batch, args.seq_len, args.mixed_precision) == ("gpt2-xl", 8, 1024, "bf16")


def _write(results: Path, name: str, rc: int, seconds: int, document: dict | None, err: str = "") -> None:
    with (results / "parts.tsv").open("a") as tsv:
        tsv.write(f"{name}\t{rc}\t{seconds}\n")
    (results / f"{name}.out").write_text("a progress line\n" + (json.dumps(document) + "\n" if document else ""))
    (results / f"{name}.err").write_text(err)


def test_report_gathers_parts_and_records_failures(tmp_path):
    run = {"elapsed_seconds": 20.0, "tokens_per_second": 40000.0, "step_tokens_per_second": 41000.0, "save_stall_s": 0.0}
    losses = [10.0 - 0.1 * step for step in range(40)]
    _write(tmp_path, "compat_straight", 0, 12, {"losses": losses})
    _write(tmp_path, "compat_resume", 0, 9, {"losses": losses[20:]})
    rows = [
        {"system": "fsdpkit", "step_ms_median": 250.0, "step_ms_min": 249.0, "step_ms_max": 252.0, "model_tflops_per_gpu": 300.0},
        {"system": "fsdp2", "step_ms_median": 350.0, "step_ms_min": 349.0, "step_ms_max": 351.0, "model_tflops_per_gpu": 219.0},
    ]
    _write(tmp_path, "engine", 0, 100, {"rows": rows})
    _write(tmp_path, "plan", 0, 6, {"hardware": "h200-ib400", "step_time_s": 0.2, "mfu": 0.4, "terms": {"matmul_s": 0.15}})
    _write(tmp_path, "plain", 0, 40, run)
    _write(tmp_path, "snapshot", 0, 41, {**run, "elapsed_seconds": 21.0})
    _write(tmp_path, "compile", 2, 1, None, err="Traceback\nerror: no such option: --compile\n")
    _write(tmp_path, "async_save", 124, 80, None)
    held = {"tensors": 3, "bitwise_equal": True, "wrong": [], "changed_after": 3}
    _write(tmp_path, "snapshot_check", 0, 20, {"step": 3, "async_save": held, "snapshot": held, "holds_its_step": True})
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/plan_gpu_check.py"), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr  # two parts failed
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["compat"] == {"bitwise_equal": True, "steps_compared": 20}
    assert report["snapshot_check"]["holds_its_step"] is True and report["snapshot_check"]["async_save"] == held
    assert report["parts"]["compile"]["error"] == "error: no such option: --compile"
    assert report["parts"]["async_save"]["error"] == "timed out"
    assert report["runs"]["snapshot"]["elapsed_vs_plain"] == pytest.approx(21.0 / 20.0)
    assert report["plan"]["predicted_over_measured"] == pytest.approx(0.2 / 0.25)
    assert [row["system"] for row in report["engine"]] == ["fsdpkit", "fsdp2"]
    assert "0.80x" in done.stdout and (tmp_path / "gpu-check.md").read_text().strip() == done.stdout.strip()
    _write(tmp_path, "compat_save", 0, 9, None)
    (tmp_path / "compat_resume.out").write_text(json.dumps({"losses": [*losses[20:39], 0.0]}) + "\n")
    subprocess.run([sys.executable, str(ROOT / "benchmarks/plan_gpu_check.py"), str(tmp_path)], capture_output=True, check=False)
    assert json.loads((tmp_path / "gpu-check.json").read_text())["compat"]["bitwise_equal"] is False


def test_snapshot_check_runs_on_cpu_and_finds_its_step_in_both_saves():
    """benchmarks/snapshot_check.py, the part that needs the GPU's streams to mean much, run here on
    CPU at a small width: both saves hold the step they name and the steps after changed every tensor."""
    command = [sys.executable, str(ROOT / "benchmarks/snapshot_check.py"), "--device", "cpu", "--n-embd", "64", "--n-layer", "2", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["holds_its_step"] is True
    for kind in ("async_save", "snapshot"):
        assert result[kind]["bitwise_equal"] and result[kind]["tensors"] == result[kind]["changed_after"] > 0, result
