"""A part of an output file written in place (spread's PartSink): the bytes and crc32 of what two
parts wrote, against the data itself and zlib's crc32, with the writeback started behind the
writes (made small here) covering each part's bytes once, in order, and only its own; a part
given more bytes than its range, or fewer, is refused and writes nothing outside its range."""

from __future__ import annotations

import os
import random
import zlib

import pytest

from fsdpkit.checkpoint.spread import writes
from fsdpkit.checkpoint.spread.writes import PartSink


def test_two_parts_written_with_write_behind_give_the_bytes_and_their_crc32(tmp_path, monkeypatch):
    monkeypatch.setattr(writes, "WRITE_BEHIND_BYTES", 64 << 10)
    advised: list[tuple[int, int]] = []
    fadvise = os.posix_fadvise

    def recorded(fd, offset, count, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        advised.append((offset, offset + count))
        fadvise(fd, offset, count, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    rng = random.Random(0)
    data = rng.randbytes(3 << 20)
    cut = 1_234_567  # not a page boundary
    path = tmp_path / "out.bin"
    for begin, end in ((cut, len(data)), (0, cut)):  # the second part first, as another rank may
        with PartSink(path, begin, end) as sink:
            at = begin
            while at < end:
                size = min(end - at, rng.choice([3, 100, 5000, writes.DIRECT_BYTES, 300_000, 1 << 20]))
                sink.write(memoryview(data)[at : at + size])
                at += size
        assert sink.crc == zlib.crc32(data[begin:end]), (begin, end)
        behind = [span for span in advised if begin <= span[0] < end]
        assert behind and all(b[0] == a[1] for a, b in zip(behind, behind[1:], strict=False)), behind
        assert behind[0][0] == begin and behind[-1][1] <= end
    assert path.read_bytes() == data


def test_a_part_given_more_or_fewer_bytes_than_its_range_is_refused(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(30))
    with pytest.raises(ValueError, match=r"writing past byte 20, the end of this part"), PartSink(path, 10, 20) as sink:
        sink.write(b"a" * 6)
        sink.write(b"b" * 5)  # one byte past the end
    with pytest.raises(ValueError, match=r"part ends at byte 19, expected 20"), PartSink(path, 10, 20) as sink:
        sink.write(b"c" * 9)
    assert path.read_bytes() == bytes(10) + b"c" * 9 + bytes(11)  # nothing past the range, nor before it
