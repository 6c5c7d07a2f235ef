"""torch DCP checkpoints in fsdpkit: real FSDP2 models (`fully_shard`, the built-in GPT and a
transformers Llama preset) at 2 ranks, trained two AdamW steps and saved with `dcp.save` in
torch's `{"model", "optimizer", ...}` layout (both serializations; the GPT, whose weights
are tied, only torch_save: torch's safetensors writer refuses tied weights) and as a plain model state
dict; one launch. Every fsdpkit result is then checked against what torch itself does:
`dcp_to_torch_save` of the same directory, transformers' `from_pretrained` logits against the
FSDP2 model's. Bad inputs: one line, exit 3 (or 2), nothing written, nothing run.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoint_files import run_cli, tree_snapshot

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from support.distributed import run_distributed  # noqa: E402

from fsdpkit.models.source import resolve  # noqa: E402

PROBE = torch.arange(2 * 16).reshape(2, 16) * 7 % 200
MODELS = {"gpt": "gpt-tiny", "llama": "hf:llama-tiny"}
SERIALIZATIONS = ("torch_save", "safetensors")


def _fsdp2_model(spec: str):
    from torch.distributed.fsdp import fully_shard

    source = resolve(spec)
    model = source.build(seed=0)
    units = source.unit_classes(model)
    for module in model.modules():
        if units and isinstance(module, units):
            fully_shard(module)
    fully_shard(model)
    return source, model


def _train_and_save(root: str) -> dict:
    """Each model: two AdamW steps under FSDP2 at 2 ranks, then dcp.save (both serializations,
    torchtitan's nesting with a bytes item; Llama also as a plain model state dict)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_state_dict

    logits = {}
    for name, spec in MODELS.items():
        source, model = _fsdp2_model(spec)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            source.logits(model, PROBE).float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "train_state": {"step": 2, "note": "pickled"}}
        for serialization in SERIALIZATIONS if name == "llama" else ("torch_save",):  # torch's safetensors writer refuses tied weights
            writer = dcp.FileSystemWriter(f"{root}/{name}-{serialization}", serialization_format=SerializationFormat(serialization))
            dcp.save(state, storage_writer=writer)
        if name == "llama":
            dcp.save(model_sd, checkpoint_id=f"{root}/llama-plain")
        with torch.no_grad():
            logits[name] = source.logits(model, PROBE).float()
    logits["fsdp1"] = _fsdp1_train_and_save(root)
    _save_fewer_rows_than_ranks(root)
    return logits


def _save_fewer_rows_than_ranks(root: str) -> None:
    """DTensors sharded by rows over 2 ranks, one with a single row (rank 1's shard is empty)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = {"one_row": torch.arange(5.0).reshape(1, 5), "three_rows": torch.arange(12.0).reshape(3, 4) - 5}
    dcp.save({name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in full.items()}, checkpoint_id=f"{root}/one-row")


def _fsdp1_train_and_save(root: str):
    """The GPT under FSDP1 (`FullyShardedDataParallel`, one unit per block, on CPU): two AdamW
    steps, then its SHARDED_STATE_DICT and `FSDP.optim_state_dict` saved with dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    source = resolve(MODELS["gpt"])
    model = source.build(seed=0)
    model = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy(set(source.unit_classes(model))), device_id=torch.device("cpu"), use_orig_params=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        source.logits(model, PROBE).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optimizer": FullyShardedDataParallel.optim_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=f"{root}/fsdp1")
    with torch.no_grad():
        return source.logits(model, PROBE).float()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    logits = run_distributed(_train_and_save, 2, str(root))[0]
    return root, logits


def _torch_reference(directory: Path, tmp: Path) -> dict:
    """What torch itself reads from a DCP directory (torch_save serialization)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{directory.name}.pt"
    if not target.exists():
        dcp_to_torch_save(directory, target)
    return torch.load(target, weights_only=False)


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_inspect_and_verify(saved, tmp_path):
    root, _ = saved
    reference = _torch_reference(root / "llama-torch_save", tmp_path)
    for serialization in SERIALIZATIONS:
        result = run_cli("inspect", root / f"llama-{serialization}", "--json")
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        assert summary["format"] == "dcp" and summary["serialization"] == [serialization]
        assert (summary["model_key"], summary["optimizer_key"]) == ("model", "optimizer")
        assert summary["model"]["tensors"] == len(reference["model"])
        assert summary["optimizer"]["tensors"] == sum(len(s) for s in reference["optimizer"]["state"].values())
        assert {"train_state.step", "train_state.note"} <= {b["key"] for b in summary["bytes_items"]}
        shapes = {t["name"]: t["shape"] for t in summary["tensors"]}
        assert all(shapes[name] == list(tensor.shape) for name, tensor in reference["model"].items())
        verified = run_cli("verify", root / f"llama-{serialization}", "--json")
        assert verified.exit_code == 0, verified.output
        report = json.loads(verified.stdout)
        assert report["ok"] and report["chunks"] == summary["chunks"] and report["not_checked"]
    groups = json.loads(run_cli("inspect", root / "llama-torch_save", "--json").stdout)["items"]
    assert set(groups) == {"train_state", "optimizer.param_groups"} and groups["train_state"] == 2, groups
    assert sum(groups.values()) == len(summary["bytes_items"])  # every non-tensor item, grouped by its key
    text = run_cli("inspect", root / "llama-torch_save").stdout.splitlines()
    assert "  train_state (2 items)" in text and f"  optimizer.param_groups ({groups['optimizer.param_groups']} items)" in text
    plain = json.loads(run_cli("inspect", root / "llama-plain", "--json").stdout)
    assert plain["model_key"] == "" and plain["model"]["tensors"] == len(reference["model"]) and plain["optimizer"]["tensors"] == 0


def test_convert_to_full_matches_torch_and_transformers(saved, tmp_path):
    root, logits = saved
    for name, spec in MODELS.items():
        reference = _torch_reference(root / f"{name}-torch_save", tmp_path)
        for serialization in SERIALIZATIONS if name == "llama" else ("torch_save",):
            plain = tmp_path / f"{name}-{serialization}-full"
            result = run_cli("convert", root / f"{name}-{serialization}", plain, "--to", "full", "--with-optimizer")
            assert result.exit_code == 0, result.output
            weights = load_file(plain / "model.safetensors")
            assert weights.keys() == reference["model"].keys()
            assert all(torch.equal(weights[k], reference["model"][k]) for k in weights)
            optim = load_file(plain / "optimizer.safetensors")
            for fqn, states in reference["optimizer"]["state"].items():
                for key, value in states.items():
                    assert torch.equal(optim[f"optim.{key}.{fqn}"], value)
        hf = tmp_path / f"{name}-hf"
        assert run_cli("convert", root / f"{name}-torch_save", hf, "--to", "full", "--model", spec).exit_code == 0
        loaded = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(PROBE).logits.float(), logits[name], atol=1e-5, rtol=1e-5)
    plain = tmp_path / "llama-plain-full"
    assert run_cli("convert", root / "llama-plain", plain, "--to", "full").exit_code == 0
    reference = _torch_reference(root / "llama-torch_save", tmp_path)["model"]
    weights = load_file(plain / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)


def test_a_tensor_with_fewer_rows_than_ranks(saved, tmp_path):
    """torch lists an empty chunk for the rank that holds no row of a 1-row tensor: convert and
    reshard read the tensor from its one stored chunk, as torch's own loading does."""
    root, _ = saved
    reference = _torch_reference(root / "one-row", tmp_path)
    assert reference["one_row"].shape == (1, 5)
    result = run_cli("convert", root / "one-row", tmp_path / "full", "--to", "full")
    assert result.exit_code == 0, result.output
    weights = load_file(tmp_path / "full" / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    result = run_cli("reshard", root / "one-row", tmp_path / "r3", "--world-size", "3")
    assert result.exit_code == 0, result.output
    resharded = _torch_reference(tmp_path / "r3", tmp_path)
    assert resharded.keys() == reference.keys() and all(torch.equal(resharded[k], reference[k]) for k in reference)


def test_diff_across_formats(saved, tmp_path):
    root, _ = saved
    dcp_a, dcp_b = root / "llama-torch_save", root / "llama-safetensors"
    result = run_cli("diff", dcp_a, dcp_b, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["counts"] == {"equal": len(json.loads(run_cli("inspect", dcp_a, "--json").stdout)["tensors"])}
    full, sharded = tmp_path / "full", tmp_path / "sharded"
    assert run_cli("convert", dcp_a, full, "--to", "full").exit_code == 0
    assert run_cli("convert", full, sharded, "--to", "sharded", "--world-size", "3").exit_code == 0
    for other in (full, sharded):
        assert run_cli("diff", dcp_b, other, "--model-only").exit_code == 0
        assert run_cli("diff", other, root / "llama-plain").exit_code == 0
    assert run_cli("diff", dcp_a, full).exit_code == 3  # the optimizer state is in one only
    weights = load_file(full / "model.safetensors")
    name = "model.norm.weight"
    weights[name] = weights[name] + 1e-3
    weights["lm_head.weight"] = weights["lm_head.weight"].double()
    embed = "model.embed_tokens.weight"  # small values: 1% off each is far under 1e-2 absolute
    original, weights[embed] = weights[embed].double(), weights[embed] * 1.01
    changed = tmp_path / "changed"
    changed.mkdir()
    from safetensors.torch import save_file

    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    result = run_cli("diff", dcp_a, changed, "--model-only", "--json")
    assert result.exit_code == 3
    rows = {r["name"]: r for r in json.loads(result.stdout)["tensors"]}
    assert rows[name]["status"] == "different" and rows[name]["max_abs"] == pytest.approx(1e-3, rel=1e-3)
    assert rows["lm_head.weight"]["status"] == "dtype"
    loose = run_cli("diff", dcp_a, changed, "--model-only", "--atol", "2e-3", "--json")
    assert json.loads(loose.stdout)["tensors"] and {r["name"]: r for r in json.loads(loose.stdout)["tensors"]}[name]["status"] == "close"
    scaled = weights[embed].double()
    delta = (scaled - original).abs()
    rel = float(torch.where(delta == 0, 0.0, delta / scaled.abs()).max())
    assert float(delta.max()) < rel / 2  # so --rtol rel / 2 without the scale would pass it
    for rtol, status in ((rel / 2, "different"), (rel * 2, "close")):
        strict = run_cli("diff", dcp_a, changed, "--model-only", "--rtol", str(rtol), "--json")
        rows = {r["name"]: r for r in json.loads(strict.stdout)["tensors"]}
        assert rows[embed]["status"] == status and rows[embed]["max_rel"] == pytest.approx(rel, rel=1e-9), (rtol, rows[embed])


def _rewrite_metadata(directory: Path, change) -> None:
    """Apply `change` to a copy's metadata (the test's own trusted file, so pickle is fine here)."""
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _overlap(metadata) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    key = "model.model.norm.weight"
    tensor = metadata.state_dict_metadata[key]
    first, second = tensor.chunks
    moved = torch.Size([second.offsets[0] - 1])
    tensor.chunks[1] = ChunkStorageMetadata(moved, second.sizes)
    metadata.storage_data[MetadataIndex(key, moved)] = metadata.storage_data[MetadataIndex(key, second.offsets)]


def _gap(metadata) -> None:
    metadata.state_dict_metadata["model.model.norm.weight"].chunks.pop()


def test_bad_inputs(saved, tmp_path):
    root, _ = saved
    marker = tmp_path / "marker"

    def damaged(name: str, damage) -> Path:
        copy = tmp_path / name
        shutil.copytree(root / "llama-torch_save", copy)
        damage(copy)
        return copy

    cases = {
        "malicious": damaged("malicious", lambda d: (d / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))),
        "not-dcp": damaged("not-dcp", lambda d: (d / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": 1}))),
        "garbage": damaged("garbage", lambda d: (d / ".metadata").write_bytes(b"\x80\x04not a pickle")),
        "truncated": damaged("truncated", lambda d: os.truncate(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size - 100)),
        "missing": damaged("missing", lambda d: (d / "__0_0.distcp").unlink()),
        "overlap": damaged("overlap", lambda d: _rewrite_metadata(d, _overlap)),
        "gap": damaged("gap", lambda d: _rewrite_metadata(d, _gap)),
    }
    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "notes.txt").write_text("hello")
    expected = {
        "malicious": "posix.system, which is not allowed",
        "not-dcp": "not DCP metadata",
        "garbage": "not a readable pickle",
        "truncated": "truncated",
        "missing": "file is missing",
        "overlap": "overlap",
        "gap": "a gap",
    }
    for name, directory in cases.items():
        before = tree_snapshot(directory)
        for command in (["inspect", directory], ["convert", directory, tmp_path / f"out-{name}", "--to", "full"]):
            result = run_cli(*command)
            assert result.exit_code == 3, (name, result.output)
            assert expected[name] in _one_error_line(result), (name, result.stderr)
        assert not (tmp_path / f"out-{name}").exists() and not list(tmp_path.glob(f".tmp-out-{name}*"))
        assert run_cli("verify", directory).exit_code == 3
        assert run_cli("diff", directory, root / "llama-torch_save").exit_code == 3
        assert tree_snapshot(directory) == before
    assert not marker.exists()  # the payload never ran
    assert run_cli("inspect", neither).exit_code == 2  # no checkpoint at all: bad input, not a failed check
    result = run_cli("convert", root / "llama-torch_save", tmp_path / "out", "--to", "full", "--dcp-model-key", "nope")
    assert result.exit_code == 2 and "top-level keys: model, optimizer, train_state" in _one_error_line(result)
    assert not (tmp_path / "out").exists()


def _raw(tensor) -> str:
    """A digest of this rank's shard's bytes (small data back to the test process: bitwise equal
    shards, equal digests)."""
    import hashlib

    return hashlib.sha256(tensor.detach().to_local().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _load_and_continue(directories: list[str]) -> dict:
    """FSDP2 at this world size loads each directory (dcp.load + set_state_dict, model and
    AdamW state), then takes one step; this rank's shards after loading and after the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    results = {}
    for directory in directories:
        source, model = _fsdp2_model(MODELS["llama"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=directory, planner=DefaultLoadPlanner(allow_partial_load=True))  # fsdpkit input has no param groups
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        loaded = {name: p.to_local().clone() for name, p in model.named_parameters()}
        loaded |= {
            f"{key}.{name}": v.to_local().clone()
            for name, p in model.named_parameters()
            for key, v in optimizer.state[p].items()
            if key != "step"
        }
        source.logits(model, PROBE).float().logsumexp(-1).mean().backward()
        optimizer.step()
        stepped = {name: _raw(p) for name, p in model.named_parameters()}
        results[directory] = [_digest(loaded), _digest(stepped), sum(name.startswith("exp_avg.") for name in loaded)]
    return results


def _digest(shards: dict[str, str]) -> str:
    import hashlib

    return hashlib.sha256(repr(sorted(shards.items())).encode()).hexdigest()


def test_fsdp2_loads_fsdpkit_outputs_bitwise(saved, tmp_path):
    """FSDP2 at 3 ranks: fsdpkit's reshard (2 -> 3) and DCP -> fsdpkit -> DCP load the same bytes
    as DCP's own load-time reshard of the original, and the next step is identical."""
    root, _ = saved
    original = root / "llama-torch_save"
    resharded, full, sharded, back = (tmp_path / name for name in ("r3", "full", "sharded", "back"))
    assert run_cli("reshard", original, resharded, "--world-size", "3").exit_code == 0
    summary = json.loads(run_cli("inspect", resharded, "--json").stdout)
    assert len([f for f in summary["files"] if f["name"].endswith(".distcp")]) == 3
    assert {b["key"] for b in summary["bytes_items"]} == {
        b["key"] for b in json.loads(run_cli("inspect", original, "--json").stdout)["bytes_items"]
    }
    assert run_cli("diff", original, resharded).exit_code == 0
    assert run_cli("convert", original, full, "--to", "full", "--with-optimizer").exit_code == 0
    assert run_cli("convert", full, sharded, "--to", "sharded", "--world-size", "2", "--with-optimizer").exit_code == 0
    assert run_cli("convert", sharded, back, "--to", "dcp", "--world-size", "2").exit_code == 0
    assert run_cli("diff", original, back).exit_code == 0  # DCP -> fsdpkit -> DCP, optimizer included
    results = run_distributed(_load_and_continue, 3, [str(original), str(resharded), str(back)])
    for rank, per_dir in results.items():
        first, *others = per_dir.values()
        assert first[2] > 0 and all(other == first for other in others), rank


def test_convert_to_sharded_resumes(saved, tmp_path):
    """DCP (FSDP2 GPT, tied weights, 2 ranks) -> fsdpkit at 3 ranks: every tensor, optimizer
    included, equals the DCP's; `fsdpkit train --resume` continues from the optimizer's step."""
    root, _ = saved
    original, sharded = root / "gpt-torch_save", tmp_path / "sharded"
    result = run_cli("convert", original, sharded, "--to", "sharded", "--world-size", "3", "--model", "gpt-tiny", "--json")
    assert result.exit_code == 0, result.output
    converted = json.loads(result.stdout)
    assert converted["step"] == 2 and converted["optimizer_tensors"] > 0
    reference = _torch_reference(original, tmp_path)
    assert converted["optimizer_tensors"] == sum(len(s) for s in reference["optimizer"]["state"].values())
    assert run_cli("diff", original, sharded).exit_code == 0  # the tied alias included
    assert run_cli("verify", sharded).exit_code == 0
    report = _resume(sharded, ranks=3)
    assert report["resumed_from_step"] == 2 and report["steps"] == 3 and len(report["losses"]) == 1
    assert (
        run_cli("convert", original, tmp_path / "x", "--to", "sharded", "--world-size", "3").exit_code == 0
    )  # without --model: an even split
    assert run_cli("diff", original, tmp_path / "x").exit_code == 0


def _resume(checkpoint: Path, *, ranks: int) -> dict:
    """`train --resume` of gpt-tiny for 3 steps at `ranks` ranks (2 sequences each); its --json report."""
    trained = run_cli(
        "train", "--model", MODELS["gpt"], "--nproc-per-node", str(ranks), "--resume", checkpoint,
        "--steps", "3", "--seq-len", "16", "--global-batch-size", str(2 * ranks), "--json",
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    return json.loads(trained.stdout)


def test_fsdp1_checkpoint(saved, tmp_path):
    """A checkpoint of FSDP1's SHARDED_STATE_DICT: inspect and verify; --to full equals torch's
    own reading and transformers' logits equal the FSDP1 model's; --to sharded equals it;
    `train --resume` takes it as it is."""
    root, logits = saved
    original = root / "fsdp1"
    reference = _torch_reference(original, tmp_path)
    summary = json.loads(run_cli("inspect", original, "--json").stdout)
    assert (summary["model_key"], summary["optimizer_key"]) == ("model", "optimizer")
    assert summary["model"]["tensors"] == len(reference["model"])
    assert summary["optimizer"]["tensors"] == sum(len(s) for s in reference["optimizer"]["state"].values())
    assert json.loads(run_cli("verify", original, "--json").stdout)["ok"]
    hf = tmp_path / "hf"
    assert run_cli("convert", original, hf, "--to", "full", "--model", MODELS["gpt"]).exit_code == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROBE).logits.float(), logits["fsdp1"], atol=1e-5, rtol=1e-5)
    sharded = tmp_path / "sharded"
    result = run_cli("convert", original, sharded, "--to", "sharded", "--world-size", "2", "--model", MODELS["gpt"], "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 2
    assert run_cli("diff", original, sharded).exit_code == 0
    _resumes_the_dcp_directly(original, reference, tmp_path / "resumed")


def _resumes_the_dcp_directly(original: Path, reference: dict, save_dir: Path) -> None:
    """`train --resume DCP --model M` converts as it loads: run to the step it was saved at and
    saved again, its weights and AdamW state are what torch's own DCP loading gives."""
    import fsdpkit

    trained = run_cli(
        "train", "--model", MODELS["gpt"], "--nproc-per-node", "2", "--resume", original, "--steps", "2",
        "--seq-len", "16", "--global-batch-size", "4", "--save-dir", save_dir, "--json",
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    report = json.loads(trained.stdout)
    assert report["resumed_from_step"] == 2 and report["optimizer_steps"] == 2 and report["losses"] == []
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step-00000002"]  # the converted copy is gone
    with fsdpkit.open_checkpoint(save_dir) as saved:
        for name, tensor in reference["model"].items():
            assert torch.equal(saved.get_tensor(name), tensor), name
        moments = [(fqn, key, value) for fqn, state in reference["optimizer"]["state"].items() for key, value in state.items()]
        assert {key for _, key, _ in moments} == {"step", "exp_avg", "exp_avg_sq"}
        for fqn, key, value in moments:
            assert torch.equal(saved.get_tensor(f"optim.{key}.{fqn}").to(value.dtype), value), (fqn, key)


def test_open_checkpoint_reads_what_torch_loads(saved, tmp_path):
    """`fsdpkit.open_checkpoint` of FSDP2's DCP (both serializations) and FSDP1's: every model
    and AdamW tensor, whole and sliced, equals what torch's own DCP loading gives
    (`dcp_to_torch_save`), and the bytes items are its plain values."""
    from test_any_checkpoint import assert_reads_like

    import fsdpkit

    root, _ = saved
    for name in ("llama-torch_save", "llama-safetensors", "fsdp1"):
        reference = _torch_reference(root / ("llama-torch_save" if name == "llama-safetensors" else name), tmp_path)
        expected = dict(reference["model"])
        expected |= {f"optim.{key}.{fqn}": value for fqn, state in reference["optimizer"]["state"].items() for key, value in state.items()}
        with fsdpkit.open_checkpoint(root / name) as checkpoint:
            assert checkpoint.format == "dcp" and set(checkpoint.model) | set(checkpoint.optimizer) == set(expected), name
            assert_reads_like(checkpoint, expected.__getitem__, sorted(expected))
            if name != "fsdp1":
                assert checkpoint.get_item("train_state.note") == reference["train_state"]["note"] == "pickled"
                assert checkpoint.get_item("optimizer.param_groups.0.lr") == reference["optimizer"]["param_groups"][0]["lr"]


def test_chunks_listed_in_any_order(saved, tmp_path):
    """torch's loader looks each chunk up, so `.metadata` may list a tensor's chunks in any
    order: reshard of a copy listing them last rank first writes what torch loads as the original."""
    root, _ = saved
    original, copy = root / "llama-torch_save", tmp_path / "reversed"
    shutil.copytree(original, copy)
    _rewrite_metadata(copy, lambda m: [item.chunks.reverse() for item in m.state_dict_metadata.values() if hasattr(item, "chunks")])
    result = run_cli("reshard", copy, tmp_path / "r3", "--world-size", "3")
    assert result.exit_code == 0, result.output
    expected, found = _torch_reference(original, tmp_path), _torch_reference(tmp_path / "r3", tmp_path)
    assert set(found["model"]) == set(expected["model"])
    assert all(torch.equal(found["model"][name], tensor) for name, tensor in expected["model"].items())
