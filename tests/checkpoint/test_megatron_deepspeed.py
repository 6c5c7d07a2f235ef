"""`convert --to megatron` of DeepSpeed ZeRO-3 checkpoints, against both tools: DeepSpeed's own
`save_checkpoint` writes a GPT-2 (Conv1D weights, tied head) and a Llama (GQA, untied head) after
one AdamW step at 2 ranks; DeepSpeed's `zero_to_fp32` gives their weights, which transformers'
models turn into the expected logits; Megatron's `dist_checkpointing.load` of fsdpkit's output at
TP=2 PP=2 gives the same logits. DeepSpeed writes no config.json: the shape comes from `--model
hf:DIR` or a config.json beside the save directory's `latest` (as transformers' Trainer keeps it),
and without either the convert is refused in one line."""

import shutil

import torch
from support.checkpoint_files import run_cli
from support.distributed import run_distributed

TOLERANCE = 1e-5
STYLES = {"gpt2": "gpt", "llama": "llama"}  # DeepSpeed run -> megatron_oracle style


def deepspeeds_logits(save_dir, config, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the weights DeepSpeed's own zero_to_fp32 reads from `save_dir`."""
    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # GPT-2's head is tied to wte
    with torch.no_grad():
        return model(tokens).logits


def files_of(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_deepspeed_zero3_gpt2_and_llama_load_in_megatron_at_tp2_pp2(tmp_path):
    from support import deepspeed_models, megatron_oracle

    run_distributed(deepspeed_models.save_zero3, 2, str(tmp_path / "ds"))
    checks, expected = [], []
    for name, config in deepspeed_models.configs().items():
        source, out = tmp_path / "ds" / name, tmp_path / f"{name}-megatron"
        config.save_pretrained(tmp_path / f"{name}-config")
        refused = run_cli("convert", source, tmp_path / "refused", "--to", "megatron")
        assert refused.exit_code == 2 and not (tmp_path / "refused").exists(), refused.output
        assert refused.output.count("\n") == 1 and "--model hf:DIR" in refused.output
        done = run_cli("convert", source, out, "--to", "megatron", "--model", f"hf:{tmp_path / f'{name}-config'}")
        assert done.exit_code == 0, done.output
        # config.json beside `latest`, as transformers' Trainer saves it: found there, the same bytes written
        trainer = tmp_path / f"{name}-trainer"
        shutil.copytree(source, trainer)
        shutil.copy(tmp_path / f"{name}-config" / "config.json", trainer)
        done = run_cli("convert", trainer, tmp_path / f"{name}-trainer-megatron", "--to", "megatron")
        assert done.exit_code == 0, done.output
        assert files_of(tmp_path / f"{name}-trainer-megatron") == files_of(out)
        model_shape = megatron_oracle.shape(STYLES[name], num_layers=2, openai_gelu=name == "gpt2")
        tokens = torch.randint(0, model_shape.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        checks.append((str(out), model_shape, tokens))
        expected.append(deepspeeds_logits(source, config, tokens))
    for loaded, logits in zip(megatron_oracle.load_logits_of(checks), expected, strict=True):
        assert (loaded - logits).abs().max().item() < TOLERANCE
