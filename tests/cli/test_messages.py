"""What a person reads: every warning is one line `warning: ...` on stderr (Python's warnings
too, with no category, file or source line), shown under --quiet; notes only without it; and
no file in the repository cites an issue number, which means nothing to a reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import warnings
from fsdpkit import log
log.setup(quiet={quiet})
warnings.warn("a python warning,\\n  over two lines", UserWarning)
log.warn("an fsdpkit warning")
log.note("a note")
"""


def _stderr(quiet: bool) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(quiet=quiet)], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == ""
    return done.stderr.splitlines()


def test_every_warning_is_one_line_and_quiet_keeps_only_warnings():
    warnings = ["warning: a python warning, over two lines", "warning: an fsdpkit warning"]
    assert _stderr(quiet=False) == [*warnings, "a note"]
    assert _stderr(quiet=True) == warnings


def test_output_whose_reader_stops_early_is_a_success_with_nothing_on_stderr(tmp_path):
    """`fsdpkit train --help | head -3` and `fsdpkit inspect ... | head -1` exit 0 quietly, as
    `ls | head` does: through a real pipe whose reader closes it at once (the first write fails)
    or after some lines, as head does; help is printed by rich, a command's output is not."""
    from safetensors.numpy import save_file

    save_file({f"layer{i}.weight": np.zeros((4, 4), np.float32) for i in range(200)}, str(tmp_path / "model.safetensors"))
    fsdpkit = str(Path(sys.executable).with_name("fsdpkit"))
    runs = []
    cases = [(["train", "--help"], 0), (["train", "--help"], 3), (["convert", "--help"], 0), (["--help"], 3)]
    for args, lines_read in [*cases, (["inspect", str(tmp_path)], 0), (["inspect", str(tmp_path)], 1)]:
        read_end, write_end = os.pipe()
        runs.append((args, lines_read, read_end, subprocess.Popen([fsdpkit, *args], stdout=write_end, stderr=subprocess.PIPE)))
        os.close(write_end)
        if not lines_read:
            os.close(read_end)  # before the command has written anything: its first write fails
    for args, lines_read, read_end, process in runs:
        head = []
        if lines_read:
            with os.fdopen(read_end, "rb") as reader:
                head = [reader.readline() for _ in range(lines_read)]
        _, stderr = process.communicate(timeout=60)
        assert (process.returncode, stderr.decode()) == (0, ""), (args, head)


def test_the_command_group_does_without_rich():
    """rich is imported only to print help: loading the group that runs every command does not import it."""
    check = "import sys, fsdpkit_cli.group; print(sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


def test_byte_progress_in_a_log_is_a_plain_line_with_the_share_done(monkeypatch, capsys):
    """Where stderr is not a terminal (a log), the byte count the commands and a spread run's
    rank 0 show is a plain line, no carriage return, with the share done."""
    import fsdpkit.progress as progress

    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    with progress.byte_progress("verify") as show:
        show(1 << 20, 4 << 20)
        show(1 << 20, 4 << 20)
    assert capsys.readouterr().err == "verify: 1.0 MiB of 4.0 MiB (25%)\nverify: 2.0 MiB of 4.0 MiB (50%)\n"


def test_help_shows_brackets_literally():
    from fsdpkit_cli.app import app
    from typer.testing import CliRunner

    runner = CliRunner()
    shown = {
        ("prepare-data", "--help"): "needs the [hf] extra",
        ("report", "--help"): "pip install 'fsdpkit[plot]'",
        ("train", "--help"): "[optimizer] lr = 0.001",
    }
    for args, text in shown.items():
        result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
        assert result.exit_code == 0 and text in " ".join(result.stdout.replace("│", " ").split()), result.stdout


def test_help_lists_every_format_fsdpkit_reads_and_writes():
    """`fsdpkit --help`'s convert line, and the SRC of convert, inspect and verify, name every
    format of the one table; convert's --to every format it writes; reshard's SRC every format
    it lays out."""
    from fsdpkit_cli.app import app
    from typer.testing import CliRunner

    from fsdpkit.checkpoint.offline.formats import FORMATS

    def shown(*args: str) -> str:
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return " ".join(result.stdout.replace("│", " ").split())

    convert_line = shown("--help").split(" convert ", 1)[1].split(" reshard ", 1)[0]
    for command in ("convert", "inspect", "verify"):
        text = shown(command, "--help")
        assert all(f.label in text for f in FORMATS.values()), (command, text)
    assert all(f.label in convert_line for f in FORMATS.values()), convert_line
    written = [f.name for f in FORMATS.values() if f.writable]
    assert set(written) == {"sharded", "full", "dcp", "deepspeed", "megatron"}
    assert all(name in convert_line for name in written) and all(name in shown("convert", "--help") for name in written)
    resharded = [f.label for f in FORMATS.values() if f.reshardable]
    assert resharded == ["fsdpkit", "DCP", "DeepSpeed"] and all(label in shown("reshard", "--help") for label in resharded)


def test_help_panels_group_the_train_options():
    from fsdpkit_cli.group import load_command

    command = load_command("fsdpkit_cli.train_cmd", "train")
    panels = {name: param.rich_help_panel for param in command.params for name in param.opts}
    expected = {"--config": "Output", "--print-config": "Output", "--json": "Output", "--steps": "Optimizer", "--seed": "Data"}
    assert {flag: panels[flag] for flag in expected} == expected


def test_help_never_breaks_a_sentence():
    """Every command's help is whole paragraphs (the terminal wraps them, not the source's line
    breaks), and no option's help is half a sentence continued in the next option's."""
    import click
    from fsdpkit_cli.app import COMMANDS, app
    from typer.main import get_command

    root = get_command(app)
    with click.Context(root, info_name="fsdpkit") as ctx:
        commands = [root.get_command(ctx, name) for name in COMMANDS]
        commands += [sub.get_command(ctx, name) for sub in commands if isinstance(sub, click.Group) for name in sub.list_commands(ctx)]
        for command in commands:
            for paragraph in (command.help or "").split("\n\n"):
                assert "\n" not in paragraph, (command.name, paragraph)
            for param in command.get_params(ctx):
                text = getattr(param, "help", None) or ""
                assert not text.startswith("...") and not text.rstrip().endswith("..."), (command.name, param.name, text)
    listing = " ".join(CliRunner().invoke(app, ["--help"]).stdout.replace("│", " ").split())
    for name, (_, short_help) in COMMANDS.items():
        assert short_help in listing, name


def test_counts_are_singular_for_one_and_sizes_agree(tmp_path, monkeypatch):
    """One file is '1 file', one save '1 save'; reshard counts rank files (never DCP's
    .metadata) and says the size verify says for the directory it wrote."""
    import dataclasses
    import json

    import torch
    from fsdpkit_cli.app import app
    from fsdpkit_cli.train_cmd import format_summary
    from support.checkpoint_files import save_checkpoint

    from fsdpkit.train.summary import TrainSummary

    monkeypatch.chdir(tmp_path)
    # 380003 float32 = 1.45 MiB: the rank files' headers would tip it to 1.5 MiB
    save_checkpoint(tmp_path / "run", 1, {"w": torch.randn(380000), "b": torch.ones(3)}, world_size=2)
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, result.output
        return result.stdout

    assert run("convert", "run", "full", "--to", "full").startswith("wrote full: 1 file, 2 tensors, 1.4 MiB")
    assert run("reshard", "run", "r3", "--world-size", "3").startswith("wrote r3: 3 files, 2 tensors, 1.4 MiB")
    assert "sharded, 2 tensors, 6 fragments, 1.4 MiB" in run("verify", "r3")
    written = json.loads(run("convert", "run", "dcp", "--to", "dcp", "--world-size", "2", "--json"))
    assert written["files"] == ["__0_0.distcp", "__1_0.distcp"] and (tmp_path / "dcp" / ".metadata").is_file()
    assert run("reshard", "dcp", "d1", "--world-size", "1").startswith("wrote d1: 1 file, 2 tensors, 1.4 MiB")
    assert "dcp, 2 tensors, 2 chunks, 0 bytes items, 1.4 MiB" in run("verify", "d1")
    summary = TrainSummary(
        model="gpt-tiny",
        num_params=1,
        world_size=2,
        strategy="full",
        mixed_precision="none",
        device="cpu",
        steps=1,
        resumed_from_step=None,
        optimizer_steps=1,
        global_batch_size=2,
        seq_len=4,
        losses=[1.0],
        eval_losses=[],
        tokens_per_second=4.0,
        step_tokens_per_second=None,
        elapsed_seconds=1.0,
        peak_memory_bytes=0,
        checkpoint="run/step-00000001",
        save_stall_s=0.5,
        snapshot_stall_s=0.0,
        save_timings={"saves": 1},
        restarts=0,
        steps_redone=None,
        preempted=False,
    )
    assert "(1 save; max over ranks)" in format_summary(summary)
    assert "(2 saves; max over ranks)" in format_summary(dataclasses.replace(summary, save_timings={"saves": 2}))


def test_every_install_hint_has_one_form_from_one_function():
    """A message about an absent optional extra says `pip install 'fsdpkit[EXTRA]'` (what works for
    an installed fsdpkit), always through errors.install_hint, naming an extra pyproject defines."""
    import re
    import tomllib

    from fsdpkit.errors import install_hint

    sources = {path: path.read_text(encoding="utf-8") for folder in ("fsdpkit", "cli") for path in sorted((ROOT / folder).rglob("*.py"))}
    spelled = [path.relative_to(ROOT) for path, text in sources.items() if "pip install" in text]
    assert spelled == [Path("fsdpkit/errors.py")], spelled
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    named = {extra for text in sources.values() for extra in re.findall(r"install_hint\(['\"]([^'\"]+)['\"]\)", text)}
    assert named == {"plot", "tensorboard", "hf", "data", "wandb", "mlflow", "cloud"} and named <= extras.keys(), named
    assert install_hint("plot") == "pip install 'fsdpkit[plot]'"
