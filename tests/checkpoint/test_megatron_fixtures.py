"""Checkpoints that megatron-core itself wrote (committed under tests/fixtures/megatron/, with
Megatron's own `load_plain_tensors` of each and its forward's logits): fsdpkit opens every
generation there without Megatron, each unstacked layer equals Megatron's stacked tensor's row,
transformers' logits of `convert --to full` are within 1e-5 of Megatron's forward, and `convert
--to megatron` of those transformers files stores Megatron's own tensors again."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoint_files import run_cli
from support.spread_verify import assert_spread_verify_is_one_process

from fsdpkit.checkpoint.offline.formats import open_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
FOUND = sorted(p.parent.name for p in FIXTURES.glob("*/expected.safetensors") if (p.parent / "checkpoint").is_dir())
TOLERANCE = 1e-5


def checkpoint_of(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def test_fixtures_are_there():
    assert FOUND, f"no torch_dist fixture under {FIXTURES}"


@pytest.mark.parametrize("name", FOUND)
def test_every_layer_equals_megatrons_own_reading(name):
    expected = load_file(FIXTURES / name / "expected.safetensors")
    with open_checkpoint(checkpoint_of(name)) as opened:
        assert opened.format == "megatron"
        for key, whole in expected.items():
            if key.startswith("oracle."):
                continue
            if key.removeprefix("module.").startswith("decoder.layers."):  # NeMo 2 stores the model under `module.`
                for layer in range(whole.shape[0]):
                    name_of_layer = key.removeprefix("module.").replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
                    assert torch.equal(opened.get_tensor(name_of_layer), whole[layer]), name_of_layer
            assert torch.equal(opened.get_tensor(key), whole), key


@pytest.mark.parametrize("name", FOUND)
def test_hf_conversion_gives_megatrons_logits(name, tmp_path):
    import transformers

    document = json.loads((FIXTURES / name / "expected.json").read_text())
    summary = json.loads(run_cli("inspect", checkpoint_of(name), "--json").stdout)
    version = document["versions"]["megatron-core"][:4]
    assert summary["generation"].startswith("zarr" if document.get("backend") == "zarr" else f"torch_dist {version}")
    assert summary["model_shape"]["recorded_by"], summary["model_shape"]  # every fixture records its shape: no --model
    done = run_cli("convert", checkpoint_of(name), tmp_path / "hf", "--to", "full")
    assert done.exit_code == 0, done.output
    expected = load_file(FIXTURES / name / "expected.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = hf(expected["oracle.tokens"]).logits
    assert (logits - expected["oracle.logits"]).abs().max().item() < TOLERANCE
    # and back: `--to megatron` of those files stores Megatron's own tensors (torch's DCP reader)
    import torch.distributed.checkpoint as dcp

    done = run_cli("convert", tmp_path / "hf", tmp_path / "back", "--to", "megatron")
    assert done.exit_code == 0, done.output
    stored = {key.removeprefix("module."): whole for key, whole in expected.items() if not key.startswith("oracle.")}
    reader = dcp.FileSystemReader(str(tmp_path / "back"))
    assert sorted(key for key, item in reader.read_metadata().state_dict_metadata.items() if hasattr(item, "size")) == sorted(stored)
    loaded = {key: torch.empty_like(whole) for key, whole in stored.items()}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert [key for key, whole in stored.items() if not torch.equal(loaded[key], whole)] == []


KIT_TARGETS = [".metadata", "common.pt", "shard"]


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec"])
@pytest.mark.parametrize("target", KIT_TARGETS)
def test_a_poisoned_file_is_refused_with_nothing_run(tmp_path, target, payload):
    from support.megatron_malicious import poison

    sentinel = tmp_path / "ran"
    checkpoint = poison(tmp_path / "ckpt", target, sentinel, payload)
    for command in (["inspect"], ["verify"], ["convert", "--to", "full"]):
        out = [tmp_path / "out"] if command[0] == "convert" else []
        done = run_cli(command[0], checkpoint, *out, *command[1:])
        assert done.exit_code == 3, (command, done.output)
        assert not sentinel.exists() and not (tmp_path / "out").exists()


def test_verify_checks_the_sha256_that_integrity_json_lists(tmp_path):
    import shutil

    checkpoint = shutil.copytree(checkpoint_of("mcore_0_19_torch_dist"), tmp_path / "ckpt")
    assert (checkpoint / "integrity.json").exists()
    assert run_cli("verify", checkpoint).exit_code == 0
    # spread over 1 and 2 processes, then a flipped byte inside a tensor's bytes (DCP's structure still holds)
    line = assert_spread_verify_is_one_process(checkpoint, checkpoint / "__1_0.distcp", 100)
    assert "__1_0.distcp: SHA-256" in line, line
    zarr = checkpoint_of("mcore_0_15_zarr")  # no data checked: the same report from rank 0
    one, spread = run_cli("verify", zarr), run_cli("verify", zarr, "--nproc-per-node", "2")
    assert one.exit_code == spread.exit_code == 0 and spread.stdout == one.stdout, spread.output


def test_a_metadata_json_of_another_backend_is_named_not_read_as_dcp(tmp_path):
    """A torch_dist directory is a DCP directory too: one whose metadata.json names a backend
    fsdpkit does not read is still Megatron's, and every command names that file (exit 3)."""
    import shutil

    checkpoint = shutil.copytree(checkpoint_of("mcore_0_19_torch_dist"), tmp_path / "ckpt")
    (checkpoint / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr3", "sharded_backend_version": 1}))
    for command in (["inspect"], ["verify"], ["convert", "--to", "full"]):
        out = [tmp_path / "out"] if command[0] == "convert" else []
        done = run_cli(command[0], checkpoint, *out, *command[1:])
        expected = f"error: {checkpoint}/metadata.json: sharded_backend 'zarr3', fsdpkit reads torch_dist and zarr"
        assert done.exit_code == 3 and done.stderr.strip() == expected, (command, done.output)
    assert not (tmp_path / "out").exists()
