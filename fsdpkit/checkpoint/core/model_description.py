"""A model's units, tied parameters and export recipe for the offline commands, without torch
in their process: `fsdpkit.models.units` builds the model on the meta device in a child
process, which exits before any checkpoint byte is copied, so torch's memory is never held
beside the copy's."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from ...errors import UsageError
from .export import HfExport


@dataclass(frozen=True)
class ModelDescription:
    units: list[list[tuple[str, tuple[int, ...]]]]  # the flat-parameter units the engine shards the model into: (name, shape)
    aliases: dict[str, str]  # tied parameters: {other name: canonical name}
    export: HfExport | None  # what `convert --to full` writes for transformers


def describe(model: str) -> ModelDescription:
    """Model `model` (a spec as `--model` takes it), described by a child process."""
    done = subprocess.run([sys.executable, "-m", "fsdpkit.models.units", model], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise UsageError(lines[-1] if done.returncode == 2 else f"--model {model!r}: building it failed: {lines[-1]}")
    document = json.loads(done.stdout)
    units = [[(name, tuple(shape)) for name, shape in unit] for unit in document["units"]]
    export = document["export"]
    return ModelDescription(
        units,
        dict(document["aliases"]),
        None if export is None else HfExport.from_json(export, where=f"model {model!r}"),
    )
