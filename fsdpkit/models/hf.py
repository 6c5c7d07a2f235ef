"""Hugging Face transformers causal LMs as model sources (the optional `.[hf]` extra).

    fsdpkit train --model hf:llama-tiny            # a preset config: no network, no weights
    fsdpkit train --model hf:./my-llama            # a directory with config.json (+ weights, tokenizer)

The model is built from its config on the meta device (`AutoModelForCausalLM.from_config`)
and keeps its own parameter names, so `state_dict()` keys equal transformers'. Its units are
the classes it names in `_no_split_modules` (its decoder layers); logits come from the output
object. Buffers the model computes from its config (rotary frequencies) are made real at once
by the model's own `_init_weights`.

Random initialisation (`init_parameter(name, tensor)`, which fsdpkit's deferred init calls
one parameter at a time) runs the model's own `_init_weights` on the module holding the
parameter and then on each of its ancestors (GPT-2 rescales its residual projections from the
attention and MLP modules), with every other parameter replaced by a meta placeholder, from a
generator seeded by the run seed, the module and the parameter: the values depend neither on
the world size nor on the order units are materialised in, and an eager build gets the same.

A directory's weights (`model.safetensors`, or shards with `model.safetensors.index.json`)
are loaded when the run starts, as `from_pretrained` would, unless `--init-from` or `--resume`
gives others; only safetensors are read (a `pytorch_model.bin` is pickle, refused).
"""

from __future__ import annotations

import importlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..checkpoint.core.export import SIDE_FILES, HfExport
from ..checkpoint.format.reader import is_full_checkpoint
from ..engine.model_hooks import ModelHooks, declare_hooks
from ..errors import UsageError, install_hint

PREFIX = "hf:"
INSTALL_HINT = f"Hugging Face models need the optional extra: {install_hint('hf')} (transformers, tokenizers)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# Small configs of known architectures, no dropout (a run must not depend on the world size).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2-tiny": (
        "GPT2Config",
        dict(
            vocab_size=256,
            n_positions=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "llama-tiny": (
        "LlamaConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "qwen2-tiny": (
        "Qwen2Config",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    # Big enough that compute, not communication, dominates a CPU step (benchmarks/engine.py): 11.0M parameters.
    "llama-bench": (
        "LlamaConfig",
        dict(
            vocab_size=2048,
            hidden_size=384,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


def transformers_module() -> Any:
    """transformers, or the one-line UsageError saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise UsageError(INSTALL_HINT) from None


def is_hf_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def load_config(spec: str) -> tuple[Any, Path | None]:
    """The transformers config of `hf:PRESET` or `hf:PATH`, and the directory (None for a preset)."""
    name = spec[len(PREFIX) :]
    transformers = transformers_module()
    if name in PRESETS:
        class_name, values = PRESETS[name]
        return getattr(transformers, class_name)(**values), None
    path = Path(name)
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True), path
    except Exception as error:  # a malformed or unknown config is the user's input
        raise UsageError(f"--model {spec!r}: transformers cannot read {path / 'config.json'}: {error}") from None


def weights_in(directory: Path | None, spec: str) -> Path | None:
    """The directory's safetensors weights, if any (pickled weights are refused, not loaded)."""
    if directory is None:
        return None
    if is_full_checkpoint(directory):
        return directory
    if (directory / "pytorch_model.bin").exists() or (directory / "pytorch_model.bin.index.json").exists():
        raise UsageError(
            f"--model {spec!r}: its weights are pickle files (pytorch_model.bin), which fsdpkit never "
            "loads; save them as safetensors (model.save_pretrained(..., safe_serialization=True))"
        )
    return None


def has_tokenizer(directory: Path | None) -> bool:
    return directory is not None and any((directory / name).is_file() for name in TOKENIZER_FILES)


def export_for(config: Any, directory: Path | None) -> HfExport:
    """config.json as transformers writes it (with the model class), and the directory's side files."""
    document = json.loads(config.to_json_string(use_diff=False))
    if not document.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        document["architectures"] = [architecture] if architecture else None
    files = tuple(name for name in SIDE_FILES if directory is not None and (directory / name).is_file())
    return HfExport(document, files_from=str(directory.resolve()) if directory is not None else None, files=files)


def build(config: Any, device: str | torch.device, seed: int) -> nn.Module:
    """The causal LM of `config`, with its hooks declared (`init_parameter`, rotary buffers kept in fp32). On the meta device nothing is
    allocated but the buffers the model computes from its config; on a real device (eager) the
    parameters get the values deferred init gives."""
    transformers = transformers_module()
    meta = torch.device(device).type == "meta"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_parameter = initializer(model, seed)
    keep = frozenset(  # transformers computes rotary embeddings in fp32 from these
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if "RotaryEmbedding" in type(module).__name__
        for name, b in module._buffers.items()
        if b is not None
    )
    if meta:
        _compute_buffers(model)
    else:
        with torch.no_grad():
            for name, param in model.named_parameters():
                init_parameter(name, param.data)
    declare_hooks(model, ModelHooks(init_parameter=init_parameter, keep_dtype_buffers=keep))
    return model


def _compute_buffers(model: nn.Module) -> None:
    """Buffers on the meta device get their values (on the CPU) from the model's own
    `_init_weights` on their module; one it leaves unset is an error naming it."""
    for module_name, module in model.named_modules():
        own = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if not own:
            continue
        for name in own:
            buffer = module._buffers[name]
            if not buffer.is_floating_point():
                raise UsageError(
                    f"buffer {module_name}.{name} of {type(model).__name__} is not a float computed by "
                    "_init_weights: build it eagerly (--eager-init)"
                )
            module._buffers[name] = torch.full(buffer.shape, float("nan"), dtype=buffer.dtype, device="cpu")
        with _placeholders(model, keep={(id(module), name): module._buffers[name] for name in own}), torch.no_grad():
            model._init_weights(module)  # type: ignore[operator]  # a PreTrainedModel method; torch types Module attributes as Tensor | Module
        for name in own:
            if torch.isnan(module._buffers[name]).any():
                raise UsageError(
                    f"buffer {module_name}.{name} of {type(model).__name__} is not computed by its "
                    "_init_weights: build it eagerly (--eager-init)"
                )


def unit_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes the model says must not be split: its decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple(sorted({type(m) for m in model.modules() if type(m).__name__ in names}, key=lambda c: c.__name__))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


# ----- initialisation
class _Slots:
    """Every (module, attribute) holding a parameter or a buffer, with the shapes they had when
    the model was built (before sharding replaced them with fragments)."""

    def __init__(self, model: nn.Module):
        modules = dict(model.named_modules(remove_duplicate=False))
        # (module, attribute, its meta placeholder), made once: writes to a meta tensor do nothing
        self.params = [
            (modules[m], attr, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))
            for m, attr, p in _owned(model, "_parameters")
        ]
        self.buffers = [(modules[m], attr, torch.empty(b.shape, dtype=b.dtype, device="meta")) for m, attr, b in _owned(model, "_buffers")]
        self.groups: dict[str, list[tuple[nn.Module, str]]] = {}  # canonical name -> every slot of that parameter
        first: dict[int, str] = {}
        for m, attr, param in _owned(model, "_parameters"):
            canonical = first.setdefault(id(param), f"{m}.{attr}" if m else attr)
            self.groups.setdefault(canonical, []).append((modules[m], attr))


def _owned(model: nn.Module, kind: str):
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, tensor in getattr(module, kind).items():
            if tensor is not None:
                yield module_name, attr, tensor


_SLOTS_ATTR = "_fsdpkit_slots"


class _placeholders:
    """Within: every parameter and buffer of `model` is a meta tensor of its built shape (writes
    to it do nothing), except the slots in `keep` ({(module id, attr): tensor})."""

    def __init__(self, model: nn.Module, keep: dict[tuple[int, str], torch.Tensor]):
        self.slots: _Slots = model.__dict__.get(_SLOTS_ATTR) or _Slots(model)
        self.keep = keep
        self.saved: list[tuple[dict, str, Any]] = []

    def __enter__(self):
        for kind, slots in (("_parameters", self.slots.params), ("_buffers", self.slots.buffers)):
            for module, attr, placeholder in slots:
                table = getattr(module, kind)
                self.saved.append((table, attr, table[attr]))
                kept = self.keep.get((id(module), attr))
                if kept is None:
                    table[attr] = placeholder
                else:
                    table[attr] = nn.Parameter(kept, requires_grad=False) if kind == "_parameters" else kept
        return self

    def __exit__(self, *exc) -> None:
        for table, attr, value in reversed(self.saved):
            table[attr] = value


def initializer(model: nn.Module, seed: int) -> Callable[[str, torch.Tensor], None]:
    """`init_parameter(name, tensor)`: fill `tensor` as the model's own `_init_weights` would
    initialise parameter `name` (see the module docstring)."""
    slots = _Slots(model)
    model.__dict__[_SLOTS_ATTR] = slots  # not a submodule, not in state_dict
    modules = dict(model.named_modules())

    def init_parameter(name: str, tensor: torch.Tensor) -> None:
        if tensor.is_meta:
            return
        if name not in slots.groups:
            raise UsageError(f"{type(model).__name__} has no parameter {name!r} to initialise")
        owner = name.rpartition(".")[0]
        chain = [owner] + [owner.rsplit(".", depth)[0] for depth in range(1, owner.count(".") + 1)] + ([""] if owner else [])
        keep = {(id(module), attr): tensor for module, attr in slots.groups[name]}
        with _placeholders(model, keep), torch.no_grad(), torch.random.fork_rng(devices=[]):
            for module_name in chain:
                torch.manual_seed((seed * 1_000_003 + zlib.crc32(f"{module_name}|{name}".encode())) % 2**63)
                model._init_weights(modules[module_name])  # type: ignore[operator]  # as in _compute_buffers

    return init_parameter
