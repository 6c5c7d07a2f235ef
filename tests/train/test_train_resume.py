"""`--resume DIR` continues the run it names, and a save directory belongs to one run, through
the real CLI: a resume given nothing but --resume (and where to save) takes every setting from
the checkpoint and continues bitwise; a flag that changes a saved setting says so in one
warning line; a fresh run into a directory holding another run's checkpoints exits 2 before
launch, and --new-run sets them aside so that `latest` never points back to them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsdpkit_cli.app import app
from support.checkpoint_files import run_cli, save_checkpoint
from typer.testing import CliRunner

from fsdpkit import log
from fsdpkit.checkpoint.format.manifest import load_manifest
from fsdpkit.checkpoint.format.save_dir import continued_run_id
from fsdpkit.checkpoint.format.storage import complete_steps
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.models.source import resolve
from fsdpkit.train import launcher
from fsdpkit.train.config import TrainConfig
from fsdpkit.train.foreign import converted

runner = CliRunner()
# Every carried setting away from its default, so that a resume that fell back to a default would differ.
SETTINGS = [
    "--seed", "5", "--seq-len", "32", "--global-batch-size", "4", "--grad-accum", "2",
    "--lr", "0.01", "--weight-decay", "0.05", "--betas", "0.8,0.9", "--lr-schedule", "cosine",
    "--warmup-steps", "2", "--max-grad-norm", "1.0", "--wrap-every", "2",
]  # fmt: skip


def train(*args: str) -> dict:
    result = runner.invoke(app, ["train", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def weights(path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.read_tensor(name) for name in reader.tensor_names()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    summary = train(*SETTINGS, "--steps", "6", "--save-every", "3", "--keep-last", "2", "--save-dir", str(root / "run"))
    return root, summary


def test_a_resume_with_nothing_but_resume_continues_bitwise(run):
    root, full = run
    result = runner.invoke(app, ["train", "--resume", str(root / "run" / "step-00000003"), "--save-dir", str(root / "resumed"), "--json"])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr, result.stderr
    resumed = json.loads(result.stdout)
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6  # the saved run's step count
    assert resumed["seq_len"] == 32 and resumed["global_batch_size"] == 4
    assert resumed["losses"] == full["losses"][3:]
    reference, mine = weights(root / "run"), weights(root / "resumed")
    assert reference.keys() == mine.keys() and all(torch.equal(reference[n], mine[n]) for n in reference)


def _print_config(*args: str) -> tuple[dict, list[str]]:
    result = runner.invoke(app, ["train", *args, "--print-config"])
    assert result.exit_code == 0, result.output
    return tomllib.loads(result.stdout), result.stderr.splitlines()


def test_print_config_of_a_resume_shows_the_saved_settings_and_each_override_warns_once(run, tmp_path):
    root, _ = run
    saved, warnings = _print_config("--resume", str(root / "run"))
    assert warnings == []
    assert saved["seed"] == 5 and saved["steps"] == 6
    assert saved["data"]["seq_len"] == 32 and saved["data"]["grad_accum"] == 2
    assert saved["optimizer"]["lr"] == 0.01 and saved["optimizer"]["betas"] == [0.8, 0.9] and saved["optimizer"]["schedule"] == "cosine"
    assert saved["model"]["wrap_every"] == 2
    # Free to change, silently: world size, step count, save and log settings; a flag equal to the saved value says nothing.
    free = ["--nproc-per-node", "1", "--steps", "9", "--save-dir", str(tmp_path / "new"), "--log-every", "1", "--lr", "0.01"]
    _, warnings = _print_config("--resume", str(root / "run"), *free)
    assert warnings == []
    merged, warnings = _print_config("--resume", str(root / "run"), "--seq-len", "16", "--betas", "0.9,0.95", "--quiet")
    assert merged["data"]["seq_len"] == 16 and merged["data"]["global_batch_size"] == 4
    step_dir = root / "run" / "step-00000006"
    assert warnings == [
        f"warning: --seq-len 16 replaces 32 saved in {step_dir}",
        f"warning: --betas 0.9,0.95 replaces 0.8,0.9 saved in {step_dir}",
    ]


def test_a_resume_saves_as_the_run_did_unless_told_otherwise(run, tmp_path):
    """--save-every and --keep-last are saved settings too: a resume into a --save-dir takes them
    (--print-config shows them), a flag still wins and says so, and without a --save-dir nothing
    about saving is carried."""
    root, _ = run
    step_dir = root / "run" / "step-00000006"
    carried, warnings = _print_config("--resume", str(root / "run"), "--save-dir", str(tmp_path / "new"))
    assert warnings == [] and carried["checkpoint"]["save_every"] == 3 and carried["checkpoint"]["keep_last"] == 2
    given, warnings = _print_config("--resume", str(root / "run"), "--save-dir", str(tmp_path / "new"), "--save-every", "4")
    assert given["checkpoint"]["save_every"] == 4 and given["checkpoint"]["keep_last"] == 2
    assert warnings == [f"warning: --save-every 4 replaces 3 saved in {step_dir}"]
    unsaved, warnings = _print_config("--resume", str(root / "run"))
    assert warnings == [] and unsaved["checkpoint"]["save_every"] == 0 and "keep_last" not in unsaved["checkpoint"]
    # the run goes on in its own directory (a copy): saved at 9 and 12, only the newest two kept;
    # with the optimizer's settings its flags give, not the saved ones its checkpoint loaded
    shutil.copytree(root / "run", tmp_path / "run")
    train(
        "--resume",
        str(tmp_path / "run"),
        "--steps",
        "12",
        "--save-dir",
        str(tmp_path / "run"),
        "--weight-decay",
        "0.2",
        "--betas",
        "0.7,0.8",
    )
    assert [step for step, _ in complete_steps(tmp_path / "run")] == [9, 12]
    groups = load_manifest(tmp_path / "run" / "step-00000012").training_state["optimizer"]["groups"]
    assert [(g["settings"]["weight_decay"], g["settings"]["betas"]) for g in groups] == [(0.2, [0.7, 0.8]), (0.0, [0.7, 0.8])]


def test_a_checkpoint_of_another_model_names_the_model_it_was_saved_from(run):
    root, _ = run
    result = runner.invoke(app, ["train", "--resume", str(root / "run"), "--model", "gpt-small"])
    assert result.exit_code == 3
    warning, error = result.stderr.splitlines()
    assert warning.startswith("warning: --model gpt-small replaces gpt-tiny saved in ")
    assert error.startswith("error: ") and error.endswith("(saved from gpt-tiny, not gpt-small)"), error


def test_inspect_names_the_model_and_its_main_settings(run):
    root, _ = run
    result = runner.invoke(app, ["inspect", str(root / "run")])
    assert result.exit_code == 0, result.output
    assert (
        "run         gpt-tiny: 32 tokens x 4 sequences (grad-accum 2), adamw lr 0.01 cosine, precision none, data synthetic, seed 5"
        in result.stdout
    )


@pytest.fixture
def no_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda *args, **kwargs: launched.append(args) or {0: None})
    return launched


def test_a_fresh_run_into_a_used_save_dir_exits_2_before_launch(run, tmp_path, no_launch):
    import shutil

    root, _ = run
    used = tmp_path / "used"
    shutil.copytree(root / "run", used)
    before = sorted(p.name for p in used.iterdir())
    result = runner.invoke(app, ["train", "--steps", "2", "--save-dir", str(used)])
    assert result.exit_code == 2 and no_launch == []
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: --save-dir {used} already holds checkpoints step-00000003, step-00000006 of another run (run ")
    assert "model gpt-tiny" in line and f"--resume {used}" in line and "--new-run" in line
    assert sorted(p.name for p in used.iterdir()) == before
    # Continuing it is fine; so is a new run, which first sets the earlier checkpoints aside.
    assert runner.invoke(app, ["train", "--resume", str(used), "--save-dir", str(used)]).exit_code == 0
    result = runner.invoke(app, ["train", "--steps", "2", "--save-dir", str(used), "--new-run"])
    assert result.exit_code == 0, result.output
    (earlier,) = [p for p in used.iterdir() if p.name.startswith("earlier-")]
    assert sorted(p.name for p in earlier.iterdir()) == ["latest", "step-00000003", "step-00000006"]
    assert not (used / "latest").exists() and not list(used.glob("step-*"))
    assert (earlier / "latest").read_text().strip() == "step-00000006"
    assert len(no_launch) == 2


def fsdpkit(*args: str, cwd) -> subprocess.CompletedProcess:
    """The real CLI in a process of its own (a run id is made from the process that takes the lock)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fsdpkit_cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_run_and_its_resumes_are_one_run(tmp_path, no_launch, monkeypatch):
    """A resume that goes on from the newest checkpoint of its --save-dir keeps the run id, so a
    fresh run into that directory names the run once; a resume from an earlier step is a new run."""
    common = ("train", "--nproc-per-node", "1", "--global-batch-size", "2", "--seq-len", "16", "--save-dir", "run", "--quiet")
    done = fsdpkit(*common, "--steps", "2", "--save-every", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = fsdpkit(*common, "--steps", "4", "--resume", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    monkeypatch.chdir(tmp_path)
    refused = runner.invoke(app, [*common, "--steps", "2"])  # refused before launch: in this process
    run = tmp_path / "run"
    writers = [load_manifest(path).run_id for _, path in complete_steps(run)]
    assert len(writers) == 4 and len(set(writers)) == 1 and writers[0], writers  # the resume saves every step, as the run did
    (line,) = refused.stderr.splitlines()
    assert (
        refused.exit_code == 2
        and no_launch == []
        and f"checkpoints step-00000002, step-00000003, step-00000004 (and 1 earlier) of another run (run {writers[0]}, model gpt-tiny): "
        in line
    ), line
    assert continued_run_id(run, run) == writers[0] == continued_run_id(run, run / "step-00000004")
    assert continued_run_id(run, run / "step-00000002") is None and continued_run_id(run, None) is None


def test_a_resume_from_a_dcp_conversion_on_other_data_says_so(tmp_path, capfd):
    """`convert --to dcp` of a run keeps the data source it trained on; a resume from that DCP
    reading other data says so in one note before it converts; the same data, or a DCP that
    records none (torch's own), says nothing."""
    weights = {k: v for k, v in resolve("gpt-tiny").build(seed=0).state_dict().items() if k != "lm_head.weight"}
    state = {"step": 1, "config": {"data": {"source": "synthetic"}}}
    save_checkpoint(tmp_path / "run", 1, weights, world_size=1, aliases={"lm_head.weight": "wte.weight"}, training_state=state)
    assert run_cli("convert", tmp_path / "run", tmp_path / "dcp", "--to", "dcp").exit_code == 0
    with warnings.catch_warnings():  # torch says it assumes a single process: it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": weights}, checkpoint_id=tmp_path / "torch-dcp", no_dist=True)
    (tmp_path / "text.txt").write_text("other data " * 200)
    log.setup()
    capfd.readouterr()
    notes = {}
    for name, data in (("dcp", str(tmp_path / "text.txt")), ("dcp", "synthetic"), ("torch-dcp", str(tmp_path / "text.txt"))):
        values = {"model": {"name": "gpt-tiny"}, "data": {"source": data}, "checkpoint": {"resume": str(tmp_path / name)}}
        with converted(TrainConfig.from_values(values), 1):
            pass
        notes[(name, data)] = [line for line in capfd.readouterr().err.splitlines() if not line.startswith("converting ")]
    assert notes == {
        ("dcp", str(tmp_path / "text.txt")): [
            f"--data {tmp_path / 'text.txt'}: {tmp_path / 'dcp'} was trained on synthetic; the resumed run reads other data"
        ],
        ("dcp", "synthetic"): [],
        ("torch-dcp", str(tmp_path / "text.txt")): [],
    }
