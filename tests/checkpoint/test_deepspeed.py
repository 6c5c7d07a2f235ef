"""DeepSpeed ZeRO checkpoints read without DeepSpeed: real DeepSpeed (2 gloo ranks, CPU) writes
ZeRO-1 fp32, ZeRO-2 bf16, ZeRO-3 bf16 and a tied ZeRO-2 fp32 checkpoint of a small Llama
in one launch; the oracles are DeepSpeed's own `zero_to_fp32` and torch.load of its files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from support import deepspeed_worker
from support.checkpoint_files import run_cli
from support.distributed import run_distributed

LAYOUTS = [name for name, _, _ in deepspeed_worker.LAYOUTS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_distributed(deepspeed_worker.save_all, 2, str(root))
    return root


def _zero_to_fp32(src: Path, dst: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(src), str(dst), safe_serialization=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_full_is_zero_to_fp32_bitwise(saved, tmp_path, layout):
    _zero_to_fp32(saved / layout, tmp_path / "ref")
    result = run_cli("convert", saved / layout, tmp_path / "ours", "--to", "full")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()


def test_tied_and_frozen_match_deepspeed_state_dict(saved, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    expected = get_fp32_state_dict_from_zero_checkpoint(str(saved / "z2_tied"))
    assert run_cli("convert", saved / "z2_tied" / "global_step3", tmp_path / "out", "--to", "full").exit_code == 0
    ours = load_file(tmp_path / "out" / "model.safetensors")
    metadata = json.loads(_header(tmp_path / "out" / "model.safetensors")["__metadata__"]["fsdpkit_tied_weights"])
    assert metadata == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "model.norm.weight" in ours  # the frozen parameter
    for name, tensor in expected.items():
        got = ours[metadata.get(name, name)]
        assert torch.equal(got, tensor.float()), name


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def test_optimizer_state_is_deepspeed_partitions(saved):
    """Adam's moments of every parameter = DeepSpeed's flat partitions sliced as zero_to_fp32
    slices the fp32 masters (torch.load of the rank files)."""
    import fsdpkit

    for layout in ("z2_bf16", "z3_bf16"):
        tag = saved / layout / "global_step3"
        files = sorted(tag.glob("*optim_states.pt"))
        states = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]
        with fsdpkit.open_checkpoint(saved / layout) as checkpoint:
            read = {name: checkpoint.get_tensor(name) for name in checkpoint.optimizer}
        stage = int(layout[1])
        base = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
        group0 = [s[base]["state"][0] for s in states]
        assert float(read["optim.step.model.embed_tokens.weight"]) == float(group0[0]["step"]) == 3.0
        numel = 67 * 36
        if stage <= 2:  # the first parameter of group 0 starts rank 0's partition
            flat = torch.cat([g["exp_avg"] for g in group0])
            expected = flat[:numel]
        else:  # each rank holds ceil(numel / 2) elements of it at the start of its flat state
            per = -(-numel // 2)
            expected = torch.cat([g["exp_avg"][:per] for g in group0])[:numel]
        assert torch.equal(read["optim.exp_avg.model.embed_tokens.weight"].flatten(), expected)


def test_inspect_and_verify(saved):
    result = run_cli("inspect", saved / "z3_bf16", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert (summary["format"], summary["stage"], summary["precision"], summary["world_size"]) == ("deepspeed", 3, "BF16", 2)
    assert summary["ds_version"] == "0.19.8" and summary["global_steps"] == 3
    assert summary["model"]["frozen"] == ["model.norm.weight"] and len(summary["optimizer"]["param_groups"]) == 2
    assert summary["items"]["ds_config"] >= 1
    assert summary["items"]["optimizer.param_groups"] >= sum(len(group) for group in summary["optimizer"]["param_groups"])
    text = run_cli("inspect", saved / "z2_tied")
    assert "ZeRO-2" in text.output and "lm_head.weight -> model.embed_tokens.weight" in text.output
    lines = text.output.splitlines()  # the non-tensor items: one line per top-level key
    tied_items = json.loads(run_cli("inspect", saved / "z2_tied", "--json").stdout)["items"]
    assert f"  ds_config ({tied_items['ds_config']} items)" in lines and "  ds_version (1 item)" in lines
    assert f"  optimizer.param_groups ({tied_items['optimizer.param_groups']} items)" in lines
    for layout in [*LAYOUTS, "z2_tied"]:
        result = run_cli("verify", saved / layout)
        assert result.exit_code == 0 and "CRC-32" in result.output, result.output


def test_reading_needs_no_deepspeed(saved, tmp_path):
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from typer.testing import CliRunner\nfrom fsdpkit_cli.app import app\n"
        f"for args in (['inspect', {str(saved / 'z3_bf16')!r}], ['verify', {str(saved / 'z3_bf16')!r}],"
        f" ['convert', {str(saved / 'z3_bf16')!r}, {str(tmp_path / 'out')!r}, '--to', 'full']):\n"
        "    r = CliRunner().invoke(app, args); assert r.exit_code == 0, r.output\n"
        "assert sys.modules['deepspeed'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert (tmp_path / "out" / "model.safetensors").exists()


def _copy(saved: Path, layout: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved / layout, tmp_path / layout))


def _fails(args: list, code: int, words: str) -> None:
    result = run_cli(*args)
    assert result.exit_code == code, result.output
    assert words in result.output, result.output


def test_bad_inputs(saved, tmp_path):
    copy = _copy(saved, "z3_bf16", tmp_path)
    tag = copy / "global_step3"
    rank1 = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    # a storage byte flipped: the zip's CRC-32 catches it
    raw = bytearray(rank1.read_bytes())
    info = next(i for i in zipfile.ZipFile(rank1).infolist() if "/data/" in i.filename and i.file_size > 64)
    name_length, extra_length = (int.from_bytes(raw[info.header_offset + at : info.header_offset + at + 2], "little") for at in (26, 28))
    raw[info.header_offset + 30 + name_length + extra_length + 8] ^= 0xFF  # a byte of the storage's data
    rank1.write_bytes(bytes(raw))
    _fails(["verify", copy], 3, "CRC-32")
    # truncated, then missing rank file
    rank1.write_bytes(bytes(raw[: len(raw) // 2]))
    _fails(["inspect", copy], 3, "not a readable torch.save zip")
    rank1.unlink()
    _fails(["verify", copy], 3, "1 optimizer files, the checkpoint was saved by 2 ranks")
    # a rank file of another run (another stage)
    shutil.copy(saved / "z2_bf16" / "global_step3" / rank1.name, rank1)
    _fails(["inspect", copy], 3, "files of two runs")
    # latest naming a missing tag
    (copy / "latest").write_text("global_step9")
    _fails(["inspect", copy], 3, "names tag 'global_step9'")
    assert not (tmp_path / "never").exists()
    _fails(["convert", copy, tmp_path / "never", "--to", "full"], 3, "is missing")
    assert not (tmp_path / "never").exists()


def test_malicious_pickle_runs_nothing(saved, tmp_path):
    copy = _copy(saved, "z1_fp32", tmp_path)
    model = copy / "global_step3" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"module": {}, "evil": Evil()}, model)
    _fails(["inspect", copy], 3, "which is not allowed")
    _fails(["verify", copy], 3, "which is not allowed")
    assert not marker.exists()


def test_diff_takes_deepspeed(saved, tmp_path):
    """diff of a DeepSpeed checkpoint and its export: equal; against another stage's run: not."""
    assert run_cli("convert", saved / "z1_fp32", tmp_path / "hf", "--to", "full", "--with-optimizer").exit_code == 0
    result = run_cli("diff", saved / "z1_fp32", tmp_path / "hf")
    assert result.exit_code == 0 and "equal" in result.output, result.output
    _fails(["diff", saved / "z1_fp32", saved / "z2_bf16"], 3, "not equal: deepspeed")


def test_convert_sharded_holds_deepspeed_state(saved, tmp_path):
    """--to sharded at 3 ranks (ZeRO-3 from 2): every weight and Adam state equal to the DeepSpeed
    checkpoint's, the step taken from Adam's; --model is required."""
    deepspeed_worker.llama_config().save_pretrained(tmp_path / "llama")
    model = f"hf:{tmp_path / 'llama'}"
    result = run_cli("convert", saved / "z3_bf16", tmp_path / "sh", "--to", "sharded", "--world-size", "3", "--model", model, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["step"] == 3 and report["optimizer_tensors"] == 60
    assert run_cli("diff", saved / "z3_bf16", tmp_path / "sh").exit_code == 0
    assert run_cli("verify", tmp_path / "sh").exit_code == 0
    _fails(["convert", saved / "z3_bf16", tmp_path / "x", "--to", "sharded", "--world-size", "3"], 2, "--model")


def test_open_checkpoint_reads_what_zero_to_fp32_gives(saved):
    """`fsdpkit.open_checkpoint` of ZeRO-3 and ZeRO-2 (frozen and tied parameters): every
    model tensor, whole and sliced, equals DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from test_any_checkpoint import assert_reads_like

    import fsdpkit

    for layout in ("z3_bf16", "z2_tied"):  # ZeRO-3 with a frozen parameter, ZeRO-2 with a tied one
        expected = get_fp32_state_dict_from_zero_checkpoint(str(saved / layout))
        with fsdpkit.open_checkpoint(saved / layout) as checkpoint:
            assert checkpoint.format == "deepspeed" and set(checkpoint.model) == set(expected), layout
            assert_reads_like(checkpoint, expected.__getitem__, sorted(expected))
            assert checkpoint.get_item("ds_version") == "0.19.8" and checkpoint.get_item("global_steps") == 3
            groups = checkpoint.get_item("optimizer.param_groups")
            assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-2, 0.1), (1e-2, 0.0)], layout  # the worker's AdamW groups
