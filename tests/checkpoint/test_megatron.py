"""Megatron checkpoints against Megatron itself: megatron-core writes `torch_dist` checkpoints of
tiny Llama, Qwen2 and GPT models at TP=2 PP=2 on CPU; fsdpkit, with no Megatron in its process,
inspects and verifies them, reads their tensors (unstacked layers equal torch's DCP
reading of the stacked ones), converts them to Hugging Face files whose `from_pretrained` logits equal
Megatron's forward, and back to `torch_dist`, which Megatron's `dist_checkpointing.load` loads at
TP=2 PP=2 with the same logits. A malicious common state is refused with nothing run."""

import json
import pickle

import pytest
import torch
from support.checkpoint_files import run_cli

from fsdpkit.checkpoint.offline.formats import open_checkpoint

TOLERANCE = 1e-5


def tokens_for(model_shape) -> torch.Tensor:
    return torch.randint(0, model_shape.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))


STYLES = ("llama", "qwen2", "gpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{style: (directory, shape, Megatron's logits)}, each written by Megatron at TP=2 PP=2, all
    three in one launch (one start-up of Megatron's ranks), at the first test that asks."""
    from support import megatron_oracle

    found = {}

    def get(style: str):
        if not found:
            shapes = {name: megatron_oracle.shape(name, num_layers=4) for name in STYLES}
            directories = {name: tmp_path_factory.mktemp(name) for name in STYLES}
            checkpoints = [(str(directories[name]), shapes[name], tokens_for(shapes[name]), 7) for name in STYLES]
            all_logits = megatron_oracle.save_checkpoints(checkpoints)
            found.update({name: (directories[name], shapes[name], logits) for name, logits in zip(STYLES, all_logits, strict=True)})
        return found[style]

    return get


def hf_logits(directory, tokens: torch.Tensor) -> tuple[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return type(model).__name__, model(tokens).logits


@pytest.mark.parametrize(
    ("style", "architecture"), [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("gpt", "GPT2LMHeadModel")]
)
def test_megatron_to_hf_gives_megatrons_logits(saved, tmp_path, style, architecture):
    directory, model_shape, logits = saved(style)
    done = run_cli("convert", directory, tmp_path / "hf", "--to", "full", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["from"] == "megatron"
    name, got = hf_logits(tmp_path / "hf", tokens_for(model_shape))
    assert name == architecture
    assert (got - logits).abs().max().item() < TOLERANCE


def test_inspect_verify_and_tensors_match_torchs_dcp_reading(saved):
    directory, model_shape, _ = saved("llama")
    summary = json.loads(run_cli("inspect", directory, "--json").stdout)
    assert summary["format"] == "megatron" and summary["generation"].startswith("torch_dist 0.16")
    assert summary["parallel"] == {"tensor": 2, "pipeline": 2, "data": 1}
    recorded = summary["model_shape"]
    assert (recorded["layers"], recorded["heads"], recorded["query_groups"], recorded["ffn"]) == (4, 4, 2, 96)
    assert (recorded["norm"], recorded["activation"], recorded["position_embedding"]) == ("RMSNorm", "swiglu", "rope")
    assert summary["optimizer_kind"] is None
    verified = run_cli("verify", directory, "--json")
    assert verified.exit_code == 0 and json.loads(verified.stdout)["ok"], verified.stdout

    plain = dcp_plain_tensors(directory, ["decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.mlp.linear_fc1.weight"])
    with open_checkpoint(directory) as opened:
        assert opened.format == "megatron"
        stacked = plain["decoder.layers.self_attention.linear_qkv.weight"]
        for layer in range(4):
            got = opened.get_tensor(f"decoder.layers.{layer}.self_attention.linear_qkv.weight")
            assert torch.equal(got, stacked[layer])
        fc1 = plain["decoder.layers.mlp.linear_fc1.weight"]
        assert torch.equal(opened.get_slice("decoder.layers.2.mlp.linear_fc1.weight")[94:100], fc1[2, 94:100])


def test_verify_spread_prints_the_one_process_report(saved, tmp_path):
    """Megatron's torch_dist files, spread over 1 and 2 processes; a byte of a chunk's record
    changed: the same line, exit 3."""
    import shutil

    from support.spread_verify import assert_spread_verify_is_one_process

    directory = shutil.copytree(saved("llama")[0], tmp_path / "llama")
    victim = sorted(directory.glob("*.distcp"))[-1]
    assert "not a readable pickle" in assert_spread_verify_is_one_process(directory, victim, 28)


def dcp_plain_tensors(directory, keys: list[str]) -> dict[str, torch.Tensor]:
    """torch's own DCP reader (no process group): the stacked tensors whole."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    state = {key: torch.empty(tuple(metadata.state_dict_metadata[key].size)) for key in keys}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return state


def test_hf_to_megatron_loads_in_megatron_at_tp2_pp2(saved, tmp_path):
    from support import megatron_oracle

    directory, model_shape, logits = saved("qwen2")
    assert run_cli("convert", directory, tmp_path / "hf", "--to", "full").exit_code == 0
    done = run_cli("convert", tmp_path / "hf", tmp_path / "back", "--to", "megatron")
    assert done.exit_code == 0, done.output
    loaded = megatron_oracle.load_logits(str(tmp_path / "back"), model_shape, tokens_for(model_shape))
    assert (loaded - logits).abs().max().item() < TOLERANCE
    diff = run_cli("diff", directory, tmp_path / "back")
    assert diff.exit_code == 0, diff.output
    # through DCP, whose checkpoint records no config: the shape named with --model, every tensor Megatron's own
    assert run_cli("convert", tmp_path / "hf", tmp_path / "dcp", "--to", "dcp").exit_code == 0
    assert run_cli("convert", tmp_path / "dcp", tmp_path / "from-dcp", "--to", "megatron").exit_code == 2
    done = run_cli("convert", tmp_path / "dcp", tmp_path / "from-dcp", "--to", "megatron", "--model", f"hf:{tmp_path / 'hf'}")
    assert done.exit_code == 0, done.output
    assert run_cli("diff", directory, tmp_path / "from-dcp").exit_code == 0


class Boom:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_malicious_common_state_is_refused_and_nothing_runs(saved, tmp_path):
    import shutil

    directory, _, _ = saved("llama")
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    torch.save({"args": Boom()}, bad / "common.pt")
    for command in ("inspect", "verify"):
        done = run_cli(command, bad)
        assert done.exit_code == 3, done.output
        assert ".print, which is not allowed" in done.output and "ran" not in done.output
    metadata = (bad / ".metadata").read_bytes()
    (bad / ".metadata").write_bytes(pickle.dumps(Boom()))
    done = run_cli("convert", bad, tmp_path / "out", "--to", "full")
    assert done.exit_code == 3 and ".print, which is not allowed" in done.output
    assert not (tmp_path / "out").exists() and metadata


def transformers_gpt2(directory, model_shape, activation: str):
    """A GPT2LMHeadModel of `model_shape` with seeded noise on every weight, saved by transformers itself; the model."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=model_shape.vocab_size,
        n_positions=model_shape.max_position_embeddings,
        n_embd=model_shape.hidden_size,
        n_layer=model_shape.num_layers,
        n_head=model_shape.num_attention_heads,
        n_inner=model_shape.ffn_hidden_size,
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    return model


def test_transformers_gpt2_to_megatron_loads_in_megatron_at_tp2_pp2(tmp_path):
    """GPT-2 as transformers saves it (Conv1D weights (in, out), c_attn [all q; all k; all v], tied
    head, gelu_new): Megatron loads fsdpkit's torch_dist at TP=2 PP=2 and its logits are transformers'."""
    from support import megatron_oracle

    model_shape = megatron_oracle.shape("gpt", num_layers=2, openai_gelu=True)
    tokens = tokens_for(model_shape)
    model = transformers_gpt2(tmp_path / "hf", model_shape, "gelu_new")
    with torch.no_grad():
        expected = model(tokens).logits
    done = run_cli("convert", tmp_path / "hf", tmp_path / "meg", "--to", "megatron", "--json")
    assert done.exit_code == 0, done.output
    assert not list((tmp_path / "meg").glob(".*conv1d*"))  # the transposing scratch file is gone
    spread = run_cli("convert", tmp_path / "hf", tmp_path / "meg-2", "--to", "megatron", "--nproc-per-node", "2")
    assert spread.exit_code == 0, spread.output  # spread: each rank transposes the weights its byte ranges take
    assert _files(tmp_path / "meg-2") == _files(tmp_path / "meg")
    loaded = megatron_oracle.load_logits(str(tmp_path / "meg-2"), model_shape, tokens)
    assert (loaded - expected).abs().max().item() < TOLERANCE
    # and back: transformers loads the Megatron checkpoint's export with the source's logits
    assert run_cli("convert", tmp_path / "meg", tmp_path / "back", "--to", "full").exit_code == 0
    name, got = hf_logits(tmp_path / "back", tokens)
    assert name == "GPT2LMHeadModel" and (got - expected).abs().max().item() < TOLERANCE
    # through fsdpkit's own format, whose export recipe gives the shape: torch reads the same tensors
    done = run_cli(
        "convert", tmp_path / "hf", tmp_path / "sharded", "--to", "sharded", "--world-size", "2", "--model", f"hf:{tmp_path / 'hf'}"
    )
    assert done.exit_code == 0, done.output
    assert run_cli("convert", tmp_path / "sharded", tmp_path / "meg2", "--to", "megatron").exit_code == 0
    assert_same_dcp_tensors(tmp_path / "meg", tmp_path / "meg2")


def _files(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_megatron_gpt_through_hf_and_dcp_back_to_megatron_gives_megatrons_own_tensors(saved, tmp_path):
    """Megatron's GPT checkpoint -> full -> megatron, and full -> DCP (the model's (out, in)
    orientation, no config) -> megatron: torch's DCP reading of every tensor equals Megatron's own."""
    directory, _, _ = saved("gpt")
    assert run_cli("convert", directory, tmp_path / "hf", "--to", "full").exit_code == 0
    done = run_cli("convert", tmp_path / "hf", tmp_path / "back", "--to", "megatron")
    assert done.exit_code == 0, done.output
    assert run_cli("convert", tmp_path / "hf", tmp_path / "dcp", "--to", "dcp").exit_code == 0
    done = run_cli("convert", tmp_path / "dcp", tmp_path / "from-dcp", "--to", "megatron", "--model", f"hf:{tmp_path / 'hf'}")
    assert done.exit_code == 0, done.output
    keys = assert_same_dcp_tensors(directory, tmp_path / "back")
    assert "embedding.position_embeddings.weight" in keys and "decoder.layers.self_attention.linear_qkv.bias" in keys
    assert_same_dcp_tensors(directory, tmp_path / "from-dcp")
    # a GPT-2 whose math Megatron's GPT does not have: one line, nothing written
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"activation_function": "relu"}))
    done = run_cli("convert", tmp_path / "hf", tmp_path / "relu", "--to", "megatron")
    assert done.exit_code == 3 and "activation_function 'relu'" in done.output and not (tmp_path / "relu").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def assert_same_dcp_tensors(expected, got) -> list[str]:
    """torch's DCP reader finds the same tensor keys in both checkpoints, each equal; the keys."""
    import torch.distributed.checkpoint as dcp

    keys = {}
    for directory in (expected, got):
        metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        keys[directory] = sorted(key for key, item in metadata.items() if hasattr(item, "size"))
    assert keys[got] == keys[expected]
    a, b = dcp_plain_tensors(expected, keys[expected]), dcp_plain_tensors(got, keys[expected])
    assert [key for key in keys[expected] if not torch.equal(a[key], b[key])] == []
    return keys[expected]
