"""Fixtures shared by the whole suite. Helpers that worker processes import (the distributed
launcher, the reference models and loop, checkpoint files written by hand) live in the
`support` package, importable from spawned workers; `tests/` is on the path (pyproject's
`pythonpath`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a command launches workers: bad input must be rejected before that."""
    from fsdpkit.bench import runner as bench_runner
    from fsdpkit.train import launcher

    def launch(*_args, **_kwargs):
        raise AssertionError("bad input must be rejected before launching")

    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(bench_runner, "launch", launch)
