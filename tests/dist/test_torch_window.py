"""A torch older than the supported window: every command ends with one line naming the window
and exit 2, before anything starts; the supported releases, and newer ones, pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
from fsdpkit_cli.app import app
from typer.testing import CliRunner

from fsdpkit.dist import torch_window
from fsdpkit.errors import UsageError

runner = CliRunner()


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0.dev20270101", "3.0.0"])
def test_the_window_and_newer_releases_pass(version):
    torch_window.check_torch_release(version)


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.4.1", "1.13.1"])
def test_an_older_release_names_the_window(version):
    with pytest.raises(UsageError, match=re.escape(f"torch {version}; fsdpkit needs torch 2.11 or newer (tested: 2.11 to 2.14)")):
        torch_window.check_torch_release(version)


@pytest.fixture
def old_torch(monkeypatch):
    """The installed torch's version is 2.10.0."""
    monkeypatch.setattr(torch_window, "installed_torch_version", lambda: "2.10.0+cu128")


@pytest.mark.parametrize("command", [["train", "--steps", "2"], ["bench", "allgather"], ["inspect", "nowhere"]])
def test_every_command_under_an_older_torch_is_one_line_and_exit_2(old_torch, no_launch, command):
    result = runner.invoke(app, command)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        "error: this environment has torch 2.10.0+cu128; fsdpkit needs torch 2.11 or newer (tested: 2.11 to 2.14): "
        "pip install 'torch>=2.11'"
    ]


def test_version_still_says_which_torch(old_torch):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and "torch 2.10.0+cu128" in result.output


def test_version_names_torchs_build_where_the_package_metadata_does_not(tmp_path):
    """A CUDA wheel from PyPI: its metadata says 2.11.0, torch.__version__ says 2.11.0+cu130
    (a torch package of that shape first on the path, in a process of its own)."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('--version must not import torch')\n")
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda = '13.0'\n")
    (tmp_path / "torch-2.11.0.dist-info").mkdir()
    (tmp_path / "torch-2.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "fsdpkit_cli", "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stderr) == (0, "") and done.stdout.endswith("(torch 2.11.0+cu130)\n"), (done.stdout, done.stderr)
