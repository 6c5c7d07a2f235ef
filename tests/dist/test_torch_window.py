"""A torch older than the supported window: every command ends with one line naming the window
and exit 2, before anything starts; the supported releases, and newer ones, pass."""

from __future__ import annotations

import re
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
    """The installed torch's version, as the package metadata gives it, is 2.10.0."""
    installed = metadata.version

    def version(name: str) -> str:
        return "2.10.0+cu128" if name == "torch" else installed(name)

    monkeypatch.setattr(torch_window.metadata, "version", version)


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
