"""Documents tokenised once into a flat token file (`fsdpkit prepare-data`), for data trained on
many times: the same tokens, end-of-text tokens included, that `train --data` packs on the fly.

Documents are tokenised in chunks by `num_proc` processes (in order: the file is the same
whatever `num_proc`), written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataCheckError, UsageError
from .documents import Documents
from .packing import encode_document, end_of_text, shard_documents
from .tokens import ByteTokenizer, HfTokenizer, TokenDtype, load_tokenizer, staged_token_file

DOCUMENTS_PER_CHUNK = 256


@functools.lru_cache(maxsize=1)
def _tokenizer(spec: str) -> ByteTokenizer | HfTokenizer:
    """Loaded once per pool process."""
    return load_tokenizer(spec)


def _encode_chunk(work: tuple[str, list[str]]) -> tuple[int, np.ndarray]:
    spec, texts = work
    tokenizer = _tokenizer(spec)
    eot = end_of_text(tokenizer)
    return len(texts), np.concatenate([encode_document(tokenizer, text, eot) for text in texts])


def _chunks(documents: Documents, spec: str) -> Iterator[tuple[str, list[str]]]:
    texts = (text for _, _, text in shard_documents(documents))
    while chunk := list(islice(texts, DOCUMENTS_PER_CHUNK)):
        yield spec, chunk


def write_document_tokens(
    documents: Documents,
    out: str | Path,
    *,
    tokenizer: str,
    dtype: TokenDtype,
    num_proc: int = 1,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Tokenise every document into the flat token file `out`; `progress(n)` after n documents."""
    if num_proc < 1:
        raise UsageError(f"--num-proc must be >= 1, got {num_proc}")
    reader = load_tokenizer(tokenizer)
    if reader.vocab_size > dtype.limit:
        raise UsageError(f"tokenizer {tokenizer!r} has {reader.vocab_size} tokens, more than {dtype.value} holds: use --token-dtype uint32")
    out = Path(out)
    tokens = largest = count = 0
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_proc) as pool, staged_token_file(out) as sink:
        for documents_done, ids in pool.imap(_encode_chunk, _chunks(documents, tokenizer)):
            largest = max(largest, int(ids.max()))
            if largest >= dtype.limit:
                raise UsageError(f"token id {largest} does not fit {dtype.value}: use --token-dtype uint32")
            sink.write(ids.astype(np.dtype(dtype.value).newbyteorder("<")).tobytes())
            tokens += len(ids)
            count += documents_done
            if progress is not None:
                progress(documents_done)
        if count == 0:
            raise DataCheckError(f"{documents.spec!r} holds no documents")
    return {
        "text": documents.spec,
        "out": str(out),
        "tokenizer": tokenizer,
        "token_dtype": dtype.value,
        "documents": count,
        "tokens": tokens,
        "bytes": tokens * np.dtype(dtype.value).itemsize,
        "largest_token": largest,
    }
