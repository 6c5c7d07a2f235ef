"""Every torch.optim optimizer that keeps state survives fsdpkit.save / fsdpkit.load: trained
3 steps at 2 ranks, saved, loaded into a fresh model and optimizer and trained 3 more, the
weights are bitwise those of the run that never stopped; loaded at 3 ranks, equal to 1e-6;
and both agree with the unsharded reference. A saved state the loading optimizer would not
keep is a one-line error naming it, before launch and in fsdpkit.load; a state that cannot be
stored is an error at save, not silently left out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.distributed import run_distributed
from support.models import EdgeCaseNet

import fsdpkit
from fsdpkit.checkpoint.live.checkpointer import check_before_launch
from fsdpkit.errors import DataCheckError, RunError

OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "sgd-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "rmsprop-momentum": (torch.optim.RMSprop, {"momentum": 0.9}),
    "rmsprop-centered": (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
    "adagrad": (torch.optim.Adagrad, {}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "adamax": (torch.optim.Adamax, {}),
    "nadam": (torch.optim.NAdam, {}),
    "radam": (torch.optim.RAdam, {}),
    "adam": (torch.optim.Adam, {}),
    "adam-amsgrad": (torch.optim.Adam, {"amsgrad": True}),
    "adamw": (torch.optim.AdamW, {}),
    "adamw-amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    "asgd": (torch.optim.ASGD, {}),
    "rprop": (torch.optim.Rprop, {}),
}
ROWS = 12  # divides among 1, 2, 3 and 4 ranks


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    cls, settings = OPTIMIZERS[kind]
    return cls(fsdpkit.param_groups(model, weight_decay=0.1), **{"lr": 1e-2, **settings})


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 5, generator=generator), torch.randn(ROWS, 2, generator=generator)


def train(model, optimizer, steps: range) -> None:
    sharded = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    rows = ROWS // world
    for step in steps:
        x, y = batch(step)
        F.mse_loss(model(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows]).backward()
        optimizer.step()
        optimizer.zero_grad()


def fresh(kind: str, seed: int):
    torch.manual_seed(seed)
    model = fsdpkit.shard(EdgeCaseNet())
    return model, make_optimizer(kind, model)


def save_and_resume_worker(directory: str) -> dict:
    """Per optimizer: the uninterrupted 6 steps, and 3 + save + load into a fresh one + 3."""
    results = {}
    for kind in OPTIMIZERS:
        model, optimizer = fresh(kind, 0)
        train(model, optimizer, range(3))
        fsdpkit.save(model, optimizer, f"{directory}/{kind}", step=3)
        train(model, optimizer, range(3, 6))
        uninterrupted = fsdpkit.full_state_dict(model)
        model, optimizer = fresh(kind, 1)
        fsdpkit.load(model, optimizer, f"{directory}/{kind}")
        train(model, optimizer, range(3, 6))
        results[kind] = (uninterrupted, fsdpkit.full_state_dict(model))
    return results


def load_elsewhere_worker(directory: str) -> dict:
    """Per optimizer: load the 2-rank checkpoint and train 3 more; and the error of loading
    SGD's momentum into Adagrad."""
    results: dict = {}
    for kind in OPTIMIZERS:
        model, optimizer = fresh(kind, 1)
        fsdpkit.load(model, optimizer, f"{directory}/{kind}")
        train(model, optimizer, range(3, 6))
        results[kind] = fsdpkit.full_state_dict(model)
    model, optimizer = fresh("adagrad", 1)
    try:
        fsdpkit.load(model, optimizer, f"{directory}/sgd-momentum")
        results["error"] = "loaded"
    except DataCheckError as error:
        results["error"] = str(error)
    model, optimizer = fresh("adamw", 1)
    train(model, optimizer, range(1))
    for param_state in optimizer.state.values():
        param_state["custom"] = 0.5  # a state that is not a tensor cannot be stored: refused, not dropped
    try:
        fsdpkit.save(model, optimizer, f"{directory}/custom", step=1)
        results["save_error"] = "saved"
    except RunError as error:
        results["save_error"] = str(error)
    return results


def reference(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = EdgeCaseNet()
    optimizer = make_optimizer(kind, model)
    train(model, optimizer, range(6))
    return model.state_dict()


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    return bool(((a - b).norm() / b.norm().clamp_min(1e-12)).item() < tolerance)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("optimizers")
    return directory, run_distributed(save_and_resume_worker, 2, str(directory))[0]


def test_every_optimizer_resumes_bitwise_at_the_same_world_size(saved):
    _, results = saved
    for kind, (uninterrupted, resumed) in results.items():
        expected = reference(kind)
        assert uninterrupted.keys() == resumed.keys() == expected.keys()
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), (kind, name)
            assert close(tensor, expected[name], 1e-5), (kind, name)


def test_every_optimizer_resumes_at_another_world_size(saved):
    directory, results = saved
    elsewhere = run_distributed(load_elsewhere_worker, 3, str(directory))[0]
    for kind, (uninterrupted, _) in results.items():
        for name, tensor in uninterrupted.items():
            assert close(elsewhere[kind][name], tensor, 1e-6), (kind, name)
    message = elsewhere["error"]
    assert "optim.momentum_buffer." in message and "Adagrad" in message and "\n" not in message, message
    assert "optimizer state 'custom' of " in elsewhere["save_error"] and "not a tensor" in elsewhere["save_error"]
    assert not (directory / "custom").exists()


def test_a_saved_state_the_optimizer_would_not_keep_is_refused_before_launch(saved):
    directory, _ = saved
    model = EdgeCaseNet()
    with pytest.raises(DataCheckError) as error:
        check_before_launch(directory / "adamw-amsgrad", model=model, optimizer=make_optimizer("adagrad", model), strict=True)
    assert "optim.exp_avg." in str(error.value) and "\n" not in str(error.value)
    model = EdgeCaseNet()  # the saved settings (amsgrad) are the resumed run's: its max_exp_avg_sq is expected
    check_before_launch(directory / "adamw-amsgrad", model=model, optimizer=make_optimizer("adamw", model), strict=True)
