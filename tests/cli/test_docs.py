"""The README and docs/ as a user reads them: every `fsdpkit ...` line of their code blocks
parses against the real command-line app (each subcommand and flag exists, each value has the
flag's type and choices; a training's settings make a valid config), without running it.

Paths in the examples are placeholders: parsing never opens them. A command line may be split
with a trailing backslash, prefixed with environment assignments or `.venv/bin/`, run as
`python -m fsdpkit_cli` (under torchrun too), and followed by a comment, a redirection or a pipe.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from fsdpkit_cli.app import app
from fsdpkit_cli.settings_options import given_values
from fsdpkit_cli.train_cmd import ALL_SECTIONS
from typer.core import TyperCommand

from fsdpkit.errors import UsageError
from fsdpkit.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 230
SHELL_STOPS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1"}


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line in a fenced block or an indented (4+ spaces) block;
    backslash-continued lines joined, numbered by their first line."""
    lines, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ") or pending):
            continue
        if not pending:
            start = number
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        lines.append((start, pending))
        pending = ""
    return lines


def fsdpkit_arguments(line: str) -> list[str] | None:
    """The arguments after `fsdpkit` (or `-m fsdpkit_cli`) of a shell line, or None if it runs something else."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    for index, word in enumerate(words):
        if word in SHELL_STOPS:
            return None
        if word == "fsdpkit" or word.endswith("/fsdpkit") or (word == "fsdpkit_cli" and words[index - 1] == "-m"):
            arguments = words[index + 1 :]
            cut = next((i for i, w in enumerate(arguments) if w in SHELL_STOPS or w.startswith(("2>", ">"))), len(arguments))
            return arguments[:cut]
        if "=" not in word and index == 0 and word not in ("python", "torchrun") and not word.endswith("/python"):
            return None
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for document in DOCUMENTS:
        for number, line in code_lines(document.read_text(encoding="utf-8")):
            arguments = fsdpkit_arguments(line)
            if arguments is not None:
                found.append((f"{document.relative_to(ROOT)}:{number}", arguments))
    return found


COMMANDS = documented_commands()


def parse_only(arguments: list[str], monkeypatch: pytest.MonkeyPatch) -> typer.Context | None:
    """Run the real app on the arguments with every command's body replaced by a no-op: what
    the parser accepted comes back as the command's context (None for the root's --help)."""
    parsed: list[typer.Context] = []
    monkeypatch.setattr(TyperCommand, "invoke", lambda self, ctx: parsed.append(ctx))
    code = typer.main.get_command(app).main(list(arguments), prog_name="fsdpkit", standalone_mode=False)
    assert code in (0, None), f"fsdpkit {shlex.join(arguments)}: exit {code}"
    return parsed[-1] if parsed else None


def check_command(arguments: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = parse_only(arguments, monkeypatch)
    if ctx is None:
        assert "--help" in arguments or "--version" in arguments
        return
    path = ctx.command_path.split()[1:]  # fsdpkit bench allgather: ["bench", "allgather"]
    assert path == arguments[: len(path)]
    if path == ["train"] and ctx.params.get("config_file") is None:
        TrainConfig.from_values(given_values(ALL_SECTIONS, ctx, ctx.params))  # a bad value raises UsageError


def test_the_documents_show_commands() -> None:
    assert len(COMMANDS) >= 40, [where for where, _ in COMMANDS]


@pytest.mark.parametrize("arguments", [arguments for _, arguments in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(arguments: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    check_command(arguments, monkeypatch)
    assert "error:" not in capsys.readouterr().err


def test_a_wrong_command_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    for wrong in (["train", "--stepz", "3"], ["reshard", "a", "b", "--world-size", "two"], ["trian"], ["bench", "allgathr"]):
        with pytest.raises(AssertionError):
            check_command(wrong, monkeypatch)
    with pytest.raises(UsageError, match="--steps"):
        check_command(["train", "--steps", "0"], monkeypatch)
    assert fsdpkit_arguments("OMP_NUM_THREADS=1 .venv/bin/fsdpkit bench all -b 8 > out.txt  # note") == ["bench", "all", "-b", "8"]
    assert fsdpkit_arguments("torchrun --nproc-per-node 2 -m fsdpkit_cli train --steps 20") == ["train", "--steps", "20"]
    assert fsdpkit_arguments("python -c 'print(1)'") is None
    assert code_lines("text\n\n    fsdpkit train \\\n        --steps 3\n") == [(3, "fsdpkit train --steps 3")]


def test_the_readme_shows_every_command_and_stays_short() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    shown = {arguments[0] for where, arguments in COMMANDS if where.startswith("README.md") and arguments}
    listed = set(typer.main.get_command(app).list_commands(typer.Context(typer.main.get_command(app))))
    assert listed <= shown, f"README has no example of {sorted(listed - shown)}"


def anchors(document: Path) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", document.read_text(encoding="utf-8"), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_between_documents_resolve() -> None:
    for document in DOCUMENTS:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", document.read_text(encoding="utf-8")):
            path = document.parent / target if target else document
            assert path.exists(), f"{document.relative_to(ROOT)} links to missing {target}"
            assert not anchor or anchor in anchors(path), f"{document.relative_to(ROOT)} links to missing {target}#{anchor}"


# An issue or pull request cited by number (the word issue, PR or pull request, or a hash, then digits), or a
# link to one. Code, comments and docs stand on their own.
CITATION = re.compile(r"(?i:issue [0-9])|#[0-9]+|\bPR ?#?[0-9]|(?i:pull request #?[0-9])|/(?:pull|issues)/[0-9]")
SOURCES = [
    *DOCUMENTS,
    ROOT / "Makefile",
    ROOT / "pyproject.toml",
    *(
        path
        for folder in ("fsdpkit", "cli", "benchmarks", "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != Path(__file__)
    ),
]


def test_no_document_or_source_cites_an_issue_or_pr_number() -> None:
    for document in (path for path in SOURCES if path != Path(__file__)):  # this file holds examples
        for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), start=1):
            assert not CITATION.search(line), f"{document.relative_to(ROOT)}:{number}: {line}"


@pytest.mark.parametrize("line", [f"see issue {38}", "fixed in #1357", "pytorch PR #1189", "PR 7", "github.com/o/r/pull/5", "o/r/issues/9"])
def test_a_citation_is_recognised(line: str) -> None:
    assert CITATION.search(line)
