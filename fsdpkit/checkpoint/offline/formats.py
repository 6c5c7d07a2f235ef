"""Every checkpoint format fsdpkit reads, by its one name (the one `convert --to`, the `--json`
reports and `open_checkpoint(...).format` use): FORMATS, one `Format` (core/protocol.py) per
format, each implemented in its own package. `detect_format` is the only place that tells a
format; `convert` is `FORMATS[to].write(open(src))` (convert.py), and `inspect`, `verify` and
`reshard` go through the format too. Adding a format is its package and one entry here.
Reading the table imports no torch: the offline side of every format is pure Python.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import UsageError
from ..core.any_checkpoint import AnyCheckpoint
from ..core.protocol import Format
from ..core.request import Keys
from ..dcp.format import DcpFormat
from ..deepspeed.format import DeepSpeedFormat
from ..format.format import ShardedFormat
from ..format.full_format import FullFormat
from ..torchsave.format import TorchSaveFormat

# In the order messages list them. A DeepSpeed save directory has a `latest` as fsdpkit's run
# directory does: `detect_format` tries fsdpkit's own format last.
FORMATS: dict[str, Format] = {f.name: f for f in (ShardedFormat(), DcpFormat(), DeepSpeedFormat(), TorchSaveFormat(), FullFormat())}
SHARDED, DCP, DEEPSPEED, TORCH_SAVE, FULL = ShardedFormat.name, DcpFormat.name, DeepSpeedFormat.name, TorchSaveFormat.name, FullFormat.name
READ_LABELS = ", ".join(f.label for f in FORMATS.values())  # "fsdpkit, DCP, DeepSpeed, verl, full safetensors"
RESHARD_LABELS = ", ".join(f.label for f in FORMATS.values() if f.reshardable)
TARGETS = tuple(name for name, found in FORMATS.items() if found.writable)
CONVERT_HELP = f"Convert a checkpoint ({READ_LABELS}) --to {', '.join(TARGETS[:-1])} or {TARGETS[-1]}."


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of the checkpoint at `path`; a UsageError when it is none that fsdpkit reads
    (the format's reader then says what is wrong inside it)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: does not exist")
    for found in sorted(FORMATS.values(), key=lambda f: f.name == SHARDED):
        if found.detect(path):
            return found
    raise UsageError(f"{path}: not a checkpoint fsdpkit reads ({READ_LABELS})")


def open_checkpoint(path: str | os.PathLike[str], *, model_key: str | None = None, optimizer_key: str | None = None) -> AnyCheckpoint:
    """The checkpoint at `path` in any format (`model_key`, `optimizer_key`: a DCP checkpoint's, as `Keys`)."""
    found = detect_format(path)
    opened = found.open(Path(path), Keys(model_key, optimizer_key))
    opened.format, opened.opened_from = found.name, str(path)
    return opened
