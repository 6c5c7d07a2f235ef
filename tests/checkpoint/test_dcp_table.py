"""The pure parts of DCP support against torch computing the same thing: chunk boxes as flat
runs, coverage, FSDP2's dim-0 chunks; and the allow-list unpicklers on hostile pickles."""

from __future__ import annotations

import itertools
import os
import pickle

import pytest
import torch

from fsdpkit.checkpoint.core.boxes import coverage_problem, flat_runs, run_count
from fsdpkit.checkpoint.dcp.metadata import METADATA_GLOBALS
from fsdpkit.checkpoint.dcp.writer import dim0_chunks
from fsdpkit.checkpoint.torchfile import unpickler
from fsdpkit.errors import DataCheckError


@pytest.mark.parametrize("shape", [(7,), (5, 6), (4, 3, 5), (2, 3, 4, 2)])
def test_flat_runs_match_torch_indexing(shape):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for offsets in itertools.product(*(range(0, d, max(1, d // 2)) for d in shape)):
        sizes = tuple(max(1, (d - o) // 2 + (i % 2)) for i, (o, d) in enumerate(zip(offsets, shape, strict=True)))
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].contiguous().reshape(-1)
        runs = list(flat_runs(shape, offsets, sizes))
        assert len(runs) == run_count(shape, offsets, sizes)
        gathered = torch.cat([full.reshape(-1)[first : first + count] for first, count, _ in runs])
        assert torch.equal(gathered, box)
        assert [within for _, _, within in runs] == [sum(c for _, c, _ in runs[:i]) for i in range(len(runs))]


def test_coverage():
    shape = (6, 4)
    halves = [((0, 0), (3, 4)), ((3, 0), (3, 4))]
    columns = [((0, 0), (6, 2)), ((0, 2), (6, 2))]
    assert coverage_problem(shape, halves) is None and coverage_problem(shape, columns) is None
    assert "overlap" in coverage_problem(shape, [((0, 0), (4, 4)), ((3, 0), (3, 4))])
    assert "gap" in coverage_problem(shape, [((0, 0), (3, 4))])
    assert coverage_problem((), [((), ())]) is None


@pytest.mark.parametrize("rows,world", [(7, 2), (7, 3), (3, 8), (0, 2), (64, 64)])
def test_dim0_chunks_are_torch_chunk(rows, world):
    pieces = torch.arange(rows).chunk(world) if rows else ()
    expected = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
    assert [c for c in dim0_chunks(rows, world) if c[0] < c[1]] == expected


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unpickler_refuses_everything_else(tmp_path):
    marker = tmp_path / "marker"
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(DataCheckError, match="not allowed"):
            unpickler.restricted_loads(pickle.dumps(_Payload(marker), protocol=protocol), allowed=METADATA_GLOBALS, where="x")
    with pytest.raises(DataCheckError, match="not allowed"):
        unpickler.restricted_loads(pickle.dumps(torch.nn.Linear(2, 2)), allowed=METADATA_GLOBALS, where="x")
    with pytest.raises(DataCheckError, match="persistent id"):
        unpickler.restricted_loads(b"\x80\x02X\x01\x00\x00\x00aQ.", allowed=METADATA_GLOBALS, where="x")
    assert not marker.exists()
    assert unpickler.restricted_loads(pickle.dumps(torch.Size([2, 3])), allowed=METADATA_GLOBALS, where="x") == (2, 3)
    assert unpickler.restricted_loads(pickle.dumps(torch.bfloat16), allowed=METADATA_GLOBALS, where="x") == unpickler.Dtype("BF16")


def _getattr_pickle(module: str, name: str, attribute: str) -> bytes:
    """A pickle of `getattr(<module>.<name>, attribute)`, as a ShardedTensor's names its process group state's class."""
    owner = f"c{module}\n{name}\n".encode()
    return b"\x80\x02c__builtin__\ngetattr\n" + owner + b"X" + len(attribute).to_bytes(4, "little") + attribute.encode() + b"\x86R."


def test_torchsave_unpickler_allows_one_getattr():
    """getattr(ShardedTensor, "ProcessGroupState") is an inert record class; any other getattr is refused."""
    from fsdpkit.checkpoint.torchsave import unpickler as torchsave

    sharded = ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")
    assert torchsave.loads(_getattr_pickle(*sharded, "ProcessGroupState"), where="x") is torchsave.ProcessGroupState
    for owner, attribute in ((sharded, "__init__"), (sharded, "__class__"), (("torch", "device"), "ProcessGroupState")):
        with pytest.raises(DataCheckError, match="not allowed"):
            torchsave.loads(_getattr_pickle(*owner, attribute), where="x")


def _dcp_reference_metadata(original, world: int):
    """The `Metadata` torch's own classes give for the original's tensors chunked as FSDP2 at `world` ranks."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    expected = {}
    for key, item in original.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            expected[key] = item
            continue
        shape = tuple(item.size)
        boxes = (
            [((), ())]
            if not shape
            else [((a, *[0] * (len(shape) - 1)), (b - a, *shape[1:])) for a, b in dim0_chunks(shape[0], world) if a < b]
        )
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        expected[key] = TensorStorageMetadata(TensorProperties(dtype=item.properties.dtype), torch.Size(shape), chunks)
    return expected


def test_dcp_output_metadata_is_dcps_own(tmp_path):
    """`.metadata` pickled without torch unpickles in torch to DCP's own classes, equal to what
    they give; torch's `dcp.load` reads every tensor and bytes item back."""
    import torch.distributed.checkpoint as dcp
    from support.checkpoint_files import run_cli
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from fsdpkit.checkpoint.dcp.export import reshard_dcp
    from fsdpkit.checkpoint.dcp.metadata import read_metadata

    g = torch.Generator().manual_seed(0)
    model = {
        "w": torch.randn(70, 9, generator=g),
        "b": torch.randn(5, generator=g).bfloat16(),
        "n": torch.arange(300),
        "s": torch.tensor(2.0),
    }
    state = {"model": model, "extra": {"note": "kept", "steps": [1, 2]}}
    dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    reshard_dcp(tmp_path / "a", tmp_path / "b", world_size=4)
    original, written = (FileSystemReader(tmp_path / name).read_metadata() for name in ("a", "b"))
    assert type(written) is type(original) and written.version == original.version
    assert written.state_dict_metadata == _dcp_reference_metadata(original, 4)
    assert all(type(t.size) is torch.Size for t in written.state_dict_metadata.values() if hasattr(t, "size"))
    assert written.planner_data == original.planner_data
    expected_index = {MetadataIndex(k, c.offsets) for k, t in written.state_dict_metadata.items() for c in getattr(t, "chunks", [])}
    assert set(written.storage_data) == expected_index | {MetadataIndex(k) for k in ("extra.note", "extra.steps")}
    assert read_metadata(tmp_path / "b").tensors.keys() == {f"model.{k}" for k in model}
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "extra": {"note": "", "steps": []}}
    dcp.load(loaded, checkpoint_id=tmp_path / "b", no_dist=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.items()) and loaded["extra"] == state["extra"]
    for command in (
        ("convert", tmp_path / "b", tmp_path / "full", "--to", "full"),
        ("convert", tmp_path / "full", tmp_path / "c", "--to", "dcp", "--world-size", "2"),
    ):
        assert run_cli(*command).exit_code == 0
    again = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    dcp.load(again, checkpoint_id=tmp_path / "c", no_dist=True)  # full safetensors -> DCP: raw byte ranges too
    assert all(torch.equal(again["model"][k], v) for k, v in model.items())


def _replace_chunks(directory, tensors: dict) -> None:
    """Rewrite a one-file DCP so each tensor's chunk is torch.save of the given tensor (a view),
    the metadata's byte ranges moved to match (the test's own trusted file, so pickle is fine here)."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    with open(directory / "__0_0.distcp", "wb") as f:
        for key, tensor in tensors.items():
            buffer = io.BytesIO()
            torch.save(tensor, buffer)
            info = metadata.storage_data[MetadataIndex(key, (0,) * tensor.dim())]
            info.offset, info.length = f.tell(), len(buffer.getvalue())
            f.write(buffer.getvalue())
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_torch_save_chunk_views(tmp_path):
    """A chunk saved as a view at a storage offset is read from there, as torch reads it; a
    non-contiguous one is refused, naming the chunk."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from support.checkpoint_files import run_cli

    base = torch.arange(24.0).reshape(8, 3)
    for name, tensor in (("view", base[2:6]), ("strided", base[:4].t())):
        dcp.save({"a": torch.zeros(tensor.shape)}, checkpoint_id=tmp_path / name, no_dist=True)
        _replace_chunks(tmp_path / name, {"a": tensor})
        result = run_cli("convert", tmp_path / name, tmp_path / f"{name}-full", "--to", "full")
        if name == "view":
            assert result.exit_code == 0, result.output
            loaded = {"a": torch.zeros(4, 3)}
            dcp.load(loaded, checkpoint_id=tmp_path / name, no_dist=True)
            assert torch.equal(load_file(tmp_path / "view-full" / "model.safetensors")["a"], loaded["a"])
            assert torch.equal(loaded["a"], base[2:6])
        else:
            assert result.exit_code == 3 and "'a'" in result.output and "not contiguous" in result.output, result.output


def test_param_groups_in_index_order_whatever_the_metadata_order():
    """DCP's planner hands bytes items to ranks to even out their files, so `.metadata` may list
    group 10's settings before group 2's: the groups come back in index order all the same."""
    import io

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from fsdpkit.checkpoint.dcp.param_groups import read_param_groups

    groups = [{"lr": 0.1 * (i + 1), "betas": (0.9, 0.99 - i / 100), "params": [f"layers.{i}.weight"]} for i in range(11)]
    flat, _ = flatten_state_dict({"optimizer": {"param_groups": groups}})
    saved = {}
    for key, value in flat.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        saved[key] = buffer.getvalue()
    got = read_param_groups(sorted(saved, reverse=True), saved.__getitem__, optimizer_key="optimizer")
    expected = [{"settings": {"lr": g["lr"], "betas": list(g["betas"])}, "params": g["params"]} for g in groups]
    assert got == expected


def test_flattened_param_groups_are_torchs_groups():
    """`flatten_optimizer_state_dict=True` stores each parameter's settings under its fqn: the
    parameters with the same settings come back as one group, as torch's nested form holds them."""
    import io

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from fsdpkit.checkpoint.dcp.param_groups import read_param_groups

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    weights, biases = [model[0].weight, model[1].weight], [model[0].bias, model[1].bias]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}], lr=0.01)
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    flat, _ = flatten_state_dict(
        {"optimizer": get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))}
    )
    saved = {}
    for key in (k for k in flat if ".param_groups." in k):
        buffer = io.BytesIO()
        torch.save(flat[key], buffer)
        saved[key] = buffer.getvalue()
    nested = get_optimizer_state_dict(model, optimizer)["param_groups"]
    expected = [
        {"settings": {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}, "params": g["params"]}
        for g in nested
    ]
    assert read_param_groups(list(saved), saved.__getitem__, optimizer_key="optimizer") == expected
