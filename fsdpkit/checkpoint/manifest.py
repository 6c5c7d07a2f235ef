"""The manifest of a sharded checkpoint: schema, JSON round trip, validation, building.

`Manifest.from_json(document, where=...)` accepts only a well-formed manifest (types,
format name and version, safe file names, known dtypes, fragment coverage exactly once,
plan consistent with the tensors, aliases pointing at stored tensors); anything else is a
`DataCheckError` naming `where` and the wrong value. `load_manifest(step_dir)` reads
`manifest.json` and does the same.

`build_manifest(...)` merges the `WrittenFile`s that `writer.write_rank_file` returned on every
rank into a validated `Manifest`; `storage.commit` then writes it. `check_compatible` says
whether a checkpoint fits a model, before any weight is read. JSON layout: see
docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataCheckError
from ..layout import ElementRange
from .format import (FORMAT_NAME, FORMAT_VERSION, LEGACY_STRATEGIES, MANIFEST_NAME, MAX_MANIFEST_BYTES, STRATEGIES,
                     is_known_dtype, is_optimizer_tensor, is_safe_file_name, numel)
from .placement import Placement


@dataclass(frozen=True)
class FragmentEntry:
    file: str  # a file name inside the checkpoint directory
    key: str  # the safetensors key in that file (fsdpkit writes the tensor name)
    start: int
    end: int
    crc32: int  # zlib.crc32 of the fragment's bytes as stored

    @property
    def range(self) -> ElementRange:
        return ElementRange(self.start, self.end)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    fragments: tuple[FragmentEntry, ...]  # sorted by start, tiling [0, numel)

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int


@dataclass(frozen=True)
class Manifest:
    world_size: int
    strategy: str
    placement: Placement
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> stored tensor name
    training_state: dict = field(default_factory=dict)  # opaque JSON from the caller

    def tensor(self, name: str) -> TensorEntry:
        name = self.aliases.get(name, name)
        for entry in self.tensors:
            if entry.name == name:
                return entry
        raise KeyError(f"no tensor {name!r} in the checkpoint")

    def tensor_map(self) -> dict[str, TensorEntry]:
        return {entry.name: entry for entry in self.tensors}

    def to_json(self) -> dict:
        index = {f.name: i for i, f in enumerate(self.files)}
        return {
            "format": FORMAT_NAME, "version": FORMAT_VERSION,
            "world_size": self.world_size, "strategy": self.strategy,
            "plan": self.placement.to_json(self.world_size),
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                         "fragments": [{"file": index[f.file], "key": f.key, "start": f.start, "end": f.end, "crc32": f.crc32}
                                       for f in t.fragments]}
                        for t in self.tensors],
            "aliases": dict(self.aliases),
            "training_state": self.training_state,
        }

    @classmethod
    def from_json(cls, document: object, *, where: str) -> "Manifest":
        return _parse(document, where)


def load_manifest(step_dir: str | Path) -> Manifest:
    path = Path(step_dir) / MANIFEST_NAME
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise DataCheckError(f"{path}: {size} bytes, over the {MAX_MANIFEST_BYTES}-byte manifest limit")
        document = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise DataCheckError(f"{path}: missing; {step_dir} is not an fsdpkit checkpoint") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise DataCheckError(f"{path}: not valid JSON ({error})") from None
    return Manifest.from_json(document, where=str(path))


def _int(value: object, what: str, where: str, *, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise DataCheckError(f"{where}: {what} must be an int >= {minimum}, got {value!r}")
    return value


def _parse(doc: object, where: str) -> Manifest:
    if not isinstance(doc, dict):
        raise DataCheckError(f"{where}: manifest must be a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise DataCheckError(f"{where}: format is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise DataCheckError(f"{where}: format version {doc.get('version')!r} is not supported (this fsdpkit reads {FORMAT_VERSION})")
    world_size = _int(doc.get("world_size"), "world_size", where, minimum=1)
    strategy = LEGACY_STRATEGIES.get(doc.get("strategy"), doc.get("strategy"))
    if strategy not in STRATEGIES:
        raise DataCheckError(f"{where}: strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    files_doc = doc.get("files")
    if not isinstance(files_doc, list):
        raise DataCheckError(f"{where}: files must be a list")
    files = []
    for item in files_doc:
        name = item.get("name") if isinstance(item, dict) else None
        if not is_safe_file_name(name):
            raise DataCheckError(f"{where}: file name {name!r} is not a plain file name inside the checkpoint directory")
        files.append(FileEntry(name, _int(item.get("size"), f"size of {name}", where)))
    tensors = []
    for item in _list(doc.get("tensors"), "tensors", where):
        tensors.append(_parse_tensor(item, files, where))
    aliases = doc.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise DataCheckError(f"{where}: aliases must map names to names")
    training_state = doc.get("training_state", {})
    if not isinstance(training_state, dict):
        raise DataCheckError(f"{where}: training_state must be an object")
    placement = Placement.from_json(doc.get("plan"), world_size=world_size, where=where)
    manifest = Manifest(world_size, strategy, placement, tuple(files), tuple(tensors), dict(aliases), training_state)
    problems = manifest_problems(manifest)
    if problems:
        raise DataCheckError(f"{where}: {problems[0]}" + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    return manifest


def _list(value: object, what: str, where: str) -> list:
    if not isinstance(value, list):
        raise DataCheckError(f"{where}: {what} must be a list, got {type(value).__name__}")
    return value


def _parse_tensor(item: object, files: list[FileEntry], where: str) -> TensorEntry:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise DataCheckError(f"{where}: tensor entry without a name: {str(item)[:80]}")
    name = item["name"]
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise DataCheckError(f"{where}: tensor {name!r} has invalid shape {shape!r}")
    if not is_known_dtype(item.get("dtype")):
        raise DataCheckError(f"{where}: tensor {name!r} has unknown dtype {item.get('dtype')!r}")
    fragments = []
    for frag in _list(item.get("fragments"), f"fragments of {name}", where):
        if not isinstance(frag, dict):
            raise DataCheckError(f"{where}: tensor {name!r} has a fragment that is not an object")
        index = frag.get("file")
        if type(index) is not int or not 0 <= index < len(files):
            raise DataCheckError(f"{where}: tensor {name!r} names file index {index!r}, the manifest lists {len(files)} files")
        key = frag.get("key")
        if not isinstance(key, str):
            raise DataCheckError(f"{where}: tensor {name!r} has a fragment with key {key!r}")
        start = _int(frag.get("start"), f"fragment start of {name}", where)
        end = _int(frag.get("end"), f"fragment end of {name}", where)
        crc = _int(frag.get("crc32"), f"crc32 of a fragment of {name}", where)
        if crc >= 2**32:
            raise DataCheckError(f"{where}: crc32 {crc} of a fragment of {name!r} is not a 32-bit value")
        fragments.append(FragmentEntry(files[index].name, key, start, end, crc))
    fragments.sort(key=lambda f: f.start)
    return TensorEntry(name, tuple(shape), item["dtype"], tuple(fragments))


def manifest_problems(manifest: Manifest) -> list[str]:
    """Every internal inconsistency of a manifest (no file is opened)."""
    problems = []
    names = [t.name for t in manifest.tensors]
    if len(set(names)) != len(names):
        problems.append(f"duplicate tensor names {sorted({n for n in names if names.count(n) > 1})[:3]}")
    file_names = [f.name for f in manifest.files]
    if len(set(file_names)) != len(file_names):
        problems.append(f"duplicate file names {sorted({n for n in file_names if file_names.count(n) > 1})[:3]}")
    used_keys: set[tuple[str, str]] = set()
    for tensor in manifest.tensors:
        position = 0
        for frag in tensor.fragments:
            if frag.start != position or frag.end <= frag.start:
                problems.append(f"tensor {tensor.name!r}: fragment [{frag.start}, {frag.end}) in {frag.file} "
                                f"does not continue at element {position} (gap, overlap or empty)")
                break
            position = frag.end
            if (frag.file, frag.key) in used_keys:
                problems.append(f"tensor {tensor.name!r}: key {frag.key!r} of {frag.file} is used twice")
            used_keys.add((frag.file, frag.key))
        else:
            if position != tensor.numel:
                problems.append(f"tensor {tensor.name!r}: fragments cover [0, {position}) of {tensor.numel} elements")
    stored = set(names)
    for alias, target in manifest.aliases.items():
        if alias in stored or target not in stored:
            problems.append(f"alias {alias!r} -> {target!r} must name a stored tensor and not be one")
    shapes = {t.name: t.shape for t in manifest.tensors}
    for name, shape in manifest.placement.param_shapes().items():
        if shapes.get(name) != shape:
            problems.append(f"plan parameter {name!r} has shape {list(shape)}, the tensor table has "
                            f"{list(shapes[name]) if name in shapes else 'no such tensor'}")
    return problems


def build_manifest(*, world_size: int, strategy: str, placement: Placement, files: list, training_state: dict | None = None,
                   aliases: dict[str, str] | None = None, tensor_order: list[str] | None = None) -> Manifest:
    """Merge every rank's `writer.WrittenFile` into a validated manifest.

    Tensor order: `tensor_order` when given, else model tensors before optimizer tensors,
    each by first appearance in rank order.
    """
    entries, merged, seen_order = [], {}, []
    for written in files:
        entries.append(FileEntry(written.name, written.size))
        for frag in written.fragments:
            if frag.name not in merged:
                merged[frag.name] = (frag.shape, frag.dtype, [])
                seen_order.append(frag.name)
            shape, dtype, fragments = merged[frag.name]
            if frag.shape != shape or frag.dtype != dtype:
                raise ValueError(f"tensor {frag.name!r}: {written.name} says {frag.dtype}{list(frag.shape)}, "
                                 f"another rank said {dtype}{list(shape)}")
            fragments.append(FragmentEntry(written.name, frag.name, frag.range.start, frag.range.end, frag.crc32))
    if tensor_order is not None:
        missing = [n for n in seen_order if n not in tensor_order]
        order = [n for n in tensor_order if n in merged] + missing
    else:
        order = sorted(seen_order, key=is_optimizer_tensor)  # stable
    # a tensor with no elements has no fragments; it still needs an entry, so writers report
    # it with an empty range: drop those fragments here
    tensors = tuple(TensorEntry(n, merged[n][0], merged[n][1],
                                tuple(sorted((f for f in merged[n][2] if f.end > f.start), key=lambda f: f.start)))
                    for n in order)
    manifest = Manifest(world_size, strategy, placement, tuple(entries), tensors, dict(aliases or {}), dict(training_state or {}))
    json.dumps(manifest.training_state)  # fails now, with the caller's traceback, if not JSON-able
    problems = manifest_problems(manifest)
    if problems:
        raise ValueError(f"inconsistent checkpoint fragments: {problems[0]}")
    return manifest


def save_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write `directory/manifest.json` (via a temporary name, fsynced, renamed)."""
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    data = json.dumps(manifest.to_json(), indent=1).encode("utf-8")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


PER_RANK_KEY = "per_rank"  # training_state[PER_RANK_KEY]: state that only makes sense at this world size


def resharded_training_state(state: dict, *, old_world_size: int, new_world_size: int) -> tuple[dict, list[str]]:
    """The training state for another world size: `per_rank` (e.g. per-rank RNG streams or
    data order) is dropped, with a warning, when the world size changes; the rest is kept."""
    if old_world_size == new_world_size or PER_RANK_KEY not in state:
        return dict(state), []
    kept = {k: v for k, v in state.items() if k != PER_RANK_KEY}
    return kept, [f"training_state.{PER_RANK_KEY} (per-rank state for {old_world_size} ranks) dropped: "
                  f"it cannot be resharded to {new_world_size} ranks"]


def check_compatible(manifest: Manifest, expected: dict[str, tuple[int, ...]], *, strict: bool = True,
                     where: str = "checkpoint") -> list[str]:
    """Does the checkpoint fit a model? `expected` maps each tensor the loader wants (model
    parameters and buffers, `optim.<state>.<param>` names) to its shape. A missing or extra
    model tensor, or a shape difference, is a `DataCheckError` naming the first offenders;
    missing optimizer state is fatal only with `strict`. Returns the missing optimizer tensors."""
    stored = {t.name: t.shape for t in manifest.tensors}
    for alias, target in manifest.aliases.items():
        stored.setdefault(alias, stored.get(target))
    wrong = [f"{name} {list(stored[name])} vs model {list(shape)}" for name, shape in expected.items()
             if name in stored and stored[name] is not None and tuple(stored[name]) != tuple(shape)]
    if wrong:
        raise DataCheckError(f"{where}: shapes differ from the model: {', '.join(wrong[:3])}"
                             + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    missing_model = [n for n in expected if n not in stored and not is_optimizer_tensor(n)]
    if missing_model:
        raise DataCheckError(f"{where}: missing model tensors {missing_model[:3]}"
                             + (f" (+{len(missing_model) - 3} more)" if len(missing_model) > 3 else "")
                             + " (a checkpoint of another model?)")
    extra = [n for n in stored if n not in expected and not is_optimizer_tensor(n) and n not in manifest.aliases]
    if extra:
        raise DataCheckError(f"{where}: tensors the model does not have: {extra[:3]}"
                             + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else "") + " (a checkpoint of another model?)")
    missing_optim = [n for n in expected if n not in stored and is_optimizer_tensor(n)]
    if missing_optim and strict:
        raise DataCheckError(f"{where}: missing optimizer state {missing_optim[:3]}"
                             + (f" (+{len(missing_optim) - 3} more)" if len(missing_optim) > 3 else "")
                             + "; pass --no-strict to start the optimizer fresh")
    return missing_optim
