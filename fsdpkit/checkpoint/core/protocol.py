"""`Format`: what each checkpoint format's package implements, in a module of its own
(`<package>/format.py`), for the registry (`offline.formats.FORMATS`) and the offline commands
to use every format the same way. Nothing here reads a checkpoint.

A format that `convert` cannot write says so with `writable = False`, one that `reshard` cannot
lay out for another world size with `reshardable = False`; the registry then refuses the
command with a message naming what to do instead, and never calls that method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .any_checkpoint import AnyCheckpoint
from .report import VerifyReport, WriteReport
from .request import ConvertRequest, Keys, Options, Progress, ReshardRequest
from .summary import Summary


class Format(Protocol):
    name: str  # the one name: `convert --to`, the `--json` reports and `open_checkpoint(...).format` use it
    label: str  # how help and messages name it
    reads: Options  # the options `open` takes
    writes: Options  # the options `write` takes
    writable: bool  # `convert --to` it
    reshardable: bool  # `reshard` lays it out for another world size

    def detect(self, path: Path) -> bool:
        """Whether the checkpoint at `path` is of this format (cheap: names and headers only)."""
        ...

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        """The checkpoint at `path` as a table of named tensors (`keys`: a DCP checkpoint's)."""
        ...

    def inspect(self, path: Path, keys: Keys) -> Summary:
        """The summary `inspect` prints."""
        ...

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        """Every check the format allows; a checkpoint that cannot be opened is a failed report."""
        ...

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        """`convert --to` this format: `opened` written at `dst` (staged, renamed when complete)."""
        ...

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        """`reshard`: the checkpoint at `src` laid out for `request.world_size` ranks at `dst`."""
        ...
