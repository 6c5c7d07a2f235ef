"""Pure pieces of the checkpoint format: safetensors header I/O, casts, plans, manifest JSON."""

from __future__ import annotations

import json
import random
import struct
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fsdpkit.checkpoint.bytecopy import CrcShifter, cast_into
from fsdpkit.checkpoint.format import split_optim_tensor_name
from fsdpkit.checkpoint.manifest import Manifest
from fsdpkit.checkpoint.placement import Placement, placements, rank_contents
from fsdpkit.checkpoint.reader import read_header
from fsdpkit.checkpoint.state import SAFETENSORS_TO_TORCH, safetensors_dtype, tensor_bytes
from fsdpkit.checkpoint.storage import resolve_checkpoint
from fsdpkit.checkpoint.writer import StreamingWriter
from fsdpkit.errors import DataCheckError
from fsdpkit.layout import ElementRange, FlatLayout

from _checkpoint_helpers import SAMPLE_UNITS, sample_tensors, save_checkpoint


def _write(path, tensors, piece=7):
    entries = [(n, safetensors_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with StreamingWriter(path, entries, metadata={"format": "pt"}) as writer:
        for name, _ in writer.order:
            data = tensor_bytes(tensors[name])
            for i in range(0, data.nbytes, piece):  # odd-sized pieces: the writer must not care
                writer.write(data[i:i + piece])
    return writer


def test_streaming_writer_reads_back_with_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.tensor([True, False, True]),
               "d": torch.randn(4).to(torch.bfloat16), "e": torch.zeros(0, 3), "f": torch.tensor(2.5, dtype=torch.float64),
               "g": torch.randn(5).half(), "h": torch.tensor([1, -2], dtype=torch.int8)}
    path = tmp_path / "x.safetensors"
    writer = _write(path, tensors)
    assert path.stat().st_size == writer.size
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert header_len % 8 == 0
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_slice("a")[1:3], tensors["a"][1:3])
    header = read_header(path)
    for name, info in header.tensors.items():  # every tensor starts aligned to its element size
        assert (header.data_start + info.begin) % torch.empty(0, dtype=SAFETENSORS_TO_TORCH[info.dtype]).element_size() == 0


def test_streaming_writer_refuses_short_or_long_data(tmp_path):
    path = tmp_path / "short.safetensors"
    with pytest.raises(ValueError, match="announced"):
        with StreamingWriter(path, [("a", "F32", (4,))]) as writer:
            writer.write(b"\0" * 8)
            writer.close()
    with pytest.raises(ValueError, match="past"):
        with StreamingWriter(tmp_path / "long.safetensors", [("a", "F32", (1,))]) as writer:
            writer.write(b"\0" * 8)
    assert not (tmp_path / "long.safetensors").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw[:-3], "truncated or extended"),
    (lambda raw: raw + b"\0", "truncated or extended"),
    (lambda raw: struct.pack("<Q", 2**62) + raw[8:], "over the"),
    (lambda raw: struct.pack("<Q", 10_000) + raw[8:], "header claims 10000 bytes"),
    (lambda raw: raw[:4], "no header length"),
    (lambda raw: raw[:8] + b"[" + raw[9:], "not valid JSON"),
])
def test_read_header_rejects_bad_files(tmp_path, edit, message):
    path = tmp_path / "x.safetensors"
    _write(path, {"a": torch.randn(10), "b": torch.randn(3)})
    path.write_bytes(edit(path.read_bytes()))
    with pytest.raises(DataCheckError, match=message):
        read_header(path)


def test_read_header_rejects_holes_and_wrong_spans(tmp_path):
    path = tmp_path / "x.safetensors"
    document = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    raw = json.dumps(document).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    with pytest.raises(DataCheckError, match="starts at byte 8, expected 0"):
        read_header(path)
    document = {"a": {"dtype": "F32", "shape": [1000000], "data_offsets": [0, 8]}}
    raw = json.dumps(document).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    with pytest.raises(DataCheckError, match="needs 4000000"):
        read_header(path)


EDGE = [0.0, -0.0, 1.0, -1.5, 3.0e38, -3.0e38, 1e-40, 65504.0, 65520.0, 1e5, 1.00390625, 1.01171875, float("inf"), float("-inf")]


@pytest.mark.parametrize("src, dst", [("F32", "BF16"), ("F32", "F16"), ("BF16", "F32"), ("F16", "F32"), ("F16", "BF16"),
                                      ("BF16", "F16"), ("F64", "BF16"), ("F64", "F16"), ("F64", "F32"), ("F32", "F64")])
def test_cast_matches_torch(src, dst):
    src_t, dst_t = SAFETENSORS_TO_TORCH[src], SAFETENSORS_TO_TORCH[dst]
    values = torch.cat([torch.tensor(EDGE, dtype=torch.float64), torch.randn(3000, dtype=torch.float64) * 100,
                        torch.randn(1000, dtype=torch.float64) * 1e-6]).to(src_t)
    expected = values.to(dst_t)
    out = bytearray(values.numel() * expected.element_size())
    result = cast_into(tensor_bytes(values), src, dst, out)
    got = torch.frombuffer(bytearray(result), dtype=dst_t)
    assert torch.equal(got, expected)
    nan = torch.tensor([float("nan")], dtype=src_t)
    got_nan = torch.frombuffer(bytearray(cast_into(tensor_bytes(nan), src, dst, bytearray(8))[: expected.element_size()]), dtype=dst_t)
    assert torch.isnan(got_nan).all()


def test_flat_placement_follows_flat_layout():
    tensors = sample_tensors()
    units = [[(n, tuple(tensors[n].shape)) for n in unit] for unit in SAMPLE_UNITS]
    placement = Placement.flat(units)
    names = [(n, tuple(t.shape)) for n, t in tensors.items()] + [
        ("optim.exp_avg.h.0.attn.weight", (8, 8)), ("optim.step", ()), ("buf", (5,))]
    for world in (1, 2, 3, 4, 7, 64):
        result = placements(placement, names, world)
        for unit in units:
            layout = FlatLayout.from_shapes(unit, world)
            for rank in range(world):
                for frag in layout.fragments(rank):
                    if frag.param_range.size:
                        assert (rank, frag.param_range) in result[frag.name]
        for name, shape in names:
            pieces = result[name]
            assert [r for r, _ in pieces] == sorted(r for r, _ in pieces)
            position = 0
            for _, rng in pieces:
                assert rng.start == position and rng.size > 0
                position = rng.end
            assert position == torch.empty(shape).numel()
        assert result["optim.exp_avg.h.0.attn.weight"] == result["h.0.attn.weight"]
        assert result["optim.step"] == [(0, ElementRange(0, 1))] and result["buf"] == [(0, ElementRange(0, 5))]
    contents = rank_contents(Placement.even(), [("a", (10,)), ("b", (2,))], 4)
    assert contents == [[("a", ElementRange(0, 3)), ("b", ElementRange(0, 1))], [("a", ElementRange(3, 6)), ("b", ElementRange(1, 2))],
                        [("a", ElementRange(6, 9))], [("a", ElementRange(9, 10))]]


def test_optim_names():
    assert split_optim_tensor_name("optim.exp_avg.h.0.attn.weight") == ("exp_avg", "h.0.attn.weight")
    assert split_optim_tensor_name("optim.step") is None
    assert split_optim_tensor_name("h.0.weight") is None


def test_manifest_json_round_trip(tmp_path):
    tensors = sample_tensors()
    step_dir = save_checkpoint(tmp_path / "run", 3, tensors, world_size=4, units=SAMPLE_UNITS,
                               training_state={"step": 3, "samples": 96, "config": {"lr": 0.1}})
    document = json.loads((step_dir / "manifest.json").read_text())
    manifest = Manifest.from_json(document, where="m")
    assert manifest.to_json() == document
    assert document["format"] == "fsdpkit-checkpoint" and document["version"] == 1
    assert document["plan"]["kind"] == "flat" and [u["padding"] for u in document["plan"]["units"]] == [
        FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in unit], 4).padding for unit in SAMPLE_UNITS]
    assert manifest.training_state == {"step": 3, "samples": 96, "config": {"lr": 0.1}}
    assert resolve_checkpoint(tmp_path / "run") == step_dir


def test_crc_combine_and_split_match_zlib():
    shifter, rng = CrcShifter(), random.Random(0)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 3000))
        b = rng.randbytes(rng.choice([0, 1, 7, 4096, rng.randrange(0, 3000)]))
        assert shifter.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert zlib.crc32(b, zlib.crc32(a)) ^ shifter.shift(zlib.crc32(a), len(b)) == zlib.crc32(b)  # a block's own crc
