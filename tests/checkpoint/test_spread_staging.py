"""The staging area of a spread conversion, on its own (no process launched): a part's record is
written only once its file is fsynced, a rerun finds only the parts whose file is still there
and long enough, and the commit leaves a DST that appeared while the run went on as it was,
with the finished parts still there for a rerun with --overwrite."""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import pytest

from fsdpkit.checkpoint.spread.staging import DONE_DIR, PLAN_NAME, PartResult, Staging
from fsdpkit.errors import UsageError


def _staging(tmp_path: Path, files: dict[str, bytes]) -> Staging:
    staging = Staging(tmp_path / ".tmp-out-resumable")
    (staging.state / DONE_DIR).mkdir(parents=True)
    (staging.state / PLAN_NAME).write_text('{"fingerprint": "f"}\n')
    for name, data in files.items():
        (staging.path / name).write_bytes(data)
    return staging


def _part(file: int, index: int, name: str, data: bytes, begin: int, end: int) -> PartResult:
    return PartResult(file, index, name, begin, end, crc32=zlib.crc32(data[begin:end]))


def test_a_part_is_recorded_only_once_its_file_is_fsynced(tmp_path, monkeypatch):
    data = os.urandom(300)
    staging = _staging(tmp_path, {"a.bin": data, "b.bin": data[:100]})
    done = staging.state / DONE_DIR
    fsynced: list[tuple[Path, list[str]]] = []  # (the file, the records there as it was fsynced)
    fsync = os.fsync

    def noted(fd: int) -> None:
        fsynced.append((Path(os.readlink(f"/proc/self/fd/{fd}")), sorted(p.name for p in done.iterdir())))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", noted)
    first = _part(0, 0, "a.bin", data, 0, 300)
    staging.record(first)
    assert fsynced == [((staging.path / "a.bin").resolve(), [])]
    assert staging.records() == {(0, 0): first}

    def full(fd: int) -> None:  # a full disk's delayed allocation fails the fsync
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        staging.record(_part(1, 0, "b.bin", data, 0, 100))
    assert staging.records() == {(0, 0): first} and sorted(p.name for p in done.iterdir()) == ["00000-00000.json"]


def test_a_rerun_finds_only_the_parts_whose_file_is_there_and_long_enough(tmp_path):
    data = os.urandom(400)
    staging = _staging(tmp_path, {"a.bin": data, "b.bin": data[:100]})
    parts = [_part(0, 0, "a.bin", data, 0, 200), _part(0, 1, "a.bin", data, 200, 400), _part(1, 0, "b.bin", data, 0, 100)]
    for part in parts:
        staging.record(part)
    assert staging.records() == {(p.file, p.index): p for p in parts}
    with open(staging.path / "a.bin", "r+b") as cut_short:  # as a file system that lost the end of a file
        cut_short.truncate(399)
    (staging.path / "b.bin").unlink()
    assert staging.records() == {(0, 0): parts[0]}


def test_the_commit_leaves_a_dst_that_appeared_meanwhile_and_keeps_the_parts(tmp_path):
    """Without --overwrite: one line, DST as it was, and the staging area with its records (a
    rerun with --overwrite continues it); with --overwrite DST is replaced by the output alone."""
    data = os.urandom(100)
    staging = _staging(tmp_path, {"model.safetensors": data})
    part = _part(0, 0, "model.safetensors", data, 0, 100)
    staging.record(part)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "theirs.txt").write_text("not ours")
    with pytest.raises(UsageError, match=f"destination {dst} appeared while the conversion ran; pass --overwrite"):
        staging.commit(dst, overwrite=False)
    assert [p.name for p in dst.iterdir()] == ["theirs.txt"] and (dst / "theirs.txt").read_text() == "not ours"
    assert staging.records() == {(0, 0): part}
    staging.commit(dst, overwrite=True)
    assert [p.name for p in dst.iterdir()] == ["model.safetensors"] and (dst / "model.safetensors").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_commit_makes_the_output_durable_before_it_renames_it_to_dst(tmp_path, monkeypatch):
    """Every output file and the staging area are fsynced before the rename to DST, and DST's
    parent after it: a crash never leaves a DST whose files the disk did not get."""
    files = {"model-00001-of-00002.safetensors": os.urandom(300), "model-00002-of-00002.safetensors": os.urandom(100)}
    staging = _staging(tmp_path, {**files, "model.safetensors.index.json": b"{}"})
    events: list[tuple] = []
    fsync, rename = os.fsync, os.rename

    def noted_fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def noted_rename(src, dst) -> None:
        events.append(("rename", Path(src), Path(dst)))
        rename(src, dst)

    monkeypatch.setattr(os, "fsync", noted_fsync)
    monkeypatch.setattr(os, "rename", noted_rename)
    dst = tmp_path / "out"
    staging.commit(dst, overwrite=False)
    renamed = events.index(("rename", staging.path, dst))
    synced = {event[1] for event in events[:renamed] if event[0] == "fsync"}
    expected = {(staging.path / name).resolve() for name in [*files, "model.safetensors.index.json"]} | {staging.path.resolve()}
    assert synced == expected, events
    assert events[renamed + 1 :] == [("fsync", tmp_path.resolve())], events
    assert sorted(p.name for p in dst.iterdir()) == sorted([*files, "model.safetensors.index.json"])
