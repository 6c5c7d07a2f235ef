"""`--resume DIR` and `--init-from DIR` of a checkpoint in another format: torch DCP, DeepSpeed
ZeRO, or (for --resume) full safetensors.

Before launch, the checkpoint is converted, as `fsdpkit convert --to sharded --world-size W
--model NAME` converts it, into an fsdpkit checkpoint for the run's world size: the model's
weights and, when the source holds it, the optimizer state (AdamW's moments and step, the
param groups) and the step. The run then resumes (or starts) from that checkpoint, which lives
in a hidden directory of the `--save-dir` (of the system's temporary directory without one)
and is removed when the run ends. Such a checkpoint records no fsdpkit settings, so `--model`
must name the model; the other settings are the flags'. A full checkpoint is read directly by
--init-from; its optimizer files come with a --resume when they are there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .. import log
from ..checkpoint.core.any_checkpoint import recorded_data_source
from ..checkpoint.offline.formats import FULL, SHARDED, detect_format, open_checkpoint
from ..checkpoint.storage.location import is_url
from ..errors import UsageError
from ..paths import check_writable_directory
from .config import TrainConfig

HOLDER_PREFIX = ".fsdpkit-converted-"


def foreign_format(path: str | None, *, init_from: bool = False) -> str | None:
    """The format of `path` when the run must convert it first (None: read it as it is)."""
    if not path or not Path(path).exists():
        return None  # the reader says what is wrong
    found = detect_format(path).name
    return None if found == SHARDED or (init_from and found == FULL) else found


def check_model_named(path: str, explicit_model: str | None, flag: str) -> None:
    """A converted checkpoint records no settings: --model must name its model. The checkpoint is
    read first, so a corrupt or truncated one is called that (DataCheckError), whatever the flags."""
    found = foreign_format(path, init_from=flag == "--init-from")
    if found is None:
        return
    with open_checkpoint(path):
        pass
    if not explicit_model:
        raise UsageError(f"{flag} {path} is a {found} checkpoint, which records no fsdpkit settings: name its model with --model")


@contextlib.contextmanager
def converted(config: TrainConfig, world_size: int) -> Iterator[TrainConfig]:
    """`config`, its --resume or --init-from pointing at an fsdpkit checkpoint converted for
    `world_size` ranks when it named another format (removed on leaving)."""
    checkpoint = config.checkpoint
    field = "resume" if checkpoint.resume else "init_from"
    source = checkpoint.resume or checkpoint.init_from
    found = foreign_format(source, init_from=field == "init_from")
    if source is None or found is None:
        yield config
        return
    if field == "resume":
        _note_other_data(source, config.data.source)
    holder = Path(tempfile.mkdtemp(prefix=HOLDER_PREFIX, dir=_holder_parent(checkpoint.save_dir)))
    try:
        target = holder / "checkpoint"
        log.note(f"converting the {found} checkpoint {source} for {world_size} ranks of {config.model.name} into {target}")
        _convert(Path(source), target, config.model.name, world_size)
        if field == "resume":
            local = dataclasses.replace(checkpoint, resume=str(target))
        else:
            local = dataclasses.replace(checkpoint, init_from=str(target))
        yield dataclasses.replace(config, checkpoint=local)
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def _note_other_data(source: str, data: str) -> None:
    """One line when the checkpoint records the data its run trained on and this run reads other
    data: its loss starts where that data, not this one, left it."""
    with open_checkpoint(source) as opened:
        recorded = recorded_data_source(opened)
    if recorded is not None and recorded != data:
        log.note(f"--data {data}: {source} was trained on {recorded}; the resumed run reads other data")


def _holder_parent(save_dir: str | None) -> str | None:
    if save_dir is None or is_url(save_dir):
        return None
    check_writable_directory(save_dir, "--save-dir")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return save_dir


def _convert(source: Path, target: Path, model: str, world_size: int) -> None:
    from ..checkpoint.core.request import ConvertRequest
    from ..checkpoint.offline.formats import convert_any

    convert_any(source, target, ConvertRequest(to="sharded", world_size=world_size, model=model))
