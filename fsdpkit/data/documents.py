"""Documents (no torch, no process group): the text of each row of a dataset, shard by shard.

    documents = open_documents("corpus.jsonl", text_field="text")
    for text in documents.shards[0].texts(start_row=0): ...

What `--data` names, besides a `.bin` token file, `synthetic` or a plain text file:

- `*.jsonl` / `*.json`: one JSON object per line (read with the standard library);
- `*.parquet`: one file, a directory of them, or a glob (pyarrow, a row group at a time);
- a directory of such files, or one written by `datasets`' `save_to_disk` ([data] extra);
- a Hugging Face Hub dataset name (user/name[@revision]) whose files are already in the local
  Hub cache: its parquet (else jsonl) files, found with `huggingface_hub` in local-files-only
  mode, so no network is ever used.

Shards come in a fixed order (sorted file names), so a position (shard, row) names the same
document every time. Every error is one line naming the file, the shard or the line.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..errors import DataCheckError, UsageError, install_hint

JSON_SUFFIXES = (".jsonl", ".json")
ROWS_PER_READ = 1024


class Shard(Protocol):
    name: str

    def texts(self, start_row: int = 0) -> Iterator[str]:
        """The text of each row from `start_row` on."""
        ...


def is_document_source(spec: str) -> bool:
    """Whether `--data spec` names documents (else: synthetic, a .bin or a plain text file)."""
    if spec.endswith(JSON_SUFFIXES) or spec.endswith(".parquet"):
        return True
    if os.path.isdir(spec):
        return True
    return spec != "synthetic" and not os.path.exists(spec) and not spec.endswith((".bin", ".txt"))  # a Hub name


def datasets_module() -> Any:
    try:
        import datasets
    except ImportError:
        raise UsageError(f"this --data needs Hugging Face datasets: {install_hint('data')}") from None
    return datasets


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"parquet --data needs pyarrow: {install_hint('data')}") from None
    return pq


def _text_of(value: Any, field: str, where: str, fields: list[str]) -> str:
    if isinstance(value, str):
        return value
    if value is None and field not in fields:
        raise DataCheckError(f"{where} has no text field {field!r}; its fields: {', '.join(fields) or '(none)'} (use --text-field)")
    raise DataCheckError(f"{where}: field {field!r} is {type(value).__name__}, not text (use --text-field)")


@dataclass(frozen=True)
class JsonLinesShard:
    path: str
    field: str

    @property
    def name(self) -> str:
        return self.path

    def texts(self, start_row: int = 0) -> Iterator[str]:
        row = 0
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                if row >= start_row:
                    yield self._text(line, number)
                row += 1

    def _text(self, line: bytes, number: int) -> str:
        where = f"{self.path} line {number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise DataCheckError(f"{where} is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise DataCheckError(f"{where} is a JSON {type(record).__name__}, not an object with a {self.field!r} field")
        return _text_of(record.get(self.field), self.field, where, list(record))


@dataclass(frozen=True)
class ParquetShard:
    path: str
    field: str

    @property
    def name(self) -> str:
        return self.path

    def _open(self) -> Any:
        pq = _pyarrow_parquet()
        try:
            return pq.ParquetFile(self.path)
        except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise DataCheckError(f"parquet shard {self.path} cannot be read: {error}") from None

    def check(self) -> None:
        schema = self._open().schema_arrow
        if self.field not in schema.names:
            raise DataCheckError(
                f"parquet shard {self.path} has no text field {self.field!r}; its fields: {', '.join(schema.names)} (use --text-field)"
            )
        kind = str(schema.field(self.field).type)
        if kind not in ("string", "large_string", "string_view"):
            raise DataCheckError(f"parquet shard {self.path}: field {self.field!r} is {kind}, not text (use --text-field)")

    def texts(self, start_row: int = 0) -> Iterator[str]:
        self.check()
        handle = self._open()
        first = 0
        for group in range(handle.num_row_groups):
            rows = handle.metadata.row_group(group).num_rows
            if first + rows > start_row:
                try:
                    column = handle.read_row_group(group, columns=[self.field]).column(0)
                except Exception as error:
                    raise DataCheckError(f"parquet shard {self.path} row group {group} cannot be read: {error}") from None
                for value in column.slice(max(0, start_row - first)).to_pylist():
                    yield _text_of(value, self.field, f"parquet shard {self.path}", [self.field])
            first += rows


@dataclass(frozen=True)
class DatasetShard:
    """A `datasets.Dataset` (from save_to_disk or the local Hub cache), one shard."""

    name: str
    dataset: Any
    field: str

    def texts(self, start_row: int = 0) -> Iterator[str]:
        for first in range(start_row, len(self.dataset), ROWS_PER_READ):
            for value in self.dataset[first : first + ROWS_PER_READ][self.field]:
                yield _text_of(value, self.field, f"dataset {self.name}", [self.field])


@dataclass(frozen=True)
class Documents:
    spec: str
    text_field: str
    shards: tuple[Shard, ...]


def _parquet_files(spec: str) -> list[str]:
    if os.path.isdir(spec):
        return sorted(glob.glob(os.path.join(spec, "**", "*.parquet"), recursive=True))
    if any(c in spec for c in "*?["):
        return sorted(glob.glob(spec, recursive=True))
    if not os.path.isfile(spec):
        raise UsageError(f"--data {spec!r}: no such file")
    return [spec]


def _jsonl_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "**", "*.jsonl"), recursive=True))


def _hub_documents(spec: str, text_field: str) -> Documents:
    """A Hub dataset from the local cache: its parquet files, else its jsonl files."""
    snapshot = cached_hub_dataset(spec)
    if not (_parquet_files(snapshot) or _jsonl_files(snapshot)):
        raise DataCheckError(f"Hub dataset {spec!r} (cached in {snapshot}) holds no .parquet or .jsonl files")
    return replace(open_documents(snapshot, text_field=text_field), spec=spec)


def _first_split(loaded: Any, spec: str) -> Any:
    if hasattr(loaded, "keys") and not hasattr(loaded, "features"):  # a DatasetDict
        splits = list(loaded.keys())
        if not splits:
            raise DataCheckError(f"--data {spec!r} holds no splits")
        return loaded["train" if "train" in splits else splits[0]]
    return loaded


def _saved_dataset(spec: str) -> Any:
    datasets = datasets_module()
    try:
        return _first_split(datasets.load_from_disk(spec), spec)
    except FileNotFoundError as error:
        raise UsageError(f"--data {spec!r} is not a datasets directory (save_to_disk) nor holds .parquet/.jsonl: {error}") from None


def cached_hub_dataset(spec: str) -> str:
    """The local snapshot directory of Hub dataset `spec` (user/name[@revision]), from the cache only."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise UsageError(f"a Hub dataset name needs huggingface_hub: {install_hint('data')}") from None
    repo, _, revision = spec.partition("@")
    try:
        return snapshot_download(repo, repo_type="dataset", revision=revision or None, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise UsageError(
            f"--data {spec!r}: no such file, and no Hub dataset of that name in the local cache (no network is used)"
        ) from None


def _dataset_shard(spec: str, field: str) -> DatasetShard:
    dataset = _saved_dataset(spec)
    features = dict(dataset.features)
    if field not in features:
        raise DataCheckError(f"dataset {spec} has no text field {field!r}; its fields: {', '.join(features)} (use --text-field)")
    dtype = getattr(features[field], "dtype", type(features[field]).__name__)
    if dtype not in ("string", "large_string"):
        raise DataCheckError(f"dataset {spec}: field {field!r} is {dtype}, not text (use --text-field)")
    return DatasetShard(spec, dataset, field)


def open_documents(spec: str, *, text_field: str = "text") -> Documents:
    """The shards `spec` names; schema errors (a missing or non-text field) are raised here for
    parquet and datasets, on the first bad row for jsonl."""
    shards: list[Any]
    if not os.path.exists(spec) and not any(c in spec for c in "*?["):
        return _hub_documents(spec, text_field)
    if spec.endswith(JSON_SUFFIXES):
        if not os.path.isfile(spec):
            raise UsageError(f"--data {spec!r}: no such file")
        shards = [JsonLinesShard(spec, text_field)]
    elif spec.endswith(".parquet") or (os.path.isdir(spec) and _parquet_files(spec)):
        files = _parquet_files(spec)
        if not files:
            raise UsageError(f"--data {spec!r}: no .parquet files match")
        shards = [ParquetShard(path, text_field) for path in files]
        for shard in shards:
            shard.check()
    elif os.path.isdir(spec) and _jsonl_files(spec):
        shards = [JsonLinesShard(path, text_field) for path in _jsonl_files(spec)]
    else:
        shards = [_dataset_shard(spec, text_field)]
    return Documents(spec, text_field, tuple(shards))
