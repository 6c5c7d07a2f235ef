"""The `fsdpkit` console script: the CLI imported and run inside one handler, so that Ctrl-C at
any moment, the imports of the first second included, ends with `error: interrupted` and exit
130, never a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .app import main as run

        run()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
