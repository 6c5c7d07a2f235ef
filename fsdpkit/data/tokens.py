"""Token data (no torch, no process group): tokenizers, flat token files, and writing them.

- Tokenizers by spec: `bytes` (each byte a token: 256 of them) or `hf:DIR`, a transformers
  tokenizer directory (AutoTokenizer, local files only, no special tokens added; needs the
  [hf] extra).
- A flat token file (`.bin`, nanoGPT's format) is the tokens as raw little-endian unsigned
  integers, uint16 (vocabularies up to 65,536) or uint32, no header. `open_token_file`
  memory-maps it: a batch reads only its rows, no process loads the whole file.
- `write_token_file` (`fsdpkit prepare-data`) tokenises a text file in blocks of about 1 MiB
  that end at a line break, appending each block's tokens to the output (written under a
  temporary name, renamed when complete), so memory stays bounded whatever the text's size.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import DataCheckError, RunError, UsageError

BLOCK_BYTES = 1 << 20


class TokenDtype(enum.StrEnum):
    UINT16 = "uint16"
    UINT32 = "uint32"

    @property
    def limit(self) -> int:
        """Token ids must be below this."""
        return 1 << (16 if self is TokenDtype.UINT16 else 32)


class ByteTokenizer:
    spec = "bytes"
    vocab_size = 256

    def encode(self, block: bytes):
        import numpy as np

        return np.frombuffer(block, dtype=np.uint8)


class HfTokenizer:
    """A transformers tokenizer directory (tokenizer.json, or vocab.json + merges.txt, ...)."""

    def __init__(self, spec: str, directory: str):
        from ..models.hf import transformers_module

        transformers = transformers_module()
        self.spec = spec
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as error:  # a missing or malformed tokenizer is the user's input
            raise UsageError(f"tokenizer {spec!r}: transformers cannot load it: {error}") from None
        self._tokenizer.model_max_length = sys.maxsize  # whole texts, no "sequence too long" warning
        self.vocab_size = len(self._tokenizer)
        self.eos_token_id: int | None = self._tokenizer.eos_token_id

    def encode(self, block: bytes):
        import numpy as np

        ids = self._tokenizer.encode(block.decode("utf-8", errors="replace"), add_special_tokens=False)
        return np.asarray(ids, dtype=np.int64)


def load_tokenizer(spec: str) -> ByteTokenizer | HfTokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        directory = spec[3:]
        if not os.path.isdir(directory):
            raise UsageError(f"tokenizer {spec!r}: {directory!r} is not a directory")
        return HfTokenizer(spec, directory)
    raise UsageError(f"unknown tokenizer {spec!r}: use bytes or hf:DIR (a transformers tokenizer directory)")


def read_file(path: str | Path, what: str = "data file") -> bytes:
    if os.path.isdir(path):
        raise UsageError(f"{what} {str(path)!r} is a directory, not a file")
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as error:
        raise UsageError(f"cannot read {what} {str(path)!r}: {error.strerror or error}") from None


def text_tokens(path: str | Path, tokenizer: ByteTokenizer | HfTokenizer):
    """All the tokens of a text file, in memory (for large texts, prepare a .bin file)."""
    return tokenizer.encode(read_file(path))


def open_token_file(path: str | Path, dtype: TokenDtype):
    """A flat token file, memory-mapped read-only (a numpy array of `dtype`)."""
    import numpy as np

    if os.path.isdir(path):
        raise UsageError(f"data path {str(path)!r} is a directory, not a token file")
    try:
        size = os.path.getsize(path)
    except OSError as error:
        raise UsageError(f"cannot read data file {str(path)!r}: {error.strerror or error}") from None
    itemsize = np.dtype(dtype.value).itemsize
    if size % itemsize:
        raise DataCheckError(
            f"token file {str(path)!r} has {size} bytes, not a whole number of {dtype.value} tokens (written with another --token-dtype?)"
        )
    if size == 0:
        raise DataCheckError(f"token file {str(path)!r} is empty")
    return np.memmap(path, dtype=np.dtype(dtype.value).newbyteorder("<"), mode="r")


def _blocks(handle, block_bytes: int):
    """Blocks of about `block_bytes` that end at a line break (the last one wherever the file ends)."""
    carry = b""
    while True:
        data = handle.read(block_bytes)
        if not data:
            if carry:
                yield carry
            return
        data = carry + data
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            carry = data
            continue
        carry = data[cut:]
        yield data[:cut]


def write_token_file(
    text: str | Path,
    out: str | Path,
    *,
    tokenizer: ByteTokenizer | HfTokenizer,
    dtype: TokenDtype,
    progress: Callable[[int], None] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, Any]:
    """Tokenise `text` into the flat token file `out`; returns a JSON-able summary."""
    import numpy as np

    if tokenizer.vocab_size > dtype.limit:
        raise UsageError(
            f"tokenizer {tokenizer.spec!r} has {tokenizer.vocab_size} tokens, more than {dtype.value} holds: use --token-dtype uint32"
        )
    if os.path.isdir(text):
        raise UsageError(f"text {str(text)!r} is a directory, not a file")
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"output {str(out)!r} is a directory, expected a file name")
    try:
        source = open(text, "rb")
    except OSError as error:
        raise UsageError(f"cannot read text {str(text)!r}: {error.strerror or error}") from None
    tokens = largest = 0
    with source, staged_token_file(out) as sink:
        for block in _blocks(source, block_bytes):
            ids = tokenizer.encode(block)
            if len(ids):
                largest = max(largest, int(ids.max()))
                if largest >= dtype.limit:
                    raise UsageError(f"token id {largest} does not fit {dtype.value}: use --token-dtype uint32")
                sink.write(ids.astype(np.dtype(dtype.value).newbyteorder("<")).tobytes())
                tokens += len(ids)
            if progress is not None:
                progress(len(block))
    return {
        "text": str(text),
        "out": str(out),
        "tokenizer": tokenizer.spec,
        "token_dtype": dtype.value,
        "tokens": tokens,
        "bytes": tokens * np.dtype(dtype.value).itemsize,
        "largest_token": largest,
    }


@contextmanager
def staged_token_file(out: Path) -> Iterator[BinaryIO]:
    """A token file written under a temporary name beside `out`, synced and renamed to `out` when
    the block completes; removed, and `out` untouched, when it fails."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as sink:
            yield sink
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(tmp, out)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write {str(out)!r}: {error.strerror or error}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
