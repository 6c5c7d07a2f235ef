"""The torch releases fsdpkit supports: OLDEST_TORCH and newer, tested up to NEWEST_TESTED_TORCH.

The check reads the installed torch's version without importing torch (seconds), so that a
command started under an older torch ends at once with one line: from torch's own version.py,
which names the build as torch.__version__ does ('2.11.0+cu130'), where the package metadata
of a wheel from PyPI says only '2.11.0'; from the metadata when that file cannot be read.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

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


def installed_torch_version() -> str | None:
    """torch.__version__ of the torch installed here, build included; None when none is."""
    spec = importlib.util.find_spec("torch")
    for directory in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            tree = ast.parse((Path(directory) / "version.py").read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if [getattr(target, "id", None) for target in node.targets] == ["__version__"]:
                    return str(node.value.value)
    from importlib import metadata  # a tenth of a second of imports, for a torch without version.py only

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_installed_torch() -> None:
    """check_torch_release on the torch installed here; nothing when none is (the commands
    that need it say so)."""
    version = installed_torch_version()
    if version is not None:
        check_torch_release(version)
