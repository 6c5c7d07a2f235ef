"""Pure pieces of the checkpoint format: safetensors header I/O, casts, plans, manifest JSON."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import struct
import subprocess
import sys
import zlib
from contextlib import closing

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.checkpoint_files import SAMPLE_UNITS, make_manifest, sample_tensors, save_checkpoint, write_ranks

from fsdpkit.checkpoint.core.crc import cast_into, crc32, crc32_combine
from fsdpkit.checkpoint.core.names import split_optim_tensor_name
from fsdpkit.checkpoint.format.manifest import Manifest
from fsdpkit.checkpoint.format.placement import Placement, ShardLayout, TensorSpec
from fsdpkit.checkpoint.format.reader import read_header
from fsdpkit.checkpoint.format.storage import resolve_checkpoint
from fsdpkit.checkpoint.format.writer import DIRECT_BUFFER_BYTES, CacheMode, RankFileWriter, StreamingWriter
from fsdpkit.checkpoint.live.tensors import raw_bytes, safetensors_dtype
from fsdpkit.dtypes import dtype_info
from fsdpkit.errors import DataCheckError
from fsdpkit.flat_layout import ElementRange, FlatLayout


def _write(path, tensors, piece=7):
    entries = [(n, safetensors_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with StreamingWriter(path, entries, metadata={"format": "pt"}) as writer:
        for name, _ in writer.order:
            data = raw_bytes(tensors[name])
            for i in range(0, data.nbytes, piece):  # odd-sized pieces: the writer must not care
                writer.write(data[i : i + piece])
    return writer


def test_streaming_writer_reads_back_with_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.tensor([True, False, True]),
        "d": torch.randn(4).to(torch.bfloat16),
        "e": torch.zeros(0, 3),
        "f": torch.tensor(2.5, dtype=torch.float64),
        "g": torch.randn(5).half(),
        "h": torch.tensor([1, -2], dtype=torch.int8),
    }
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
    for info in header.tensors.values():  # every tensor starts aligned to its element size
        assert (header.data_start + info.begin) % torch.empty(0, dtype=dtype_info(info.dtype).torch).element_size() == 0


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


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: raw[:-3], "truncated or extended"),
        (lambda raw: raw + b"\0", "truncated or extended"),
        (lambda raw: struct.pack("<Q", 2**62) + raw[8:], "over the"),
        (lambda raw: struct.pack("<Q", 10_000) + raw[8:], "header claims 10000 bytes"),
        (lambda raw: raw[:4], "no header length"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "not valid JSON"),
    ],
)
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


@pytest.mark.parametrize(
    "src, dst",
    [
        ("F32", "BF16"),
        ("F32", "F16"),
        ("BF16", "F32"),
        ("F16", "F32"),
        ("F16", "BF16"),
        ("BF16", "F16"),
        ("F64", "BF16"),
        ("F64", "F16"),
        ("F64", "F32"),
        ("F32", "F64"),
    ],
)
def test_cast_matches_torch(src, dst):
    src_t, dst_t = dtype_info(src).torch, dtype_info(dst).torch
    g = torch.Generator().manual_seed(0)  # seed 0 holds an F64 value that F16 rounds differently directly and via F32
    values = torch.cat(
        [
            torch.tensor(EDGE, dtype=torch.float64),
            torch.randn(3000, dtype=torch.float64, generator=g) * 100,
            torch.randn(1000, dtype=torch.float64, generator=g) * 1e-6,
        ]
    ).to(src_t)
    expected = values.to(dst_t)
    out = bytearray(values.numel() * expected.element_size())
    result = cast_into(raw_bytes(values), src, dst, out)
    got = torch.frombuffer(bytearray(result), dtype=dst_t)
    assert torch.equal(got, expected)
    nan = torch.tensor([float("nan")], dtype=src_t)
    got_nan = torch.frombuffer(bytearray(cast_into(raw_bytes(nan), src, dst, bytearray(8))[: expected.element_size()]), dtype=dst_t)
    assert torch.isnan(got_nan).all()


def _specs(shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
    return [TensorSpec(name, "F32", shape) for name, shape in shapes]


def test_flat_placement_follows_flat_layout():
    tensors = sample_tensors()
    units = [[(n, tuple(tensors[n].shape)) for n in unit] for unit in SAMPLE_UNITS]
    placement = Placement.flat(units)
    names = [(n, tuple(t.shape)) for n, t in tensors.items()] + [
        ("optim.exp_avg.h.0.attn.weight", (8, 8)),
        ("optim.step", ()),
        ("optim.step.h.1.mlp.weight", ()),
        ("buf", (5,)),
    ]
    index = {name: i for i, (name, _) in enumerate(names)}
    for world in (1, 2, 3, 4, 7, 64):
        layout = ShardLayout(placement, _specs(names), world)
        held = {}  # (tensor, rank) -> range, from each rank's own view
        for rank in range(world):
            frags = layout.fragments(rank)
            assert [f.tensor for f in frags] == sorted(f.tensor for f in frags)  # one dtype: tensor-table order
            held.update({(f.tensor, rank): f.range for f in frags})
        for unit in units:  # exactly the engine's FlatLayout fragments
            flat = FlatLayout.from_shapes(unit, world)
            for rank in range(world):
                for frag in flat.fragments(rank):
                    if frag.param_range.size:
                        assert held[(index[frag.name], rank)] == frag.param_range
        for name, shape in names:
            pieces = layout.pieces(index[name])
            assert pieces == sorted((r, rng) for (t, r), rng in held.items() if t == index[name])
            position = 0
            for _, rng in pieces:
                assert rng.start == position and rng.size > 0
                position = rng.end
            assert position == torch.empty(shape).numel()
            wanted = ElementRange(position // 3, position - position // 4)
            assert layout.pieces(index[name], wanted) == [p for p in pieces if p[1].intersect(wanted).size]
        assert [r for r, _ in layout.pieces(index["optim.exp_avg.h.0.attn.weight"])] == [
            r for r, _ in layout.pieces(index["h.0.attn.weight"])
        ]
        assert layout.pieces(index["optim.step"]) == [(0, ElementRange(0, 1))] and layout.pieces(index["buf"]) == [(0, ElementRange(0, 5))]
        first = layout.pieces(index["h.1.mlp.weight"])[0][0]  # a scalar state lives with its parameter's first element
        assert layout.pieces(index["optim.step.h.1.mlp.weight"]) == [(first, ElementRange(0, 1))]
    even = ShardLayout(Placement.even(), _specs([("a", (10,)), ("b", (2,))]), 4)
    assert [[(f.tensor, f.start, f.end) for f in even.fragments(r)] for r in range(4)] == [
        [(0, 0, 3), (1, 0, 1)],
        [(0, 3, 6), (1, 1, 2)],
        [(0, 6, 9)],
        [(0, 9, 10)],
    ]


def test_rank_file_header_is_derived_and_reads_back(tmp_path):
    """The header the layout derives is a valid safetensors header: the library reads the file
    back, fragments aligned, bigger elements first; its size is the layout's."""
    tensors = {"w": torch.randn(5, 3), "ids": torch.arange(7), "half": torch.randn(9).half(), "flag": torch.tensor([True, False])}
    manifest = make_manifest(tensors, world_size=3)
    write_ranks(tmp_path, manifest, tensors)
    layout = manifest.layout()
    for rank in range(3):
        path = tmp_path / f"rank-{rank:05d}-of-00003.safetensors"
        expected = layout.file_layout(rank)
        assert path.stat().st_size == expected.size and path.read_bytes()[: expected.crc_offset] == expected.header[: expected.crc_offset]
        loaded = load_file(path)
        for fragment in expected.fragments:
            name = manifest.tensors[fragment.tensor].name
            assert torch.equal(loaded[name], tensors[name].reshape(-1)[fragment.start : fragment.end])
        header = read_header(path)
        itemsizes = [
            torch.empty(0, dtype=dtype_info(header.tensors[manifest.tensors[f.tensor].name].dtype).torch).element_size()
            for f in expected.fragments
        ]
        assert itemsizes == sorted(itemsizes, reverse=True)
        crcs = header.metadata["fsdpkit_crc32"]
        assert [int(crcs[8 * i : 8 * i + 8], 16) for i in range(len(expected.fragments))] == [
            zlib.crc32(raw_bytes(loaded[manifest.tensors[f.tensor].name])) for f in expected.fragments
        ]


def test_manifest_size_does_not_depend_on_world_size():
    from fsdpkit.models.units import placement_for_model

    placement = placement_for_model("gpt2-medium")
    params = [TensorSpec(n, "F32", s) for unit in placement.units for n, s in unit]
    table = params + [TensorSpec(f"optim.{k}.{p.name}", "F32", p.shape) for k in ("exp_avg", "exp_avg_sq") for p in params]
    table += [TensorSpec(f"optim.step.{p.name}", "F32", ()) for p in params]
    sizes = [
        len(Manifest(w, "full", placement, tuple(table), {"lm_head.weight": "wte.weight"}, {"step": 1}).to_bytes())
        for w in (2, 1024, 65536)
    ]
    assert sizes[2] - sizes[0] == len("65536") - len("2") and sizes[2] < 1_000_000  # only the world size's digits differ


def test_optim_names():
    assert split_optim_tensor_name("optim.exp_avg.h.0.attn.weight") == ("exp_avg", "h.0.attn.weight")
    assert split_optim_tensor_name("optim.step") is None
    assert split_optim_tensor_name("h.0.weight") is None


def test_manifest_json_round_trip(tmp_path):
    tensors = sample_tensors()
    step_dir = save_checkpoint(
        tmp_path / "run",
        3,
        tensors,
        world_size=4,
        units=SAMPLE_UNITS,
        training_state={"step": 3, "samples": 96, "config": {"lr": 0.1}},
        aliases={"lm_head.weight": "wte.weight"},
    )
    document = json.loads((step_dir / "manifest.json").read_text())
    manifest = Manifest.from_json(document, where="m")
    assert manifest.to_json() == document and json.loads(manifest.to_bytes()) == document
    assert document["format"] == "fsdpkit-checkpoint" and document["version"] == 2 and document["world_size"] == 4
    assert document["placement"] == {"kind": "flat", "units": SAMPLE_UNITS}
    assert document["tensors"] == [[n, "F32", list(t.shape)] for n, t in tensors.items()]
    assert document["files"] == "rank-{rank:05d}-of-{world_size:05d}.safetensors"
    assert manifest.training_state == {"step": 3, "samples": 96, "config": {"lr": 0.1}}
    assert resolve_checkpoint(tmp_path / "run") == step_dir
    assert sorted(p.name for p in step_dir.iterdir()) == ["manifest.json"] + [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)]


def test_crc_combine_and_split_match_zlib():
    rng = random.Random(0)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 3000))
        b = rng.randbytes(rng.choice([0, 1, 7, 4096, rng.randrange(0, 3000)]))
        assert crc32(a + b) == zlib.crc32(a + b) and crc32(b, crc32(a)) == zlib.crc32(a + b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def _python(script: str) -> subprocess.CompletedProcess:
    """`script` run by a fresh interpreter, which must succeed."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_format_library_and_offline_commands_load_no_torch():
    """Every module of fsdpkit.checkpoint.core (the shared core), fsdpkit.checkpoint.format (the on-disk format) and
    fsdpkit.checkpoint.offline imported in a fresh process: neither torch nor the torch side (fsdpkit.checkpoint.live)
    comes with them."""
    script = (
        "import importlib, json, pkgutil, sys\n"
        "for package in ('fsdpkit.checkpoint.core', 'fsdpkit.checkpoint.format', 'fsdpkit.checkpoint.offline'):\n"
        "    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):\n"
        "        importlib.import_module(f'{package}.{module.name}')\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = _python(script)
    loaded = set(json.loads(done.stdout))
    assert {"fsdpkit.checkpoint.core.bytecopy", "fsdpkit.checkpoint.format.writer", "fsdpkit.checkpoint.offline.formats"} <= loaded
    assert not [name for name in loaded if name.split(".")[0] == "torch" or name.startswith("fsdpkit.checkpoint.live")]


def test_model_description_comes_from_a_child_process_and_equals_the_in_process_build():
    """`convert --model` learns the model's units, tied weights and export recipe from a child
    process: the converting process never imports torch, and what it learns equals the
    placement, aliases and export of the model built here."""
    from fsdpkit.models.source import resolve
    from fsdpkit.models.units import placement_for_model

    script = (
        "import json, sys\n"
        "from fsdpkit.checkpoint.core.model_description import describe\n"
        "d = describe('gpt-tiny')\n"
        "print(json.dumps([[[n, list(s)] for n, s in u] for u in d.units]))\n"
        "print(json.dumps(d.aliases))\n"
        "print(json.dumps(d.export.to_json()))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    done = _python(script)
    units, aliases, export, torch_modules = map(json.loads, done.stdout.splitlines())
    assert torch_modules == []
    model = resolve("gpt-tiny").build(device="meta")
    canonical = {id(p): n for n, p in model.named_parameters()}
    tied = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}
    assert units == [[[n, list(s)] for n, s in u] for u in placement_for_model("gpt-tiny").units]
    assert aliases == tied and tied  # gpt-tiny ties its head to the embedding
    assert export == resolve("gpt-tiny").export.to_json()
    bad = subprocess.run(
        [sys.executable, "-c", "from fsdpkit.checkpoint.core.model_description import describe; describe('no-such')"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("fsdpkit.errors.UsageError: model factory 'no-such'")


def test_direct_writes_equal_cached_writes_and_bypass_the_cache(tmp_path):
    """A rank file written past the page cache (O_DIRECT through an aligned staging buffer) has
    the bytes of one written through the cache, whatever the pieces' sizes; where the filesystem
    refuses O_DIRECT the writer falls back to cached writes."""
    tensors = {"w": torch.randn(4_500_001), "h": torch.randn(1_000_003).half(), "ids": torch.arange(5)}
    manifest = make_manifest(tensors, world_size=1)
    layout = manifest.layout().file_layout(0)
    written = {}
    for cache in (CacheMode.CACHED, CacheMode.DIRECT):
        path = tmp_path / f"{cache.value}.safetensors"
        with RankFileWriter(path, layout, cache=cache) as writer:
            pieces = random.Random(0)
            for fragment in layout.fragments:
                data = raw_bytes(tensors[manifest.tensors[fragment.tensor].name].reshape(-1)[fragment.start : fragment.end])
                offset = 0
                while offset < data.nbytes:
                    size = pieces.choice([1, 7, 4096, 1 << 20, 9 << 20])
                    writer.write(data[offset : offset + size])
                    offset += size
                writer.end_fragment(zlib.crc32(data))
        written[cache] = (path.read_bytes(), writer.direct_bytes)
    assert written[CacheMode.DIRECT][0] == written[CacheMode.CACHED][0]
    assert written[CacheMode.CACHED][1] == 0
    loaded = load_file(tmp_path / "direct.safetensors")
    assert all(torch.equal(loaded[name], tensor.reshape(-1)) for name, tensor in tensors.items())
    try:
        probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        supported = os.write(probe, mmap.mmap(-1, 4096)) == 4096
        os.close(probe)
    except OSError:
        supported = False
    whole_buffers = (layout.size // DIRECT_BUFFER_BYTES) * DIRECT_BUFFER_BYTES
    assert written[CacheMode.DIRECT][1] == (whole_buffers if supported else 0)


def test_a_failed_direct_write_raises_its_own_error_and_leaves_no_file(tmp_path, monkeypatch):
    """A disk that fills up while a rank file is written past the page cache: the OSError
    names the file, and the partial file is removed."""
    tensors = {"w": torch.randn(6_000_000)}
    layout = make_manifest(tensors, world_size=1).layout().file_layout(0)
    real_write, calls = os.write, []

    def write_until_full(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_until_full)
    path = tmp_path / "rank.safetensors"
    with pytest.raises(OSError, match="No space left on device") as failure:
        with RankFileWriter(path, layout, cache=CacheMode.DIRECT) as writer:
            writer.write(raw_bytes(tensors["w"]))
    assert failure.value.filename == str(path) and not path.exists()


@pytest.mark.parametrize("cache", [CacheMode.WRITE_BEHIND, CacheMode.DIRECT])
def test_kernel_copies_of_unchecked_pieces_interleave_with_mapped_ones(tmp_path, cache):
    """copy_or_send: pieces without a checksum of at least KERNEL_COPY_BYTES go to the kernel, the
    small and the checksummed ones through the mapping (a wrong checksum still fails), a cast
    through numpy; safetensors reads back exactly the source's elements."""
    from fsdpkit.checkpoint.core.bytecopy import KERNEL_COPY_BYTES, ByteEngine, SourcePiece, SourceTensor

    values = torch.randn(DIRECT_BUFFER_BYTES // 2 + 300, generator=torch.Generator().manual_seed(0))  # a DIRECT file: 24 MiB
    raw = raw_bytes(values).tobytes()
    (tmp_path / "src.bin").write_bytes(b"pad!" + raw)
    bounds = [0, 100, 100 + KERNEL_COPY_BYTES // 4, 200 + KERNEL_COPY_BYTES // 4, values.numel()]  # small, large, small, large
    pieces = []
    for i, (first, last) in enumerate(zip(bounds, bounds[1:], strict=False)):
        crc = zlib.crc32(raw[first * 4 : last * 4]) if i == 2 else None
        pieces.append(SourcePiece(ElementRange(first, last), tmp_path / "src.bin", 4 + first * 4, (last - first) * 4, crc, "t"))
    source = SourceTensor("t", (values.numel(),), "F32", tuple(pieces))
    sent: list[int] = []
    entries = [("t", "F32", (values.numel(),)), ("cast", "BF16", (values.numel(),))]
    path = tmp_path / "out.safetensors"
    with closing(ByteEngine()) as engine, StreamingWriter(path, entries, cache=cache) as writer:
        send = lambda fd, offset, count: (sent.append(count), writer.send(fd, offset, count))  # noqa: E731
        engine.copy_or_send(source, ElementRange(0, values.numel()), "F32", writer.write, send)
        engine.copy_or_send(source, ElementRange(0, values.numel()), "BF16", writer.write, send)
    assert sent == [(bounds[2] - bounds[1]) * 4, (bounds[4] - bounds[3]) * 4]
    loaded = load_file(path)
    assert torch.equal(loaded["t"], values) and torch.equal(loaded["cast"], values.bfloat16())

    bad = SourceTensor("t", source.shape, "F32", (*pieces[:2], pieces[2]._replace(crc32=1), pieces[3]))
    with pytest.raises(DataCheckError, match="crc32"), closing(ByteEngine()) as engine:
        engine.copy_or_send(bad, ElementRange(0, values.numel()), "F32", lambda view: None, lambda *a: None)


def test_write_behind_leaves_kernel_copies_to_the_final_sync(tmp_path, monkeypatch):
    """WRITE_BEHIND starts the writeback of written bytes every WRITE_BEHIND_BYTES, never of bytes
    the kernel copied (`send`), which the caller's sync writes back; the file holds both."""
    from fsdpkit.checkpoint.format import writer as writer_module

    monkeypatch.setattr(writer_module, "WRITE_BEHIND_BYTES", 1 << 20)
    advised: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise
    monkeypatch.setattr(
        os,
        "posix_fadvise",
        lambda fd, offset, length, advice: (advised.append((offset, offset + length)), real_fadvise(fd, offset, length, advice))[1],
    )
    sent, written = os.urandom(3 << 20), os.urandom(3 << 20)
    (tmp_path / "src.bin").write_bytes(sent)
    entries = [("a", "U8", (len(sent),)), ("b", "U8", (len(written),))]
    path = tmp_path / "out.safetensors"
    with StreamingWriter(path, entries, cache=CacheMode.WRITE_BEHIND, sync=False) as out:
        data_start = out._written + out._buffered  # the header
        source = os.open(tmp_path / "src.bin", os.O_RDONLY)
        try:
            out.send(source, 0, len(sent))
        finally:
            os.close(source)
        for at in range(0, len(written), 256 << 10):
            out.write(written[at : at + (256 << 10)])
    copied = (data_start, data_start + len(sent))
    assert advised and all(end <= copied[0] or start >= copied[1] for start, end in advised)
    assert sum(end - start for start, end in advised) >= len(written) - (1 << 20)
    loaded = load_file(path)
    assert loaded["a"].numpy().tobytes() == sent and loaded["b"].numpy().tobytes() == written


@pytest.mark.parametrize("fails_after", [None, 0, 2])
def test_send_splices_in_steps_and_copies_the_rest_where_splice_fails(tmp_path, monkeypatch, fails_after):
    """`send` splices through its pipe (a small one here, so a range takes several steps); where
    splice fails, at once or part way through, the kernel copy goes on from the last byte
    spliced. The file safetensors reads holds the source's bytes at every offset."""
    from fsdpkit.checkpoint.format import writer as writer_module
    from fsdpkit.checkpoint.format.writer import StreamingWriter

    monkeypatch.setattr(writer_module, "PIPE_BYTES", 4096)
    real_splice, calls = os.splice, []

    def splice(*args, **kwargs):
        calls.append(args)
        if fails_after is not None and len(calls) > fails_after:
            raise OSError(errno.EINVAL, "no splice here")
        return real_splice(*args, **kwargs)

    monkeypatch.setattr(os, "splice", splice)
    sent = os.urandom(50_000)
    (tmp_path / "src.bin").write_bytes(b"x" * 777 + sent)
    entries = [("a", "U8", (3,)), ("b", "U8", (len(sent),)), ("c", "U8", (5,))]
    with StreamingWriter(tmp_path / "out.safetensors", entries, sync=False) as out:
        out.write(b"abc")
        source = os.open(tmp_path / "src.bin", os.O_RDONLY)
        try:
            out.send(source, 777, len(sent))
        finally:
            os.close(source)
        out.write(b"defgh")
    loaded = load_file(tmp_path / "out.safetensors")
    assert loaded["b"].numpy().tobytes() == sent
    assert loaded["a"].numpy().tobytes() == b"abc" and loaded["c"].numpy().tobytes() == b"defgh"
    assert len(calls) > (4 if fails_after is None else fails_after)
