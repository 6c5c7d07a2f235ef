"""The commands a user runs first, through the real console script, under whichever torch this
environment has: `make test-compat` runs this module under the oldest torch fsdpkit supports.

A run saved halfway and resumed ends with the weights of the straight run, bitwise (their full
conversions are equal); torch's own DCP reader loads convert's DCP output as the saved weights;
the allgather benchmark checks every element it gathers. Every command runs in its own process group, and
when it returns, nothing it started is left in that group: not the launcher's fork server, its
resource tracker or a worker, and not as a zombie either, after a normal run or after Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
TRAIN = ["--nproc-per-node", "2", "--steps", "4", "--global-batch-size", "4", "--seq-len", "16", "--json"]
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1"}


def processes_in_group(group: int) -> list[str]:
    """'pid (name) state' of every process whose process group is `group`, zombies included."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, NotADirectoryError):
            continue  # not a process, or one that exited meanwhile
        name_end = stat.rindex(")")
        state, _parent, process_group = stat[name_end + 2 :].split()[:3]
        if int(process_group) == group:
            found.append(f"{stat[: name_end + 1]} {state}")
    return found


@dataclass(frozen=True)
class Command:
    """One fsdpkit command that ran to its end, and what its process group held right then."""

    returncode: int
    stdout: str
    stderr: str
    left_in_group: list[str]


def fsdpkit(*args: str, cwd: Path) -> Command:
    done = subprocess.Popen(
        [FSDPKIT, *args], cwd=cwd, env=ENVIRONMENT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout, stderr = done.communicate(timeout=300)
    return Command(done.returncode, stdout, stderr, processes_in_group(done.pid))


def interrupted_train(cwd: Path) -> Command:
    """`fsdpkit train` given Ctrl-C (SIGINT to its whole group, as a terminal sends it) once it
    has trained a step."""
    run = subprocess.Popen(
        [FSDPKIT, "train", *TRAIN, "--steps", "100000"], cwd=cwd, env=ENVIRONMENT, start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    assert run.stderr is not None
    lines = []
    for line in run.stderr:
        lines.append(line)
        if line.startswith("step "):
            break
    os.killpg(run.pid, signal.SIGINT)
    lines.append(run.stderr.read())
    run.wait(timeout=120)
    return Command(run.returncode, "", "".join(lines), processes_in_group(run.pid))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, Command]]:
    root = tmp_path_factory.mktemp("compat")
    commands = {
        "straight": fsdpkit("train", *TRAIN, "--save-every", "2", "--save-dir", "straight", cwd=root),
        "resumed": fsdpkit("train", "--resume", "straight/step-00000002", "--save-dir", "resumed", "--json", cwd=root),
        "interrupted": interrupted_train(root),
        "bench": fsdpkit(
            "bench", "allgather", "--nproc-per-node", "2", "-b", "1K", "-e", "64K", "-n", "2", "-w", "1", "-c", "1", "--json", cwd=root
        ),
    }
    for name, source, to in (("full", "straight/step-00000004", "full"), ("resumed-full", "resumed", "full"), ("dcp", "straight", "dcp")):
        commands[f"convert {name}"] = fsdpkit("convert", source, name, "--to", to, cwd=root)
    return root, commands


def test_each_command_succeeds(runs):
    _, commands = runs
    for name, command in commands.items():
        if name != "interrupted":
            assert command.returncode == 0, f"{name}: {command.stderr}"


def test_a_resumed_run_ends_where_the_straight_run_does(runs):
    root, commands = runs
    straight, resumed = (json.loads(commands[name].stdout) for name in ("straight", "resumed"))
    assert resumed["resumed_from_step"] == 2 and resumed["losses"] == straight["losses"][2:]
    reference, mine = load_file(root / "full" / "model.safetensors"), load_file(root / "resumed-full" / "model.safetensors")
    assert reference.keys() == mine.keys() and len(reference) > 1
    for name, tensor in reference.items():
        assert torch.equal(tensor, mine[name]), name


def test_torch_reads_the_dcp_conversion_as_the_saved_weights(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import fsdpkit

    root, _ = runs
    dcp_to_torch_save(root / "dcp", tmp_path / "torch.pt")
    loaded = torch.load(tmp_path / "torch.pt", weights_only=True)
    weights = loaded.get("model", loaded)
    with fsdpkit.open_checkpoint(root / "straight" / "step-00000004") as saved:
        model = [name for name in saved.keys() if not name.startswith("optim.")]  # convert leaves the optimizer out by default
        assert set(model) == set(weights) and len(model) > 1
        for name in model:
            assert torch.equal(saved.get_tensor(name), weights[name]), name


def test_the_allgather_benchmark_gathers_every_element_right(runs):
    _, commands = runs
    report = json.loads(commands["bench"].stdout)
    rows = report["results"][0]["rows"]
    assert report["world_size"] == 2 and len(rows) == 7
    assert report["wrong_total"] == 0 and all(row[mode]["wrong"] == 0 for row in rows for mode in ("out_of_place", "in_place"))


def test_ctrl_c_stops_training_with_one_line(runs):
    _, commands = runs
    interrupted = commands["interrupted"]
    assert interrupted.returncode == 130, interrupted.stderr
    assert interrupted.stderr.rstrip().splitlines()[-1] == "error: interrupted"
    assert "Traceback" not in interrupted.stderr


def test_no_process_outlives_its_command_in_the_group(runs):
    _, commands = runs
    assert {name: command.left_in_group for name, command in commands.items()} == {name: [] for name in commands}
