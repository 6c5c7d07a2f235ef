"""The README and docs/ render as written: parsed as GitHub-style markdown (markdown-it with
pipe tables), no text sits inside a table. A table goes on until a blank line, so a sentence
written on the line after its last row would show as one more row; every line a table takes
in must be a row of it, starting with `|`."""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PARSER = MarkdownIt("commonmark").enable("table")


def text_inside_tables(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line a table takes in that is not a row of it."""
    lines = text.splitlines()
    found = []
    for token in PARSER.parse(text):
        if token.type == "table_open" and token.map is not None:
            start, end = token.map
            found += [(number + 1, lines[number]) for number in range(start, end) if not lines[number].lstrip().startswith("|")]
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(path.relative_to(ROOT)) for path in DOCUMENTS])
def test_no_text_sits_inside_a_table(document: Path) -> None:
    assert text_inside_tables(document.read_text(encoding="utf-8")) == []


def test_a_sentence_right_after_a_table_is_caught() -> None:
    table = "| kill every | goodput |\n| --- | --- |\n| 30 s | 0.83 |\n| 60 s | 0.97 |\n"
    sentence = "The tables and how they were measured: docs/performance.md."
    assert text_inside_tables("Failures:\n\n" + table + sentence + "\n") == [(7, sentence)]
    assert text_inside_tables("Failures:\n\n" + table + "\n" + sentence + "\n") == []
    assert [token.type for token in PARSER.parse(table)].count("table_open") == 1 and text_inside_tables(table) == []
