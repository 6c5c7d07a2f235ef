"""DeepSpeed ZeRO checkpoints read without DeepSpeed: real DeepSpeed (2 gloo ranks, CPU) writes
ZeRO-1 fp32, ZeRO-2 bf16, ZeRO-3 bf16 and a tied ZeRO-2 fp32 checkpoint of a small Llama
in one launch; the oracles are DeepSpeed's own `zero_to_fp32` and torch.load of its files.
verl's per-rank torch.save files, written by FSDP2 and FSDP1 in one more launch, are checked
against FSDP2's and FSDP1's own full state dicts."""

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
from support.fsdp2_loader import SETTINGS

import fsdpkit

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
    """Byte for byte zero_to_fp32's file, except that a ZeRO-1 checkpoint's frozen parameter
    (which zero_to_fp32 leaves out: stage 1 lists none) is there, as DeepSpeed's module holds it."""
    from safetensors.torch import load_file

    _zero_to_fp32(saved / layout, tmp_path / "ref")
    result = run_cli("convert", saved / layout, tmp_path / "ours", "--to", "full")
    assert result.exit_code == 0, result.output
    ours, ref = tmp_path / "ours" / "model.safetensors", tmp_path / "ref" / "model.safetensors"
    if layout != "z1_fp32":
        assert ours.read_bytes() == ref.read_bytes()
        return
    got, expected = load_file(ours), load_file(ref)
    module = torch.load(saved / layout / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert set(got) == {*expected, "model.norm.weight"}
    assert all(torch.equal(got[name], expected.get(name, module[name])) for name in got)


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


def test_verify_spread_prints_the_one_process_report(saved, fsdp2, tmp_path):
    """DeepSpeed's ZeRO-3 files and verl's, spread over 1 and 2 processes; a byte of a storage
    changed: the same CRC-32 line, exit 3."""
    from support.spread_verify import assert_spread_verify_is_one_process, storage_offset

    zero3 = Path(shutil.copytree(saved / "z3_bf16", tmp_path / "z3"))
    victim = max(zero3.rglob("*.pt"), key=lambda p: p.stat().st_size)
    assert "CRC-32" in assert_spread_verify_is_one_process(zero3, victim, storage_offset(victim))
    verl = Path(shutil.copytree(fsdp2[0] / "verl" / "fsdp2", tmp_path / "verl"))
    victim = verl / "optim_world_size_2_rank_1.pt"
    assert "CRC-32" in assert_spread_verify_is_one_process(verl, victim, storage_offset(victim))


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


@pytest.mark.parametrize("layout", ["z1_fp32", "z3_bf16"])
def test_a_damaged_storage_stops_convert_and_reshard_in_one_process_or_two(saved, tmp_path, layout, s3_bucket, s3_endpoint):
    """One byte flipped in the middle of every storage of rank 1's optimizer file (DeepSpeed's
    own): what reads it (convert --to full, --to dcp, reshard, in one process and spread over
    two, and convert --to full into a bucket, whose one model file's upload is held open until
    the checks pass) stops with the zip's CRC-32 line naming the file, exit 3, and writes no DST
    (boto3 lists no object)."""
    from support.object_store import s3_client

    copy = _copy(saved, layout, tmp_path)
    rank1 = next((copy / "global_step3").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    raw = bytearray(rank1.read_bytes())
    for info in zipfile.ZipFile(rank1).infolist():
        if "/data/" in info.filename and info.file_size > 64:
            name_length, extra_length = (
                int.from_bytes(raw[info.header_offset + at : info.header_offset + at + 2], "little") for at in (26, 28)
            )
            raw[info.header_offset + 30 + name_length + extra_length + info.file_size // 2] ^= 0xFF
    rank1.write_bytes(bytes(raw))
    commands = [
        ["convert", copy, tmp_path / "full", "--to", "full", "--with-optimizer"],
        ["convert", copy, tmp_path / "spread", "--to", "full", "--with-optimizer", "--max-shard-size", "300KB", "--nproc-per-node", "2"],
        ["convert", copy, tmp_path / "dcp", "--to", "dcp", "--world-size", "2"],
        ["reshard", copy, tmp_path / "reshard", "--world-size", "1"],
        ["convert", copy, f"s3://{s3_bucket}/full", "--to", "full", "--with-optimizer"],
    ]
    for command in commands:
        result = run_cli(*command)
        assert result.exit_code == 3 and f"{rank1}: storage " in result.output and "(damaged)" in result.output, result.output
        assert not Path(command[2]).exists()
    assert s3_client(s3_endpoint).list_objects_v2(Bucket=s3_bucket).get("Contents", []) == []


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
    checkpoint's, the step taken from Adam's; without --model, an even split that holds the same
    values (diff, and DeepSpeed's zero_to_fp32 functions' weights and moments)."""
    deepspeed_worker.llama_config().save_pretrained(tmp_path / "llama")
    model = f"hf:{tmp_path / 'llama'}"
    result = run_cli("convert", saved / "z3_bf16", tmp_path / "sh", "--to", "sharded", "--world-size", "3", "--model", model, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["step"] == 3 and report["optimizer_tensors"] == 60
    assert run_cli("diff", saved / "z3_bf16", tmp_path / "sh").exit_code == 0
    assert run_cli("verify", tmp_path / "sh").exit_code == 0
    assert run_cli("convert", saved / "z3_bf16", tmp_path / "x", "--to", "sharded", "--world-size", "3").exit_code == 0  # even split
    assert run_cli("verify", tmp_path / "x").exit_code == 0
    assert run_cli("diff", saved / "z3_bf16", tmp_path / "x").exit_code == 0
    expected = deepspeed_worker.deepspeed_tensors(str(saved / "z3_bf16"))["tensors"]  # weights and moments by DeepSpeed's functions
    with fsdpkit.open_checkpoint(tmp_path / "x") as checkpoint:
        assert all(torch.equal(checkpoint.get_tensor(name).reshape(t.shape), t) for name, t in expected.items())


@pytest.fixture(scope="module")
def fsdp2(saved, tmp_path_factory) -> tuple[Path, dict]:
    """FSDP2 at 2 ranks loads the ZeRO-3 bf16 checkpoint converted --to dcp for 3 ranks, and
    saves per-rank state dicts as verl does, under FSDP2 and FSDP1 (one launch)."""
    from support import fsdp2_loader

    root = tmp_path_factory.mktemp("fsdp2")
    result = run_cli("convert", saved / "z3_bf16", root / "dcp", "--to", "dcp", "--world-size", "3")
    assert result.exit_code == 0, result.output
    return root, run_distributed(fsdp2_loader.fsdp2_checks, 2, {"z3_bf16": (str(root / "dcp"), False)}, str(root / "verl"))[0]


@pytest.mark.parametrize("flatten", [False, True])
def test_convert_dcp_loads_in_fsdp2(saved, fsdp2, flatten):
    """dcp.load + set_state_dict (both flatten_optimizer_state_dict settings) give the weights and
    Adam moments DeepSpeed's zero_to_fp32 puts together, its step and its groups' settings."""
    expected = deepspeed_worker.deepspeed_tensors(str(saved / "z3_bf16"))
    found = fsdp2[1]["dcp"]["z3_bf16"][flatten]
    for name, tensor in expected["tensors"].items():
        assert torch.equal(found["tensors"][name], tensor.float()), name
    steps = {name: float(t) for name, t in found["tensors"].items() if name.startswith("optim.step.")}
    assert len(steps) == sum(len(names) for names in expected["names"]) and set(steps.values()) == set(expected["steps"])
    settings = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in expected["param_groups"]]
    assert found["param_groups"] == settings


@pytest.mark.parametrize(("layout", "stage"), [("z1_fp32", 1), ("z2_tied", 2), ("z3_bf16", 3)])
def test_deepspeed_to_sharded_to_deepspeed_is_bitwise(saved, tmp_path, layout, stage):
    """DeepSpeed -> fsdpkit (3 ranks) -> DeepSpeed (2 ranks, the same stage): every tensor of
    every file equal to DeepSpeed's own (torch.load of both), frozen and tied ones included,
    a tied name sharing its storage as in DeepSpeed's file. The bf16 ZeRO-3 one goes through
    `reshard` to 3 ranks and back (the sharded format keeps no bf16 run), its frozen parameter's
    fragments each rank's own."""
    if stage == 3:
        assert run_cli("reshard", saved / layout, tmp_path / "at-3", "--world-size", "3").exit_code == 0
        result = run_cli("reshard", tmp_path / "at-3", tmp_path / "ds", "--world-size", "2")
    else:
        config = tmp_path / "llama"
        deepspeed_worker.llama_config(tied=layout == "z2_tied").save_pretrained(config)
        args = ("--to", "sharded", "--world-size", "3", "--model", f"hf:{config}")
        assert run_cli("convert", saved / layout, tmp_path / "sh", *args).exit_code == 0
        result = run_cli("convert", tmp_path / "sh", tmp_path / "ds", "--to", "deepspeed", "--stage", str(stage), "--world-size", "2")
    assert result.exit_code == 0, result.output
    original = sorted(p.name for p in (saved / layout / "global_step3").iterdir())
    assert sorted(p.name for p in (tmp_path / "ds" / "global_step3").iterdir()) == original
    for name in original:
        expected = _tensors(torch.load(saved / layout / "global_step3" / name, weights_only=False))
        found = _tensors(torch.load(tmp_path / "ds" / "global_step3" / name, weights_only=False))
        assert set(found) == set(expected), name
        for path, tensor in expected.items():
            assert found[path].dtype == tensor.dtype and torch.equal(found[path], tensor), (name, path)
    if layout == "z2_tied":
        module = torch.load(tmp_path / "ds" / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        assert module["lm_head.weight"].data_ptr() == module["model.embed_tokens.weight"].data_ptr()


def _tensors(value, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else []
    return {k: v for key, item in items for k, v in _tensors(item, f"{path}/{key}").items()}


def test_reshard_matches_ds_to_universal(saved, tmp_path):
    """reshard 2 -> 3 of DeepSpeed's tied ZeRO-2 checkpoint: DeepSpeed's own zero_to_fp32
    functions, run on the 3 rank files, give the weights, moments and step that DeepSpeed's
    ds_to_universal holds for every parameter (what load_universal at 3 ranks starts from)."""
    universal = tmp_path / "universal"
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(saved / "z2_tied" / "global_step3")]
    command += ["--output_folder", str(universal), "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    result = run_cli("reshard", saved / "z2_tied", tmp_path / "at3", "--world-size", "3")
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "at3" / "global_step3").glob("*optim_states.pt"))) == 3
    ours = deepspeed_worker.deepspeed_tensors(str(tmp_path / "at3"))
    names = [name for group in ours["names"] for name in group]
    for name in names:
        for key, file in (("", "fp32"), ("optim.exp_avg.", "exp_avg"), ("optim.exp_avg_sq.", "exp_avg_sq")):
            expected = torch.load(universal / "zero" / name / f"{file}.pt", weights_only=False)["param"]
            assert torch.equal(ours["tensors"][f"{key}{name}"], expected.reshape(ours["tensors"][f"{key}{name}"].shape)), (name, file)
        assert float(torch.load(universal / "zero" / name / "step.pt", weights_only=False)) in ours["steps"]


def test_verl_rank_state_dicts(fsdp2, tmp_path):
    """Per-rank torch.save state dicts of FSDP2 DTensors (verl's files, written by FSDP2 at 2
    ranks in the launch, the optimizer's one param group over `model.parameters()` as verl's):
    inspect, verify, convert --to full --with-optimizer (every weight and Adam state equal to
    FSDP2's own full state dicts) and diff read them; an optimizer file missing is listed as
    not read; a file naming another global runs nothing."""
    from safetensors.torch import load_file

    verl, expected = fsdp2[0] / "verl" / "fsdp2", fsdp2[1]["verl"]["tensors"]
    summary = json.loads(run_cli("inspect", verl, "--json").output)
    assert (summary["format"], summary["world_size"], summary["sharding"], summary["model"]["tensors"]) == (
        "torch-save-ranks",
        2,
        "FSDP2 DTensors",
        21,
    )
    assert summary["optimizer"]["tensors"] == 60 and summary["optimizer"]["states"] == ["exp_avg", "exp_avg_sq", "step"]
    assert summary["not_read"] == [] and summary["items"] == {"lr_scheduler": 3, "rng": 1 + 5 + 627}
    assert summary["extra_state"]["lr_scheduler"] == {"last_epoch": 3, "base_lrs": [1e-2], "_step_count": 4}
    rng = summary["extra_state"]["rng"]
    assert rng["cpu"] == f"tensor U8{list(torch.get_rng_state().shape)}" and rng["numpy"][:2] == ["MT19937", "numpy array u4[624]"]
    assert rng["random"][0] == 3 and len(rng["random"][1]) == 625
    assert "rank 0's extra state" in run_cli("inspect", verl).output
    result = run_cli("verify", verl)
    assert result.exit_code == 0 and "CRC-32" in result.output and "extra state files" in result.output, result.output
    assert run_cli("convert", verl, tmp_path / "hf", "--to", "full", "--with-optimizer").exit_code == 0
    found = {**load_file(tmp_path / "hf" / "model.safetensors"), **load_file(tmp_path / "hf" / "optimizer.safetensors")}
    assert set(found) == set(expected) and len([n for n in found if n.startswith("optim.")]) == 60
    assert all(torch.equal(found[name], expected[name]) for name in found)
    result = run_cli("diff", verl, tmp_path / "hf")
    assert result.exit_code == 0 and "81 equal" in result.output, result.output
    with fsdpkit.open_checkpoint(verl) as checkpoint:
        assert checkpoint.get_item("lr_scheduler")["last_epoch"] == 3
        groups = checkpoint.get_item("optimizer.param_groups")
        assert [{k: g[k] for k in SETTINGS} for g in groups] == fsdp2[1]["verl"]["param_groups"]
    partial = Path(shutil.copytree(verl, tmp_path / "partial"))
    (partial / "optim_world_size_2_rank_1.pt").unlink()
    summary = json.loads(run_cli("inspect", partial, "--json").output)
    assert summary["optimizer"]["tensors"] == 0 and "ranks [0] of 2 only" in summary["optimizer"]["not_read"]
    copy = Path(shutil.copytree(verl, tmp_path / "evil"))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model.norm.weight": Evil()}, copy / "model_world_size_2_rank_1.pt")
    _fails(["inspect", copy], 3, "which is not allowed")
    extra = Path(shutil.copytree(verl, tmp_path / "evil-extra"))
    torch.save({"rng": Evil()}, extra / "extra_state_world_size_2_rank_1.pt")
    _fails(["verify", extra], 3, "which is not allowed")
    _fails(["convert", copy, tmp_path / "never", "--to", "full"], 3, "which is not allowed")
    assert not marker.exists() and not (tmp_path / "never").exists()


def test_verl_to_dcp_and_sharded_hold_fsdp2s_state(fsdp2, tmp_path):
    """verl's FSDP2 files --to dcp at 3 ranks: torch's dcp.load gives every weight and Adam state
        of FSDP2's own full state dicts; the param group's settings are carried. --to sharded at 3
        ranks by the model's placement holds them too, the step taken from Adam's; --to deepspeed at
    ZeRO-2 and 3 ranks gives zero_to_fp32 the weights, and DeepSpeed's own merge of its moment
    partitions (zero_to_fp32's functions) the moments."""
    import torch.distributed.checkpoint as dcp

    verl, expected = fsdp2[0] / "verl" / "fsdp2", fsdp2[1]["verl"]["tensors"]
    written = run_cli("convert", verl, tmp_path / "dcp", "--to", "dcp", "--world-size", "3", "--json")
    assert written.exit_code == 0, written.output
    assert json.loads(written.output)["param_groups"] == 1
    model = {name: torch.empty_like(t) for name, t in expected.items() if not name.startswith("optim.")}
    state: dict = {}
    for name, tensor in expected.items():
        if name.startswith("optim."):
            _, kind, param = name.split(".", 2)
            state.setdefault(param, {})[kind] = torch.empty_like(tensor)
    groups = [dict.fromkeys((*SETTINGS, "params"))]
    loaded = {"model": model, "optimizer": {"state": state, "param_groups": groups}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(model[name], expected[name]) for name in model)
    assert all(torch.equal(t, expected[f"optim.{kind}.{param}"]) for param, kinds in state.items() for kind, t in kinds.items())
    assert len(model) == 21 and sum(len(kinds) for kinds in state.values()) == 60
    assert [{k: g[k] for k in SETTINGS} for g in groups] == fsdp2[1]["verl"]["param_groups"]
    assert sorted(groups[0]["params"]) == sorted(state)
    deepspeed_worker.llama_config().save_pretrained(tmp_path / "llama")
    args = ("--to", "sharded", "--world-size", "3", "--model", f"hf:{tmp_path / 'llama'}", "--json")
    result = run_cli("convert", verl, tmp_path / "sh", *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["optimizer_tensors"] == 60 and json.loads(result.stdout)["step"] == 1
    with fsdpkit.open_checkpoint(tmp_path / "sh") as checkpoint:
        assert all(torch.equal(checkpoint.get_tensor(name), tensor) for name, tensor in expected.items())
    assert run_cli("verify", tmp_path / "sh").exit_code == 0
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    result = run_cli("convert", verl, tmp_path / "ds", "--to", "deepspeed", "--stage", "2", "--world-size", "3")
    assert result.exit_code == 0, result.output
    weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds"))
    model_names = {name for name in expected if not name.startswith("optim.")}
    assert set(weights) == model_names and all(torch.equal(weights[name], expected[name]) for name in weights)
    moments = {
        name: t for name, t in deepspeed_worker.deepspeed_tensors(str(tmp_path / "ds"))["tensors"].items() if name.startswith("optim.")
    }
    assert set(moments) == {name for name in expected if name.startswith("optim.exp_avg")}
    assert all(torch.equal(t.reshape(expected[name].shape), expected[name]) for name, t in moments.items())


def test_verl_fsdp1_sharded_tensors(fsdp2, tmp_path):
    """verl's files under FSDP1 (SHARDED_STATE_DICT: ShardedTensors of whole-row chunks, written
    at 2 ranks in the launch): inspect, verify, convert --to full (every tensor equal to FSDP1's
    own FULL_STATE_DICT) and diff read them; the optimizer files (flat parameters) are not read,
    saying why; shards split by columns, or ranks whose shards overlap, are refused."""
    from safetensors.torch import load_file

    verl, expected = fsdp2[0] / "verl" / "fsdp1", fsdp2[1]["verl_fsdp1"]
    summary = json.loads(run_cli("inspect", verl, "--json").output)
    assert (summary["sharding"], summary["model"]["tensors"], summary["optimizer"]["tensors"]) == ("FSDP1 ShardedTensors", 21, 0)
    assert "FSDP1" in summary["optimizer"]["not_read"] and len(summary["not_read"]) == 2
    assert "optimizer   not read: " in run_cli("inspect", verl).output
    result = run_cli("verify", verl)
    assert result.exit_code == 0 and "every tensor covered exactly once" in result.output, result.output
    assert run_cli("convert", verl, tmp_path / "hf", "--to", "full").exit_code == 0
    found = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(found) == set(expected) and all(torch.equal(found[name], expected[name]) for name in found)
    result = run_cli("diff", verl, tmp_path / "hf")
    assert result.exit_code == 0 and "21 equal" in result.output, result.output
    with fsdpkit.open_checkpoint(verl) as checkpoint:  # rows across both ranks' shards
        assert torch.equal(checkpoint.get_slice("lm_head.weight")[30:40], expected["lm_head.weight"][30:40])
    _fails(["inspect", fsdp2[0] / "verl" / "columns"], 3, "'w' is a ShardedTensor [4, 6] with a shard of sizes [4, 3] at offsets [0, 0]")
    overlap = Path(shutil.copytree(verl, tmp_path / "overlap"))
    shutil.copy(verl / "model_world_size_2_rank_0.pt", overlap / "model_world_size_2_rank_1.pt")
    for command in (["verify", overlap], ["convert", overlap, tmp_path / "never", "--to", "full"]):
        _fails(command, 3, "its ranks' shards overlap at element 0")
    assert not (tmp_path / "never").exists()


def test_open_checkpoint_reads_what_zero_to_fp32_gives(saved):
    """`fsdpkit.open_checkpoint` of ZeRO-3 and ZeRO-2 (frozen and tied parameters): every
    model tensor, whole and sliced, equals DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from test_any_checkpoint import assert_reads_like

    for layout in ("z3_bf16", "z2_tied"):  # ZeRO-3 with a frozen parameter, ZeRO-2 with a tied one
        expected = get_fp32_state_dict_from_zero_checkpoint(str(saved / layout))
        with fsdpkit.open_checkpoint(saved / layout) as checkpoint:
            assert checkpoint.format == "deepspeed" and set(checkpoint.model) == set(expected), layout
            assert_reads_like(checkpoint, expected.__getitem__, sorted(expected))
            assert checkpoint.get_item("ds_version") == "0.19.8" and checkpoint.get_item("global_steps") == 3
            groups = checkpoint.get_item("optimizer.param_groups")
            assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-2, 0.1), (1e-2, 0.0)], layout  # the worker's AdamW groups
            optim = torch.load(next((saved / layout / "global_step3").glob("*rank_0_*optim_states.pt")), weights_only=False)
            state = optim["optimizer_state_dict"]
            base = state["base_optimizer_state"] if "base_optimizer_state" in state else state["optimizer_state_dict"]
            plain = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
            assert groups == plain, layout


def test_train_resumes_and_starts_from_a_deepspeed_checkpoint(saved, tmp_path):
    """`train --resume DS --model M`, run to the step DeepSpeed saved at and saved again: its
    weights are zero_to_fp32's and its Adam moments DeepSpeed's (DeepSpeed's run froze a
    parameter, which fsdpkit trains: its state is missing, and --no-strict starts it fresh);
    `--init-from DS` at lr 0 (AdamW then leaves every weight as it is) saves zero_to_fp32's weights."""
    from safetensors.torch import load_file

    import fsdpkit

    deepspeed_worker.llama_config().save_pretrained(tmp_path / "llama")
    common = ["--model", f"hf:{tmp_path / 'llama'}", "--nproc-per-node", "2", "--seq-len", "16", "--global-batch-size", "4", "--json"]
    for layout in ("z3_bf16", "z2_bf16"):
        _zero_to_fp32(saved / layout, tmp_path / f"{layout}-fp32")
    _fails(["train", *common, "--resume", saved / "z3_bf16", "--steps", "3"], 3, "optim.exp_avg.model.norm.weight")
    resumed = run_cli("train", *common, "--resume", saved / "z3_bf16", "--no-strict", "--steps", "3", "--save-dir", tmp_path / "resumed")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["resumed_from_step"] == 3 and json.loads(resumed.stdout)["losses"] == []
    started = run_cli("train", *common, "--init-from", saved / "z2_bf16", "--steps", "1", "--lr", "0", "--save-dir", tmp_path / "started")
    assert started.exit_code == 0, started.output
    for layout, run in (("z3_bf16", "resumed"), ("z2_bf16", "started")):
        expected = load_file(tmp_path / f"{layout}-fp32" / "model.safetensors")
        with fsdpkit.open_checkpoint(tmp_path / run) as checkpoint:
            assert all(torch.equal(checkpoint.get_tensor(name), tensor) for name, tensor in expected.items()), (layout, run)
            if run == "resumed":
                with fsdpkit.open_checkpoint(saved / layout) as original:
                    moments = [name for name in original.optimizer if name.startswith("optim.exp_avg")]
                    assert moments and all(torch.equal(checkpoint.get_tensor(n), original.get_tensor(n)) for n in moments)
