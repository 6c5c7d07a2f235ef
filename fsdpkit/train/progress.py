"""What rank 0 shows on stderr while training: a tqdm bar when stderr is a terminal, otherwise
one plain line every N steps or S seconds (a log file gets no carriage returns), or nothing
(--quiet). And the one throughput figure every output uses."""

from __future__ import annotations

import enum
import sys
import time
from typing import TextIO


class ProgressMode(enum.Enum):
    BAR = "bar"
    LINES = "lines"
    NONE = "none"


def progress_mode(*, quiet: bool, shown: bool, stream: TextIO) -> ProgressMode:
    if quiet or not shown:
        return ProgressMode.NONE
    return ProgressMode.BAR if stream.isatty() else ProgressMode.LINES


class Throughput:
    """Tokens per second over the global batch: global batch x sequence length per training
    step, divided by the training steps' time (forward, backward, optimizer; not evaluation
    or saving), excluding the first step this process runs (warm-up)."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.steps_seen = 0
        self.counted_steps = 0
        self.counted_seconds = 0.0

    def add(self, step_seconds: float) -> None:
        self.steps_seen += 1
        if self.steps_seen > 1:
            self.counted_steps += 1
            self.counted_seconds += step_seconds

    @property
    def tokens_per_second(self) -> float | None:
        if not self.counted_steps or self.counted_seconds <= 0:
            return None
        return self.tokens_per_step * self.counted_steps / self.counted_seconds


class Progress:
    def __init__(
        self, mode: ProgressMode, *, total: int, initial: int, every_steps: int, every_seconds: float, stream: TextIO = sys.stderr
    ) -> None:
        self.mode = mode
        self.total = total
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.stream = stream
        self.started = self.last_line = time.monotonic()
        self.bar = None
        if mode is ProgressMode.BAR:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=stream, dynamic_ncols=True)

    def update(self, step: int, *, loss: float, tokens_per_second: float | None) -> None:
        rate = "-" if tokens_per_second is None else f"{tokens_per_second:,.0f}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, tokens/s {rate}", refresh=False)
            self.bar.update(1)
            return
        if self.mode is ProgressMode.NONE:
            return
        now = time.monotonic()
        if step % self.every_steps == 0 or step == self.total or now - self.last_line >= self.every_seconds:
            self.last_line = now
            self.stream.write(f"step {step}/{self.total}  loss {loss:.4f}  tokens/s {rate}  elapsed {now - self.started:.1f}s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
