"""The `fsdpkit` console script: the CLI imported and run inside one handler, so that Ctrl-C at
any moment, the imports of the first second included, ends with `error: interrupted` and exit
130, never a traceback.

A KeyboardInterrupt can be swallowed by code that catches everything (an optional import
somewhere below torch, say); the SIGINT handler therefore also leaves a mark in the
environment (INTERRUPTED_ENV), which `fsdpkit.dist.launch` checks before it starts any worker.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

INTERRUPTED_ENV = "FSDPKIT_INTERRUPTED"  # fsdpkit.dist.launch reads the same name


def _interrupt(signum: int, frame: Any) -> None:
    os.environ[INTERRUPTED_ENV] = "1"
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGINT, _interrupt)
    try:
        from .app import main as run

        run()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
