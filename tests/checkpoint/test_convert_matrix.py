"""`fsdpkit convert` for every (source, target) pair through the command line, 5 sources x 4
targets, all holding one small Llama. Each source is written by its own tool: fsdpkit's sharded
format as training writes it, full safetensors by transformers' `save_pretrained`, DCP by FSDP2 and `dcp.save`, DeepSpeed
ZeRO-2 by DeepSpeed's `save_checkpoint` and verl's per-rank torch.save files by FSDP2 (one launch
of 2 gloo ranks writes the last three). Each target is read back by its own tool and compared
exactly with the source's tensors: full by safetensors and transformers' `from_pretrained`, DCP by torch's `dcp_to_torch_save`,
DeepSpeed by DeepSpeed's `zero_to_fp32`, sharded by fsdpkit's reader. A same-format pair is
`fsdpkit reshard --world-size 3` instead (full has no ranks: its convert is refused). What a
pair cannot hold is one line: full (no Adam state) -> DeepSpeed is refused, and the optimizer
state left out of full output without --with-optimizer is a warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import deepspeed_worker
from support.checkpoint_files import run_cli, save_checkpoint
from support.distributed import run_distributed

import fsdpkit

SOURCES = ("sharded", "full", "dcp", "deepspeed", "torch-save-ranks")
TARGETS = ("sharded", "full", "dcp", "deepspeed")
MOMENTS = ("exp_avg", "exp_avg_sq")
SHARDED_STEP = 7
TARGET_OPTIONS = {"sharded": ["--world-size", "3"], "full": [], "dcp": ["--world-size", "2"], "deepspeed": ["--stage", "2"]}


def _write_launched_sources(root: str) -> dict:
    """DeepSpeed's ZeRO-2 run, FSDP2's DCP save after one AdamW step and verl's files after one
    more; the whole DCP and verl state as FSDP2 holds it (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from support.fsdp2_loader import _full, save_verl, sharded_llama
    from support.verl_fsdp1 import train_step
    from torch.distributed.checkpoint.state_dict import get_state_dict

    deepspeed_worker.init_deepspeed()
    deepspeed_worker.train_and_save(root, "deepspeed", 2, "fp32")
    model, optimizer = sharded_llama(False)
    train_step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{root}/dcp")
    written = {"dcp": _full(model, optimizer)}
    written["torch-save-ranks"] = save_verl(f"{root}/torch-save-ranks", f"{root}/dcp")
    return written


def _split(tensors: dict[str, torch.Tensor]) -> dict:
    """{"model": ..., "optimizer": Adam's moments, "steps": {param: step}} of a flat table."""
    model = {n: t for n, t in tensors.items() if not n.startswith("optim.")}
    optimizer = {n: t for n, t in tensors.items() if n.startswith("optim.") and n.split(".")[1] in MOMENTS}
    steps = {n.removeprefix("optim.step."): float(t) for n, t in tensors.items() if n.startswith("optim.step.")}
    return {"model": model, "optimizer": optimizer, "steps": steps}


def _deepspeed_state(save_dir: Path) -> dict:
    """What DeepSpeed's own zero_to_fp32 functions read from a DeepSpeed save directory."""
    read = deepspeed_worker.deepspeed_tensors(str(save_dir))
    state = _split(read["tensors"])
    state["steps"] = {name: step for names, step in zip(read["names"], read["steps"], strict=True) for name in names}
    return state


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each source format: (its path, its whole state as `_split` gives it)."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("sources")
    launched = run_distributed(_write_launched_sources, 2, str(root))[0]

    torch.manual_seed(2)
    params = dict(LlamaForCausalLM(deepspeed_worker.llama_config()).state_dict())
    generator = torch.Generator().manual_seed(1)
    optimizer = {}
    for name, tensor in params.items():
        optimizer[f"optim.exp_avg.{name}"] = torch.randn(tensor.shape, generator=generator)
        optimizer[f"optim.exp_avg_sq.{name}"] = torch.rand(tensor.shape, generator=generator)
        optimizer[f"optim.step.{name}"] = torch.tensor(float(SHARDED_STEP))
    sharded_tensors = {**params, **optimizer}
    save_checkpoint(root / "sharded", SHARDED_STEP, sharded_tensors, world_size=2)

    torch.manual_seed(0)
    LlamaForCausalLM(deepspeed_worker.llama_config()).save_pretrained(root / "full")

    return {
        "sharded": (root / "sharded", _split(sharded_tensors)),
        "full": (root / "full", _split(load_file(root / "full" / "model.safetensors"))),
        "dcp": (root / "dcp", _split(launched["dcp"]["tensors"])),
        "deepspeed": (root / "deepspeed", _deepspeed_state(root / "deepspeed")),
        "torch-save-ranks": (root / "torch-save-ranks", _split(launched["torch-save-ranks"]["tensors"])),
    }


def _read_sharded(path: Path) -> dict:
    with fsdpkit.open_checkpoint(path) as checkpoint:
        return _split({name: checkpoint.get_tensor(name) for name in [*checkpoint.model, *checkpoint.optimizer]})


def _read_full(path: Path) -> dict:
    tensors = load_file(path / "model.safetensors")
    if (path / "optimizer.safetensors").exists():
        tensors.update(load_file(path / "optimizer.safetensors"))
    return _split(tensors)


def _assert_from_pretrained(path: Path, model: dict[str, torch.Tensor]) -> None:
    """transformers loads the full output, given the model's config.json as a user adds it, as
    the Llama it is: every weight found and equal."""
    from transformers import LlamaForCausalLM

    deepspeed_worker.llama_config().save_pretrained(path)
    loaded, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    state = loaded.state_dict()
    assert sorted(state) == sorted(model)
    for name, tensor in model.items():
        assert torch.equal(state[name], tensor), name


def _read_dcp(path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    state = torch.load(path.parent / f"{path.name}.pt", weights_only=False)
    tensors = dict(state["model"])
    for name, values in state.get("optimizer", {}).get("state", {}).items():
        tensors.update({f"optim.{key}.{name}": value for key, value in values.items()})
    return _split(tensors)


READERS = {"sharded": _read_sharded, "full": _read_full, "dcp": _read_dcp, "deepspeed": _deepspeed_state}


def _assert_same_state(got: dict, expected: dict) -> None:
    for part in ("model", "optimizer"):
        assert sorted(got[part]) == sorted(expected[part]), part
        for name, tensor in expected[part].items():
            assert got[part][name].dtype == tensor.dtype and got[part][name].shape == tensor.shape, name
            assert torch.equal(got[part][name], tensor), name
    assert got["steps"] == expected["steps"]


def _refusal_line(result) -> str:
    line = result.stderr.strip()
    assert result.exit_code == 2 and "\n" not in line and "Traceback" not in result.output, result.output
    return line


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_convert(sources, tmp_path, source, target):
    src, expected = sources[source]
    dst = tmp_path / "out"
    if source == target == "full":
        line = _refusal_line(run_cli("convert", src, dst, "--to", "full"))
        assert line == (
            "error: a full checkpoint cannot be converted --to full: use --to sharded or megatron or dcp or deepspeed; "
            "`fsdpkit reshard` lays it out for another world size"
        )
        return
    if source == "full" and target == "deepspeed":
        line = _refusal_line(run_cli("convert", src, dst, "--to", "deepspeed", "--stage", "2"))
        assert line == "error: the source holds no parameter with Adam state (optim.exp_avg.<name>): nothing to write for DeepSpeed"
        assert not dst.exists()
        return
    if source == target:
        result = run_cli("reshard", src, dst, "--world-size", "3", "--json")
    else:
        with_optimizer = ["--with-optimizer"] if expected["optimizer"] and target in ("sharded", "full") else []
        result = run_cli("convert", src, dst, "--to", target, *TARGET_OPTIONS[target], *with_optimizer, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the same keys whatever the pair, and the files it names are there
    assert {"src", "dst", "files", "tensors", "bytes", "warnings"} <= set(report) and report["dst"] == str(dst), report
    assert report["files"] and all((dst / name).is_file() for name in report["files"]) and report["tensors"] > 0, report
    _assert_same_state(READERS[target](dst), expected)
    if target == "full":
        _assert_from_pretrained(dst, expected["model"])


@pytest.mark.parametrize("source", [name for name in SOURCES if name != "full"])
def test_full_without_optimizer_says_so(sources, tmp_path, source):
    src, expected = sources[source]
    result = run_cli("convert", src, tmp_path / "out", "--to", "full")
    assert result.exit_code == 0, result.output
    count = len(expected["optimizer"]) + len(expected["steps"])
    assert f"warning: the optimizer state ({count} tensors) is not written: add --with-optimizer" in result.stderr.splitlines()
    assert not (tmp_path / "out" / "optimizer.safetensors").exists()
    _assert_same_state(_read_full(tmp_path / "out"), {**expected, "optimizer": {}, "steps": {}})
    _assert_from_pretrained(tmp_path / "out", expected["model"])
