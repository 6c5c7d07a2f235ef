"""How a model's weights are handed to Hugging Face transformers (no torch, no I/O; the format:
docs/checkpoint-format.md, "Export to transformers"): a model source's `HfExport` says what
`convert --to full` writes so that `AutoModelForCausalLM.from_pretrained(OUT)` loads it. It
travels in the training state (`EXPORT_STATE_KEY`) through reshard and convert; a full file
written with a layout records it (`LAYOUT_METADATA_KEY`) so reading it back restores fsdpkit's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ...dtypes import dtype_info
from ...errors import DataCheckError
from .names import is_safe_file_name

EXPORT_STATE_KEY = "export"  # training_state["export"]: HfExport.to_json()
LAYOUT_METADATA_KEY = "fsdpkit_export_layout"  # full files' __metadata__: ExportLayout.to_json() as a string
CONFIG_NAME = "config.json"
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ExportLayout:
    """fsdpkit names -> transformers names: `prefix` added to every name but `unprefixed`;
    2-D weights whose name ends with one of `transposed` are stored transposed."""

    prefix: str = ""
    unprefixed: tuple[str, ...] = ()
    transposed: tuple[str, ...] = ()

    @property
    def is_identity(self) -> bool:
        return not self.prefix and not self.transposed

    def exported_name(self, name: str) -> str:
        return name if not self.prefix or name in self.unprefixed else self.prefix + name

    def original_name(self, exported: str) -> str | None:
        """The fsdpkit name of an exported tensor (None: not one this layout writes)."""
        if not self.prefix or exported in self.unprefixed:
            return exported
        return exported[len(self.prefix) :] if exported.startswith(self.prefix) else None

    def is_transposed(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether tensor `name` (fsdpkit's name) is stored transposed."""
        return len(shape) == 2 and any(name.endswith(suffix) for suffix in self.transposed)

    def to_json(self) -> dict:
        return {"prefix": self.prefix, "unprefixed": list(self.unprefixed), "transposed": list(self.transposed)}

    @classmethod
    def from_json(cls, document: object, *, where: str) -> ExportLayout:
        if not isinstance(document, dict):
            raise DataCheckError(f"{where}: export layout must be an object")
        prefix, unprefixed, transposed = document.get("prefix", ""), document.get("unprefixed", []), document.get("transposed", [])
        if not isinstance(prefix, str) or not _strings(unprefixed) or not _strings(transposed):
            raise DataCheckError(f"{where}: export layout needs a string prefix and lists of names")
        return cls(prefix, tuple(unprefixed), tuple(transposed))


@dataclass(frozen=True)
class HfExport:
    """What `convert --to full` writes for transformers: `config` as config.json, `files`
    copied from `files_from` when they are there, weights renamed/transposed by `layout`."""

    config: dict
    layout: ExportLayout = field(default_factory=ExportLayout)
    files_from: str | None = None
    files: tuple[str, ...] = ()

    def config_for(self, weight_dtype: str | None) -> dict:
        """config.json, saying the dtype the weights were written in."""
        config = dict(self.config)
        if weight_dtype is not None and dtype_info(weight_dtype).castable:
            config["dtype"] = dtype_info(weight_dtype).torch_name
            config.pop("torch_dtype", None)
        return config

    def to_json(self) -> dict:
        return {"config": self.config, "layout": self.layout.to_json(), "files_from": self.files_from, "files": list(self.files)}

    @classmethod
    def from_json(cls, document: object, *, where: str) -> HfExport:
        if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
            raise DataCheckError(f"{where}: training state '{EXPORT_STATE_KEY}' must be an object with a config object")
        files_from, files = document.get("files_from"), document.get("files", [])
        if files_from is not None and not isinstance(files_from, str):
            raise DataCheckError(f"{where}: export files_from must be a path")
        if not _strings(files) or not all(is_safe_file_name(name) for name in files):
            raise DataCheckError(f"{where}: export files must be plain file names, got {str(files)[:80]}")
        return cls(document["config"], ExportLayout.from_json(document.get("layout", {}), where=where), files_from, tuple(files))


def export_of(training_state: dict, *, where: str) -> HfExport | None:
    document = training_state.get(EXPORT_STATE_KEY)
    return None if document is None else HfExport.from_json(document, where=where)


def layout_of(metadata: dict[str, str], *, where: str) -> ExportLayout | None:
    """The export layout a full checkpoint file records (None: its names are the model's)."""
    raw = metadata.get(LAYOUT_METADATA_KEY)
    if raw is None:
        return None
    try:
        document = json.loads(raw)
    except ValueError:
        raise DataCheckError(f"{where}: metadata {LAYOUT_METADATA_KEY} is not JSON") from None
    return ExportLayout.from_json(document, where=f"{where}: metadata {LAYOUT_METADATA_KEY}")


def _strings(values: object) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)
