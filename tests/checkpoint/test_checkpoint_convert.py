"""convert / reshard / inspect / verify on checkpoints built in the test, compared exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.checkpoint_files import SAMPLE_UNITS, run_cli, sample_buffers, sample_optimizer, sample_tensors, save_checkpoint, tree_snapshot

from fsdpkit.checkpoint.core.report import WriteReport
from fsdpkit.checkpoint.core.request import ReshardRequest
from fsdpkit.checkpoint.format.format import ShardedFormat
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.errors import UsageError
from fsdpkit.flat_layout import ElementRange, FlatLayout
from fsdpkit.models.source import build_model
from fsdpkit.models.units import unit_specs_for_model

ALIASES = {"lm_head.weight": "wte.weight"}


def reshard(src, dst, **request) -> WriteReport:
    """fsdpkit's own reshard, as `fsdpkit reshard` calls it."""
    return ShardedFormat().reshard(Path(src), Path(dst), ReshardRequest(**request))


def everything():
    params = sample_tensors()
    return params, {**params, **sample_buffers(), **sample_optimizer(params)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """W=2 and W=4 checkpoints with the flat plan, and W=3 with an even split."""
    root = tmp_path_factory.mktemp("sharded")
    params, tensors = everything()
    state = {"step": 12, "samples": 384, "optimizer": {"type": "AdamW", "lr": 3e-4}, "per_rank": [{"rng": 1}, {"rng": 2}]}
    runs = {}
    for world, units in ((2, SAMPLE_UNITS), (4, SAMPLE_UNITS), (3, None)):
        runs[world] = save_checkpoint(
            root / f"run{world}", 12, tensors, world_size=world, units=units, training_state=state, aliases=ALIASES
        )
    return root, tensors, runs


def _model_tensors(tensors):
    return {n: t for n, t in tensors.items() if not n.startswith("optim.")}


def _assert_full_equal(directory, expected, prefix="model"):
    index = directory / f"{prefix}.safetensors.index.json"
    files = sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists() else [f"{prefix}.safetensors"]
    loaded = {}
    for name in files:
        loaded.update(load_file(directory / name))
        with safe_open(directory / name, framework="pt") as f:
            assert f.metadata()["format"] == "pt"
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("world", [2, 4, 3])
def test_convert_to_full_equals_original(sharded, tmp_path, world):
    root, tensors, runs = sharded
    before = tree_snapshot(runs[world].parent)
    result = run_cli("convert", runs[world].parent, tmp_path / "full", "--to", "full", "--with-optimizer", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["files"] == ["model.safetensors", "optimizer.safetensors"]
    _assert_full_equal(tmp_path / "full", _model_tensors(tensors))
    _assert_full_equal(tmp_path / "full", {n: t for n, t in tensors.items() if n.startswith("optim.")}, prefix="optimizer")
    with safe_open(tmp_path / "full" / "model.safetensors", framework="pt") as f:
        assert json.loads(f.metadata()["fsdpkit_tied_weights"]) == ALIASES
    assert tree_snapshot(runs[world].parent) == before


def test_max_shard_size_writes_index(sharded, tmp_path):
    _, tensors, runs = sharded
    result = run_cli("convert", runs[2], tmp_path / "full", "--to", "full", "--max-shard-size", "600B")
    assert result.exit_code == 0, result.output
    index = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())
    model = _model_tensors(tensors)
    assert set(index["weight_map"]) == set(model)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.values())
    files = sorted(p.name for p in (tmp_path / "full").glob("model-*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for name in files:
        part = load_file(tmp_path / "full" / name)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 600 or len(part) == 1
    _assert_full_equal(tmp_path / "full", model)
    assert not (tmp_path / "full" / "optimizer.safetensors").exists()


def test_dtype_cast_on_the_way_out(sharded, tmp_path):
    _, tensors, runs = sharded
    result = run_cli("convert", runs[4], tmp_path / "bf16", "--to", "full", "--dtype", "bf16", "--chunk-size", "1K")
    assert result.exit_code == 0, result.output
    expected = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in _model_tensors(tensors).items()}
    _assert_full_equal(tmp_path / "bf16", expected)
    assert run_cli("convert", runs[4], tmp_path / "x", "--to", "full", "--dtype", "int8").exit_code == 2
    assert run_cli("convert", runs[4], tmp_path / "f32", "--to", "full").exit_code == 0
    result = run_cli("convert", tmp_path / "f32", tmp_path / "sh", "--to", "sharded", "--world-size", 3, "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    reader = CheckpointReader(tmp_path / "sh")
    for name, tensor in expected.items():
        assert torch.equal(reader.read_tensor(name), tensor), name


def test_full_to_sharded_to_full_round_trip(sharded, tmp_path):
    _, tensors, runs = sharded
    assert run_cli("convert", runs[2], tmp_path / "full", "--to", "full", "--with-optimizer").exit_code == 0
    for world in (1, 3, 5):
        out = tmp_path / f"s{world}"
        result = run_cli("convert", tmp_path / "full", out, "--to", "sharded", "--world-size", world, "--with-optimizer", "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["placement"] == "even"
        assert run_cli("verify", out).exit_code == 0
        reader = CheckpointReader(out)
        assert reader.manifest.shard_factor == world and reader.aliases == ALIASES
        for name, tensor in tensors.items():
            assert torch.equal(reader.read_tensor(name), tensor), name
        assert torch.equal(reader.read_tensor("lm_head.weight"), tensors["wte.weight"])
        back = tmp_path / f"back{world}"
        assert run_cli("convert", out, back, "--to", "full", "--with-optimizer", "--chunk-size", "2K").exit_code == 0
        _assert_full_equal(back, _model_tensors(tensors))


@pytest.mark.parametrize("target", [1, 3, 4, 64])
def test_reshard_then_read_equals_original(sharded, tmp_path, target):
    _, tensors, runs = sharded
    out = tmp_path / f"m{target}"
    result = run_cli("reshard", runs[2].parent, out, "--world-size", target, "--chunk-size", "1K", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["from_world_size"] == 2 and len(summary["files"]) == target
    assert ("per_rank" in summary["warnings"][0]) if target != 2 else not summary["warnings"]
    assert run_cli("verify", out).exit_code == 0
    reader = CheckpointReader(out)
    assert reader.manifest.shard_factor == target and reader.manifest.placement.kind == "flat"
    assert "per_rank" not in reader.training_state and reader.training_state["step"] == 12
    for name, tensor in tensors.items():
        assert torch.equal(reader.read_tensor(name), tensor), name
    # each new rank's own chunk is in its own file, and only there
    for unit in SAMPLE_UNITS:
        layout = FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in unit], target)
        for rank in range(target):
            for frag in layout.fragments(rank):
                if not frag.param_range.size:
                    continue
                for name in (frag.name, f"optim.exp_avg.{frag.name}"):
                    holders = [file for file, rng in reader.fragments(name) if rng.intersect(frag.param_range).size]
                    assert holders == [f"rank-{rank:05d}-of-{target:05d}.safetensors"]
                    got = reader.read_range(name, frag.param_range)
                    assert torch.equal(got, tensors[name].reshape(-1)[frag.param_range.start : frag.param_range.end])
    assert run_cli("convert", out, tmp_path / "full", "--to", "full", "--with-optimizer").exit_code == 0
    _assert_full_equal(tmp_path / "full", _model_tensors(tensors))


def test_reshard_even_plan_and_back(sharded, tmp_path):
    _, tensors, runs = sharded
    assert run_cli("reshard", runs[3], tmp_path / "e7", "--world-size", 7).exit_code == 0
    assert run_cli("reshard", tmp_path / "e7", tmp_path / "e2", "--world-size", 2).exit_code == 0
    reader = CheckpointReader(tmp_path / "e2")
    assert reader.manifest.placement.kind == "even"
    for name, tensor in tensors.items():
        assert torch.equal(reader.read_tensor(name), tensor), name


def test_read_range_across_fragments(sharded):
    _, tensors, runs = sharded
    reader = CheckpointReader(runs[4])
    flat = tensors["wte.weight"].reshape(-1)
    for start, end in [(0, 136), (5, 6), (30, 101), (135, 136), (40, 40)]:
        assert torch.equal(reader.read_range("wte.weight", ElementRange(start, end)), flat[start:end])
    with pytest.raises(ValueError, match="outside"):
        reader.read_range("wte.weight", ElementRange(0, 137))


def test_inspect_and_verify_report(sharded):
    _, tensors, runs = sharded
    result = run_cli("inspect", runs[4].parent, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["world_size"] == 4 and summary["step"] == 12 and summary["samples"] == 384
    model = _model_tensors(tensors)
    assert summary["model"]["tensors"] == len(model)
    assert summary["model"]["bytes"] == sum(t.numel() * t.element_size() for t in model.values())
    assert summary["optimizer"]["tensors"] == len(tensors) - len(model)
    assert summary["dtypes"]["BOOL"] == 1 and len(summary["files"]) == 4 and summary["aliases"] == ALIASES
    text = run_cli("inspect", runs[4])
    assert text.exit_code == 0 and "world size  4" in text.stdout
    report = run_cli("verify", runs[4], "--json")
    assert report.exit_code == 0 and json.loads(report.stdout)["ok"] is True
    fragments = json.loads(report.stdout)["fragments"]
    line = run_cli("verify", runs[4]).stdout
    assert line.startswith(f"ok {runs[4]}: sharded, {len(tensors)} tensors, {fragments} fragments, ")
    assert line.rstrip().endswith(f"checked: the crc32 of all {fragments} fragments; file sizes; headers; fragment coverage; file names")


def test_inspect_and_verify_of_a_full_export_count_its_optimizer_state(sharded, tmp_path):
    _, tensors, runs = sharded
    assert run_cli("convert", runs[4], tmp_path / "full", "--to", "full", "--with-optimizer").exit_code == 0
    summary = json.loads(run_cli("inspect", tmp_path / "full", "--json").stdout)
    model = _model_tensors(tensors)
    assert summary["model"]["tensors"] == len(model) and summary["optimizer"]["tensors"] == len(tensors) - len(model) > 0
    result = run_cli("verify", tmp_path / "full")
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.startswith(f"ok {tmp_path / 'full'}: full, {len(tensors)} tensors, 2 files, ")
    assert result.stdout.rstrip().endswith("checked: headers; file sizes; the index; not checked: the data (this format has no checksums)")


def test_convert_to_sharded_with_model_plan(tmp_path):
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    state = model.state_dict()
    stored = {n: t.contiguous() for n, t in state.items() if n != "lm_head.weight"}
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])
    save_file(
        stored,
        tmp_path / "model.safetensors",
        metadata={"format": "pt", "fsdpkit_tied_weights": json.dumps({"lm_head.weight": "wte.weight"})},
    )
    result = run_cli(
        "convert", tmp_path / "model.safetensors", tmp_path / "s2", "--to", "sharded", "--world-size", 2, "--model", "gpt-tiny", "--json"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["placement"] == "flat"
    reader = CheckpointReader(tmp_path / "s2")
    units = unit_specs_for_model("gpt-tiny")
    assert [[p for p, _ in u] for u in reader.manifest.placement.units] == [[p for p, _ in u] for u in units]
    for unit in units:  # rank r finds its FlatLayout chunk in its own file
        layout = FlatLayout.from_shapes(unit, 2)
        for rank in range(2):
            for frag in layout.fragments(rank):
                if frag.param_range.size:
                    files = [file for file, rng in reader.fragments(frag.name) if rng.intersect(frag.param_range).size]
                    assert files == [f"rank-{rank:05d}-of-00002.safetensors"]
    for name, tensor in state.items():
        assert torch.equal(reader.read_tensor(name), tensor), name
    other = build_model("gpt-small").state_dict()
    save_file({n: t.contiguous() for n, t in other.items() if n != "lm_head.weight"}, tmp_path / "other.safetensors")
    bad = run_cli("convert", tmp_path / "other.safetensors", tmp_path / "s3", "--to", "sharded", "--world-size", 2, "--model", "gpt-tiny")
    assert bad.exit_code == 3 and "does not match model 'gpt-tiny'" in bad.stderr
    assert not (tmp_path / "s3").exists()


@pytest.mark.parametrize("chunk", [64, 200])
def test_many_small_blocks(sharded, tmp_path, chunk):
    """Chunks far smaller than the tensors: every copy takes many blocks, output checksums
    combined block by block; results stay exact."""
    from fsdpkit.checkpoint.core.request import ConvertRequest
    from fsdpkit.checkpoint.format.verify import verify_checkpoint
    from fsdpkit.checkpoint.offline.formats import convert_any

    _, tensors, runs = sharded
    reshard(runs[2].parent, tmp_path / "r3", world_size=3, chunk_size=chunk)
    assert verify_checkpoint(tmp_path / "r3").ok
    convert_any(tmp_path / "r3", tmp_path / "full", ConvertRequest(to="full", with_optimizer=True, chunk_size=chunk))
    _assert_full_equal(tmp_path / "full", _model_tensors(tensors))
    _assert_full_equal(tmp_path / "full", {n: t for n, t in tensors.items() if n.startswith("optim.")}, prefix="optimizer")


@pytest.mark.parametrize("unsupported", [(), ("copy_file_range",)])
def test_large_fragments_copied_by_the_kernel(sharded, tmp_path, monkeypatch, unsupported):
    """Fragments above the kernel-copy size go file to file (copy_file_range, else read and
    write where the filesystem refuses) in the write threads, each file streamed in steps at
    their offsets, checksummed through the mapping: the result equals the mapped-slices path
    byte for byte, and a corrupt source byte is caught."""
    import errno
    import os

    from fsdpkit.checkpoint.core import bytecopy
    from fsdpkit.errors import DataCheckError

    _, tensors, runs = sharded
    reshard(runs[2].parent, tmp_path / "slices", world_size=3)

    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    for name in unsupported:
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(bytecopy, "KERNEL_COPY_BYTES", 64)
    monkeypatch.setattr(bytecopy, "WHOLE_FILE_BYTES", 256)
    reshard(runs[2].parent, tmp_path / "kernel", world_size=3)
    for rank in range(3):
        name = f"rank-{rank:05d}-of-00003.safetensors"
        assert (tmp_path / "kernel" / name).read_bytes() == (tmp_path / "slices" / name).read_bytes()
    reader = CheckpointReader(tmp_path / "kernel")
    for name, tensor in tensors.items():
        assert torch.equal(reader.read_tensor(name), tensor), name
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs[2], corrupt)
    path = corrupt / "rank-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataCheckError, match="checksum mismatch"):
        reshard(corrupt, tmp_path / "out", world_size=3)
    assert not (tmp_path / "out").exists()


def test_a_loading_rank_reads_only_the_files_its_chunk_overlaps(sharded, tmp_path):
    """W=4 loaded at W'=2: rank 0's chunk (and the whole tensors, on rank 0) need only files 0
    and 1, so with files 2 and 3 gone it still loads; rank 1's chunk needs them."""
    from fsdpkit.errors import DataCheckError

    _, tensors, runs = sharded
    step = tmp_path / "step"
    shutil.copytree(runs[4], step)
    for rank in (2, 3):
        (step / f"rank-{rank:05d}-of-00004.safetensors").unlink()
    reader = CheckpointReader(step, validate_all=False)
    for unit in SAMPLE_UNITS:
        layout = FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in unit], 2)
        for frag in layout.fragments(0):
            for name in (frag.name, f"optim.exp_avg.{frag.name}"):
                expected = tensors[name].reshape(-1)[frag.param_range.start : frag.param_range.end]
                assert torch.equal(reader.read_range(name, frag.param_range), expected)
    for name in ("attn.mask", "pos.ids", "optim.step"):
        assert torch.equal(reader.read_tensor(name), tensors[name])
    frag = FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in SAMPLE_UNITS[0]], 2).fragments(1)[-1]
    with pytest.raises(DataCheckError, match=r"rank-0000[23]-of-00004.safetensors: file is missing"):
        reader.read_range(frag.name, frag.param_range)


def test_reshard_to_many_files_and_back(sharded, tmp_path):
    """Many rank files, each cut from slices of the same source fragments (their checksums
    combined piece by piece), and back to few files, each fragment assembled from many source
    fragments: the results are exact, verify reports every fragment, and a flipped byte is
    caught on either side, leaving nothing behind."""
    from fsdpkit.checkpoint.format.reader import read_header
    from fsdpkit.checkpoint.format.verify import verify_checkpoint
    from fsdpkit.errors import DataCheckError

    _, tensors, runs = sharded
    reshard(runs[2], tmp_path / "r37", world_size=37, chunk_size=1024)
    reshard(tmp_path / "r37", tmp_path / "back", world_size=2, chunk_size=64)
    for out in ("r37", "back"):
        reader = CheckpointReader(tmp_path / out)
        assert run_cli("verify", tmp_path / out).exit_code == 0
        for name, tensor in tensors.items():
            assert torch.equal(reader.read_tensor(name), tensor), name
    assert all(
        (tmp_path / "back" / name).read_bytes() == (runs[2] / name).read_bytes()
        for name in ("rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors")
    )
    done = []
    report = verify_checkpoint(tmp_path / "r37", progress=lambda count, total: done.append((count, total)))
    assert report.ok and report.counts["fragment"] > 37 and sum(count for count, _ in done) == report.bytes == done[0][1]
    victim = tmp_path / "r37" / "rank-00030-of-00037.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 1
    victim.write_bytes(bytes(raw))
    report = verify_checkpoint(tmp_path / "r37")
    assert len(report.problems) == 1 and "rank-00030-of-00037.safetensors: checksum mismatch" in report.problems[0]
    with pytest.raises(DataCheckError, match="checksum mismatch in rank-00030-of-00037.safetensors"):
        reshard(tmp_path / "r37", tmp_path / "out", world_size=2)
    broken = tmp_path / "broken"
    shutil.copytree(runs[2], broken)
    path = broken / "rank-00000-of-00002.safetensors"
    header = read_header(path)
    raw = bytearray(path.read_bytes())
    raw[header.data_start + header.tensors["optim.exp_avg.wte.weight"].begin + 100] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(DataCheckError, match="checksum mismatch in rank-00000-of-00002.safetensors tensor 'optim.exp_avg.wte.weight'"):
        reshard(broken, tmp_path / "out", world_size=37)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "broken", "r37"]


def test_reshard_by_two_processes_equals_one(sharded, tmp_path, monkeypatch):
    """Many rank files are written by two forked processes, each a contiguous share of the
    ranks (forced here at 37 and 64 files): byte for byte the one-process output, progress
    adding up to every byte, and the source pieces cut by the share boundary checked from
    their two parts. An error in either process (a flipped byte in a cut piece or in a whole
    one, a failed write in the child) is the one-process error and leaves nothing behind."""
    import errno
    import re

    from fsdpkit.checkpoint.core import bytecopy, workers
    from fsdpkit.checkpoint.format import writer
    from fsdpkit.errors import DataCheckError, RunError

    _, tensors, runs = sharded
    assert workers.process_count(64) == 1
    parts = []
    monkeypatch.setattr(writer, "check_parts", lambda found: parts.extend(found) or bytecopy.check_parts(found))
    for world in (37, 64):
        reshard(runs[2], tmp_path / f"one{world}", world_size=world)
    assert parts == []
    monkeypatch.setattr(workers, "process_count", lambda world_size: 2)
    done: list[tuple[int, int]] = []
    for world in (37, 64):
        done.clear()
        reshard(runs[2], tmp_path / f"two{world}", world_size=world, progress=lambda count, total: done.append((count, total)))
        names = sorted(p.name for p in (tmp_path / f"one{world}").iterdir())
        assert names == sorted(p.name for p in (tmp_path / f"two{world}").iterdir()) and len(names) == world + 1
        for name in names:
            assert (tmp_path / f"one{world}" / name).read_bytes() == (tmp_path / f"two{world}" / name).read_bytes(), name
        assert sum(count for count, _ in done) == done[0][1] == sum(t.numel() * t.element_size() for t in tensors.values())
    cut = next(part for part in parts if part.begin > 0)
    assert run_cli("verify", tmp_path / "two64").exit_code == 0

    def errors(source, **patches) -> list[str]:
        """The error of a one-process and of a two-process reshard of `source` to 64 files; neither leaves anything behind."""
        lines, before = [], sorted(tmp_path.iterdir())
        for name, value in patches.items():
            monkeypatch.setattr(bytecopy, name, value)
        for count in (1, 2):
            monkeypatch.setattr(workers, "process_count", lambda world_size, count=count: count)
            with pytest.raises((DataCheckError, RunError)) as caught:
                reshard(source, tmp_path / "out", world_size=64)
            lines.append(re.sub(r"-[0-9a-f]{8}/", "-*/", str(caught.value)))
            assert sorted(tmp_path.iterdir()) == before
        return lines

    broken = tmp_path / "broken"
    for path, at, label in ((cut.path, cut.offset + cut.begin + 4, cut.label), (runs[2] / "rank-00001-of-00002.safetensors", -5, "")):
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(runs[2], broken)
        raw = bytearray((broken / path.name).read_bytes())
        raw[at] ^= 1
        (broken / path.name).write_bytes(bytes(raw))
        one, two = errors(broken)
        assert one == two and f"checksum mismatch in {label}" in one
        assert run_cli("reshard", broken, tmp_path / "out", "--world-size", "64").exit_code == 3

    def full_disk(path, views):
        if int(path.name[5:10]) >= 32:  # the child's share
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_file(path, views)

    write_file = bytecopy.write_file
    one, two = errors(runs[2], write_file=full_disk)
    assert one == two and "nothing written" in one and "(ENOSPC)" in one


def _some_value(option: str):
    return 2 if option in ("world_size", "max_shard_size") else True if option == "with_optimizer" else "x"


def test_every_writer_and_opener_names_known_options():
    """The table of formats names, for each target's writer and each source's opener, only
    options ConvertRequest has and the command line spells; with what the writer needs given,
    the options check passes, and each option neither side takes is refused in one line."""
    import dataclasses

    from fsdpkit.checkpoint.core.request import OPTION_FLAGS, ConvertRequest, check_options
    from fsdpkit.checkpoint.offline.formats import FORMATS, TARGETS

    assert set(OPTION_FLAGS) <= {f.name for f in dataclasses.fields(ConvertRequest)}
    for source, found in FORMATS.items():
        for target in TARGETS:
            writes = FORMATS[target].writes
            known = {*writes.needs, *writes.takes, *found.reads.takes}
            assert known <= set(OPTION_FLAGS)
            given = {name: _some_value(name) for name in writes.needs}
            check_options(source, found.reads, writes, ConvertRequest(to=target, **given))
            for name in set(OPTION_FLAGS) - known:
                with pytest.raises(UsageError, match=f"^{OPTION_FLAGS[name]} does not apply to --to {target} from a {source} checkpoint"):
                    check_options(source, found.reads, writes, ConvertRequest(to=target, **given, **{name: _some_value(name)}))
