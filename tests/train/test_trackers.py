"""--wandb and --mlflow through the real libraries, offline: a run whose worker is killed and
restarted, and its resume, log the whole config once and every step once into one tracker run,
with the values --metrics writes. The
oracle is what each library reads back from what it wrote (MLflow's client, W&B's own
record reader over its offline run files)."""

from __future__ import annotations

import json
import os

import pytest
from fsdpkit_cli.app import app
from typer.testing import CliRunner

from fsdpkit.checkpoint.format.manifest import load_manifest
from fsdpkit.checkpoint.format.storage import resolve_checkpoint
from fsdpkit.dist.faults import FAULT_ENV

mlflow = pytest.importorskip("mlflow", reason="the [mlflow] extra (make install installs it)")
wandb = pytest.importorskip("wandb", reason="the [wandb] extra (make install installs it)")

runner = CliRunner()


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading back a local mlruns/ directory


def wandb_records(path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte W&B header, then LevelDB's log format (32 KiB
    blocks of chunks, each a 7-byte header: CRC, length, type FULL/FIRST/MIDDLE/LAST)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, at, block = [], b"", 7, 32768
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        chunk, at = data[at + 7 : at + 7 + length], at + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def wandb_history(wandb_dir) -> dict[str, list[tuple[int, float]]]:
    """Every history record W&B wrote offline under `wandb_dir`, parsed with W&B's own protobuf."""
    from wandb.proto import wandb_internal_pb2

    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "run":
                for item in record.run.config.update:
                    series.setdefault("config." + item.key, []).append((0, json.loads(item.value_json)))
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    series.setdefault(key, []).append((int(items["_step"]), value))
    return series


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Two launches into one run: 3 steps in which rank 1 is killed after step 3 (--max-restarts 1:
    the group restarts from step 2's checkpoint and runs step 3 again), MLflow at its default
    ./mlruns; then a resume to step 5 with --mlflow-uri naming that same directory."""
    root = tmp_path_factory.mktemp("tracked")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}
    env |= {"MLFLOW_TRACKING_URI": None, "OMP_NUM_THREADS": "1"}
    common = ["--model", "gpt-tiny", "--seq-len", "16", "--global-batch-size", "4", "--nproc-per-node", "2", "--json"]
    common += ["--wandb", "fsdpkit-test/first", "--mlflow", "--metrics", str(root / "metrics.jsonl"), "--save-dir", str(root / "run")]
    cwd = os.getcwd()
    os.chdir(root)  # the workers inherit it: --mlflow without --mlflow-uri writes ./mlruns
    try:
        first = runner.invoke(
            app, ["train", *common, "--steps", "3", "--save-every", "2", "--max-restarts", "1"], env={**env, FAULT_ENV: "kill:1:3"}
        )
    finally:
        os.chdir(cwd)
    assert first.exit_code == 0, first.output
    summary = json.loads(first.stdout)
    assert summary["restarts"] == 1 and summary["steps_redone"] == 1, summary
    resumed = runner.invoke(
        app, ["train", *common, "--steps", "5", "--resume", str(root / "run"), "--mlflow-uri", str(root / "mlruns")], env=env
    )
    assert resumed.exit_code == 0, resumed.output
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5]
    ids = load_manifest(resolve_checkpoint(root / "run")).training_state["trackers"]
    return root, metrics, ids


def test_mlflow_holds_the_config_once_and_each_step_once_in_one_run(tracked):
    root, metrics, ids = tracked
    client = mlflow.tracking.MlflowClient(tracking_uri="file://" + str(root / "mlruns"))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [run.info.run_id for run in runs] == [ids["mlflow"]]
    params = runs[0].data.params
    assert params["optimizer.lr"] == "0.003" and params["data.seq_len"] == "16" and params["model.name"] == "gpt-tiny"
    for name in ("loss", "lr"):  # step 3 as the killed attempt logged it, equal to its redone value
        history = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], name))
        assert history == [(r["step"], pytest.approx(r[name])) for r in metrics], name
    for name in ("tokens_per_second", "peak_memory_bytes"):  # timings and memory differ between attempts
        assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], name)) == [1, 2, 3, 4, 5], name


def test_wandb_offline_holds_each_step_once_under_the_saved_run_id(tracked):
    root, metrics, ids = tracked
    runs = sorted(root.glob("wandb/offline-run-*"))
    # the killed attempt, the restarted one and the resume: one W&B run
    assert len(runs) == 3 and all(run.name.endswith(ids["wandb"]) for run in runs)
    history = wandb_history(root)
    assert history["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in metrics]
    assert history["lr"] == [(r["step"], pytest.approx(r["lr"])) for r in metrics]
    assert history["config.optimizer"][0][1]["lr"] == 0.003 and history["config.data"][0][1]["seq_len"] == 16


def test_mlflow_uri_without_mlflow_is_one_line_before_launch():
    result = runner.invoke(app, ["train", "--mlflow-uri", "mlruns", "--steps", "1"])
    assert result.exit_code == 2 and result.stderr.strip().count("\n") == 0
    assert "--mlflow-uri 'mlruns' is where --mlflow logs: give --mlflow too" in result.stderr


def test_without_the_library_one_line_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    result = runner.invoke(app, ["train", "--wandb", "p", "--steps", "1"])
    assert result.exit_code == 2 and "pip install 'fsdpkit[wandb]'" in result.stderr
