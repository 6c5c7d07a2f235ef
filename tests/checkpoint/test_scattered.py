"""An output filled out of order in one pass over its source objects (`spread/scattered.py`):
tensors stored in one order in two objects, each split in two pieces across them as ZeRO-3
splits a parameter, wanted in another order, some cast to bf16, streamed in blocks of an odd
number of bytes (elements split between blocks). The oracle is torch: the head, then each
tensor cast by torch, in the output's order. A piece whose bytes do not match its checksum,
and an object shorter than its pieces, fail naming the file."""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from fsdpkit.checkpoint.core.bytecopy import SourcePiece, SourceTensor
from fsdpkit.checkpoint.spread import scattered
from fsdpkit.checkpoint.storage.local import LocalStorage
from fsdpkit.checkpoint.storage.stored_path import stored_root
from fsdpkit.errors import DataCheckError
from fsdpkit.flat_layout import ElementRange

HEAD = b"a header of 27 bytes......."
CAST = {"F32": torch.float32, "BF16": torch.bfloat16}


def _sources(tmp_path, *, corrupt: str | None = None):
    """Tensors a..e, fp32, each split in half: first halves in object rank0, second halves in
    rank1, in the order a..e; the oracle's tensors by name."""
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(n, generator=g) for name, n in zip("abcde", (1000, 7, 40000, 333, 5000), strict=True)}
    halves: dict[str, list[tuple[str, int, int, int]]] = {}  # name -> (object, offset, first element, count)
    for rank in (0, 1):
        data, at = bytearray(b"\x00" * 64), 64
        for name, t in tensors.items():
            first, count = (0, t.numel() // 2) if rank == 0 else (t.numel() // 2, t.numel() - t.numel() // 2)
            chunk = t[first : first + count].numpy().tobytes()
            halves.setdefault(name, []).append((f"rank{rank}", at, first, count))
            data += chunk
            at += len(chunk)
        (tmp_path / f"rank{rank}").write_bytes(bytes(data))
    listed = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    root = stored_root(LocalStorage(tmp_path), listed)
    sources = {}
    for name, t in tensors.items():
        pieces = []
        for obj, offset, first, count in halves[name]:
            crc = zlib.crc32(t[first : first + count].numpy().tobytes())
            pieces.append(SourcePiece(ElementRange(first, first + count), root / obj, offset, count * 4, crc ^ (name == corrupt), name))
        sources[name] = SourceTensor(name, (t.numel(),), "F32", tuple(pieces))
    return tensors, sources


@pytest.fixture
def spool(tmp_path):
    """A spool file's descriptor."""
    with open(tmp_path / "spool", "w+b") as file:
        yield file.fileno()


def _wanted(sources, order):
    wanted, at = [], len(HEAD)
    for name, dtype in order:
        source = sources[name]
        wanted.append(scattered.Wanted(source, ElementRange(0, source.numel), dtype, at))
        at += source.numel * (4 if dtype == "F32" else 2)
    return wanted, at


ORDER = [("e", "BF16"), ("c", "F32"), ("a", "BF16"), ("d", "F32"), ("b", "BF16")]


def test_an_output_is_filled_out_of_order_from_each_object_read_once(tmp_path, spool, monkeypatch):
    monkeypatch.setattr(scattered, "STREAM_BLOCK_BYTES", 1001)  # blocks split elements
    monkeypatch.setattr(scattered, "TILE_BYTES", 4096)
    tensors, sources = _sources(tmp_path)
    wanted, size = _wanted(sources, ORDER)
    reads: list[tuple[str, list]] = []
    original = LocalStorage.read_blocks

    def counted(self, name, ranges, **kwargs):
        reads.append((name, list(ranges)))
        return original(self, name, ranges, **kwargs)

    monkeypatch.setattr(LocalStorage, "read_blocks", counted)
    out = bytearray()
    read = scattered.fill_and_send(spool, scattered.segments_of(wanted, 0), HEAD, size, out.extend, None)
    expected = HEAD + b"".join(tensors[name].to(CAST[dtype]).view(torch.uint8).numpy().tobytes() for name, dtype in ORDER)
    assert bytes(out) == expected
    assert read == sum(t.numel() * 4 for t in tensors.values())
    assert sorted(name for name, _ in reads) == ["rank0", "rank1"] and all(len(ranges) == 1 for _, ranges in reads), reads


def test_a_piece_that_fails_its_checksum_or_an_object_cut_short_is_an_error(tmp_path, spool):
    for corrupt in "ce":  # e: the last piece of each object, its bytes the last the part waits for
        _, sources = _sources(tmp_path, corrupt=corrupt)
        wanted, size = _wanted(sources, ORDER)
        with pytest.raises(DataCheckError, match=rf"rank\d.*checksum mismatch in .*'{corrupt}'"):
            scattered.fill_and_send(spool, scattered.segments_of(wanted, 0), HEAD, size, lambda data: None, None)
    _, sources = _sources(tmp_path)
    wanted, size = _wanted(sources, ORDER)
    segments = scattered.segments_of(wanted, 0)
    with open(tmp_path / "rank1", "r+b") as cut:
        cut.truncate(1000)
    with pytest.raises(DataCheckError, match="rank1.*truncated"):
        scattered.fill_and_send(spool, segments, HEAD, size, lambda data: None, None)


def test_a_piece_wanted_in_part_or_in_a_local_file_is_left_to_the_byte_engine(tmp_path):
    _, sources = _sources(tmp_path)
    part = [scattered.Wanted(sources["a"], ElementRange(0, 700), "F32", 0)]  # its second piece starts at 500
    assert scattered.segments_of(part, 0) is None
    local = SourceTensor("a", (4,), "F32", (SourcePiece(ElementRange(0, 4), tmp_path / "rank0", 64, 16, None, "a"),))
    assert scattered.segments_of([scattered.Wanted(local, ElementRange(0, 4), "F32", 0)], 0) is None


def test_a_failure_reads_no_object_whose_turn_had_not_come(tmp_path, spool, monkeypatch):
    """8 objects of one tensor each, 4 streamed at once: the first fails at once, the others
    that started with it are slow; the 4 whose turn had not come are never asked for."""
    data = {f"o{i}": torch.arange(64, dtype=torch.float32) + i for i in range(8)}
    for name, t in data.items():
        (tmp_path / name).write_bytes(t.numpy().tobytes())
    root = stored_root(LocalStorage(tmp_path), {name: 256 for name in data})
    pieces = [SourcePiece(ElementRange(64 * i, 64 * i + 64), root / f"o{i}", 0, 256, None, "t") for i in range(8)]
    wanted = [scattered.Wanted(SourceTensor("t", (512,), "F32", tuple(pieces)), ElementRange(0, 512), "F32", 0)]
    asked: list[str] = []
    original = LocalStorage.read_blocks

    def failing_or_slow(self, name, ranges, **kwargs):
        asked.append(name)
        if name == "o0":
            raise DataCheckError(f"{self.where(name)}: cannot read")
        time.sleep(0.5)
        yield from original(self, name, ranges, **kwargs)

    monkeypatch.setattr(LocalStorage, "read_blocks", failing_or_slow)
    with pytest.raises(DataCheckError, match="o0: cannot read"):
        scattered.fill_and_send(spool, scattered.segments_of(wanted, 0), b"", 2048, lambda data: None, None)
    assert "o0" in asked and not {"o4", "o5", "o6", "o7"} & set(asked), asked


def test_a_spool_goes_only_on_a_disk_with_room_it_reserves(tmp_path, monkeypatch):
    """Never on a filesystem in memory (its spool would be memory the bound does not count), nor
    where the disk has no room for it; the filesystem is the longest mount point holding the path.
    A spool's room is reserved as it is made, so that ranks of one node that each found room do
    not run out of it midway; where the reservation fails, there is no spool."""
    import errno
    import os
    import tempfile

    mounts = "/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n/dev/vdb /tmp/my\\040disk ext4 rw 0 0\n"
    assert scattered.filesystem_of("/dev/shm/spool", mounts) == "tmpfs"
    assert scattered.filesystem_of("/tmp", mounts) == "tmpfs"
    assert scattered.filesystem_of("/tmpdir/spool", mounts) == "ext4"
    assert scattered.filesystem_of("/tmp/my disk/spool", mounts) == "ext4"
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")  # tmpfs on Linux
    assert scattered.reserved_spool(1) is None
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert scattered.reserved_spool(1 << 60) is None
    if scattered.filesystem_of(os.path.realpath(tmp_path), open("/proc/self/mounts").read()) in scattered.MEMORY_FILESYSTEMS:
        pytest.fail(f"{tmp_path} is in memory: this test needs pytest's tmp_path on a disk")
    spool = scattered.reserved_spool(3 << 20)
    assert spool is not None
    with spool:
        assert os.fstat(spool.fileno()).st_blocks * 512 >= 3 << 20  # reserved, not merely sized
        assert not list(tmp_path.iterdir())  # a file without a name: nothing is left behind

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    assert scattered.reserved_spool(3 << 20) is None
