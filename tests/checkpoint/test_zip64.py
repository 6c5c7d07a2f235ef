"""torch zips of any size: a storage of 4 GiB or more, a record that starts 4 GiB or more into
the archive, and a central directory past 4 GiB are written as zip64, and torch.load and Python's
zipfile read them (zipfile checks the CRC-32 of the record past 4 GiB). The real sizes are sparse files (the data's holes
read as zeros, a few bytes set at each end of the big storage); the writers' own paths (one
process, and the spread's parts with the CRC-32s written at the commit) are tried with the zip64
threshold lowered, so that small checkpoints take them, and checked by DeepSpeed's own reader."""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from support.checkpoint_files import run_cli, save_checkpoint

from fsdpkit.checkpoint.core.crc import crc32_combine
from fsdpkit.checkpoint.torchfile import archive
from fsdpkit.checkpoint.torchfile.pickler import pickled_text

BIG_ELEMENTS = (1 << 30) + 16  # float32: 4 GiB and 64 bytes
ENDS = 64  # float32 elements set at each end of the big storage


def _crc_of_zeros(count: int) -> int:
    """The CRC-32 of `count` zero bytes, from that of 1 MiB doubled (no 4 GiB read)."""
    crc = zlib.crc32(bytes(count % (1 << 20)))
    blocks, run, size = count >> 20, zlib.crc32(bytes(1 << 20)), 1 << 20
    while blocks:
        if blocks & 1:
            crc = crc32_combine(crc, run, size)
        run, size, blocks = crc32_combine(run, run, size), size * 2, blocks >> 1
    return crc


def _sparse_archive(path: Path, parts: list[bytes], data: list[tuple[bytes, int, bytes]]) -> None:
    """The archive `parts` around storages given as (head, zero bytes, tail), the zeros left as holes."""
    with open(path, "wb") as out:
        for part, (head, zeros, tail) in zip(parts, [*data, (b"", 0, b"")], strict=True):
            out.write(part + head)
            out.seek(zeros, os.SEEK_CUR)
            out.write(tail)


@pytest.mark.parametrize("with_crcs", [False, True], ids=["crc-0", "data-descriptors"])
def test_a_storage_and_an_offset_past_4_gib_are_zip64_records_torch_loads(tmp_path, with_crcs):
    start = torch.arange(ENDS, dtype=torch.float32) + 1
    end = -torch.arange(ENDS, dtype=torch.float32) - 1
    small = torch.linspace(-3, 3, 8)
    big_data = (start.numpy().tobytes(), (BIG_ELEMENTS - 2 * ENDS) * 4, end.numpy().tobytes())
    small_data = (small.numpy().tobytes(), 0, b"")
    sizes = [BIG_ELEMENTS * 4, small.numel() * 4]
    data_pkl = b"\x80\x02}(" + pickled_text("big") + archive.tensor_pickle("F32", "0", (BIG_ELEMENTS,))
    data_pkl += pickled_text("small") + archive.tensor_pickle("F32", "1", (8,)) + b"u."
    crcs = None
    if with_crcs:
        big_crc = crc32_combine(zlib.crc32(big_data[0]), _crc_of_zeros(big_data[1]), big_data[1])
        crcs = [crc32_combine(big_crc, zlib.crc32(big_data[2]), len(big_data[2])), zlib.crc32(small_data[0])]
    path = tmp_path / "big.pt"
    try:
        _sparse_archive(path, archive.torch_zip_parts("big", data_pkl, sizes, crcs), [big_data, small_data])
        assert path.stat().st_size > 1 << 32 and path.stat().st_blocks * 512 < 1 << 24  # sparse: 16 MiB or less on disk
        tail = _read_tail(path, 4096)
        assert b"PK\x06\x06" in tail and b"PK\x06\x07" in tail  # the zip64 end record and its locator

        loaded = torch.load(path, mmap=True, weights_only=True)
        assert loaded["big"].shape == (BIG_ELEMENTS,) and torch.equal(loaded["small"], small)
        assert torch.equal(loaded["big"][:ENDS], start) and torch.equal(loaded["big"][-ENDS:], end)
        assert not loaded["big"][ENDS : ENDS + 4096].any() and not loaded["big"][-ENDS - 4096 : -ENDS].any()
        del loaded

        with zipfile.ZipFile(path) as opened:
            infos = {info.filename: info for info in opened.infolist()}
            assert infos["big/data/0"].file_size == sizes[0] and infos["big/data/1"].header_offset > 1 << 32
            if with_crcs:
                assert [infos[f"big/data/{key}"].CRC for key in (0, 1)] == crcs
                assert opened.read("big/data/1") == small_data[0]  # its CRC-32 checked
                big = infos["big/data/0"]
                with open(path, "rb") as raw:
                    raw.seek(big.header_offset + 26)
                    name_length, extra_length = struct.unpack("<HH", raw.read(4))
                    raw.seek(name_length + extra_length + big.file_size, os.SEEK_CUR)
                    descriptor = struct.unpack("<IIQQ", raw.read(24))  # a zip64 record's: 8-byte sizes
                assert descriptor == (0x08074B50, crcs[0], sizes[0], sizes[0])
    finally:
        path.unlink(missing_ok=True)


def _read_tail(path: Path, count: int) -> bytes:
    with open(path, "rb") as opened:
        opened.seek(-count, os.SEEK_END)
        return opened.read()


def test_a_dcp_chunk_of_4_gib_or_more_is_a_zip64_archive_torch_loads(tmp_path):
    rows = (1 << 30) + 8  # bf16 pairs: 4 GiB and 32 bytes
    head, tail = archive.archive_parts("BF16", (rows, 2), rows * 4)
    marks = torch.tensor([1.5, -2.0, 3.25, 7.0], dtype=torch.bfloat16)
    first, last = (marks[at : at + 2].view(torch.uint8).numpy().tobytes() for at in (0, 2))
    path = tmp_path / "chunk"
    try:
        _sparse_archive(path, [head, tail], [(first, rows * 4 - 8, last)])
        loaded = torch.load(path, mmap=True, weights_only=True)
        assert loaded.shape == (rows, 2) and loaded.dtype == torch.bfloat16
        assert torch.equal(loaded[0], marks[:2]) and torch.equal(loaded[-1], marks[2:]) and not loaded[1:4096].any()
        del loaded
    finally:
        path.unlink(missing_ok=True)


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_deepspeed_files_past_the_zip64_threshold_are_what_deepspeed_reads(tmp_path, monkeypatch):
    """With the threshold at 1 KiB every storage but the smallest is a zip64 record and every file's
    central directory is past it: one process and the spread (its CRC-32s written at the commit)
    write the same bytes, zipfile checks every CRC-32, DeepSpeed's own zero_to_fp32 reads the weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    g = torch.Generator().manual_seed(3)
    tensors = {f"layer.{i}.weight": torch.randn(20 + 9 * i, 16, generator=g) for i in range(4)}
    tensors["tiny.bias"] = torch.randn(3, generator=g)
    optim = {f"optim.{m}.{n}": torch.rand(t.shape, generator=g) for n, t in tensors.items() for m in ("exp_avg", "exp_avg_sq")}
    save_checkpoint(tmp_path / "run", 2, {**tensors, **optim}, world_size=2, training_state={"step": 2})
    monkeypatch.setattr(archive, "ZIP32_LIMIT", 1024)
    archive.archive_parts.cache_clear()
    try:
        for stage, flags in (("3", ()), ("2", ("--nproc-per-node", "1", "--json"))):
            out = tmp_path / f"stage{stage}"
            made = run_cli("convert", tmp_path / "run", out, "--to", "deepspeed", "--stage", stage, "--world-size", "2", *flags)
            assert made.exit_code == 0, made.output
            if flags:
                assert json.loads(made.stdout)["spread"]["world_size"] == 1
                one = run_cli("convert", tmp_path / "run", tmp_path / "one", "--to", "deepspeed", "--stage", stage, "--world-size", "2")
                assert one.exit_code == 0, one.output
                assert _files(out) == _files(tmp_path / "one")
            rank_files = sorted(out.glob("*/*.pt"))
            zip64_records = 0
            for path in rank_files:
                assert b"PK\x06\x06" in path.read_bytes()[-1024:], path
                with zipfile.ZipFile(path) as opened:
                    assert opened.testzip() is None, path
                    zip64_records += sum(info.file_size >= 1024 and "/data/" in info.filename for info in opened.infolist())
            assert zip64_records >= 4, zip64_records
            checked = run_cli("verify", out)
            assert checked.exit_code == 0, checked.output
            weights = get_fp32_state_dict_from_zero_checkpoint(str(out))
            assert all(torch.equal(weights[n], t) for n, t in tensors.items()), stage
    finally:
        archive.archive_parts.cache_clear()
