"""DeepSpeed output of bf16 and fp16 runs, checked by DeepSpeed itself.

DeepSpeed trains a small model in bf16 at 2 ranks, ZeRO-2 and ZeRO-3, saves (with the
`universal_checkpoint_info` its `ds_to_universal` needs) and trains two steps more. Then
`fsdpkit reshard --world-size 3` lays each checkpoint out again, DeepSpeed's `ds_to_universal`
makes its own universal checkpoint of it, and fsdpkit writes the same run as an fp16 one (the
bf16 layout with fp16 weights, `zero_pp_rank_*` files and a dynamic loss scaler). One launch of
3 ranks resumes each stage three ways: plain `load_checkpoint` of fsdpkit's output, its
universal checkpoint with `load_universal`, and the fp16 files, which DeepSpeed reads into an
fp32 engine (an fp16 engine needs a CPU with fp16 kernels; a bf16 engine looks for `bf16_` files).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
from support.checkpoint_files import run_cli
from support.deepspeed_worker import init_deepspeed
from support.distributed import run_distributed

from fsdpkit.checkpoint.deepspeed.table import open_deepspeed
from fsdpkit.checkpoint.deepspeed.to_deepspeed import RunShape, build_run, write_run
from fsdpkit.checkpoint.deepspeed.writer_precision import Precision
from fsdpkit.checkpoint.deepspeed.writer_records import DynamicScale

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU with gloo, in the launched workers too

STAGES = (2, 3)
STEPS_BEFORE, STEPS_AFTER = 2, 2
WAYS = ("resharded", "universal", "fp16")
MOMENTS = ("exp_avg", "exp_avg_sq")


class _Model(torch.nn.Module):
    """Two layers (odd sizes: every stage pads at 3 ranks), a frozen bias and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)
        self.out.bias.requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x))) + self.shift


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + step)).bfloat16()


def _engine(stage: int, way: str = "bf16"):  # type: ignore[no-untyped-def]
    """A bf16 engine (`universal`: loading universal checkpoints), or an fp32 one for way `fp16`."""
    import deepspeed

    model = _Model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.8, 0.99], "weight_decay": 0.05, "torch_adam": True}},
        "checkpoint": {"load_universal": way == "universal"},
    }
    if way != "fp16":
        config["bf16"] = {"enabled": True}
    trained = [p for p in model.parameters() if p.requires_grad]
    return deepspeed.initialize(model=model, model_parameters=trained, config=config)[0]


def _steps(engine, first: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Train STEPS_AFTER steps from step `first` (the same batch on every rank); the losses."""
    losses = []
    for step in range(first, first + STEPS_AFTER):
        loss = engine(_batch(step)).float().pow(2).mean()
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def _train_and_save(root: str) -> dict[int, list[float]]:
    """At 2 ranks: each stage's run saved after STEPS_BEFORE steps; the losses of the steps after."""
    init_deepspeed()
    out = {}
    for stage in STAGES:
        engine = _engine(stage)
        _steps(engine, 0)
        engine.save_checkpoint(f"{root}/z{stage}", client_state={"universal_checkpoint_info": {}})
        out[stage] = _steps(engine, STEPS_BEFORE)
        engine.destroy()
    return out


def _state(engine, stage: int) -> dict:  # type: ignore[no-untyped-def]
    """The engine's full fp32 weights and Adam moments of the trained parameters, and its
    module's tensors (`module.<name>`: low-precision weights, the frozen bias, the buffer)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if stage != 3:  # stages 1 and 2 link their moments to the parameters at the first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    found: dict = {}
    params = dict(engine.module.named_parameters())
    for name, p in params.items():
        if p.requires_grad:
            found[name] = safe_get_full_fp32_param(p).clone()
            for moment in MOMENTS:
                found[f"optim.{moment}.{name}"] = safe_get_full_optimizer_state(p, moment).clone()
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        found.update({f"module.{name}": p.detach().clone() for name, p in engine.module.state_dict().items()})
    return found


def _resume(directories: dict[int, dict[str, str]]) -> dict:
    """At 3 ranks, each stage resumed each way: the state loaded, its loss scaler and (bf16) the
    next losses; and what a bf16 engine's load_checkpoint of the fp16 files raises."""
    init_deepspeed()
    out: dict = {}
    for stage, ways in directories.items():
        for way, directory in ways.items():
            engine = _engine(stage, way)
            engine.load_checkpoint(directory)
            scaler = engine.optimizer.loss_scaler
            found = {"tensors": _state(engine, stage), "global_steps": engine.global_steps}
            found["scaler"] = (type(scaler).__name__, dict(vars(scaler)))
            found["losses"] = _steps(engine, STEPS_BEFORE) if way != "fp16" else []
            out[(stage, way)] = found
            engine.destroy()
        engine = _engine(stage)
        try:
            engine.load_checkpoint(ways["fp16"])
        except FileNotFoundError as error:
            out[(stage, "fp16 into bf16")] = Path(str(error.filename)).name
        engine.destroy()
    return out


def _universal(save_dir: Path) -> None:
    """DeepSpeed's own way to another world size: `ds_to_universal` (in this process: one
    worker each), named by `latest_universal`."""
    from deepspeed.checkpoint import ds_to_universal

    tag = (save_dir / "latest").read_text()
    command = ["ds_to_universal", "--input_folder", str(save_dir / tag), "--output_folder", str(save_dir / f"{tag}_universal")]
    with mock.patch.object(sys, "argv", [*command, "--num_extract_workers", "1", "--num_merge_workers", "1"]):
        ds_to_universal.main(ds_to_universal.parse_arguments())
    (save_dir / "latest_universal").write_text(f"{tag}_universal")


def _as_fp16(src: Path, dst: Path, scale: DynamicScale | None = None) -> dict:
    """The bf16 checkpoint at `src` written for 3 ranks as an fp16 run's (with loss scaler `scale`)."""
    with open_deepspeed(src) as checkpoint:
        shape = RunShape(checkpoint.stage, 3, checkpoint.global_steps or 0, checkpoint.aliases, checkpoint.buffers)
        run = replace(
            build_run({t.name: t for t in checkpoint.sources}, checkpoint.groups(), shape), precision=Precision.F16, loss_scale=scale
        )
        return write_run(run, src, dst, overwrite=False, progress=None)


def _zero_to_fp32(save_dir: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(save_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("dsbf16")
    continued = run_distributed(_train_and_save, 2, str(root))[0]
    directories: dict[int, dict[str, str]] = {}
    for stage in STAGES:
        saved = root / f"z{stage}"
        result = run_cli("reshard", saved, root / f"z{stage}-at-3", "--world-size", "3")
        assert result.exit_code == 0, result.output
        _universal(saved)
        _as_fp16(saved, root / f"z{stage}-fp16")
        directories[stage] = {"resharded": str(root / f"z{stage}-at-3"), "universal": str(saved), "fp16": str(root / f"z{stage}-fp16")}
    return root, continued, run_distributed(_resume, 3, directories)


@pytest.mark.parametrize("stage", STAGES)
def test_resharded_bf16_resumes_as_deepspeeds_universal_checkpoint(runs, stage: int) -> None:
    """DeepSpeed's plain load_checkpoint of `reshard --world-size 3`'s output: the same fp32
    weights, moments, bf16 module weights and next losses as its load_universal of its own
    universal checkpoint; the weights are zero_to_fp32's of the saved run, the losses the run's own."""
    root, continued, by_rank = runs
    reference = _zero_to_fp32(root / f"z{stage}")
    for rank, results in by_rank.items():
        ours, universal = results[(stage, "resharded")], results[(stage, "universal")]
        assert set(ours["tensors"]) == set(universal["tensors"])
        for name, value in universal["tensors"].items():
            assert value.dtype == ours["tensors"][name].dtype and torch.equal(ours["tensors"][name], value), (rank, name)
        assert {f"module.{name}" for name in reference} == {name for name in ours["tensors"] if name.startswith("module.")}
        for name, value in reference.items():
            if name in ours["tensors"]:  # trained: its fp32 master
                assert torch.equal(ours["tensors"][name].reshape(value.shape), value), (rank, name)
            assert torch.equal(ours["tensors"][f"module.{name}"], value.bfloat16()), (rank, name)
        assert ours["losses"] == universal["losses"]
        assert ours["losses"] == pytest.approx(continued[stage], rel=1e-2)
        assert ours["global_steps"] == universal["global_steps"] == STEPS_BEFORE
        assert ours["scaler"] == universal["scaler"] == ("LossScaler", {"cur_scale": 1.0, "dynamic": False})


@pytest.mark.parametrize("stage", STAGES)
def test_written_files_are_deepspeeds_bf16_and_fp16_layouts(runs, stage: int) -> None:
    """File names, module dtypes and loss scalers as DeepSpeed writes them (torch.load of the
    files); DeepSpeed's zero_to_fp32 reads the fp16 files to the bf16 run's weights."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    root = runs[0]
    for way, prefix, dtype in (("at-3", "bf16_", torch.bfloat16), ("fp16", "", torch.float16)):
        tag = root / f"z{stage}-{way}" / f"global_step{STEPS_BEFORE}"
        models = ["mp_rank_00_model_states.pt"] if stage == 2 else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)]
        assert sorted(p.name for p in tag.iterdir()) == sorted(
            [*models, *(f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3))]
        )
        states = torch.load(tag / models[0], weights_only=False)
        assert {t.dtype for t in states["module"].values()} == {dtype}
        assert states["ds_config"][{torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]] == {"enabled": True}
    expected = CreateLossScaler(torch.float16, 0, True, DeepSpeedFP16Config().dynamic_loss_scale_args())
    optim = torch.load(
        root / f"z{stage}-fp16" / f"global_step{STEPS_BEFORE}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False
    )
    assert type(optim["optimizer_state_dict"]["loss_scaler"]) is type(expected)
    assert vars(optim["optimizer_state_dict"]["loss_scaler"]) == vars(expected)
    assert optim["optimizer_state_dict"]["dynamic_loss_scale"] is True
    bf16, fp16 = _zero_to_fp32(root / f"z{stage}"), _zero_to_fp32(root / f"z{stage}-fp16")
    assert set(bf16) == set(fp16) and all(torch.equal(fp16[name], value) for name, value in bf16.items())


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_loads_fp16_output(runs, stage: int) -> None:
    """What DeepSpeed's loader accepts of fsdpkit's fp16 output on CPU: an fp32 engine reads the
    `zero_pp_rank_*` files, with the fp32 masters and moments of the bf16 output, its module the
    fp16 weights, and the fp16 dynamic loss scaler as saved; a bf16 engine asks for `bf16_` files."""
    for rank, results in runs[2].items():
        fp16, bf16 = results[(stage, "fp16")], results[(stage, "resharded")]
        for name, value in bf16["tensors"].items():
            if name.startswith("module.") and stage == 2:
                fp32 = bf16["tensors"].get(name.removeprefix("module."), value)  # frozen and buffer: bf16
                assert torch.equal(fp16["tensors"][name], fp32.half().float()), (rank, name)
            elif not name.startswith("module."):
                assert torch.equal(fp16["tensors"][name], value), (rank, name)
        assert fp16["scaler"][0] == "DynamicLossScaler" and fp16["scaler"][1]["cur_scale"] == 2**16
        assert fp16["global_steps"] == STEPS_BEFORE
        assert results[(stage, "fp16 into bf16")] == f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_reshard_keeps_an_fp16_runs_loss_scale(runs, tmp_path: Path) -> None:
    """`reshard` of an fp16 run whose scale has moved: the fp16 layout again, and DeepSpeed's
    DynamicLossScaler (torch.load) with every attribute the source's scaler had."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    moved = {"cur_scale": 1024.0, "cur_iter": 7, "last_overflow_iter": 3, "cur_hysteresis": 1}
    scale = DynamicScale(1024.0, scale_window=1000, min_scale=1, delayed_shift=2, cur_hysteresis=1, cur_iter=7, last_overflow_iter=3)
    _as_fp16(runs[0] / "z2", tmp_path / "fp16", scale)
    result = run_cli("reshard", tmp_path / "fp16", tmp_path / "at-2", "--world-size", "2")
    assert result.exit_code == 0, result.output
    expected = CreateLossScaler(torch.float16, 0, True, DeepSpeedFP16Config().dynamic_loss_scale_args())
    vars(expected).update(moved)
    tag = tmp_path / "at-2" / f"global_step{STEPS_BEFORE}"
    for rank in range(2):
        optim = torch.load(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
        assert type(optim["loss_scaler"]) is type(expected) and vars(optim["loss_scaler"]) == vars(expected)
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert {t.dtype for t in module.values()} == {torch.float16}
