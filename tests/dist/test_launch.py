"""The launcher's workers: forked from a server that imported torch once, they still start with
the launcher's environment as it is at each launch, and its thread count. Their error files lie
under TMPDIR while they run, a failure's reason is read from them, and a launch leaves nothing
behind there (torch's default is a torchelastic_* directory per launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from support.distributed import run_distributed

from fsdpkit.errors import RunError


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


def _error_file() -> str:
    return os.environ["TORCHELASTIC_ERROR_FILE"]


def _fail() -> None:
    raise ValueError("the reason in the error file")


def test_a_launch_keeps_its_workers_files_under_tmpdir_and_leaves_none_there(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what TMPDIR sets
    error_files = run_distributed(_error_file, 2)
    assert all(Path(path).is_relative_to(tmp_path) for path in error_files.values()), error_files
    with pytest.raises(RunError, match="ValueError: the reason in the error file"):
        run_distributed(_fail, 2)
    # multiprocessing's own pymp-* directory, where this launch started its fork server, goes when this process exits
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith("pymp-")) == []


def test_a_run_under_a_tmpdir_too_long_for_a_socket_path_trains(tmp_path):
    """AF_UNIX paths end at 108 bytes: under a longer TMPDIR the launcher's fork server still
    finds a place for its socket, and `fsdpkit train` (its smallest run) ends as under /tmp."""
    long_tmpdir = tmp_path / ("t" * max(1, 120 - len(str(tmp_path))))
    long_tmpdir.mkdir()
    assert len(str(long_tmpdir)) > 108
    args = ["--model", "gpt-tiny", "--seq-len", "16", "--global-batch-size", "4", "--nproc-per-node", "2", "--steps", "1", "--json"]
    fsdpkit = str(Path(sys.executable).with_name("fsdpkit"))
    done = subprocess.run(
        [fsdpkit, "train", *args], capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(long_tmpdir)}
    )
    assert (done.returncode, "Traceback" in done.stderr) == (0, False), done.stderr[-2000:]
    assert json.loads(done.stdout)["optimizer_steps"] == 1
