"""A count of bytes done, shown on stderr (the command line's, a spread run's rank 0): a tqdm
bar on a terminal, otherwise one plain line every LINE_SECONDS, since a log gets no carriage
returns. Results are never shown here: they are stdout's."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

LINE_SECONDS = 10.0

ByteProgress = Callable[[int, int], None]  # (bytes just done, bytes in all)


def stderr_progress(desc: str) -> tuple[ByteProgress, Callable[[], None]]:
    """(show, close) of a count of bytes on stderr, labelled `desc`."""
    from .sizes import format_size

    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr, leave=False)

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
                bar.refresh()
            if done:
                bar.update(done)

        return update, bar.close
    done_bytes, shown_at = [0], [time.monotonic()]

    def line(done: int, total: int) -> None:
        done_bytes[0] += done
        now = time.monotonic()
        if now - shown_at[0] >= LINE_SECONDS:
            shown_at[0] = now
            share = f" ({100 * done_bytes[0] / total:.0f}%)" if total else ""
            sys.stderr.write(f"{desc}: {format_size(done_bytes[0])} of {format_size(total)}{share}\n")
            sys.stderr.flush()

    return line, lambda: None


@contextlib.contextmanager
def byte_progress(desc: str) -> Iterator[ByteProgress]:
    """The `show` of stderr_progress for the block, closed when it ends."""
    show, close = stderr_progress(desc)
    try:
        yield show
    finally:
        close()
