"""What a person reads: every warning is one line `warning: ...` on stderr (Python's warnings
too, with no category, file or source line), shown under --quiet; notes only without it; and
no file in the repository cites an issue number, which means nothing to a reader."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_no_tracked_file_cites_an_issue_number():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    pattern = re.compile(r"issue [0-9]", re.IGNORECASE)
    hits = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)


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
