"""Experiment trackers on rank 0: Weights & Biases (--wandb PROJECT[/RUN]) and MLflow
(--mlflow, at --mlflow-uri, else $MLFLOW_TRACKING_URI, else a local mlruns/ directory). Each
gets the run's whole config once, then every step's record (what --metrics writes: loss, eval
loss, lr, tokens/s, memory, grad norm).

A tracker's run id is kept in each checkpoint's training state (`trackers`), so a run resumed
from it continues the same tracker run; a restarted attempt skips the steps the failed one
already logged (`logged_through`), so each step is logged once.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from ..errors import UsageError, install_hint

TRACKED_CONFIG_NAME = "fsdpkit"
MLFLOW_FILE_STORE_OPT_IN = "MLFLOW_ALLOW_FILE_STORE"
MLFLOW_URI_ENV = "MLFLOW_TRACKING_URI"
MLFLOW_DEFAULT_DIRECTORY = "mlruns"


class Tracker(Protocol):
    name: str
    run_id: str

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def mlflow_uri(given: str | None) -> str:
    """Where --mlflow logs: --mlflow-uri, else MLflow's own environment variable, else ./mlruns."""
    return given or os.environ.get(MLFLOW_URI_ENV) or MLFLOW_DEFAULT_DIRECTORY


def check_installed(*, wandb: bool, mlflow: bool) -> None:
    """Before launch: the libraries the chosen trackers need."""
    import importlib.util

    if wandb and importlib.util.find_spec("wandb") is None:
        raise UsageError(f"--wandb needs the wandb package: {install_hint('wandb')}")
    if mlflow and importlib.util.find_spec("mlflow") is None:
        raise UsageError(f"--mlflow needs the mlflow package: {install_hint('mlflow')}")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in record.items() if name != "step" and isinstance(value, (int, float))}


def flat_config(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys with plain values ("optimizer.lr": 0.003)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return flat


class WandbTracker:
    name = "wandb"

    def __init__(self, spec: str, config: dict[str, Any], *, run_id: str | None, directory: str | None) -> None:
        import wandb

        project, _, run_name = spec.partition("/")
        if not project:
            raise UsageError(f"--wandb {spec!r}: give PROJECT or PROJECT/RUN")
        self._run = wandb.init(
            project=project,
            name=run_name or None,
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            dir=directory,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = self._run.id

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=int(record["step"]), commit=True)  # sent now, not when the next step comes

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, config: dict[str, Any], *, run_id: str | None, experiment: str = TRACKED_CONFIG_NAME) -> None:
        from mlflow.tracking import MlflowClient

        if "://" not in uri:  # a local directory: MLflow's file store, which MLflow 3 keeps behind an opt-in
            uri = "file://" + os.path.abspath(uri)
            os.environ.setdefault(MLFLOW_FILE_STORE_OPT_IN, "true")
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
            run_id = self._client.create_run(experiment_id).info.run_id
            for key, value in flat_config(config).items():
                self._client.log_param(run_id, key, value)
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(record["step"]), _millis()
        metrics = [Metric(name, value, now, step) for name, value in scalars(record).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _millis() -> int:
    import time

    return int(time.time() * 1000)


class Trackers:
    """The trackers of a run on rank 0; `ids` go into the checkpoint's training state."""

    def __init__(self, trackers: list[Tracker], *, logged_through: int = 0) -> None:
        self.trackers = trackers
        self.logged_through = logged_through

    @property
    def ids(self) -> dict[str, str]:
        return {tracker.name: tracker.run_id for tracker in self.trackers}

    def log(self, record: dict[str, Any]) -> None:
        if record["step"] <= self.logged_through:
            return
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(
    *,
    wandb: str | None,
    mlflow: str | None,
    config: dict[str, Any],
    saved_ids: dict[str, str],
    logged_through: int,
    directory: str | None = None,
) -> Trackers:
    """`saved_ids`: the checkpoint's tracker run ids (a resumed or restarted run continues them)."""
    opened: list[Tracker] = []
    if wandb:
        opened.append(WandbTracker(wandb, config, run_id=saved_ids.get("wandb"), directory=directory))
    if mlflow:
        opened.append(MlflowTracker(mlflow, config, run_id=saved_ids.get("mlflow")))
    return Trackers(opened, logged_through=logged_through)
