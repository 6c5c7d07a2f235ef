"""`fsdpkit train`: parse the flags, run the library, print the summary."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from fsdpkit.errors import UsageError
from fsdpkit.launch import LaunchOptions
from fsdpkit.sizes import format_size

from .app import app
from .common import handle_errors, print_json
from .launch_options import NnodesOption, NodeRankOption, NprocOption, RdzvOption


def _parse_betas(text: str) -> tuple[float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--betas {text!r} must be two numbers separated by a comma, e.g. 0.9,0.95") from None
    if len(values) != 2:
        raise UsageError(f"--betas {text!r} must be two numbers separated by a comma, e.g. 0.9,0.95")
    return values  # type: ignore[return-value]


@app.command("train")
@handle_errors
def train(
    model: Annotated[str, typer.Option(help="gpt-tiny, gpt-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl, or package.module:factory.")] = "gpt-tiny",
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocabulary size, if the model has no vocab_size attribute.")] = None,
    wrap: Annotated[Optional[list[str]], typer.Option(help="package.module:ClassName whose instances are units (repeatable).")] = None,
    data: Annotated[str, typer.Option(help="'synthetic' (seeded) or a path to a text file, read as bytes.")] = "synthetic",
    steps: Annotated[int, typer.Option(help="The step count the run ends at.")] = 20,
    global_batch_size: Annotated[int, typer.Option(help="Sequences per optimizer step, over all ranks and micro-batches.")] = 8,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step.")] = 1,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed for weights and data.")] = 0,
    optimizer: Annotated[str, typer.Option(help="adamw or sgd.")] = "adamw",
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 3e-3,
    weight_decay: Annotated[float, typer.Option(help="Weight decay on matrices and embeddings (not biases or norms).")] = 0.1,
    betas: Annotated[str, typer.Option(help="AdamW betas, e.g. 0.9,0.95.")] = "0.9,0.95",
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 0,
    lr_schedule: Annotated[str, typer.Option(help="constant or cosine.")] = "constant",
    lr_decay_steps: Annotated[Optional[int], typer.Option(help="Steps the cosine schedule decays over (default: --steps; set it to extend a run exactly).")] = None,
    eval_every: Annotated[int, typer.Option(help="Held-out loss every N steps (0: never).")] = 0,
    metrics: Annotated[Optional[str], typer.Option(help="Append one JSON line per step to this file.")] = None,
    strategy: Annotated[str, typer.Option(help="full, grad-op, hybrid or none.")] = "full",
    shard_group_size: Annotated[Optional[int], typer.Option(help="Ranks per shard group with --strategy hybrid.")] = None,
    mixed_precision: Annotated[str, typer.Option(help="bf16, fp16 or none.")] = "none",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    wrap_min_params: Annotated[Optional[int], typer.Option(help="Also make a unit of every module holding at least N parameters not already in a nested unit.")] = None,
    wrap_every: Annotated[int, typer.Option(help="K consecutive blocks per unit.")] = 1,
    no_sync: Annotated[bool, typer.Option("--no-sync", help="With --grad-accum: accumulate unsharded gradients locally, reduce once on the last micro-batch.")] = False,
    max_grad_norm: Annotated[Optional[float], typer.Option(help="Clip the global gradient norm to this value.")] = None,
    cpu_offload: Annotated[bool, typer.Option("--cpu-offload", help="Keep sharded parameters, gradients and optimizer state in host memory; step there.")] = False,
    activation_checkpointing: Annotated[bool, typer.Option("--activation-checkpointing", help="Recompute each unit's activations in backward.")] = False,
    deferred_init: Annotated[Optional[bool], typer.Option("--deferred-init/--eager-init", help="Build on the meta device and materialise unit by unit (default for built-in models).", show_default=False)] = None,
    backward_prefetch: Annotated[str, typer.Option(help="pre, post or none: when the next unit's all-gather is issued in backward.")] = "pre",
    forward_prefetch: Annotated[bool, typer.Option("--forward-prefetch", help="Issue the next unit's all-gather before the current unit's forward.")] = False,
    limit_all_gathers: Annotated[int, typer.Option(help="Most all-gathers in flight (0: no limit).")] = 2,
    save_dir: Annotated[Optional[str], typer.Option(help="Run directory for sharded checkpoints (step-NNNNNNNN/ and latest); on several nodes, a filesystem all see.")] = None,
    save_every: Annotated[int, typer.Option(help="Save every N steps (0: only at the end).")] = 0,
    keep_last: Annotated[Optional[int], typer.Option(help="Keep only the newest K complete checkpoints.")] = None,
    async_save: Annotated[bool, typer.Option("--async-save", help="Write checkpoints in a background thread while training goes on.")] = False,
    resume: Annotated[Optional[str], typer.Option(help="Resume from a run directory (its latest) or a step-* directory, at any world size.")] = None,
    strict: Annotated[bool, typer.Option("--strict/--no-strict", help="Missing optimizer state in --resume is an error (--no-strict: start it fresh).")] = True,
    init_from: Annotated[Optional[str], typer.Option(help="Start from the weights of a full safetensors or sharded checkpoint.")] = None,
    nproc_per_node: NprocOption = 2,
    nnodes: NnodesOption = 1,
    node_rank: NodeRankOption = 0,
    rdzv_endpoint: RdzvOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Train a model with fsdpkit's sharded engine across several processes."""
    from fsdpkit.train.config import TrainConfig
    from fsdpkit.train.launcher import run_in_process_group, run_training

    config = TrainConfig(
        model=model, vocab_size=vocab_size, wrap=tuple(wrap or ()), data=data, steps=steps,
        global_batch_size=global_batch_size, grad_accum=grad_accum, seq_len=seq_len, seed=seed,
        optimizer=optimizer, lr=lr, weight_decay=weight_decay, betas=_parse_betas(betas),
        warmup_steps=warmup_steps, lr_schedule=lr_schedule, lr_decay_steps=lr_decay_steps, eval_every=eval_every, metrics=metrics,
        strategy=strategy, shard_group_size=shard_group_size, mixed_precision=mixed_precision, device=device,
        wrap_min_params=wrap_min_params, wrap_every=wrap_every, no_sync=no_sync, max_grad_norm=max_grad_norm,
        cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing, deferred_init=deferred_init,
        backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
        save_dir=save_dir, save_every=save_every, keep_last=keep_last, async_save=async_save, resume=resume,
        strict=strict, init_from=init_from,
    )
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        summary = run_in_process_group(config)  # already a worker, started by torchrun
    else:
        options = LaunchOptions(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
        summary = run_training(config, options)
    if summary is None:
        return
    if json_output:
        print_json(summary)
    else:
        typer.echo(format_summary(summary))


def format_summary(summary: dict) -> str:
    losses = summary["losses"]
    lines = [
        f"model            {summary['model']} ({summary['num_params']:,} parameters)",
        f"world size       {summary['world_size']} ({summary['strategy']} sharding, {summary['device']}, mixed precision {summary['mixed_precision']})",
        f"steps            {summary['steps']} x {summary['global_batch_size']} sequences x {summary['seq_len']} tokens",
        f"loss             {losses[0]:.4f} -> {summary['final_loss']:.4f}" if losses else "loss             (no steps run)",
        f"throughput       {summary['tokens_per_second']:,.0f} tokens/s" if summary["tokens_per_second"] else "",
        f"peak memory      {format_size(summary['peak_memory_bytes'])} per rank (max over ranks)",
    ]
    for entry in summary.get("eval_losses") or []:
        lines.append(f"eval loss        {entry['loss']:.4f} at step {entry['step']}")
    if summary.get("checkpoint"):
        lines.append(f"checkpoint       {summary['checkpoint']}")
    return "\n".join(line for line in lines if line)
