"""What fsdpkit tells a person while it works, on stderr, one line per message:

    warning: --seq-len 16 replaces 32 saved in run/step-00000100   (a warning: shown under --quiet too)
    launching 2 workers on this node ...                          (a note: shown unless --quiet)

Everything goes through the `fsdpkit` logger with this one format, including Python warnings
(`warnings.warn`, torch's among them): `setup()` routes them here, so no category, source file
or source line reaches the terminal. The CLI calls `setup()` in its process, and fsdpkit's worker
entry points call it in theirs (a spawned worker starts with Python's defaults).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

LOGGER = logging.getLogger("fsdpkit")


def warn(message: str) -> None:
    LOGGER.warning(message)


def note(message: str) -> None:
    LOGGER.info(message)


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = " ".join(record.getMessage().split())
        return f"{record.levelname.lower()}: {text}" if record.levelno >= logging.WARNING else text


class _Stderr(logging.Handler):
    """Writes to whatever sys.stderr is at the time (a test may have replaced it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    warn(str(message))


def setup(*, quiet: bool = False) -> None:
    """Warnings always, notes unless `quiet`, one line each on stderr (idempotent)."""
    if not any(isinstance(handler, _Stderr) for handler in LOGGER.handlers):
        handler = _Stderr()
        handler.setFormatter(_OneLine())
        LOGGER.addHandler(handler)
        LOGGER.propagate = False
    LOGGER.setLevel(logging.WARNING if quiet else logging.INFO)
    warnings.showwarning = _show_warning
