"""The manifest of a sharded checkpoint (docs/checkpoint-format.md's "manifest.json" and
"Version 1"): schema, JSON round trip, validation (no torch). Only a well-formed manifest of
either version is accepted; anything else is a one-line `DataCheckError` naming `where` and the
wrong value. `check_compatible` says whether a checkpoint fits a model, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...dtypes import is_known_dtype
from ...errors import DataCheckError
from ...flat_layout import FlatLayout
from ..core.files import read_regular, replace_file, source_path
from ..core.names import is_optimizer_tensor, is_safe_file_name, parse_json
from .names import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LEGACY_STRATEGIES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    RANK_FILE_RULE,
    READ_VERSIONS,
    STRATEGIES,
)
from .placement import Placement, ShardLayout, TensorSpec, short

MAX_WORLD_SIZE = 1 << 24


@dataclass(frozen=True)
class FragmentEntry:  # a fragment a v1 manifest lists
    file: str  # a file name inside the checkpoint directory
    key: str  # the safetensors key in that file
    start: int
    end: int
    crc32: int  # zlib.crc32 of the fragment's bytes as stored


@dataclass(frozen=True)
class V1Listing:
    """What a v1 manifest lists instead of deriving: every file with its size, every fragment."""

    files: tuple[tuple[str, int], ...]  # (name, size)
    fragments: dict[str, tuple[FragmentEntry, ...]]  # tensor name -> fragments sorted by start


@dataclass(frozen=True)
class Manifest:
    shard_factor: int  # the number of shards and rank files (JSON key "world_size")
    strategy: str
    placement: Placement
    tensors: tuple[TensorSpec, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> stored tensor name
    training_state: dict = field(default_factory=dict)  # opaque JSON from the caller
    run_id: str | None = None  # the run that wrote it (pruning never deletes another run's checkpoints)
    version: int = FORMAT_VERSION
    listing: V1Listing | None = None  # version 1 only
    _index: dict[str, int] = field(init=False, repr=False, compare=False)  # tensor name -> position

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {t.name: i for i, t in enumerate(self.tensors)})

    def tensor_index(self, name: str) -> int:
        """Position of `name` (an alias resolves to its stored tensor) in the tensor table."""
        try:
            return self._index[self.aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in the checkpoint") from None

    def layout(self) -> ShardLayout:
        """Where every fragment lives (version 2)."""
        return ShardLayout(self.placement, list(self.tensors), self.shard_factor)

    def to_json(self) -> dict:
        if self.listing is not None:
            raise ValueError("version 1 manifests are read, never written")
        document = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "world_size": self.shard_factor,
            "strategy": self.strategy,
            "files": RANK_FILE_RULE,
            "placement": self.placement.to_json(),
            "tensors": [[t.name, t.dtype, list(t.shape)] for t in self.tensors],
            "aliases": dict(self.aliases),
            "training_state": self.training_state,
        }
        if self.run_id is not None:
            document["run"] = self.run_id
        return document

    def to_bytes(self) -> bytes:
        """The JSON, one tensor and one unit per line."""
        lines = []
        for key, value in self.to_json().items():
            if key == "tensors" or (key == "placement" and value.get("units")):
                items = value if key == "tensors" else value["units"]
                body = ",\n  ".join(json.dumps(item) for item in items)
                text = f"[\n  {body}\n ]" if items else "[]"
                if key == "placement":
                    text = '{"kind": "flat", "units": ' + text + "}"
            else:
                text = json.dumps(value)
            lines.append(f" {json.dumps(key)}: {text}")
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")

    @classmethod
    def from_json(cls, document: object, *, where: str) -> Manifest:
        if not isinstance(document, dict):
            raise DataCheckError(f"{where}: manifest must be a JSON object")
        if document.get("format") != FORMAT_NAME:
            raise DataCheckError(f"{where}: format is {short(document.get('format'))}, expected {FORMAT_NAME!r}")
        version = document.get("version")
        if version not in READ_VERSIONS or type(version) is not int:
            raise DataCheckError(
                f"{where}: format version {short(version)} is not supported (this fsdpkit reads {', '.join(map(str, READ_VERSIONS))})"
            )
        return _parse_v2(document, where) if version == 2 else _parse_v1(document, where)


def load_manifest(step_dir: str | Path) -> Manifest:
    path = source_path(step_dir) / MANIFEST_NAME
    if not path.exists() and not path.is_symlink():
        raise DataCheckError(f"{path}: missing; {step_dir} is not an fsdpkit checkpoint")
    raw = read_regular(path, MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DataCheckError(f"{path}: over the {MAX_MANIFEST_BYTES}-byte manifest limit")
    return Manifest.from_json(parse_json(raw, where=str(path), what="manifest"), where=str(path))


def save_manifest(directory: str | Path, manifest: Manifest) -> Path:
    path = source_path(directory) / MANIFEST_NAME
    replace_file(path, manifest.to_bytes(), path.with_name(MANIFEST_NAME + ".tmp"))
    return path


def _int(value: object, what: str, where: str, *, minimum: int = 0, maximum: int = 1 << 62) -> int:
    if type(value) is not int or not minimum <= value <= maximum:
        raise DataCheckError(f"{where}: {what} must be an int in [{minimum}, {maximum}], got {short(value)}")
    return value


def _common(doc: dict, where: str) -> tuple[int, str, dict, dict]:
    world_size = _int(doc.get("world_size"), "world_size", where, minimum=1, maximum=MAX_WORLD_SIZE)
    strategy = doc.get("strategy")
    strategy = LEGACY_STRATEGIES.get(strategy, strategy) if isinstance(strategy, str) else strategy
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise DataCheckError(f"{where}: strategy {short(strategy)} is not one of {', '.join(STRATEGIES)}")
    aliases = doc.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise DataCheckError(f"{where}: aliases must map names to names")
    training_state = doc.get("training_state", {})
    if not isinstance(training_state, dict):
        raise DataCheckError(f"{where}: training_state must be an object")
    return world_size, strategy, aliases, training_state


def _tensor_spec(name: object, dtype: object, shape: object, where: str) -> TensorSpec:
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise DataCheckError(f"{where}: tensor name {short(name)} is not a non-empty string")
    if not is_known_dtype(dtype):
        raise DataCheckError(f"{where}: tensor {name!r} has unknown dtype {short(dtype)}")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 48 for d in shape):
        raise DataCheckError(f"{where}: tensor {name!r} has invalid shape {short(shape)}")
    spec = TensorSpec(name, dtype, tuple(shape))
    if spec.numel >= 1 << 48:
        raise DataCheckError(f"{where}: tensor {name!r} of shape {shape} is too large")
    return spec


def _check_table(tensors: list[TensorSpec], aliases: dict[str, str], where: str) -> None:
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise DataCheckError(f"{where}: duplicate tensor names {sorted({n for n in names if names.count(n) > 1})[:3]}")
    stored = set(names)
    for alias, target in aliases.items():
        if alias in stored or target not in stored:
            raise DataCheckError(f"{where}: alias {alias!r} -> {target!r} must name a stored tensor and not be one")


def _parse_v2(doc: dict, where: str) -> Manifest:
    known = {"format", "version", "world_size", "strategy", "files", "placement", "tensors", "aliases", "training_state", "run"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise DataCheckError(f"{where}: unknown manifest fields {unknown[:3]}")
    world_size, strategy, aliases, training_state = _common(doc, where)
    if doc.get("files") != RANK_FILE_RULE:
        raise DataCheckError(f"{where}: file naming rule {short(doc.get('files'))} is not {RANK_FILE_RULE!r}")
    table = doc.get("tensors")
    if not isinstance(table, list):
        raise DataCheckError(f"{where}: tensors must be a list of [name, dtype, shape]")
    tensors = []
    for item in table:
        if not isinstance(item, list) or len(item) != 3:
            raise DataCheckError(f"{where}: tensor entry {short(item)} is not [name, dtype, shape]")
        name, dtype, shape = item
        tensors.append(_tensor_spec(name, dtype, shape, where))
    _check_table(tensors, aliases, where)
    placement = Placement.from_json(doc.get("placement"), shapes={t.name: t.shape for t in tensors}, where=where)
    run_id = doc.get("run")
    if run_id is not None and not (isinstance(run_id, str) and len(run_id) <= 64):
        raise DataCheckError(f"{where}: run must be a short string, got {short(run_id)}")
    return Manifest(world_size, strategy, placement, tuple(tensors), dict(aliases), training_state, run_id)


def _parse_v1(doc: dict, where: str) -> Manifest:
    world_size, strategy, aliases, training_state = _common(doc, where)
    files_doc = doc.get("files")
    if not isinstance(files_doc, list):
        raise DataCheckError(f"{where}: files must be a list")
    files = []
    for item in files_doc:
        name = item.get("name") if isinstance(item, dict) else None
        if not is_safe_file_name(name):
            raise DataCheckError(f"{where}: file name {short(name)} is not a plain file name inside the checkpoint directory")
        files.append((name, _int(item.get("size"), f"size of {name}", where)))
    table = doc.get("tensors")
    if not isinstance(table, list):
        raise DataCheckError(f"{where}: tensors must be a list")
    tensors, fragments = [], {}
    for item in table:
        if not isinstance(item, dict):
            raise DataCheckError(f"{where}: tensor entry {short(item)} is not an object")
        spec = _tensor_spec(item.get("name"), item.get("dtype"), item.get("shape"), where)
        tensors.append(spec)
        fragments[spec.name] = _v1_fragments(spec, item.get("fragments"), files, where)
    _check_table(tensors, aliases, where)
    placement = _v1_placement(doc.get("plan"), world_size, where)
    shapes = {t.name: t.shape for t in tensors}
    for name, shape in placement.param_shapes().items():
        if shapes.get(name) != shape:
            raise DataCheckError(
                f"{where}: plan parameter {name!r} has shape {list(shape)}, the tensor table has "
                f"{list(shapes[name]) if name in shapes else 'no such tensor'}"
            )
    names = [name for name, _ in files]
    if len(set(names)) != len(names):
        raise DataCheckError(f"{where}: duplicate file names {sorted({n for n in names if names.count(n) > 1})[:3]}")
    used: set[tuple[str, str]] = set()
    for frags in fragments.values():
        for frag in frags:
            if (frag.file, frag.key) in used:
                raise DataCheckError(f"{where}: key {frag.key!r} of {frag.file} is used twice")
            used.add((frag.file, frag.key))
    listing = V1Listing(tuple(files), fragments)
    return Manifest(world_size, strategy, placement, tuple(tensors), dict(aliases), training_state, version=1, listing=listing)


def _v1_fragments(spec: TensorSpec, frags: object, files: list[tuple[str, int]], where: str) -> tuple[FragmentEntry, ...]:
    if not isinstance(frags, list):
        raise DataCheckError(f"{where}: fragments of {spec.name} must be a list")
    result = []
    for frag in frags:
        if not isinstance(frag, dict):
            raise DataCheckError(f"{where}: tensor {spec.name!r} has a fragment that is not an object")
        index = frag.get("file")
        if type(index) is not int or not 0 <= index < len(files):
            raise DataCheckError(f"{where}: tensor {spec.name!r} names file index {short(index)}, the manifest lists {len(files)} files")
        key = frag.get("key")
        if not isinstance(key, str):
            raise DataCheckError(f"{where}: tensor {spec.name!r} has a fragment with key {short(key)}")
        start = _int(frag.get("start"), f"fragment start of {spec.name}", where)
        end = _int(frag.get("end"), f"fragment end of {spec.name}", where)
        crc = _int(frag.get("crc32"), f"crc32 of a fragment of {spec.name}", where, maximum=2**32 - 1)
        result.append(FragmentEntry(files[index][0], key, start, end, crc))
    result.sort(key=lambda f: f.start)
    position = 0
    for frag in result:
        if frag.start != position or frag.end <= frag.start:
            raise DataCheckError(
                f"{where}: tensor {spec.name!r}: fragment [{frag.start}, {frag.end}) in {frag.file} "
                f"does not continue at element {position} (gap, overlap or empty)"
            )
        position = frag.end
    if position != spec.numel:
        raise DataCheckError(f"{where}: tensor {spec.name!r}: fragments cover [0, {position}) of {spec.numel} elements")
    return tuple(result)


def _v1_placement(document: object, world_size: int, where: str) -> Placement:
    """A v1 "plan": {"kind": "even"} or {"kind": "flat", "units": [{"params": [{"name", "shape"}], "padding"}]}."""
    if not isinstance(document, dict) or document.get("kind") not in ("flat", "even"):
        raise DataCheckError(f"{where}: plan must be {{'kind': 'flat'|'even', ...}}, got {short(document)}")
    if document["kind"] == "even":
        return Placement.even()
    units_doc = document.get("units")
    if not isinstance(units_doc, list):
        raise DataCheckError(f"{where}: flat plan needs a list of units, got {short(units_doc)}")
    units, seen = [], set()
    for index, unit in enumerate(units_doc):
        params = unit.get("params") if isinstance(unit, dict) else None
        if not isinstance(params, list):
            raise DataCheckError(f"{where}: plan unit {index} has no list of params")
        spec = []
        for param in params:
            name, shape = (param.get("name"), param.get("shape")) if isinstance(param, dict) else (None, None)
            if not isinstance(name, str) or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise DataCheckError(f"{where}: plan unit {index} has an invalid param entry {short(param)}")
            if name in seen:
                raise DataCheckError(f"{where}: parameter {name!r} appears twice in the plan")
            seen.add(name)
            spec.append((name, tuple(shape)))
        padding = FlatLayout.from_shapes(spec, world_size).padding
        if unit.get("padding") != padding:
            raise DataCheckError(
                f"{where}: plan unit {index} records padding {short(unit.get('padding'))}, world size {world_size} gives {padding}"
            )
        units.append(spec)
    return Placement.flat(units)


def check_compatible(
    manifest: Manifest, expected: dict[str, tuple[int, ...]], *, strict: bool = True, where: str = "checkpoint"
) -> list[str]:
    """Does the checkpoint fit a model? `expected` maps each tensor the loader wants (model
    parameters and buffers, `optim.<state>.<param>` names) to its shape. A missing or extra
    model tensor, or a shape difference, is a `DataCheckError` naming the first offenders;
    missing optimizer state is fatal only with `strict`. Returns the missing optimizer tensors."""
    stored: dict[str, tuple[int, ...] | None] = {t.name: t.shape for t in manifest.tensors}
    for alias, target in manifest.aliases.items():
        stored.setdefault(alias, stored.get(target))
    wrong = [
        f"{name} {list(have)} vs model {list(shape)}"
        for name, shape in expected.items()
        if (have := stored.get(name)) is not None and tuple(have) != tuple(shape)
    ]
    if wrong:
        raise DataCheckError(f"{where}: shapes differ from the model: {', '.join(wrong[:3])}{_more(wrong)}")
    missing_model = [n for n in expected if n not in stored and not is_optimizer_tensor(n)]
    if missing_model:
        raise DataCheckError(f"{where}: missing model tensors {missing_model[:3]}{_more(missing_model)} (a checkpoint of another model?)")
    extra = [n for n in stored if n not in expected and not is_optimizer_tensor(n) and n not in manifest.aliases]
    if extra:
        raise DataCheckError(f"{where}: tensors the model does not have: {extra[:3]}{_more(extra)} (a checkpoint of another model?)")
    missing_optim = [n for n in expected if n not in stored and is_optimizer_tensor(n)]
    if missing_optim and strict:
        raise DataCheckError(
            f"{where}: missing optimizer state {missing_optim[:3]}{_more(missing_optim)}; "
            "pass --no-strict to start that state fresh (a parameter the saved run did not train?)"
        )
    return missing_optim


def _more(items: list) -> str:
    return f" (+{len(items) - 3} more)" if len(items) > 3 else ""


PER_RANK_KEY = "per_rank"  # training_state[PER_RANK_KEY]: state that only makes sense at this world size


def resharded_training_state(state: dict, *, old_world_size: int, new_world_size: int) -> tuple[dict, list[str]]:
    """The training state for another world size: `per_rank` (e.g. per-rank RNG streams or
    data order) is dropped, with a warning, when the world size changes; the rest is kept."""
    if old_world_size == new_world_size or PER_RANK_KEY not in state:
        return dict(state), []
    kept = {k: v for k, v in state.items() if k != PER_RANK_KEY}
    return kept, [
        f"training_state.{PER_RANK_KEY} (per-rank state for {old_world_size} ranks) dropped: "
        f"it cannot be resharded to {new_world_size} ranks"
    ]
