"""Megatron's distributed optimizer state against Megatron itself: megatron-core trains a tiny
Llama-shaped model for three Adam steps on CPU (TP=2, DP=2, the grad buffer split into
buckets) and saves it in Megatron-LM's default `dp_reshardable` sharding (flat buckets per rank,
no parameter names) and as `fully_reshardable`; beside them it saves its own view of each
parameter's exp_avg and exp_avg_sq (the inner Adam's state found through the parameter itself,
laid out by the model's own sharded state dict). fsdpkit, with no Megatron in its process, gives
every moment equal to Megatron's, carries them through `convert --to sharded --with-optimizer`
under transformers' names, and `train --resume` continues from the converted checkpoint. A tied
GPT model at TP=2 PP=2 with bf16 weights and fp32 main parameters (the embedding's own bucket on
both stages, each (tp, pp) rank its own buffers) likewise."""

import argparse
import json
import shutil

import pytest
import torch
from support.checkpoint_files import run_cli

import fsdpkit

MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{style: (root, shape)}: Megatron's training run of a style, saved under root/dp,
    root/full and root/moments, once per module, lazily."""
    from support import megatron_oracle

    found = {}

    def get(style: str):
        if style not in found:
            root = tmp_path_factory.mktemp(style)
            # hidden 48: norms and biases end off the 64-element alignment
            if style == "llama":
                model_shape = megatron_oracle.shape("llama", num_layers=2, hidden_size=48)
                parallel, buckets = megatron_oracle.Parallel(tp=2, pp=1, dp=2), 5000
            else:
                model_shape = megatron_oracle.shape("gpt", num_layers=2, hidden_size=48)
                parallel, buckets = megatron_oracle.Parallel(tp=2, pp=2, dp=1), None
            directories = {"dp_reshardable": str(root / "dp"), "fully_reshardable": str(root / "full")}
            megatron_oracle.train_and_save(
                directories,
                model_shape,
                parallel=parallel,
                bucket_size=buckets,
                bf16=style == "gpt",
                moments_directory=str(root / "moments"),
            )
            found[style] = (root, model_shape)
        return found[style]

    return get


def dcp_tensors(directory) -> dict[str, torch.Tensor]:
    """torch's own DCP reader (no process group): every tensor of a checkpoint Megatron wrote, whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    items = metadata.state_dict_metadata.items()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in items if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return state


def by_layer(stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's stacked `decoder.layers.X` [L, ...] as `decoder.layers.{i}.X`."""
    out = {}
    for key, tensor in stacked.items():
        if key.startswith("decoder.layers."):
            out |= {f"decoder.layers.{i}.{key.removeprefix('decoder.layers.')}": tensor[i] for i in range(tensor.shape[0])}
        else:
            out[key] = tensor
    return out


def dcp_keys(directory) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def megatrons_moments(root) -> dict[str, torch.Tensor]:
    """Megatron's view of the trained Adam state: `optim.<state>.<model name>`, layers unstacked."""
    return {f"optim.{state}.{name}": t for state in MOMENTS for name, t in by_layer(dcp_tensors(root / "moments" / state)).items()}


def as_transformers(name: str, tensor: torch.Tensor, model_shape) -> dict[str, torch.Tensor]:
    """A Llama layer's Megatron tensor as transformers' tensors (QKV per query group, fc1 as gate then up)."""
    s = model_shape
    head_dim, per_group = s.hidden_size // s.num_attention_heads, s.num_attention_heads // s.num_query_groups
    tops = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in tops:
        return {tops[name]: tensor}
    layer, part = name.removeprefix("decoder.layers.").split(".", 1)
    out = f"model.layers.{layer}."
    if part == "self_attention.linear_qkv.weight":
        groups = tensor.reshape(s.num_query_groups, (per_group + 2) * head_dim, -1)
        q, k, v = groups.split([per_group * head_dim, head_dim, head_dim], dim=1)
        return {f"{out}self_attn.{n}_proj.weight": t.reshape(-1, tensor.shape[-1]) for n, t in zip("qkv", (q, k, v), strict=True)}
    if part == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return {f"{out}mlp.gate_proj.weight": gate, f"{out}mlp.up_proj.weight": up}
    parts = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    return {out + parts[part]: tensor}


def test_dp_reshardable_moments_equal_megatrons(trained):
    root, _ = trained("llama")
    expected = megatrons_moments(root)
    summary = json.loads(run_cli("inspect", root / "dp", "--json").stdout)
    assert "dp_reshardable" in summary["optimizer_kind"] and "moments by parameter, step 3" in summary["optimizer_kind"]
    assert summary["parallel"] == {"tensor": 2, "pipeline": 1, "data": 2}
    assert len([k for k in dcp_keys(root / "dp") if k.endswith(".exp_avg")]) == 2 * 4  # four buckets per TP rank
    with fsdpkit.open_checkpoint(root / "dp") as opened:
        assert set(opened.optimizer) == set(expected) and opened.step == 3
        for name, tensor in expected.items():
            assert torch.equal(opened.get_tensor(name), tensor), name
        assert [g["settings"]["weight_decay"] for g in opened.groups] == [0.01, 0.0]  # Megatron's groups: wd_mult 1 and 0
    # fully_reshardable holds one tensor per parameter: read as stored (torch's DCP reading of it)
    tensors = dcp_tensors(root / "full")
    stored = {}
    for state in MOMENTS:
        prefix = f"optimizer.state.{state}."
        stacked = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
        stored |= {f"optim.{state}.{name}": t for name, t in by_layer(stacked).items()}
    with fsdpkit.open_checkpoint(root / "full") as opened:
        assert set(opened.optimizer) == set(stored)
        assert all(torch.equal(opened.get_tensor(name), stored[name]) for name in opened.optimizer)


def test_convert_with_optimizer_and_train_resumes(trained, tmp_path):
    root, model_shape = trained("llama")
    expected = {}
    for name, tensor in megatrons_moments(root).items():
        state, model_name = name.split(".", 2)[1:]
        expected |= {f"optim.{state}.{n}": t for n, t in as_transformers(model_name, tensor, model_shape).items()}
    done = run_cli("convert", root / "dp", tmp_path / "sharded", "--to", "sharded", "--world-size", "2", "--with-optimizer", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert (report["optimizer"], report["step"], report["optimizer_tensors"]) == ("dp_reshardable", 3, 3 * len(expected) // 2)
    assert run_cli("convert", root / "dp", tmp_path / "full", "--to", "full", "--with-optimizer").exit_code == 0
    for out in ("sharded", "full"):
        with fsdpkit.open_checkpoint(tmp_path / out) as converted:
            assert {n for n in converted.optimizer if not n.startswith("optim.step.")} == set(expected), out
            for name, tensor in expected.items():
                assert torch.equal(converted.get_tensor(name), tensor), (out, name)
    with fsdpkit.open_checkpoint(tmp_path / "sharded") as converted:
        steps = [converted.get_tensor(n).item() for n in converted.optimizer if n.startswith("optim.step.")]
        assert steps == [3.0] * (len(expected) // 2)
    spread = ["convert", root / "dp", tmp_path / "spread", "--to", "sharded", "--world-size", "2", "--nproc-per-node", "2"]
    refused = run_cli(*spread, "--with-optimizer")  # the step has no scratch file to come from there
    assert refused.exit_code == 2 and "convert in one process" in refused.output and not (tmp_path / "spread").exists()
    common = ["--model", f"hf:{tmp_path / 'full'}", "--nproc-per-node", "2", "--seq-len", "8", "--global-batch-size", "4", "--json"]
    resumed = run_cli("train", *common, "--resume", tmp_path / "sharded", "--steps", "4", "--save-dir", tmp_path / "resumed")
    assert resumed.exit_code == 0, resumed.output
    run = json.loads(resumed.stdout)
    assert run["resumed_from_step"] == 3 and len(run["losses"]) == 1


def test_a_layout_fsdpkit_cannot_rebuild_is_refused_in_one_line(trained, tmp_path):
    root, _ = trained("llama")
    changed = tmp_path / "te"
    shutil.copytree(root / "dp", changed)
    common = torch.load(changed / "common.pt", weights_only=False)
    args = vars(common["args"]) | {"transformer_impl": "transformer_engine"}
    torch.save(common | {"args": argparse.Namespace(**args)}, changed / "common.pt")
    refused = run_cli("convert", changed, tmp_path / "out", "--to", "sharded", "--world-size", "2", "--with-optimizer")
    assert refused.exit_code == 2 and not (tmp_path / "out").exists()
    assert "transformer_impl 'transformer_engine'" in refused.output and len(refused.output.strip().splitlines()) == 1
    assert "moments not convertible" in json.loads(run_cli("inspect", changed, "--json").stdout)["optimizer_kind"]
    done = run_cli("convert", changed, tmp_path / "model-only", "--to", "full", "--json")
    assert done.exit_code == 0 and "not converted" not in done.stderr, done.output
    assert "transformer_engine" in json.loads(done.stdout)["optimizer_not_converted"]


def test_tied_pipelined_moments_equal_megatrons(trained, tmp_path):
    root, _ = trained("gpt")
    expected = megatrons_moments(root)
    assert any("dtype_(torch.bfloat16, torch.float32)" in key for key in dcp_keys(root / "dp"))  # bf16 weights, fp32 state
    with fsdpkit.open_checkpoint(root / "dp") as opened:
        assert set(opened.optimizer) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(opened.get_tensor(name), tensor), name
    done = run_cli("convert", root / "dp", tmp_path / "sharded", "--to", "sharded", "--world-size", "2", "--with-optimizer", "--json")
    assert done.exit_code == 0, done.output
    with fsdpkit.open_checkpoint(tmp_path / "sharded") as converted:
        moments = [n for n in converted.optimizer if n.startswith("optim.exp_avg.")]
        assert len(moments) == len(converted.model)  # GPT-2 keeps no lm_head of its own: tied to wte
        assert all(converted.shape(n) == converted.shape(n.removeprefix("optim.exp_avg.")) for n in moments)


def test_fully_sharded_model_space_is_refused_in_one_line(trained, tmp_path):
    """megatron-core 0.16.1 cannot save `fully_sharded_model_space` (its ShardedTensor refuses the
    flattened_range that sharding builds), so no such checkpoint is tested: one that records it
    (Megatron's fully_reshardable save, its common state saying fully_sharded_model_space) has its
    moments refused in one line, and its model still converts."""
    root, _ = trained("llama")
    changed = tmp_path / "fsms"
    shutil.copytree(root / "full", changed)
    common = torch.load(changed / "common.pt", weights_only=False)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    common["content_metadata"]["distrib_optim_sharding_type"] = "fully_sharded_model_space"
    torch.save(common, changed / "common.pt")
    refused = run_cli("convert", changed, tmp_path / "out", "--to", "sharded", "--world-size", "2", "--with-optimizer")
    assert refused.exit_code == 2 and not (tmp_path / "out").exists()
    assert "fully_sharded_model_space sharding is not converted" in refused.output and len(refused.output.strip().splitlines()) == 1
    assert "moments not convertible" in json.loads(run_cli("inspect", changed, "--json").stdout)["optimizer_kind"]
    done = run_cli("convert", changed, tmp_path / "model-only", "--to", "full", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["optimizer"] == "fully_sharded_model_space"
