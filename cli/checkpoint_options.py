"""What the offline checkpoint commands (convert, reshard, inspect, verify, diff) share: option
help, the parsing of --chunk-size, --dtype and --world-size, and the line that says what was
written.

None of these commands imports torch: they are byte-level copies over fragments
(fsdpkit/checkpoint/format), so peak memory stays bounded by --chunk-size plus a constant.
Results go to stdout (a short text summary, or one JSON document with --json); the progress
bar (bytes) goes to stderr.
"""

from __future__ import annotations

import typer

from fsdpkit.checkpoint.core.report import WriteReport
from fsdpkit.dist.host import available_memory_bytes
from fsdpkit.dtypes import from_spelling
from fsdpkit.errors import UsageError
from fsdpkit.sizes import count, format_size, parse_size

from .common import print_json

CHUNK_HELP = (
    "Bytes read, checked and written at a time; bounds memory. The default (512K) stays in the CPU cache, "
    "which is fastest on local disks (K/M/G = powers of 1024, KB/MB/GB = powers of 1000)."
)
MODEL_KEY_HELP = "DCP input: the top-level key of the model state ('' = the top level); found by itself by default."
OPTIMIZER_KEY_HELP = "DCP input: the top-level key of the optimizer state; found by itself by default."


def cast_name(dtype: str | None) -> str | None:
    """The checkpoint dtype name ("BF16") of a --dtype spelling, None for none."""
    if dtype is None:
        return None
    found = from_spelling(dtype)
    if found is None:
        raise UsageError(f"unknown --dtype {dtype!r}: use bf16, fp16 or fp32")
    return found.name


def chunk_bytes(text: str) -> int:
    """--chunk-size in bytes: at least 1K, and two buffers of it within half the memory available."""
    size = parse_size(text)
    if size < 1024:
        raise UsageError(f"--chunk-size {text!r} is {count(size, 'byte')}; use at least 1K")
    available = available_memory_bytes()
    if 2 * size > available // 2:  # a chunk read ahead while one is written: two buffers
        raise UsageError(
            f"--chunk-size {text!r} needs two {format_size(size)} buffers, more than half the "
            f"{format_size(available)} of memory available: use at most {format_size(available // 4)}"
        )
    return size


def required_world_size(world_size: int | None) -> int:
    """--world-size given (its value is checked by the request it goes into)."""
    if world_size is None:
        raise UsageError("--world-size is required")
    return world_size


def print_written(report: WriteReport, as_json: bool) -> None:
    """What convert or reshard wrote: one JSON document, or one line."""
    if as_json:
        print_json(report.to_json())
    else:
        typer.echo(report.summary_line())
