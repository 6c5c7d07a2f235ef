"""DeepSpeed ZeRO output (`convert --to deepspeed --stage S`), checked by DeepSpeed itself: its
plain `engine.load_checkpoint` at the written world size must resume the run, with the fp32
weights and Adam moments equal to the source's and the next losses equal to an unsharded
torch AdamW continuing from the same state.

One launch of 3 ranks loads stages 1, 2 and 3 one after the other (3 ranks: the flat group of
stages 1 and 2, 74 elements, ends in padding to 78, a multiple of 2 * 3 and not only of 3, and
every parameter of stage 3 ends in padding), a stage-2 checkpoint of 2 ranks
that `reshard --world-size 3` laid out again, and DeepSpeed's own way to the same: its
`ds_to_universal` of the 2-rank checkpoint, loaded with `load_universal` (both must give the
reference's weights, moments and next losses). A second launch (FSDP2, 2 ranks) checks that
DCP -> fsdpkit -> DCP keeps the optimizer's param groups for `dcp.load` in both layouts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoint_files import run_cli, save_checkpoint
from support.distributed import run_distributed

from fsdpkit.checkpoint.core.report import WriteReport
from fsdpkit.checkpoint.core.request import ConvertRequest
from fsdpkit.checkpoint.offline.formats import convert_any


def to_deepspeed(src: Path, dst: Path, *, stage: int, world_size: int, progress=None) -> WriteReport:
    return convert_any(src, dst, ConvertRequest(to="deepspeed", stage=stage, world_size=world_size), progress)


os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU with gloo, in the launched workers too

SETTINGS = {"lr": 0.02, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.05}
WORLD_SIZE = 3
STAGES = (1, 2, 3)
STEPS_BEFORE, STEPS_AFTER = 2, 2
RESHARDED = "2, resharded from 2 ranks"
UNIVERSAL = "2, DeepSpeed's universal checkpoint of 2 ranks"
LABELS = (*(str(stage) for stage in STAGES), RESHARDED, UNIVERSAL)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 4))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + step))


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=SETTINGS["lr"], betas=tuple(SETTINGS["betas"]), eps=SETTINGS["eps"], weight_decay=SETTINGS["weight_decay"]
    )


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The source's tensors after STEPS_BEFORE steps, and the losses of the steps after."""
    model = _model()
    optimizer = _adamw(model)
    losses, tensors = [], {}
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        if step == STEPS_BEFORE:
            for name, p in model.named_parameters():
                state = optimizer.state[p]
                tensors[name] = p.detach().clone()
                tensors[f"optim.exp_avg.{name}"] = state["exp_avg"].clone()
                tensors[f"optim.exp_avg_sq.{name}"] = state["exp_avg_sq"].clone()
                tensors[f"optim.step.{name}"] = state["step"].clone()
        loss = model(_batch(step)).pow(2).mean()
        if step >= STEPS_BEFORE:
            losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return tensors, losses


def _resume(directories: dict[str, tuple[int, str, bool]]) -> dict:
    """On each rank: DeepSpeed loads each stage's checkpoint; its full weights, moments, group
    settings and next losses."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    # DeepSpeed compiles a shared-memory C++ op for CPU collectives at init; gloo is enough here.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for label, (stage, directory, universal) in directories.items():
        model = _model()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "torch_adam": True}},  # the checkpoint's groups replace it
            "checkpoint": {"load_universal": universal},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.load_checkpoint(directory)
        if stage != 3:  # stages 1 and 2 link their moments to the parameters at the first step
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        found: dict = {"tensors": {}, "losses": []}
        for name, p in engine.module.named_parameters():
            found["tensors"][name] = safe_get_full_fp32_param(p).clone()
            for moment in ("exp_avg", "exp_avg_sq"):
                found["tensors"][f"optim.{moment}.{name}"] = safe_get_full_optimizer_state(p, moment).clone()
        group = engine.optimizer.optimizer.param_groups[0]
        found["settings"] = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
        found["global_steps"] = engine.global_steps
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            loss = engine(_batch(step)).pow(2).mean()  # the same batch on every rank: the mean gradient is its own
            found["losses"].append(loss.item())
            engine.backward(loss)
            engine.step()
        out[label] = found
        engine.destroy()
    return out


class _Tied(torch.nn.Module):
    """Tied weights (out.weight is inp.weight), a frozen bias and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(5, 5), torch.nn.Linear(5, 5)
        self.out.weight = self.inp.weight
        self.out.bias.requires_grad_(False)
        self.register_buffer("shift", torch.arange(5.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x))) + self.shift


def _tied_source() -> dict[str, torch.Tensor]:
    """_Tied after one AdamW step, with changed frozen and buffer values: its tensors (tied name once)."""
    model = _Tied()
    optimizer = torch.optim.AdamW([model.inp.weight, model.inp.bias], lr=0.1)
    model(_batch(0)).pow(2).mean().backward()
    optimizer.step()
    with torch.no_grad():
        model.out.bias.add_(1.0)
        model.shift.mul_(3.0)
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items() if name != "out.weight"}
    for name in ("inp.weight", "inp.bias"):
        state = optimizer.state[getattr(model.inp, name.split(".")[1])]
        tensors.update({f"optim.{key}.{name}": state[key].clone() for key in ("exp_avg", "exp_avg_sq", "step")})
    return tensors


def _resume_all(directories: dict[str, tuple[int, str, bool]], tied_directory: str) -> dict:
    """_resume, then DeepSpeed's load_checkpoint of the tied model's checkpoint at stage 2:
    what its module holds, whether the tie survived, and the moments."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = _resume(directories)
    model = _Tied()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[model.inp.weight, model.inp.bias], config=config)
    engine.load_checkpoint(tied_directory)
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    module = engine.module
    found = {name: t.detach().clone() for name, t in module.state_dict().items() if name not in ("inp.weight", "inp.bias", "out.weight")}
    for name, p in (("inp.weight", module.inp.weight), ("inp.bias", module.inp.bias)):
        found[name] = safe_get_full_fp32_param(p).clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            found[f"optim.{moment}.{name}"] = safe_get_full_optimizer_state(p, moment).clone()
    out["tied"] = {"tensors": found, "tied": module.out.weight is module.inp.weight}
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[float], dict]:
    root = tmp_path_factory.mktemp("dsout")
    tensors, losses = _reference()
    training_state = {
        "step": STEPS_BEFORE,
        "optimizer": {
            "type": "AdamW",
            "groups": [{"settings": SETTINGS, "params": [n for n in tensors if "." in n and not n.startswith("optim.")]}],
        },
    }
    run = save_checkpoint(root / "run", STEPS_BEFORE, tensors, world_size=2, training_state=training_state)
    directories = {}
    for stage in STAGES:
        out = root / f"ds{stage}"
        if stage == 3:  # through the command line
            result = run_cli("convert", run, out, "--to", "deepspeed", "--stage", "3", "--world-size", str(WORLD_SIZE))
            assert result.exit_code == 0, result.output
        else:
            assert to_deepspeed(run, out, stage=stage, world_size=WORLD_SIZE).details["world_size"] == WORLD_SIZE
        directories[str(stage)] = (stage, str(out), False)
    # a DeepSpeed checkpoint of 2 ranks resharded to 3 (read by the DeepSpeed reader, written again)
    assert to_deepspeed(run, root / "ds2-at-2", stage=2, world_size=2).details["world_size"] == 2
    result = run_cli("reshard", root / "ds2-at-2", root / "ds2-at-3", "--world-size", str(WORLD_SIZE))
    assert result.exit_code == 0, result.output
    directories[RESHARDED] = (2, str(root / "ds2-at-3"), False)
    # what DeepSpeed itself needs to resume at another world size: its universal checkpoint
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(root / "ds2-at-2" / "global_step2")]
    command += ["--output_folder", str(root / "ds2-at-2" / "universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    subprocess.run([*command, "--inject_missing_state"], check=True, capture_output=True)
    (root / "ds2-at-2" / "latest_universal").write_text("universal")
    directories[UNIVERSAL] = (2, str(root / "ds2-at-2"), True)
    tied = _tied_source()
    run = save_checkpoint(root / "tied", 1, tied, world_size=2, aliases={"out.weight": "inp.weight"})
    assert to_deepspeed(run, root / "ds-tied", stage=2, world_size=WORLD_SIZE).details["world_size"] == WORLD_SIZE
    return tensors, losses, run_distributed(_resume_all, WORLD_SIZE, directories, str(root / "ds-tied"))


@pytest.mark.parametrize("stage", LABELS)
def test_deepspeed_resumes_weights_and_moments(resumed, stage: str) -> None:
    tensors, _, by_rank = resumed
    for rank, result in by_rank.items():
        found = result[stage]["tensors"]
        for name, value in found.items():
            assert torch.equal(value.reshape(tensors[name].shape), tensors[name]), (stage, rank, name)
        assert len(found) == len([n for n in tensors if not n.startswith("optim.step.")])


@pytest.mark.parametrize("stage", LABELS)
def test_deepspeed_resumes_hyperparameters_and_next_losses(resumed, stage: str) -> None:
    _, losses, by_rank = resumed
    for result in by_rank.values():
        assert result[stage]["settings"] == {**SETTINGS, "betas": tuple(SETTINGS["betas"])}
        assert result[stage]["global_steps"] == STEPS_BEFORE
        assert result[stage]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-7)


def test_deepspeed_resumes_tied_frozen_and_buffer(resumed) -> None:
    """DeepSpeed's load_checkpoint of fsdpkit's output for a model with a tied weight, a frozen
    parameter and a buffer: every value the source held, the tie kept."""
    expected = _tied_source()
    for rank, result in resumed[2].items():
        assert result["tied"]["tied"], rank
        found = result["tied"]["tensors"]
        assert set(found) == {name for name in expected if not name.startswith("optim.step.")}
        for name, value in found.items():
            assert torch.equal(value.reshape(expected[name].shape), expected[name]), (rank, name)


def test_written_files(tmp_path: Path) -> None:
    """The layout DeepSpeed 0.19.8 writes for each stage (names and `latest`)."""
    tensors, _ = _reference()
    run = save_checkpoint(tmp_path / "run", STEPS_BEFORE, tensors, world_size=1)
    one = to_deepspeed(run, tmp_path / "s1", stage=1, world_size=2)
    three = to_deepspeed(run, tmp_path / "s3", stage=3, world_size=2)
    assert one.files == [
        "latest",
        "global_step2/mp_rank_00_model_states.pt",
        *(f"global_step2/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)),
    ]
    assert sorted(three.files) == sorted(
        ["latest", *(f"global_step2/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(2) for kind in ("model", "optim"))]
    )
    assert (tmp_path / "s3" / "latest").read_text() == "global_step2"
    for args, message in (((), "needs --stage"), (("--stage", "4"), "--stage must be one of 1, 2, 3")):
        result = run_cli("convert", run, tmp_path / "bad", "--to", "deepspeed", *args)
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "bad").exists()


def test_files_are_the_same_written_by_one_or_two_processes(tmp_path: Path, monkeypatch) -> None:
    """The files shared out between two processes (the second share written by a forked child)
    are byte for byte the ones one process writes, at every stage, with the same progress; a
    corrupt source fails either way with the same error and nothing left behind."""
    import re

    from fsdpkit.checkpoint.core import workers
    from fsdpkit.errors import DataCheckError

    assert workers.even_shares([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert workers.even_shares([1] * 6, 2) == [range(0, 3), range(3, 6)]
    assert workers.even_shares([0, 7], 2) == [range(0, 2)]
    tensors, _ = _reference()
    run = save_checkpoint(tmp_path / "run", STEPS_BEFORE, tensors, world_size=2)
    for stage in STAGES:
        written = {}
        for count in (1, 2):
            monkeypatch.setattr(workers, "process_count", lambda files, split_at, count=count: count)
            done: list[int] = []
            out = tmp_path / f"s{stage}-{count}"
            to_deepspeed(run, out, stage=stage, world_size=5, progress=lambda nbytes, total, done=done: done.append(nbytes))
            written[count] = ({p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}, sum(done))
        assert written[1] == written[2] and len(written[1][0]) == (11 if stage == 3 else 7), stage
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    rank_file = next(broken.glob("rank-00001-*"))
    raw = bytearray(rank_file.read_bytes())
    raw[-5] ^= 1
    rank_file.write_bytes(bytes(raw))
    lines, before = [], sorted(tmp_path.iterdir())
    for count in (1, 2):
        monkeypatch.setattr(workers, "process_count", lambda files, split_at, count=count: count)
        with pytest.raises(DataCheckError) as caught:
            to_deepspeed(broken, tmp_path / "out", stage=3, world_size=5)
        lines.append(re.sub(r"-[0-9a-f]{8}/", "-*/", str(caught.value)))
        assert sorted(tmp_path.iterdir()) == before
    assert lines[0] == lines[1] and "checksum mismatch" in lines[0], lines


DCP_SETTINGS = {"lr": 0.003, "betas": (0.85, 0.95), "eps": 1e-7, "weight_decay": 0.07}
DCP_MODEL = "hf:llama-tiny"


def _fsdp2_model():
    from torch.distributed.fsdp import fully_shard

    from fsdpkit.models.source import resolve

    source = resolve(DCP_MODEL)
    model = source.build(seed=0)
    fully_shard(model)
    return source, model


def _dcp_round_trip(root: str) -> dict:
    """FSDP2 at 2 ranks saves with get_state_dict's default layout; rank 0 converts DCP ->
    fsdpkit -> DCP; FSDP2 loads the result (strict: every key it asks for must be there) with
    both `flatten_optimizer_state_dict` settings; the param groups it ends with."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    source, model = _fsdp2_model()
    optimizer = torch.optim.AdamW(model.parameters(), **DCP_SETTINGS)
    source.logits(model, torch.arange(16).reshape(2, 8)).float().logsumexp(-1).mean().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{root}/src")
    if dist.get_rank() == 0:
        for args in (
            ("src", "sharded", "--to", "sharded", "--world-size", "2", "--model", DCP_MODEL),
            ("sharded", "back", "--to", "dcp", "--world-size", "2"),
        ):
            result = run_cli("convert", f"{root}/{args[0]}", f"{root}/{args[1]}", *args[2:])
            assert result.exit_code == 0, result.output
    dist.barrier()
    found = {}
    for flatten in (False, True):
        _, model = _fsdp2_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=f"{root}/back")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
        found[flatten] = [{k: group[k] for k in DCP_SETTINGS} for group in optimizer.param_groups]
    return found


def test_dcp_to_sharded_to_dcp_keeps_param_groups(tmp_path: Path) -> None:
    for rank, found in run_distributed(_dcp_round_trip, 2, str(tmp_path)).items():
        assert found == {False: [DCP_SETTINGS], True: [DCP_SETTINGS]}, rank


def test_dcp_to_deepspeed_carries_tensors_and_settings(tmp_path: Path) -> None:
    """fsdpkit -> DCP -> DeepSpeed (no launch): the DeepSpeed reader finds the source's
    weights, moments, step and group settings (DeepSpeed itself loads this writer's output
    in the launches above)."""
    from fsdpkit.checkpoint.core.bytecopy import ByteEngine
    from fsdpkit.checkpoint.deepspeed.table import open_deepspeed
    from fsdpkit.flat_layout import ElementRange

    tensors, _ = _reference()
    state = {
        "step": STEPS_BEFORE,
        "optimizer": {"groups": [{"settings": SETTINGS, "params": [n for n in tensors if not n.startswith("optim.")]}]},
    }
    run = save_checkpoint(tmp_path / "run", STEPS_BEFORE, tensors, world_size=2, training_state=state)
    assert run_cli("convert", run, tmp_path / "dcp", "--to", "dcp", "--world-size", "2").exit_code == 0
    result = run_cli("convert", tmp_path / "dcp", tmp_path / "ds", "--to", "deepspeed", "--stage", "3", "--world-size", "3")
    assert result.exit_code == 0, result.output
    engine = ByteEngine()
    with open_deepspeed(tmp_path / "ds") as checkpoint:
        assert (checkpoint.stage, checkpoint.world_size, checkpoint.global_steps) == (3, 3, STEPS_BEFORE)
        settings = {k: list(v) if isinstance(v, tuple) else v for k, v in checkpoint.param_groups[0].items() if k in SETTINGS}
        assert settings == SETTINGS
        assert sorted(s.name for s in checkpoint.sources) == sorted(tensors)
        for source in checkpoint.sources:
            data = bytearray(source.nbytes)
            engine.read_into(source, ElementRange(0, source.numel), memoryview(data))
            assert torch.equal(
                torch.frombuffer(data, dtype=torch.float32).reshape(tensors[source.name].shape), tensors[source.name].float()
            )
    engine.close()


def test_every_storage_record_carries_its_crc32(tmp_path: Path) -> None:
    """Python's zipfile finds every record's CRC-32 right in each written file (storages too, one
    large enough for the kernel to copy from a source without checksums: 76.8 KB of safetensors),
    torch.load reads the weights back, verify checks every storage against it and finds a flipped
    byte in one."""
    import json
    import struct
    import zipfile

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    model = {"big.weight": torch.randn(300, 64, generator=g), "small.weight": torch.randn(7, 5, generator=g)}
    optim = {f"optim.{m}.{n}": torch.rand(t.shape, generator=g) for n, t in model.items() for m in ("exp_avg", "exp_avg_sq")}
    (tmp_path / "full").mkdir()
    save_file({**model, **optim}, tmp_path / "full" / "model.safetensors")
    out = tmp_path / "ds"
    to_deepspeed(tmp_path / "full", out, stage=2, world_size=2)
    tag = out / (out / "latest").read_text()
    files = sorted(tag.glob("*.pt"))
    storages = 0
    for path in files:
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path
            data = [info for info in archive.infolist() if "/data/" in info.filename and info.file_size]
            assert data and all(info.CRC for info in data), path
            storages += len(data)
    loaded = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.equal(loaded[n], t) for n, t in model.items())
    report = json.loads(run_cli("verify", out, "--json").stdout)
    assert f"{storages} storages against the zip's CRC-32" in report["checked"] and report["not_checked"] == [], report
    with zipfile.ZipFile(files[0]) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith("/data/0"))
    raw = bytearray(files[0].read_bytes())
    name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)  # of the local header
    raw[info.header_offset + 30 + name_length + extra_length + 5] ^= 1  # a byte of the stored data
    files[0].write_bytes(bytes(raw))
    damaged = run_cli("verify", out)
    assert damaged.exit_code == 3 and "(damaged)" in damaged.output and files[0].name in damaged.output, damaged.output
