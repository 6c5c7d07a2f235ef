"""The launcher's workers: forked from a server that imported torch once, they still start with
the launcher's environment as it is at each launch, and its thread count."""

from __future__ import annotations

import os

import torch
from support.distributed import run_distributed



def _environment() -> tuple[str | None, str | None, str, int]:
    return os.environ.get("FSDPKIT_TEST_SET"), os.environ.get("FSDPKIT_TEST_UNSET"), os.environ["RANK"], torch.get_num_threads()


def test_each_launch_hands_its_workers_the_environment_as_it_is_then(monkeypatch):
    monkeypatch.setenv("FSDPKIT_TEST_SET", "first")
    monkeypatch.setenv("FSDPKIT_TEST_UNSET", "there")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = run_distributed(_environment, 2)
    assert first == {0: ("first", "there", "0", 1), 1: ("first", "there", "1", 1)}
    # the fork server now runs with the first launch's environment; the second launch's counts
    monkeypatch.setenv("FSDPKIT_TEST_SET", "second")
    monkeypatch.delenv("FSDPKIT_TEST_UNSET")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    second = run_distributed(_environment, 2)
    assert second == {0: ("second", None, "0", 2), 1: ("second", None, "1", 2)}
