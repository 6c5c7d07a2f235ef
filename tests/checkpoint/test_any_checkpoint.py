"""`fsdpkit.open_checkpoint` on fsdpkit sharded and full safetensors checkpoints, against
`safetensors.safe_open` of the same tensors (the DCP and DeepSpeed cases share their modules'
launches: test_dcp.py, test_deepspeed.py); `diff` of a run and its own transformers export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from support.checkpoint_files import SAMPLE_UNITS, run_cli, sample_buffers, sample_optimizer, sample_tensors, save_checkpoint

import fsdpkit

INDICES = [(), (slice(2, 5),), (3,), (-1,), (slice(1, 7, 2),), (slice(2, 5), slice(1, 3)), (slice(None), 4), (slice(9, 2),)]


def assert_reads_like(checkpoint, oracle, names) -> None:
    """Every name: shape, dtype, get_tensor and slices of it equal the oracle's tensor."""
    for name in names:
        expected = oracle(name)
        assert checkpoint.shape(name) == tuple(expected.shape) and checkpoint.get_slice(name).get_shape() == list(expected.shape), name
        assert checkpoint.get_slice(name).get_dtype() == checkpoint.dtype(name)
        got = checkpoint.get_tensor(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
        for index in INDICES[1:] if expected.dim() else ():
            if len(index) <= expected.dim() and all(
                isinstance(i, slice) or -expected.shape[d] <= i < expected.shape[d] for d, i in enumerate(index)
            ):
                assert torch.equal(checkpoint.get_slice(name)[index], expected[index]), (name, index)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """One fsdpkit checkpoint at 3 ranks (tied alias, buffers, optimizer state) and its full export."""
    root = tmp_path_factory.mktemp("any")
    params = sample_tensors()
    tensors = {**params, **sample_buffers(), **sample_optimizer(params)}
    run = save_checkpoint(
        root / "run",
        4,
        tensors,
        world_size=3,
        units=SAMPLE_UNITS,
        aliases={"head.weight": "wte.weight"},
        training_state={"step": 4, "note": "x"},
    )
    assert run_cli("convert", run, root / "full", "--to", "full", "--with-optimizer").exit_code == 0
    return run, root / "full", tensors


def test_sharded_and_full_read_like_safe_open(sample):
    run, full, tensors = sample
    files = [full / "model.safetensors", full / "optimizer.safetensors"]
    with safe_open(files[0], "pt") as model, safe_open(files[1], "pt") as optimizer:

        def oracle(name: str) -> torch.Tensor:
            stored = {"head.weight": "wte.weight"}.get(name, name)
            return (optimizer if stored.startswith("optim.") else model).get_tensor(stored)

        for path, expected_format in ((run, "sharded"), (full, "full"), (files[0], "full")):
            with fsdpkit.open_checkpoint(path) as checkpoint:
                assert checkpoint.format == expected_format
                names = set(model.keys()) | {"head.weight"} | (set(optimizer.keys()) if path != files[0] else set())
                assert set(checkpoint.keys()) == names, path
                assert_reads_like(checkpoint, oracle, sorted(names))
    with fsdpkit.open_checkpoint(run) as checkpoint:
        assert checkpoint.get_item("step") == 4 and checkpoint.get_item("note") == "x" and "note" in checkpoint.item_keys()
        assert torch.equal(checkpoint.get_tensor("optim.exp_avg.wte.weight"), tensors["optim.exp_avg.wte.weight"])


def test_a_slice_reads_only_its_bytes(sample, monkeypatch):
    """Rows of a full checkpoint's tensor: only their bytes are read (pread sizes recorded)."""
    from fsdpkit.checkpoint.core import bytecopy

    _, full, tensors = sample
    sizes = []
    real = bytecopy.pread_into
    monkeypatch.setattr(bytecopy, "pread_into", lambda fd, at, out, path: (sizes.append(out.nbytes), real(fd, at, out, path))[1])
    with fsdpkit.open_checkpoint(full) as checkpoint:
        rows = checkpoint.get_slice("wte.weight")[3:5]
    assert torch.equal(rows, tensors["wte.weight"][3:5]) and sizes == [2 * 8 * 4]


def test_bad_names_and_indices(sample):
    run, _, _ = sample
    with fsdpkit.open_checkpoint(run) as checkpoint:
        for call, words in (
            (lambda: checkpoint.get_tensor("nope"), "no tensor 'nope'"),
            (lambda: checkpoint.get_item("nope"), "no non-tensor item 'nope'"),
            (lambda: checkpoint.get_slice("wte.weight")[0, 0, 0], "3 indices for a tensor of 2 dimensions"),
            (lambda: checkpoint.get_slice("wte.weight")[17], "index 17 is out of range"),
            (lambda: checkpoint.get_slice("wte.weight")[::-1], "step must be positive"),
        ):
            with pytest.raises((fsdpkit.errors.UsageError, IndexError), match=words):
                call()


def test_diff_of_a_run_and_its_transformers_export(tmp_path):
    """The built-in GPT's export adds `transformer.` and transposes 4 weights per block: diff
    reads it back under the model's names and says equal; a tensor changed is still found, and
    names that differ by a prefix are explained."""
    from fsdpkit.models.source import resolve

    source = resolve("gpt-tiny")
    weights = {k: v for k, v in source.build(seed=0).state_dict().items() if k != "lm_head.weight"}
    state = {"step": 1, "export": source.export.to_json()}
    run = save_checkpoint(tmp_path / "run", 1, weights, world_size=2, aliases={"lm_head.weight": "wte.weight"}, training_state=state)
    assert run_cli("convert", run, tmp_path / "hf", "--to", "full").exit_code == 0
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as exported:
        assert "transformer.h.0.attn.c_attn.weight" in exported.keys()  # the export is in transformers' layout
    result = run_cli("diff", run, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert "equal: sharded" in result.stdout and "29 equal" in result.stdout
    assert "prefix 'transformer.' taken away, 8 weights transposed back" in result.stdout
    weights["h.1.mlp.c_fc.weight"][3, 5] += 1.0
    changed = save_checkpoint(tmp_path / "changed", 1, weights, world_size=1, aliases={"lm_head.weight": "wte.weight"})
    rows = {r["name"]: r for r in json.loads(run_cli("diff", tmp_path / "hf", changed, "--json").stdout)["tensors"]}
    assert rows["h.1.mlp.c_fc.weight"]["status"] == "different" and rows["h.1.mlp.c_fc.weight"]["max_abs"] == pytest.approx(1.0)
    assert sum(r["status"] == "equal" for r in rows.values()) == 28
    flipped = save_checkpoint(
        tmp_path / "flipped", 1, {**weights, "h.0.mlp.c_fc.weight": weights["h.0.mlp.c_fc.weight"].t().contiguous()}, world_size=1
    )
    result = run_cli("diff", changed, flipped, "--model-only")
    assert result.exit_code == 3 and "h.0.mlp.c_fc.weight: [256, 64] vs [64, 256] (a transpose)" in result.stdout, result.stdout
    prefixed = {f"model.{k}": v for k, v in weights.items()}
    other = save_checkpoint(tmp_path / "prefixed", 1, prefixed, world_size=1)
    result = run_cli("diff", changed, other)
    assert result.exit_code == 3 and "28 names in b only are a's with the prefix 'model.' added" in result.stdout, result.stdout
