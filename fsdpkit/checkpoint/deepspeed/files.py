"""Which files make a DeepSpeed ZeRO checkpoint (pure path logic, nothing unpickled).

`engine.save_checkpoint(dir)` writes `dir/<tag>/` and `dir/latest` (the tag's name). In the tag
directory: `mp_rank_00_model_states.pt` (ZeRO 1/2) or one `zero_pp_rank_R_mp_rank_00_model_states.pt`
per rank (ZeRO 3), and one `[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per rank.
`resolve` accepts the save directory (through `latest`) or the tag directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataCheckError
from ..core.files import read_regular, source_path
from ..core.names import STEP_PREFIX

LATEST = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
ZERO_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MAX_TAG_BYTES = 4096


@dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed tag directory, in rank order."""

    tag_dir: Path
    tag: str
    model_files: tuple[Path, ...]  # ZeRO 1/2's one model file, or ZeRO 3's in rank order
    optim_files: tuple[Path, ...]  # in rank order
    optim_prefix: str  # "", "bf16_" or "fp16_"


def _holds_rank_files(path: Path) -> bool:
    return path.is_dir() and any(ZERO_OPTIM.match(p.name) or p.name == MODEL_FILE for p in path.iterdir())


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """A tag directory of rank files, or a save directory whose `latest` names one (or names a
    missing tag that is not an fsdpkit step directory: the reader then says what is missing).
    A `latest` that names no plain directory name is left to the fsdpkit reader's message."""
    path = source_path(path)
    if not path.is_dir():
        return False
    if _holds_rank_files(path):
        return True
    if not (path / LATEST).is_file():
        return False
    tag = read_regular(path / LATEST, MAX_TAG_BYTES).decode("utf-8", "replace").strip()
    if not tag or "/" in tag or tag in (".", ".."):
        return False
    if (path / tag).is_dir():
        return _holds_rank_files(path / tag)
    return not tag.startswith(STEP_PREFIX)


def tag_directory(path: Path) -> tuple[Path, str]:
    if (path / LATEST).is_file() and not _holds_rank_files(path):
        tag = read_regular(path / LATEST, MAX_TAG_BYTES).decode("utf-8", "replace").strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise DataCheckError(f"{path / LATEST}: names no usable tag ({tag[:60]!r})")
        if not (path / tag).is_dir():
            raise DataCheckError(f"{path / LATEST}: names tag {tag!r}, but {path / tag} is missing")
        return path / tag, tag
    return path, path.name


def resolve(path: str | os.PathLike[str]) -> DeepSpeedFiles:
    """The rank files of the checkpoint at `path`, numbered 0..N-1 without gaps (DataCheckError)."""
    tag_dir, tag = tag_directory(source_path(path))
    optim: dict[int, Path] = {}
    zero_model: dict[int, Path] = {}
    prefixes = set()
    for name in sorted(p.name for p in tag_dir.iterdir()):
        if (found := ZERO_OPTIM.match(name)) is not None:
            _single_mp(tag_dir / name, found.group(3))
            prefixes.add(found.group(1) or "")
            optim[int(found.group(2))] = tag_dir / name
        elif (found := ZERO_MODEL.match(name)) is not None:
            _single_mp(tag_dir / name, found.group(2))
            zero_model[int(found.group(1))] = tag_dir / name
    if not optim:
        raise DataCheckError(f"{tag_dir}: no ZeRO optimizer files (*zero_pp_rank_N_mp_rank_00_optim_states.pt)")
    if len(prefixes) > 1:
        raise DataCheckError(f"{tag_dir}: optimizer files of several kinds ({', '.join(sorted(p or 'fp32' for p in prefixes))})")
    _no_gaps(tag_dir, "optimizer", optim)
    if zero_model:
        _no_gaps(tag_dir, "model", zero_model)
    model_files = (tag_dir / MODEL_FILE,) if (tag_dir / MODEL_FILE).exists() else tuple(zero_model[r] for r in sorted(zero_model))
    if not model_files:
        raise DataCheckError(f"{tag_dir}: no model states file ({MODEL_FILE} or zero_pp_rank_N_mp_rank_00_model_states.pt)")
    return DeepSpeedFiles(tag_dir, tag, model_files, tuple(optim[r] for r in sorted(optim)), prefixes.pop())


def _single_mp(path: Path, mp_rank: str) -> None:
    if int(mp_rank) != 0:
        raise DataCheckError(f"{path}: model-parallel rank {int(mp_rank)}; fsdpkit reads DeepSpeed checkpoints without model parallelism")


def _no_gaps(tag_dir: Path, kind: str, files: dict[int, Path]) -> None:
    missing = sorted(set(range(max(files) + 1)) - set(files))
    if missing:
        raise DataCheckError(f"{tag_dir}: {kind} file of rank {missing[0]} is missing (found ranks {sorted(files)})")
