"""`--resume DIR` continues the run it names: the settings that make the run what it is come
from the checkpoint (its training state records the whole config), not from the defaults.

    values, overrides = resume_values(explicit, saved_run(path))

Carried from the checkpoint: the seed, the model, data, sharding (strategy, precision, ...) and
optimizer sections (with the schedule), the step count the run ends at, and how the run saves
(--save-every, --keep-last, --async-save: when this run saves too, given --save-dir; and
--snapshot-every). A value given explicitly (a flag, or a --config file) wins; for a carried
setting other than the step count that differs from the saved one, `overrides` holds one line
naming the setting, the saved value and the new one. The world size, the device, where the run
saves, what it resumes from, logging and launch settings are this run's own: they are never
carried, and changing them says nothing. A checkpoint in another format (foreign.py) carries no
settings: the flags are the run's, --model among them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.live.manager import saved_checkpoint
from ..settings import merge
from .config import SECTIONS, TOP, TrainConfig
from .foreign import check_model_named, foreign_format

CARRIED_SECTIONS = ("model", "data", "sharding", "optimizer")
CARRIED_TOP = ("seed", "steps")
CARRIED_SAVES = ("save_every", "keep_last", "async_save", "snapshot_every")  # of the checkpoint section
NEED_SAVE_DIR = ("save_every", "keep_last", "async_save")  # carried only into a run that saves
SILENT = ("steps",)  # carried as the default, but changing it is the point of many resumes


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint says about the run that wrote it."""

    step_dir: str | Path  # a directory, or an object-store URL
    step: int | None
    run_id: str | None
    values: dict[str, Any]  # its config as plain values ({} when a checkpoint records none)

    @property
    def model(self) -> str | None:
        return (self.values.get("model") or {}).get("name")


def saved_run(path: str | Path) -> SavedRun:
    """The run a checkpoint (a run directory or a step directory) comes from; a missing or
    corrupt checkpoint raises the reader's UsageError / DataCheckError."""
    step_dir, manifest = saved_checkpoint(path)
    state = manifest.training_state or {}
    config = state.get("config")
    return SavedRun(step_dir, state.get("step"), manifest.run_id, dict(config) if isinstance(config, Mapping) else {})


def _flags() -> dict[tuple[str, str], str]:
    return {(section.name, spec.key): spec.long_flag for section in (TOP, *SECTIONS) for spec in section.settings}


def carried_values(saved: Mapping[str, Any], *, saves: bool) -> dict[str, Any]:
    """The part of a saved config a resumed run starts from (keys this version no longer knows
    are left out); `saves`: the resumed run has a --save-dir, so the save cadence comes too."""
    flags = _flags()
    carried: dict[str, Any] = {key: saved[key] for key in CARRIED_TOP if key in saved}
    for name in CARRIED_SECTIONS:
        section = saved.get(name)
        if isinstance(section, Mapping):
            carried[name] = {key: value for key, value in section.items() if (name, key) in flags}
    checkpoint = saved.get("checkpoint")
    if isinstance(checkpoint, Mapping):
        keys = [key for key in CARRIED_SAVES if saves or key not in NEED_SAVE_DIR]
        carried["checkpoint"] = {key: checkpoint[key] for key in keys if key in checkpoint}
    return carried


def resume_values(explicit: Mapping[str, Any], saved: SavedRun) -> tuple[dict[str, Any], list[str]]:
    """`explicit` (nested plain values) over the saved run's carried settings; and one line for
    each explicit value that replaces a different saved one."""
    checkpoint = explicit.get("checkpoint")
    carried = carried_values(saved.values, saves=isinstance(checkpoint, Mapping) and bool(checkpoint.get("save_dir")))
    flags = _flags()
    overrides = []
    for (section, key), flag in flags.items():
        have = carried.get(section, {}) if section else carried
        given = explicit.get(section, {}) if section else explicit
        if not isinstance(have, Mapping) or not isinstance(given, Mapping) or key not in have or key not in given:
            continue
        if key in SILENT and not section:
            continue
        if _plain(given[key]) != _plain(have[key]):
            overrides.append(f"{flag} {_shown(given[key])} replaces {_shown(have[key])} saved in {saved.step_dir}")
    return merge(carried, explicit), overrides


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "value"):  # an enum
        return value.value
    return value


def _shown(value: Any) -> str:
    value = _plain(value)
    if value is None:
        return "(not set)"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(none)"
    return str(value)


def train_config(explicit: Mapping[str, Any], *, where: str = "") -> tuple[TrainConfig, list[str]]:
    """The run's config from explicit values (flags over a config file): over the defaults, or,
    with a resume, over the checkpoint's carried settings; and the override lines."""
    checkpoint, model_section = explicit.get("checkpoint"), explicit.get("model")  # not yet checked to be tables
    checkpoint = checkpoint if isinstance(checkpoint, Mapping) else {}
    model = model_section.get("name") if isinstance(model_section, Mapping) else None
    resume = checkpoint.get("resume")
    for flag, path in (("--resume", resume), ("--init-from", checkpoint.get("init_from"))):
        if path:
            check_model_named(str(path), model, flag)
    if not resume or foreign_format(str(resume)) is not None:  # another format records no fsdpkit settings
        return TrainConfig.from_values(explicit, where=where), []
    values, overrides = resume_values(explicit, saved_run(resume))
    return TrainConfig.from_values(values, where=where), overrides
