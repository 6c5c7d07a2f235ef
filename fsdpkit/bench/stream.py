"""Benchmark rows shown as they are measured, not when the run ends.

Global rank 0 appends one JSON line per size to a file that the launching process named
(`append_row`); the launching process follows the file from a thread (`follow_rows`) and hands
each row to a callback. `TableStream` is such a callback: it prints a collective's header at
once, each row as it arrives and the footer when the next table starts, flushing every line
(a terminal and a pipe alike); `finish(report)` prints whatever never arrived (another node's
rank 0 measured it) from the final report, then the side-by-side comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence

from .busbw import BenchSize
from .report import format_variant_comparison, table_footer, table_header, table_row
from .results import BenchReport, SizeResult, size_result

Row = dict[str, tuple[float, int | None] | None]  # mode -> (max-over-ranks mean seconds, wrong elements) or None
RowCallback = Callable[[int, int, Row], None]  # (entry index, size index, row)
POLL_SECONDS = 0.1


def append_row(path: str, entry: int, size: int, row: Row) -> None:
    line = json.dumps({"entry": entry, "size": size, "row": row}) + "\n"
    with open(path, "a") as stream:
        stream.write(line)


@contextlib.contextmanager
def follow_rows(on_row: RowCallback) -> Iterator[str]:
    """A new rows file's path; while the block runs, and once more after it, every complete
    line appended to it goes to `on_row` (from one thread, in order)."""
    fd, path = tempfile.mkstemp(prefix="fsdpkit-bench-rows-", suffix=".jsonl")
    os.close(fd)
    done = threading.Event()
    offset = 0

    def read_new() -> None:
        nonlocal offset
        with open(path, "rb") as stream:
            stream.seek(offset)
            data = stream.read()
        complete = data[: data.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            row = {mode: None if value is None else (value[0], value[1]) for mode, value in record["row"].items()}
            on_row(record["entry"], record["size"], row)

    def follow() -> None:
        while not done.wait(POLL_SECONDS):
            read_new()

    thread = threading.Thread(target=follow, name="bench-rows", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        done.set()
        thread.join()
        try:
            read_new()
        finally:
            os.unlink(path)


class TableStream:
    """Prints the tables of `empty` (the report with no rows yet) as their rows arrive."""

    def __init__(self, empty: BenchReport, sizes: Sequence[Sequence[BenchSize]], write: Callable[[str], None]) -> None:
        self.empty, self.sizes, self.write = empty, sizes, write
        self.rows: list[list[SizeResult]] = [[] for _ in empty.results]
        self.current = -1  # the table whose header is shown and whose footer is not

    def start(self) -> None:
        self._advance_to(0)

    def row(self, entry: int, size: int, row: Row) -> None:
        self._advance_to(entry)
        result = self.empty.results[entry]
        shown = size_result(result.collective, self.empty.world_size, self.sizes[entry][size], row)
        self.rows[entry].append(shown)
        self.write(table_row(self.empty, shown))

    def finish(self, report: BenchReport) -> None:
        """The rest of every table from the final report, then the comparison."""
        for entry in range(max(self.current, 0), len(report.results)):
            self._advance_to(entry, final=report)
            for shown in report.results[entry].rows[len(self.rows[entry]) :]:
                self.rows[entry].append(shown)
                self.write(table_row(report, shown))
        self._close(final=report)
        comparison = format_variant_comparison(report)
        if comparison:
            self.write(comparison)

    def _advance_to(self, entry: int, *, final: BenchReport | None = None) -> None:
        while self.current < entry:
            self._close(final=final)
            self.current += 1
            self.write("\n".join(table_header(self.empty, self.empty.results[self.current])))

    def _close(self, *, final: BenchReport | None) -> None:
        if self.current < 0 or self.current >= len(self.empty.results):
            return
        result = final.results[self.current] if final is not None else self.empty.results[self.current]
        if final is None:
            result = dataclasses.replace(result, rows=tuple(self.rows[self.current]))
        self.write("\n".join(table_footer(self.empty, result)))
