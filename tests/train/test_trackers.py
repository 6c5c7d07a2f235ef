"""--wandb and --mlflow through the real libraries, offline: a run and its resume log the whole
config once and every step once into one tracker run, with the values --metrics writes. The
oracle is what each library reads back from what it wrote (MLflow's client, W&B's own
record reader over its offline run files)."""

from __future__ import annotations

import json

import pytest
from fsdpkit_cli.app import app
from typer.testing import CliRunner

from fsdpkit.checkpoint.format.manifest import load_manifest
from fsdpkit.checkpoint.format.storage import resolve_checkpoint
from fsdpkit.train.trackers import MlflowTracker, Trackers

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
    root = tmp_path_factory.mktemp("tracked")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}
    common = ["--model", "gpt-tiny", "--seq-len", "16", "--global-batch-size", "4", "--nproc-per-node", "2", "--json"]
    trackers = ["--wandb", "fsdpkit-test/first", "--mlflow", str(root / "mlruns"), "--metrics", str(root / "metrics.jsonl")]
    first = runner.invoke(app, ["train", *common, *trackers, "--steps", "2", "--save-dir", str(root / "run")], env=env)
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(
        app, ["train", *common, *trackers, "--steps", "4", "--resume", str(root / "run"), "--save-dir", str(root / "run")], env=env
    )
    assert resumed.exit_code == 0, resumed.output
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    ids = load_manifest(resolve_checkpoint(root / "run")).training_state["trackers"]
    return root, metrics, ids


def test_mlflow_holds_the_config_once_and_each_step_once_in_one_run(tracked):
    root, metrics, ids = tracked
    client = mlflow.tracking.MlflowClient(tracking_uri="file://" + str(root / "mlruns"))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [run.info.run_id for run in runs] == [ids["mlflow"]]
    params = runs[0].data.params
    assert params["optimizer.lr"] == "0.003" and params["data.seq_len"] == "16" and params["model.name"] == "gpt-tiny"
    for name in ("loss", "lr", "tokens_per_second", "peak_memory_bytes"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], name))
        assert history == [(r["step"], pytest.approx(r[name])) for r in metrics], name


def test_wandb_offline_holds_each_step_once_under_the_saved_run_id(tracked):
    root, metrics, ids = tracked
    runs = sorted(root.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith(ids["wandb"]) for run in runs)  # the resume continued the same run
    history = wandb_history(root)
    assert history["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in metrics]
    assert history["lr"] == [(r["step"], pytest.approx(r["lr"])) for r in metrics]
    assert history["config.optimizer"][0][1]["lr"] == 0.003 and history["config.data"][0][1]["seq_len"] == 16


def test_a_restarted_attempt_logs_only_the_steps_not_yet_logged(tmp_path):
    tracker = MlflowTracker(str(tmp_path / "mlruns"), {"steps": 3}, run_id=None)
    trackers = Trackers([tracker], logged_through=2)
    for step in (1, 2, 3):
        trackers.log({"step": step, "loss": float(step)})
    trackers.close()
    client = mlflow.tracking.MlflowClient(tracking_uri="file://" + str(tmp_path / "mlruns"))
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss")] == [(3, 3.0)]


def test_without_the_library_one_line_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    result = runner.invoke(app, ["train", "--wandb", "p", "--steps", "1"])
    assert result.exit_code == 2 and "pip install 'fsdpkit[wandb]'" in result.stderr
