"""Atomic commit: step directories appear complete or not at all, `latest` always names a
loadable checkpoint, keep-last prunes only after success, crashes leave the previous one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from support.checkpoint_files import SAMPLE_UNITS, make_manifest, sample_tensors, save_checkpoint, write_ranks

from fsdpkit.checkpoint.format import storage
from fsdpkit.checkpoint.format.manifest import save_manifest
from fsdpkit.checkpoint.format.storage import resolve_checkpoint
from fsdpkit.checkpoint.format.verify import verify_checkpoint
from fsdpkit.checkpoint.live.save_protocol import SaveJob, check_agreement
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.errors import DataCheckError, RunError

TESTS = Path(__file__).resolve().parents[1]


def _tensors(step):
    return {n: t * step for n, t in sample_tensors().items()}


def _assert_loads_step(run, step):
    reader = CheckpointReader(run)
    assert reader.step_dir.name == f"step-{step:08d}" and reader.training_state["step"] == step
    for name, tensor in _tensors(step).items():
        assert torch.equal(reader.read_tensor(name), tensor), name


def test_keep_last_and_latest(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        save_checkpoint(run, step, _tensors(step), world_size=2, units=SAMPLE_UNITS, keep_last=2)
        assert (run / "latest").read_text().strip() == f"step-{step:08d}"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    assert storage.newest_of_run(run, run_id="test-run") == run / "step-00000004"  # where a restarted attempt goes on from
    _assert_loads_step(run, 4)
    _assert_loads_step(run / "step-00000003", 3)
    # a run resumed from an older step saves it again: `latest` names it, and keep-last keeps it
    save_checkpoint(run, 2, _tensors(2), world_size=2, units=SAMPLE_UNITS, keep_last=2)
    _assert_loads_step(run, 2)


def test_crash_before_commit_leaves_previous(tmp_path):
    run = tmp_path / "run"
    save_checkpoint(run, 1, _tensors(1), world_size=2, units=SAMPLE_UNITS)
    tmp = storage.begin(run, 2)  # every rank wrote its file, then the process died before commit
    manifest = make_manifest(_tensors(2), world_size=2, units=SAMPLE_UNITS, training_state={"step": 2})
    write_ranks(tmp, manifest, _tensors(2))
    _assert_loads_step(run, 1)
    assert resolve_checkpoint(run) == run / "step-00000001"
    # crash after the manifest and the rename, before `latest` moved: still the previous one
    save_manifest(tmp, manifest)
    os.rename(tmp, run / "step-00000002")
    _assert_loads_step(run, 1)
    # the next successful save of the same run with keep_last cleans up what that run left
    stale = storage.begin(run, 3, run_id="test-run")
    save_checkpoint(run, 3, _tensors(3), world_size=2, units=SAMPLE_UNITS, keep_last=1)
    assert not stale.exists() and sorted(p.name for p in run.iterdir()) == ["latest", "step-00000003"]


def test_keep_last_never_deletes_another_runs_directories(tmp_path):
    """Two runs on one save directory: one run's prune left the other's in-progress
    save and its checkpoints alone, and so must every prune."""
    run = tmp_path / "run"
    save_checkpoint(run, 1, _tensors(1), world_size=2, units=SAMPLE_UNITS, run_id="run-a")
    in_progress = storage.begin(run, 5, run_id="run-a")
    for step in (2, 3, 4):
        save_checkpoint(run, step, _tensors(step), world_size=2, units=SAMPLE_UNITS, keep_last=1, run_id="run-b")
    assert sorted(p.name for p in run.iterdir()) == sorted(["latest", "step-00000001", "step-00000004", in_progress.name])
    _assert_loads_step(run / "step-00000001", 1)


def test_tmp_directories_are_never_checkpoints(tmp_path):
    run = tmp_path / "run"
    tmp = storage.begin(run, 5)
    write_ranks(tmp, make_manifest(_tensors(5), world_size=2, units=SAMPLE_UNITS), _tensors(5))
    with pytest.raises(DataCheckError, match="not an fsdpkit checkpoint"):
        resolve_checkpoint(run)
    for step in (1, 2):
        save_checkpoint(run, step, _tensors(step), world_size=2, units=SAMPLE_UNITS)
    (run / "latest").unlink()  # a crash (or a copy) lost `latest`: the newest complete step is taken
    _assert_loads_step(run, 2)


def test_commit_refuses_missing_rank_file(tmp_path):
    run = tmp_path / "run"
    tmp = storage.begin(run, 1)
    manifest = make_manifest(_tensors(1), world_size=2, units=SAMPLE_UNITS)
    write_ranks(tmp, manifest, _tensors(1))
    (tmp / "rank-00001-of-00002.safetensors").unlink()  # another node wrote it to a directory this one cannot see
    with pytest.raises(RunError, match="shared filesystem|filesystem all nodes share"):
        storage.commit(tmp, run, 1, manifest)
    assert not (run / "latest").exists() and not (run / "step-00000001").exists()


def test_resaving_a_step_replaces_it(tmp_path):
    run = tmp_path / "run"
    save_checkpoint(run, 1, _tensors(1), world_size=2, units=SAMPLE_UNITS)
    save_checkpoint(run, 2, _tensors(2), world_size=2, units=SAMPLE_UNITS)
    save_checkpoint(run, 2, _tensors(7) | {}, world_size=4, units=SAMPLE_UNITS, training_state={"step": 2, "again": True})
    reader = CheckpointReader(run)
    assert reader.manifest.shard_factor == 4 and reader.training_state["again"] is True
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_a_crash_while_resaving_the_latest_step_leaves_latest_at_the_newest_other(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(run, step, _tensors(step), world_size=2, units=SAMPLE_UNITS)

    def crash(source, target):
        raise OSError(f"killed before renaming {source}")

    monkeypatch.setattr(storage.os, "rename", crash)
    with pytest.raises(OSError, match="killed before renaming"):
        save_checkpoint(run, 3, _tensors(7), world_size=2, units=SAMPLE_UNITS)
    _assert_loads_step(run, 2)


SAVER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from support.checkpoint_files import SAMPLE_UNITS, sample_tensors, save_checkpoint
    base = {{n: t.repeat_interleave(200, dim=0) for n, t in sample_tensors().items()}}  # ~1.5 MB per checkpoint
    step = {start}
    while True:
        save_checkpoint(sys.argv[1], step, {{n: t * step for n, t in base.items()}}, world_size=3,
                        units=SAMPLE_UNITS, keep_last=2)
        print(step, flush=True)
        step += 1
""")


def test_killed_saver_always_leaves_a_loadable_checkpoint(tmp_path):
    run = tmp_path / "run"
    rng = random.Random(0)
    base = {n: t.repeat_interleave(200, dim=0) for n, t in sample_tensors().items()}
    start = 1
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER.format(tests=str(TESTS), start=start), str(run)], stdout=subprocess.PIPE, text=True
        )
        last = int(proc.stdout.readline())  # at least one save of this round is complete
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read().split()
        proc.wait()
        last = int(rest[-1]) if rest else last
        report = verify_checkpoint(run)
        assert report.ok, report.problems
        reader = CheckpointReader(run)
        step = reader.training_state["step"]
        assert step in (last, last + 1)  # the one it reported, or one committed just before the kill
        for name in ("h.0.attn.weight", "wte.weight"):
            assert torch.equal(reader.read_tensor(name), base[name] * step)
        start = step + 1


def test_run_lock_names_its_holder_and_takes_over_stale_ones(tmp_path):
    import json
    import socket

    from fsdpkit.checkpoint.format.lock import RunLock
    from fsdpkit.errors import UsageError

    run, host = tmp_path / "run", socket.gethostname()
    lock = RunLock.acquire(run)
    with pytest.raises(UsageError, match=f"in use by another run: pid {os.getpid()} on {host}"):
        RunLock.acquire(run)
    lock.release()
    assert not (run / ".lock").exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [
        {"host": host, "pid": dead.pid, "started": "1", "run": "dead"},  # holder gone
        {"host": host, "pid": os.getpid(), "started": "another-process", "run": "reused"},
    ]  # pid now someone else's
    for holder in stale:
        (run / ".lock").write_text(json.dumps(holder))
        messages = []
        with RunLock.acquire(run, warn=messages.append) as taken:
            assert json.loads((run / ".lock").read_text())["run"] == taken.run_id != holder["run"]
            assert len(messages) == 1 and f"pid {holder['pid']} on {host}" in messages[0] and "no longer running" in messages[0]
        assert not (run / ".lock").exists()
    (run / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": dead.pid, "started": "1", "run": "remote"}))
    with pytest.raises(UsageError, match="pid .* on elsewhere"):  # only its own host can tell it is gone
        RunLock.acquire(run)
    assert json.loads((run / ".lock").read_text())["run"] == "remote"


class _TwoRanks:
    """The all-reduce of check_agreement between this rank's values and another rank's."""

    def __init__(self, other: list[int]) -> None:
        self.other, self.sent = other, []

    def min_over_ranks(self, values, device, *, label):
        self.sent = values
        return [min(mine, theirs) for mine, theirs in zip(values, self.other, strict=True)]


def test_ranks_that_would_save_different_tensors_write_nothing(tmp_path):
    def job(tensors: dict) -> SaveJob:
        manifest = make_manifest(tensors, world_size=2, units=SAMPLE_UNITS)
        return SaveJob(0, tmp_path, 3, manifest, None, None, torch.device("cpu"), datetime.now(UTC))

    same, other = job(_tensors(1)), job(_tensors(1) | {"optim.exp_avg.wte.weight": torch.zeros(17, 8)})  # the same placement
    ranks = _TwoRanks([1, 2**63 - 1, 2**63 - 1])  # a minimum that changes nothing: what this rank sends
    check_agreement(same, ranks, visible=True, where=tmp_path)
    check_agreement(same, _TwoRanks(ranks.sent), visible=True, where=tmp_path)
    with pytest.raises(RunError, match="ranks disagree on what to save at step 3"):
        check_agreement(other, _TwoRanks(ranks.sent), visible=True, where=tmp_path)
    with pytest.raises(RunError, match="is not visible to every rank"):
        check_agreement(same, _TwoRanks([0, *ranks.sent[1:]]), visible=True, where=tmp_path)
