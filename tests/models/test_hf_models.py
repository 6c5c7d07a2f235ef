"""Hugging Face transformers models through fsdpkit and back, with no glue and no network.

Models: GPT-2 and Llama from presets (random init by fsdpkit) and from save_pretrained
directories of random weights (GPT-2 tied, sharded with an index; Llama untied, one file,
with a tokenizer), Qwen2 (Llama-style, tied). One launch per world size (1, 2, 4) trains
them all with the trainer and compares every loss and weight with an unsharded
single-process reference computed here; the 2-rank launch also saves checkpoints, which are
converted and reloaded with transformers (logits equal the sharded model's), resharded, and
runs the bf16 / keyword-argument / activation-checkpointing checks. One CLI run checks HF
weights -> --init-from -> SGD at --lr 0 -> convert: bit-identical. Four launches in all.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

os.environ["HF_HUB_OFFLINE"] = "1"  # no network anywhere (workers inherit it)
transformers = pytest.importorskip("transformers")  # the [hf] extra: `make test` and CI install it (test_hf_missing.py needs none)

from fsdpkit_cli.app import app  # noqa: E402
from support.distributed import run_distributed  # noqa: E402
from support.reference import train_unsharded  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import fsdpkit  # noqa: E402
from fsdpkit.checkpoint.live.tensors import CheckpointReader, full_reader  # noqa: E402
from fsdpkit.data.tokens import TokenDtype, load_tokenizer, write_token_file  # noqa: E402
from fsdpkit.engine.model_hooks import declare_hooks, hooks_of  # noqa: E402
from fsdpkit.models.gpt import GPT, Block, GPTConfig  # noqa: E402
from fsdpkit.models.gpt_export import gpt2_export  # noqa: E402
from fsdpkit.models.hf import PRESETS  # noqa: E402
from fsdpkit.models.source import resolve  # noqa: E402
from fsdpkit.models.units import wrap_policy  # noqa: E402
from fsdpkit.train.config import CheckpointConfig, DataConfig, LrSchedule, ModelConfig, Optimizer, OptimizerConfig, TrainConfig  # noqa: E402
from fsdpkit.train.data import TokenSource  # noqa: E402
from fsdpkit.train.loop import Trainer  # noqa: E402

runner = CliRunner()
FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
STEPS = 3
PROBE = torch.arange(2 * 24).reshape(2, 24) * 7 % 200  # token ids every test model knows
LINES = [f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i * 13 % 11}\n" for i in range(400)]


# ----- fixtures: directories as transformers writes them
def _tokenizer(corpus: Path, directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(LINES))
    write_token_file(corpus, root / "corpus.bin", tokenizer=load_tokenizer("bytes"), dtype=TokenDtype.UINT16)
    torch.manual_seed(1)
    gpt2 = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.AutoModelForCausalLM.from_config(gpt2).save_pretrained(root / "gpt2", max_shard_size="40KB")
    llama = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.AutoModelForCausalLM.from_config(llama).save_pretrained(root / "llama")
    _tokenizer(corpus, root / "llama")
    return {"root": root, "corpus": corpus, "bin": root / "corpus.bin", "gpt2": root / "gpt2", "llama": root / "llama"}


def _config(model: str, data: str = "synthetic", *, save_dir: str | None = None) -> TrainConfig:
    return TrainConfig(
        steps=STEPS,
        seed=3,
        model=ModelConfig(name=model),
        data=DataConfig(source=data, global_batch_size=8, grad_accum=2, seq_len=24),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1, schedule=LrSchedule.COSINE),
        checkpoint=CheckpointConfig(save_dir=save_dir),
    )


def cases(files, save_root: Path | None) -> dict[str, TrainConfig]:
    def save(name):
        return str(save_root / name) if save_root else None

    return {
        "gpt2-preset": _config("hf:gpt2-tiny", str(files["bin"]), save_dir=save("gpt2-preset")),
        "llama-preset": _config("hf:llama-tiny", save_dir=save("llama-preset")),
        "qwen2-preset": _config("hf:qwen2-tiny", save_dir=save("qwen2-preset")),
        "gpt2-dir": _config(f"hf:{files['gpt2']}", str(files["corpus"]), save_dir=save("gpt2-dir")),
        "llama-dir": _config(f"hf:{files['llama']}", str(files["corpus"]), save_dir=save("llama-dir")),
        "builtin": _config("gpt-tiny", save_dir=save("builtin")),
    }


# ----- the workers
def hf_worker(configs: dict[str, TrainConfig], extras: dict | None) -> dict | None:
    results = {}
    for name, config in configs.items():
        trainer = Trainer(config)
        entry = {"losses": [trainer.train_step() for _ in range(config.steps)], "weights": fsdpkit.full_state_dict(trainer.model)}
        if config.checkpoint.save_dir:
            trainer.save()
            with torch.no_grad():
                entry["logits"] = trainer.source.logits(trainer.model, PROBE)
        if name in ("qwen2-preset", "gpt2-dir"):  # the tie survives sharding and training
            model = trainer.model
            entry["tied"] = model.lm_head.weight is model.get_input_embeddings().weight
        results[name] = entry
    if extras is not None:
        results.update(precision_checks())
        trainer = Trainer(extras["lr0"])
        trainer.train_step()
        trainer.save()
    return results if dist.get_rank() == 0 else None


def precision_checks() -> dict:
    """Llama under bf16, with an attention mask (left padding) and position ids as keyword
    arguments, with and without activation checkpointing, against the same model in bf16
    unsharded; and in fp32 against fp32."""
    source = resolve("hf:llama-tiny")
    reference = source.build(device="cpu", seed=5)
    ids = PROBE.clone()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": False}
    out = {}
    for label, precision, checkpointing in (("fp32", "none", False), ("bf16", "bf16", False), ("bf16-ac", "bf16", True)):
        model = source.build(device="meta", seed=5)
        model = fsdpkit.shard(model, wrap=source.unit_classes(model), mixed_precision=precision, activation_checkpointing=checkpointing)
        logits = model(**kwargs).logits
        logits.float().square().mean().backward()
        grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
        low = copy.deepcopy(reference)
        if precision == "bf16":
            low = low.to(torch.bfloat16)
            low.model.rotary_emb.inv_freq = reference.model.rotary_emb.inv_freq.clone()  # kept fp32, as the engine keeps it
        expected = low(**kwargs).logits
        out[label] = {
            "error": (logits.detach().float() - expected.detach().float())[mask.bool()].abs().max().item(),
            "scale": expected.detach().float().abs().max().item(),
            "grads_finite": grads_finite,
            "inv_freq": str(model.model.rotary_emb.inv_freq.dtype),
        }
    return {"precision": out}


# ----- the unsharded reference
def load_directory_weights(model: torch.nn.Module, directory: Path) -> None:
    stored = {}
    for path in directory.glob("*.safetensors"):
        stored.update(load_file(path))
    missing, unexpected = model.load_state_dict(stored, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)


def reference_run(config: TrainConfig) -> dict:
    source = resolve(config.model.name)
    model = source.build(device="cpu", seed=config.seed)
    if source.weights is not None:
        load_directory_weights(model, source.weights)
    data = TokenSource(
        config.data.source,
        vocab_size=source.vocab_size or model.vocab_size,
        seq_len=config.data.seq_len,
        seed=config.seed,
        tokenizer=source.tokenizer,
    )
    return train_unsharded(model, source.logits, data, config)


@pytest.fixture(scope="module")
def references(files):
    return {name: reference_run(config) for name, config in cases(files, None).items()}


@pytest.fixture(scope="module")
def launches(files, tmp_path_factory):
    """{world size: rank 0's results}, each launched when first asked for."""
    done = {}

    def get(world: int) -> dict:
        if world not in done:
            save_root = tmp_path_factory.mktemp(f"runs{world}") if world == 2 else None
            extras = None
            if world == 2:
                lr0 = replace(
                    _config(f"hf:{files['llama']}"),
                    steps=1,
                    optimizer=OptimizerConfig(name=Optimizer.SGD, lr=0.0, weight_decay=0.0),
                    checkpoint=CheckpointConfig(save_dir=str(save_root / "lr0"), init_from=str(files["llama"])),
                )
                extras = {"lr0": lr0}
            done[world] = (run_distributed(hf_worker, world, cases(files, save_root), extras)[0], save_root)
        return done[world]

    return get


# ----- tests
@pytest.mark.parametrize("world", [1, 2, 4])
def test_world_size_invariance_against_an_unsharded_reference(world, launches, references):
    results, _ = launches(world)
    for name, reference in references.items():
        mine = results[name]
        for step, (a, b) in enumerate(zip(mine["losses"], reference["losses"], strict=True)):
            assert abs(a - b) / abs(b) <= 1e-4, f"{name} world {world} step {step}: loss {a} vs reference {b}"
        assert mine["losses"][-1] < mine["losses"][0], name
        diff = total = 0.0
        for key, ref in reference["weights"].items():
            got = mine["weights"][key]
            diff, total = diff + float((got - ref).pow(2).sum()), total + float(ref.pow(2).sum())
            if ref.dim() >= 2:
                error = ((got - ref).norm() / ref.norm()).item()
                assert error <= 1e-4, f"{name} world {world}: {key} differs by {error:.2e}"
        assert (diff / total) ** 0.5 <= 1e-4, name


def test_ties_survive_sharding_and_training(launches):
    results, _ = launches(2)
    for name in ("qwen2-preset", "gpt2-dir"):
        assert results[name]["tied"], name
        weights = results[name]["weights"]
        embedding = "transformer.wte.weight" if "gpt2" in name else "model.embed_tokens.weight"
        assert torch.equal(weights["lm_head.weight"], weights[embedding])
    untied = results["llama-preset"]["weights"]
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])


def _convert(src: Path, dst: Path, *args: str) -> None:
    result = runner.invoke(app, ["convert", str(src), str(dst), "--to", "full", *args])
    assert result.exit_code == 0, result.output


def _load(directory: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set(), info
    return model.eval()


@pytest.mark.parametrize("name", ["gpt2-preset", "llama-preset", "qwen2-preset", "gpt2-dir", "llama-dir", "builtin"])
def test_convert_to_full_loads_in_transformers_with_equal_logits(name, files, launches, tmp_path):
    results, runs = launches(2)
    _convert(runs / name, tmp_path / "out")
    model = _load(tmp_path / "out")
    with torch.no_grad():
        logits = model(PROBE).logits
    assert (logits - results[name]["logits"]).abs().max().item() <= 1e-5
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32"
    embedding = model.get_input_embeddings().weight
    assert (model.lm_head.weight is embedding) == (name != "llama-preset" and name != "llama-dir")
    if name == "llama-dir":  # the directory's side files come along
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
        assert (
            tokenizer.encode("the lazy dog", add_special_tokens=False)
            == load_tokenizer(f"hf:{files['llama']}").encode(b"the lazy dog").tolist()
        )
    if name == "builtin":  # GPT2LMHeadModel, Conv1D orientation: its weight is the transpose of fsdpkit's Linear
        assert type(model).__name__ == "GPT2LMHeadModel"
        trained = results[name]["weights"]
        for key in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert torch.equal(model.transformer.h[1].get_submodule(key).weight, trained[f"h.1.{key}.weight"].t())
        assert torch.equal(model.transformer.wte.weight, trained["wte.weight"])


def test_reshard_then_convert_keeps_the_tie(launches, tmp_path):
    _, runs = launches(2)
    assert runner.invoke(app, ["reshard", str(runs / "qwen2-preset"), str(tmp_path / "r3"), "--world-size", "3"]).exit_code == 0
    _convert(runs / "qwen2-preset", tmp_path / "direct")
    _convert(tmp_path / "r3", tmp_path / "resharded")
    a, b = load_file(tmp_path / "direct" / "model.safetensors"), load_file(tmp_path / "resharded" / "model.safetensors")
    assert a.keys() == b.keys() and "lm_head.weight" not in a and all(torch.equal(a[k], b[k]) for k in a)
    model = _load(tmp_path / "resharded")
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_sgd_at_lr_0_gives_back_the_input_weights_bit_for_bit(files, launches, tmp_path):
    """HF weights (one file, untied) through the trainer at 2 ranks, and (sharded with an
    index, tied) through the CLI: --init-from, one SGD step at --lr 0, convert."""
    _, runs = launches(2)
    _convert(runs / "lr0", tmp_path / "llama")
    assert _same_tensors(files["llama"], tmp_path / "llama")
    run = tmp_path / "run"
    done = subprocess.run(
        [
            FSDPKIT,
            "train",
            "--model",
            f"hf:{files['gpt2']}",
            "--init-from",
            str(files["gpt2"]),
            "--optimizer",
            "sgd",
            "--lr",
            "0",
            "--weight-decay",
            "0",
            "--steps",
            "1",
            "--seq-len",
            "16",
            "--nproc-per-node",
            "2",
            "--save-dir",
            str(run),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    _convert(run, tmp_path / "gpt2", "--max-shard-size", "40KB")
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").exists()
    assert _same_tensors(files["gpt2"], tmp_path / "gpt2")


def _same_tensors(a: Path, b: Path) -> bool:
    def tensors(directory):
        out = {}
        for path in directory.glob("*.safetensors"):
            out.update(load_file(path))
        return out

    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x)


def test_bf16_keyword_arguments_and_activation_checkpointing(launches):
    precision = launches(2)[0]["precision"]
    assert precision["fp32"]["error"] <= 1e-5 * max(1.0, precision["fp32"]["scale"])
    for label in ("bf16", "bf16-ac"):
        check = precision[label]
        assert check["grads_finite"] and check["inv_freq"] == "torch.float32", check
        assert check["error"] <= 2e-2 * check["scale"], (label, check)


# ----- no processes
@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_presets_keep_transformers_names_and_units(preset):
    source = resolve(f"hf:{preset}")
    meta = source.build(device="meta", seed=0)
    class_name, values = PRESETS[preset]
    plain = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**values))
    assert list(meta.state_dict()) == list(plain.state_dict())
    assert [c.__name__ for c in source.unit_classes(meta)] == sorted(plain._no_split_modules)
    assert not any(b.is_meta for b in meta.buffers())
    policy = wrap_policy(ModelConfig(name=f"hf:{preset}", wrap=("torch.nn:Embedding",)), source, meta)
    assert policy.module_classes == (torch.nn.Embedding,)  # --wrap overrides the model's own units


def test_init_is_per_parameter_deterministic_and_order_free():
    source = resolve("hf:gpt2-tiny")
    eager = source.build(device="cpu", seed=7)
    meta = source.build(device="meta", seed=7)
    params = list(eager.named_parameters())
    for name, param in reversed(params):
        fresh = torch.empty(param.shape)
        hooks_of(meta).init_parameter(name, fresh)
        assert torch.equal(fresh, param), name
    random = [p for n, p in params if p.dim() >= 2]
    assert all(not torch.equal(a.flatten()[:16], b.flatten()[:16]) for i, a in enumerate(random) for b in random[i + 1 :])
    std = {n: p.std().item() for n, p in params}
    assert abs(std["transformer.h.0.attn.c_proj.weight"] - 0.02 / 2) < 2e-3  # GPT-2's scaled residual init
    assert abs(std["transformer.h.0.attn.c_attn.weight"] - 0.02) < 2e-3
    assert not torch.equal(source.build(device="cpu", seed=8).lm_head.weight, eager.lm_head.weight)


def test_exported_builtin_gpt_reads_back_in_its_own_layout(launches, tmp_path):
    """--init-from and convert --to sharded undo the GPT-2 layout an export recorded."""
    results, runs = launches(2)
    script = (
        "import sys; from fsdpkit_cli.app import app; code = app(sys.argv[1:], standalone_mode=False); print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "convert", str(runs / "builtin"), str(tmp_path / "hf"), "--to", "full"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.split()[-2:] == ["0", "False"], (done.stdout, done.stderr)  # transposes without torch
    trained = results["builtin"]["weights"]
    with full_reader(tmp_path / "hf", ["h.0.attn.c_attn.weight"]) as reader:
        from fsdpkit.flat_layout import ElementRange

        for name, tensor in trained.items():
            if name == "lm_head.weight":
                continue
            assert torch.equal(reader.read_tensor(name), tensor), name
            flat, size = tensor.reshape(-1), tensor.numel()
            assert torch.equal(reader.read_range(name, ElementRange(size // 3, size - 5)), flat[size // 3 : size - 5]), name
    result = runner.invoke(
        app, ["convert", str(tmp_path / "hf"), str(tmp_path / "s2"), "--to", "sharded", "--world-size", "2", "--model", "gpt-tiny"]
    )
    assert result.exit_code == 0, result.output
    with CheckpointReader(tmp_path / "s2") as reader:
        assert all(torch.equal(reader.read_tensor(n), t) for n, t in trained.items()), "sharded copy differs"
    assert not list((tmp_path / "s2").glob(".*"))


def test_prepare_data_with_a_tokenizer_and_token_files(files, tmp_path):
    spec = f"hf:{files['llama']}"
    out = tmp_path / "tokens.bin"
    result = runner.invoke(app, ["prepare-data", str(files["corpus"]), str(out), "--tokenizer", spec, "--json"])
    assert result.exit_code == 0, result.output
    whole = load_tokenizer(spec).encode(files["corpus"].read_bytes())
    written = torch.from_numpy(__import__("numpy").fromfile(out, dtype="<u2").astype("int64"))
    assert json.loads(result.stdout)["tokens"] == len(whole) and torch.equal(written, torch.from_numpy(whole))
    small = tmp_path / "small.bin"  # 64-byte blocks: many blocks, the same tokens
    write_token_file(files["corpus"], small, tokenizer=load_tokenizer(spec), dtype=TokenDtype.UINT32, block_bytes=64)
    assert torch.equal(torch.from_numpy(__import__("numpy").fromfile(small, dtype="<u4").astype("int64")), written)
    source = TokenSource(str(small), vocab_size=320, seq_len=16, seed=0, token_dtype=TokenDtype.UINT32)
    batch = source.global_batch(3, 4)
    starts = [next(i for i in range(len(written)) if torch.equal(written[i : i + 17], row)) for row in batch]
    assert len(starts) == 4 and isinstance(source.train_tokens, __import__("numpy").memmap)
    wrong = TokenSource(str(out), vocab_size=256, seq_len=16, seed=0)
    with pytest.raises(Exception, match="outside the model's vocabulary"):
        for step in range(20):
            wrong.global_batch(step, 8)


def test_plan_and_convert_to_sharded_use_the_model_source(files, tmp_path):
    planned = runner.invoke(app, ["plan", "--model", f"hf:{files['llama']}", "--world-size", "4", "--bucket-bytes", "0", "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["units"] == 3  # two decoder layers and the root (one unit each: bucketing off)
    result = runner.invoke(
        app,
        [
            "convert",
            str(files["gpt2"]),
            str(tmp_path / "s"),
            "--to",
            "sharded",
            "--world-size",
            "2",
            "--model",
            f"hf:{files['gpt2']}",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["placement"] == "flat"
    with CheckpointReader(tmp_path / "s") as reader:
        assert reader.aliases == {"lm_head.weight": "transformer.wte.weight"}
        firsts = [unit[0][0] for unit in reader.manifest.placement.units]
        assert firsts == ["transformer.wte.weight", "transformer.h.0.ln_1.weight", "transformer.h.1.ln_1.weight"]


# ----- the built-in GPT's padded vocabulary
PADDED = GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16)  # GPT-2's vocabulary, computed as 50,304


def _padded_gpt_worker(directory: str) -> dict:
    """Train the model a step, save it with its GPT-2 export recipe; its logits on PROBE."""
    torch.manual_seed(0)
    model = GPT(PADDED)
    declare_hooks(model, replace(hooks_of(model), export=gpt2_export(PADDED)))
    model = fsdpkit.shard(model, wrap=(Block,))
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-3)
    tokens = torch.randint(0, PADDED.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    fsdpkit.Checkpointer(model, optimizer).save(directory, step=1)
    with torch.no_grad():
        return {"logits": model(PROBE), "rows": fsdpkit.full_state_dict(model)["wte.weight"].shape[0]}


def test_padded_vocabulary_exports_its_50257_rows_with_equal_logits(tmp_path):
    result = run_distributed(_padded_gpt_worker, 1, str(tmp_path / "run"))[0]
    assert PADDED.padded_vocab_size == 50304 and result["rows"] == 50257 and result["logits"].shape[-1] == 50257
    _convert(tmp_path / "run", tmp_path / "out")
    model = _load(tmp_path / "out")
    assert model.transformer.wte.weight.shape[0] == 50257 and model.config.vocab_size == 50257
    with torch.no_grad():
        logits = model(PROBE).logits
    assert (logits - result["logits"]).abs().max().item() <= 1e-5


class LinearShapes(TorchFunctionMode):
    """The weight shapes of every F.linear call."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.weights.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def test_padded_rows_are_never_predicted_and_the_loss_is_the_unpadded_models():
    torch.manual_seed(0)
    padded = GPT(PADDED)
    unpadded = copy.deepcopy(padded)
    unpadded.output_logits = unpadded.lm_head  # the head without padding: (50257, n_embd) as it is stored
    tokens = torch.randint(0, PADDED.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    with LinearShapes() as shapes:
        padded(tokens[:, :-1])
    assert (50304, PADDED.n_embd) in shapes.weights  # the head's matmul runs on the padded rows
    losses = []
    for model in (padded, unpadded):
        logits = model(tokens[:, :-1])
        assert logits.shape == (2, 16, PADDED.vocab_size)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0)
    for (name, grad), other in zip(((n, p.grad) for n, p in padded.named_parameters()), unpadded.parameters(), strict=True):
        assert torch.allclose(grad, other.grad, rtol=1e-5, atol=1e-8), name
