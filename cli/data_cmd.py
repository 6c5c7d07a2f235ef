"""`fsdpkit prepare-data`: tokenise a text file, or documents (jsonl, parquet, datasets), into a
flat token file for `train --data`."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from fsdpkit.errors import UsageError
from fsdpkit.progress import byte_progress
from fsdpkit.sizes import format_size

from .common import count_progress, handle_errors, print_json

command_app = typer.Typer(add_completion=False)


@command_app.command("prepare-data", short_help="Tokenise a text file or documents into a flat token file (.bin) for train --data.")
@handle_errors
def prepare_data(
    text: Path = typer.Argument(
        ...,
        help="A text file (UTF-8), tokenised in blocks that end at a line break; or documents, as train --data takes them "
        "(.jsonl/.json, .parquet files, a datasets directory or cached Hub name), each followed by an end-of-text token.",
    ),
    out: Path = typer.Argument(..., help="The token file to write (.bin: little-endian integers, no header)."),
    tokenizer: str = typer.Option(
        "bytes",
        "--tokenizer",
        help="hf:DIR (a transformers tokenizer directory, local files only; needs the [hf] extra) or bytes (each byte a token).",
    ),
    token_dtype: str = typer.Option(
        "uint16", "--token-dtype", help="uint16 (vocabularies up to 65,536) or uint32; train with the same --token-dtype."
    ),
    text_field: str = typer.Option("text", "--text-field", help="The field that holds each document's text."),
    num_proc: int = typer.Option(1, "--num-proc", help="Processes that tokenise documents in parallel."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
) -> None:
    """Tokenise TEXT into OUT, the nanoGPT-style token file `fsdpkit train --data OUT.bin` memory-maps."""
    from fsdpkit.data.documents import is_document_source, open_documents
    from fsdpkit.data.prepare import write_document_tokens
    from fsdpkit.data.tokens import TokenDtype, load_tokenizer, write_token_file

    try:
        dtype = TokenDtype(token_dtype)
    except ValueError:
        raise UsageError(f"unknown --token-dtype {token_dtype!r}: use uint16 or uint32") from None
    if out.suffix != ".bin":
        raise UsageError(f"output {str(out)!r} must end in .bin (train --data reads .bin files as tokens)")
    if is_document_source(str(text)):
        documents = open_documents(str(text), text_field=text_field)
        with count_progress("tokenise", unit="doc") as progress:
            result = write_document_tokens(documents, out, tokenizer=tokenizer, dtype=dtype, num_proc=num_proc, progress=progress)
    else:
        reader = load_tokenizer(tokenizer)
        total = os.path.getsize(text) if text.is_file() else 0
        with byte_progress("tokenise") as progress:
            progress(0, total)
            result = write_token_file(text, out, tokenizer=reader, dtype=dtype, progress=lambda done: progress(done, total))
    if as_json:
        print_json(result)
    else:
        typer.echo(
            f"wrote {result['out']}: "
            + (f"{result['documents']:,} documents, " if "documents" in result else "")
            + f"{result['tokens']:,} tokens ({result['token_dtype']}, "
            f"{format_size(result['bytes'])}), tokenizer {result['tokenizer']}"
        )
