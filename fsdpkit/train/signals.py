"""Signals in a training worker.

SIGTERM (a scheduler's notice, passed on by fsdpkit's launcher or sent by torchrun's agent)
asks the run to stop after the current step: `requested` is set, the ranks agree on it at
the end of every step (one more number in the loss's all-reduce), so all stop after the same
step, save, and exit 0. A worker started after the launcher got SIGTERM (STOP_ENV) stops
after its first step. SIGINT stops now: KeyboardInterrupt, once (the launcher may pass on a
Ctrl-C the worker already got from the terminal).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from ..dist.launch import STOP_ENV


class StopSignals:
    def __init__(self) -> None:
        self.requested = os.environ.get(STOP_ENV) == "1"
        self._interrupted = False
        self._previous: dict[int, Any] = {}

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, less once SIGTERM has come."""
        end = time.monotonic() + seconds
        while not self.requested and time.monotonic() < end:
            time.sleep(0.05)

    def _on_terminate(self, signum: int, frame: Any) -> None:
        self.requested = True

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        if not self._interrupted:
            self._interrupted = True
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {
                signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_terminate),
                signal.SIGINT: signal.signal(signal.SIGINT, self._on_interrupt),
            }
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
