"""The launcher's workers: forked from a server that imported torch once, they still start with
the launcher's environment as it is at each launch, and its thread count; and the failure it
reports is the one the others followed from."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from support.distributed import run_distributed

from fsdpkit.dist.launch import PEER_LOST, root_failure


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


def _failure(message: str, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(message=message, timestamp=timestamp, exitcode=1)


def test_the_failure_reported_is_the_cause_not_a_rank_whose_peer_went_away():
    lost = f"{PEER_LOST}: rank 0: reduce_scatter (unit h.1) at step 3 failed: Connection closed by peer"
    # the same second (torch's resolution), the lower rank only lost its peer
    assert root_failure({0: _failure(lost, 5), 1: _failure("RuntimeError: rank one cannot compute", 5)}) == (
        1,
        "RuntimeError: rank one cannot compute",
    )
    # of several causes, the earliest; a rank that lost its peer earlier still is passed over
    failures = {0: _failure(lost, 4), 1: _failure("ValueError: late", 6), 2: _failure("KeyError: 'early'", 5)}
    assert root_failure(failures) == (2, "KeyError: 'early'")
    # with nothing but lost peers, the earliest of them, the lower rank at a tie
    assert root_failure({3: _failure(lost, 7), 1: _failure(lost, 7), 2: _failure(lost, 8)}) == (1, lost)
