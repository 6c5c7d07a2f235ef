"""Exception types and the exit codes the CLI maps them to.

UsageError: the user asked for something that cannot work (exit 2).
RunError: a run failed, e.g. a worker died (exit 1).
DataCheckError: data failed a check: a corrupt checkpoint, a wrong benchmark result (exit 3).

`install_hint(extra)` is what every message about an absent optional extra tells the user to run.
"""


class FsdpkitError(Exception):
    exit_code = 1


class UsageError(FsdpkitError, ValueError):
    exit_code = 2


class RunError(FsdpkitError, RuntimeError):
    exit_code = 1


class DataCheckError(FsdpkitError):
    exit_code = 3


def install_hint(extra: str) -> str:
    """The command that installs the optional extra `extra` (a name in pyproject's optional
    dependencies) beside an installed fsdpkit."""
    return install_command(f"fsdpkit[{extra}]")


def install_command(requirement: str) -> str:
    """The pip command that installs `requirement` (a pip requirement string) into this environment."""
    return f"pip install '{requirement}'"
