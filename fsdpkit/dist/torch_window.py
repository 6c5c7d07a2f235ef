"""The torch releases fsdpkit supports: OLDEST_TORCH and newer, tested up to NEWEST_TESTED_TORCH.

The check reads the installed torch's version from its package metadata, without importing
torch (seconds), so that a command started under an older torch ends at once with one line.
"""

from __future__ import annotations

import re
from importlib import metadata

from ..errors import UsageError, install_command

OLDEST_TORCH = (2, 11)
NEWEST_TESTED_TORCH = (2, 14)
_RELEASE = re.compile(r"(\d+)\.(\d+)")


def window_text() -> str:
    oldest, newest = (".".join(map(str, release)) for release in (OLDEST_TORCH, NEWEST_TESTED_TORCH))
    return f"torch {oldest} or newer (tested: {oldest} to {newest})"


def check_torch_release(version: str) -> None:
    """UsageError when `version` (a torch version string such as '2.11.0+cu130') is older than
    OLDEST_TORCH; one whose release cannot be read passes."""
    match = _RELEASE.match(version)
    if match and (int(match[1]), int(match[2])) < OLDEST_TORCH:
        raise UsageError(
            f"this environment has torch {version}; fsdpkit needs {window_text()}: "
            + install_command(f"torch>={OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}")
        )


def check_installed_torch() -> None:
    """check_torch_release on the torch installed here; nothing when none is (the commands
    that need it say so)."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return
    check_torch_release(version)
