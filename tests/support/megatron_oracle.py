"""Megatron-Core itself as the oracle for Megatron checkpoints: it writes `torch_dist` checkpoints
of a tiny GPTModel, runs its own forward, and loads a checkpoint back into a model, all on CPU
with gloo (local layer spec, no Transformer Engine, no Apex).

Every public function spawns `tp * pp * dp` processes (torch.multiprocessing, spawn start
method), so a script calling them needs an `if __name__ == "__main__":` guard. This module
imports only torch and megatron-core (no fsdpkit), so the fixture scripts beside the committed
fixtures can use it under other megatron-core versions in throwaway environments.

Styles (one model shape each, see `shape`):
- llama: RMSNorm, SwiGLU, RoPE, GQA (query groups < heads), no biases, untied output layer.
- qwen2: llama plus a bias on the fused QKV projection.
- gpt:   LayerNorm, GELU, learned absolute positions, biases everywhere, tied output layer.

Weights are deterministic given (style, seed, tp, pp): Megatron initialises on CPU from the
seed, then every parameter gets a seeded perturbation (so norms and biases are not 1 and 0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.multiprocessing as mp

STYLES = ("llama", "qwen2", "gpt")
OPTIMIZER_SHARDING = "dp_reshardable"  # Megatron-LM's default distributed optimizer format, recorded in content_metadata
OPTIMIZER_SHARDINGS = ("dp_reshardable", "fully_reshardable")


@dataclass(frozen=True)
class MegatronShape:
    style: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int  # already padded: Megatron-LM's padded_vocab_size
    max_position_embeddings: int
    normalization: str  # "RMSNorm" | "LayerNorm"
    swiglu: bool
    position_embedding_type: str  # "rope" | "learned_absolute"
    add_bias_linear: bool
    add_qkv_bias: bool
    untie_embeddings_and_output_weights: bool
    norm_epsilon: float = 1e-5
    rotary_base: int = 10000
    openai_gelu: bool = False  # GELU's tanh approximation (Megatron-LM's --openai-gelu, transformers' gelu_new)


def shape(style: str, **overrides: Any) -> MegatronShape:
    """The default tiny shape of a style; keyword overrides replace fields (e.g. num_layers=2)."""
    if style not in STYLES:
        raise ValueError(f"style {style!r} is not one of {STYLES}")
    llama_like = style != "gpt"
    base = MegatronShape(
        style=style,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2 if llama_like else 4,
        ffn_hidden_size=96 if llama_like else 256,
        vocab_size=128,
        max_position_embeddings=32,
        normalization="RMSNorm" if llama_like else "LayerNorm",
        swiglu=llama_like,
        position_embedding_type="rope" if llama_like else "learned_absolute",
        add_bias_linear=not llama_like,
        add_qkv_bias=style == "qwen2",
        untie_embeddings_and_output_weights=llama_like,
    )
    return replace(base, **overrides)


@dataclass(frozen=True)
class Parallel:
    tp: int = 2
    pp: int = 2
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def save_checkpoint(
    directory: str,
    model_shape: MegatronShape,
    tokens: torch.Tensor | None = None,
    *,
    seed: int = 0,
    parallel: Parallel = Parallel(),
    iteration: int | None = None,
    backend: str = "torch_dist",
    layout: str = "megatron_lm",
    integrity: bool = False,
) -> torch.Tensor | None:
    """Megatron writes a `torch_dist` checkpoint of a seeded model into `directory` (as Megatron-LM
    does: model, args, checkpoint_version, iteration, rng_state; no optimizer: `train_and_save`
    writes one). `backend` "zarr" is the legacy format (megatron-core <= 0.15 with zarr 2). `layout`
    "nemo2" writes what NeMo 2's MegatronStrategy saves into a checkpoint's `weights/`: model keys
    under "module.", and Lightning's entries as the common state instead of Megatron-LM's.
    `integrity` (megatron-core >= 0.19) adds `integrity.json`, the SHA-256 of every file. With `iteration`, `directory` is a
    Megatron-LM save root: the checkpoint goes to `iter_{iteration:07d}/` beside
    `latest_checkpointed_iteration.txt`. Returns Megatron's logits [batch, seq, vocab] of the saved
    weights on `tokens` [batch, seq] when given."""
    job = _save_job(directory, model_shape, tokens, seed=seed, iteration=iteration, backend=backend, layout=layout, integrity=integrity)
    return _launch(job, parallel)


def save_checkpoints(
    checkpoints: list[tuple[str, MegatronShape, torch.Tensor, int]], *, parallel: Parallel = Parallel()
) -> list[torch.Tensor]:
    """`save_checkpoint` of each (directory, shape, tokens, seed), all in one launch (one start-up of
    Megatron); Megatron's logits of each."""
    entries = [_save_job(directory, model_shape, tokens, seed=seed) for directory, model_shape, tokens, seed in checkpoints]
    return _launch({"kind": "save_many", "entries": entries}, parallel)


def save_then_load_logits(
    directory: str, model_shape: MegatronShape, tokens: torch.Tensor, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`save_checkpoint` then `load_logits` of it, in one launch (one start-up of Megatron): the
    saved model's logits and those of the model built from another seed that loaded the checkpoint."""
    job = _save_job(directory, model_shape, tokens, seed=seed, kind="save_then_load")
    return _launch(job, Parallel())


def _save_job(directory: str, model_shape: MegatronShape, tokens: torch.Tensor | None, *, seed: int, **options: Any) -> dict:
    options = {"kind": "save", "iteration": None, "backend": "torch_dist", "layout": "megatron_lm", "integrity": False, **options}
    return {"directory": directory, "shape": asdict(model_shape), "tokens": tokens, "seed": seed, **options}


def train_and_save(
    directories: dict[str, str],
    model_shape: MegatronShape,
    *,
    seed: int = 0,
    parallel: Parallel = Parallel(tp=2, pp=1, dp=2),
    steps: int = 3,
    bucket_size: int | None = None,
    bf16: bool = False,
    moments_directory: str | None = None,
) -> None:
    """Megatron-LM's training as far as the checkpoint sees it: the seeded model wrapped in
    Megatron's DistributedDataParallel with its DistributedOptimizer (Adam with decoupled weight
    decay, Megatron's default param groups: no decay on biases and norms), `steps` real steps on
    seeded tokens (a two-stage pipeline by hand where pp is 2; the tied embedding's gradients
    all-reduced by Megatron's finalize_model_grads), then one save of model and optimizer per
    entry of `directories` ({sharding type: directory}, from OPTIMIZER_SHARDINGS), all of the same
    trained state. `bucket_size` (elements) splits the grad buffers into buckets as Megatron-LM's
    --overlap-grad-reduce does; None: one bucket per buffer. `bf16`: bf16 parameters with fp32
    main parameters. `moments_directory`: Megatron's own view of the trained Adam state, for
    `moments` (see `_save_moments`). On CPU with gloo, see `_optimizer_cpu_shims`.

    (Megatron's `fully_reshardable` save is no oracle for the moments: 0.16.1 places a bucket's
    parameters by their index in the padded buffer within its unpadded gather, so where a bucket
    ends off a multiple of lcm(DP, 128), e.g. before the tied embedding's own bucket at PP > 1,
    the next bucket's parameters come out shifted.)"""
    job = {"kind": "train", "directories": directories, "shape": asdict(model_shape), "seed": seed, "steps": steps}
    job.update(bucket_size=bucket_size, bf16=bf16, moments_directory=moments_directory)
    _launch(job, parallel)


def moments(moments_directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {checkpoint key: tensor}}: Megatron's view of the Adam state that
    `train_and_save(..., moments_directory=...)` saved, read whole by Megatron's own
    `dist_checkpointing.load_plain_tensors`."""
    return {state: plain_tensors(os.path.join(moments_directory, state)) for state in ("exp_avg", "exp_avg_sq")}


def forward_logits(model_shape: MegatronShape, tokens: torch.Tensor, *, seed: int = 0, parallel: Parallel = Parallel()) -> torch.Tensor:
    """Megatron's logits [batch, seq, vocab] on `tokens` of the seeded model (nothing saved)."""
    job = {"kind": "forward", "shape": asdict(model_shape), "tokens": tokens, "seed": seed}
    return _launch(job, parallel)


def load_logits(
    directory: str, model_shape: MegatronShape, tokens: torch.Tensor, *, parallel: Parallel = Parallel(), key_prefix: str = ""
) -> torch.Tensor:
    """`dist_checkpointing.load` of the `torch_dist` checkpoint `directory` into a model of
    `model_shape` at `parallel` (built from another seed, so every weight must come from the
    checkpoint; a missing key fails the load); returns Megatron's logits on `tokens`.
    `key_prefix` "module." reads a NeMo 2 checkpoint's `weights/`."""
    job = {"kind": "load", "directory": directory, "shape": asdict(model_shape), "tokens": tokens, "seed": 12345}
    job["prefix"] = key_prefix
    return _launch(job, parallel)


def load_logits_of(checkpoints: list[tuple[str, MegatronShape, torch.Tensor]], *, parallel: Parallel = Parallel()) -> list[torch.Tensor]:
    """`load_logits` of each (directory, shape, tokens), all in one launch (one start-up of Megatron)."""
    entries = [{"directory": d, "shape": asdict(s), "tokens": t, "seed": 12345, "prefix": ""} for d, s, t in checkpoints]
    return _launch({"kind": "load_many", "entries": entries}, parallel)


def plain_tensors(directory: str) -> dict[str, Any]:
    """Megatron's own `dist_checkpointing.load_plain_tensors`: every tensor of the checkpoint,
    whole and unsharded, under its checkpoint key (one process)."""
    job = {"kind": "plain", "directory": directory}
    return _launch(job, Parallel(tp=1, pp=1, dp=1))


def common_state(directory: str) -> dict[str, Any]:
    """Megatron's own `dist_checkpointing.load_common_state_dict` (args, iteration, ...)."""
    job = {"kind": "common", "directory": directory}
    return _launch(job, Parallel(tp=1, pp=1, dp=1))


def megatron_lm_args(model_shape: MegatronShape, parallel: Parallel, iteration: int) -> argparse.Namespace:
    """The subset of Megatron-LM's `args` that describes the model and the run, under
    Megatron-LM's own names (the whole Namespace has several hundred entries)."""
    s = model_shape
    return argparse.Namespace(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_attention_heads,
        group_query_attention=s.num_query_groups != s.num_attention_heads,
        num_query_groups=s.num_query_groups,
        kv_channels=s.hidden_size // s.num_attention_heads,
        max_position_embeddings=s.max_position_embeddings,
        seq_length=s.max_position_embeddings,
        position_embedding_type=s.position_embedding_type,
        rotary_base=s.rotary_base,
        rotary_percent=1.0,
        use_rotary_position_embeddings=s.position_embedding_type == "rope",
        normalization=s.normalization,
        norm_epsilon=s.norm_epsilon,
        swiglu=s.swiglu,
        openai_gelu=s.openai_gelu,
        squared_relu=False,
        add_bias_linear=s.add_bias_linear,
        add_qkv_bias=s.add_qkv_bias,
        untie_embeddings_and_output_weights=s.untie_embeddings_and_output_weights,
        qk_layernorm=False,
        num_experts=None,
        padded_vocab_size=s.vocab_size,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        data_parallel_size=parallel.dp,
        world_size=parallel.world,
        sequence_parallel=False,
        use_distributed_optimizer=True,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        dist_ckpt_optim_fully_reshardable=False,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        optimizer="adam",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        lr=1e-3,
        weight_decay=0.0,
        iteration=iteration,
        train_iters=iteration,
        consumed_train_samples=iteration,
        transformer_impl="local",
        tokenizer_type="NullTokenizer",
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(job: dict, parallel: Parallel) -> Any:
    with tempfile.TemporaryDirectory(prefix="megatron_oracle_") as results:
        port = _free_port()
        mp.start_processes(_entry, args=(parallel, port, job, results), nprocs=parallel.world, start_method="spawn")
        path = os.path.join(results, "result.pt")
        return torch.load(path, weights_only=False) if os.path.exists(path) else None


def _entry(rank: int, parallel: Parallel, port: int, job: dict, results: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=parallel.world)
    try:
        _cpu_shims()
        result = _JOBS[job["kind"]](job, parallel)
        if result is not None:
            torch.save(result, os.path.join(results, "result.pt"))
    finally:
        dist.destroy_process_group()


def _cpu_shims() -> None:
    """Megatron assumes CUDA in a few places that the CPU run does not need."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # the tied embedding's first all-reduce
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()  # type: ignore[method-assign,assignment,misc]


def _init_parallel(parallel: Parallel) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp)


def _transformer_config(s: MegatronShape, parallel: Parallel, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    return TransformerConfig(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups,
        ffn_hidden_size=s.ffn_hidden_size,
        kv_channels=s.hidden_size // s.num_attention_heads,
        normalization=s.normalization,
        layernorm_epsilon=s.norm_epsilon,
        gated_linear_unit=s.swiglu,
        activation_func=F.silu if s.swiglu else openai_gelu if s.openai_gelu else F.gelu,
        add_bias_linear=s.add_bias_linear,
        add_qkv_bias=s.add_qkv_bias,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _build_model(s: MegatronShape, parallel: Parallel, seed: int, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    model = GPTModel(
        config=_transformer_config(s, parallel, dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=s.normalization),
        vocab_size=s.vocab_size,
        max_sequence_length=s.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not s.untie_embeddings_and_output_weights,
        position_embedding_type=s.position_embedding_type,
        rotary_base=s.rotary_base,
    )
    _perturb(model, seed)
    _tie_output_to_embedding(model)
    return model


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Seeded noise on every parameter: the same on the TP ranks that replicate a parameter,
    different per TP rank for a TP-sharded one, different per pipeline stage."""
    import zlib

    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            sharded = getattr(param, "tensor_model_parallel", False)
            key = f"{seed}/{pp_rank}/{tp_rank if sharded else -1}/{name}"
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _tie_output_to_embedding(model) -> None:  # type: ignore[no-untyped-def]
    """A tied model on several stages keeps a copy of the embedding on the last stage; Megatron
    makes it equal to the first stage's by one all-reduce over the embedding group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not model.share_embeddings_and_output_weights or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    weight = model.shared_embedding_or_output_weight()
    with torch.no_grad():
        if parallel_state.is_pipeline_last_stage():
            weight.zero_()
        dist.all_reduce(weight.data, group=parallel_state.get_embedding_group())


def _forward(model, tokens: torch.Tensor) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    """Megatron's forward through the pipeline stages; the full-vocabulary logits on the last
    stage's TP rank 0, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: not attended
    model.eval()
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(seq, batch, model.config.hidden_size)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, mask)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        logits = gather_from_tensor_model_parallel_region(out)
    first_replica = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    return logits if first_replica else None


def _job_forward(job: dict, parallel: Parallel) -> torch.Tensor | None:
    _init_parallel(parallel)
    model = _build_model(MegatronShape(**job["shape"]), parallel, job["seed"])
    return _forward(model, job["tokens"])


def _job_save(job: dict, parallel: Parallel) -> torch.Tensor | None:
    _init_parallel(parallel)
    return _save(job, parallel)


def _job_save_many(job: dict, parallel: Parallel) -> list[torch.Tensor | None] | None:
    _init_parallel(parallel)
    found = [_save(entry, parallel) for entry in job["entries"]]
    return found if found[0] is not None else None  # the logits' rank alone writes the result


def _job_save_then_load(job: dict, parallel: Parallel) -> tuple[torch.Tensor, torch.Tensor] | None:
    _init_parallel(parallel)
    saved = _save(job, parallel)
    loaded = _load_and_forward({**job, "seed": 12345, "prefix": ""}, parallel)  # another seed: every weight from the checkpoint
    return (saved, loaded) if saved is not None else None  # the logits' rank alone writes the result


def _save(job: dict, parallel: Parallel) -> torch.Tensor | None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    s = MegatronShape(**job["shape"])
    model = _build_model(s, parallel, job["seed"])
    logits = _forward(model, job["tokens"]) if job["tokens"] is not None else None
    iteration = job["iteration"] or 0
    content_metadata = {
        "distrib_optim_sharding_type": OPTIMIZER_SHARDING,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    if job["layout"] == "nemo2":
        state = _nemo2_state(model, iteration)
    else:
        state = {"args": megatron_lm_args(s, parallel, iteration), "checkpoint_version": 3.0, "iteration": iteration}
        state["model"] = model.sharded_state_dict(metadata=content_metadata)
        state["rng_state"] = _rng_state(parallel)
        state["num_floating_point_operations_so_far"] = 0
    directory = _checkpoint_dir(job["directory"], job["iteration"])
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    integrity = {"verify_integrity": True} if job.get("integrity") else {}
    dist_checkpointing.save(state, directory, sharded_strategy=(job["backend"], 1), content_metadata=content_metadata, **integrity)
    dist.barrier()
    if dist.get_rank() == 0 and job["iteration"] is not None:
        with open(os.path.join(job["directory"], "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    return logits


def _optimizer_cpu_shims() -> None:
    """megatron-core's DistributedOptimizer assumes CUDA in three places, shimmed here for the
    oracle's process only: MixedPrecisionOptimizer.__init__ allocates torch.tensor(...,
    device='cuda') and the grad buffers go to torch.cuda.current_device() (both land on the CPU
    through a torch function mode), and DistributedOptimizer takes only parameters whose type() is
    'torch.cuda.FloatTensor'/'HalfTensor'/'BFloat16Tensor' (a CPU float tensor reports its CUDA
    type name)."""
    from torch.overrides import TorchFunctionMode

    class OnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device == "cpu" or device is None:
                return func(*args, **kwargs)
            if isinstance(device, int) or torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    OnCpu().__enter__()  # for the rest of this spawned process
    cpu_type = torch.Tensor.type
    cuda_names = {"torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"}

    def reported_type(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if args or kwargs:
            return cpu_type(self, *args, **kwargs)
        name = cpu_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if name in cuda_names else name

    torch.Tensor.type = reported_type  # type: ignore[method-assign,assignment]


def _train_step(model, tokens: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """One forward and backward of next-token loss through one or two pipeline stages (DDP's
    hooks gather the gradients into its buffers)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    hidden = None
    if not first:
        hidden = torch.empty(seq, batch, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_()
        model.module.set_input_tensor(hidden)
    labels = torch.roll(tokens, -1, dims=1)
    out = model(tokens, positions, mask, labels=labels if last else None)
    if last:
        out.float().mean().backward()
        if hidden is not None:
            dist.send(hidden.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank())
        return
    dist.send(out.detach().contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
    grad = torch.empty_like(out)
    dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank())
    out.backward(grad)


def _job_train(job: dict, parallel: Parallel) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _optimizer_cpu_shims()
    _init_parallel(parallel)
    s = MegatronShape(**job["shape"])
    dtype = torch.bfloat16 if job["bf16"] else torch.float32
    module = _build_model(s, parallel, job["seed"], dtype)
    overlap = job["bucket_size"] is not None
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, bucket_size=job["bucket_size"]
    )
    if job["bf16"]:  # Megatron-LM's wrapper: inputs cast to bf16, the last stage's output back to fp32
        from megatron.core.transformer.module import Float16Module

        model = DistributedDataParallel(module.config, ddp_config, Float16Module(module.config, module))
    else:
        model = DistributedDataParallel(module.config, ddp_config, module)
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        use_distributed_optimizer=True, bf16=job["bf16"], params_dtype=dtype,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    generator = torch.Generator().manual_seed(1000 + job["seed"] + parallel_state.get_data_parallel_rank())
    for _ in range(job["steps"]):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _train_step(model, torch.randint(0, s.vocab_size, (2, 8), generator=generator))
        finalize_model_grads([model])
        stepped, _, _ = optimizer.step()
        assert stepped, "Megatron's optimizer skipped a step"
    _save_trained(job, parallel, s, module, optimizer, dtype, overlap)
    if job["moments_directory"] is not None:
        fp32 = module if dtype == torch.float32 else _build_model(s, parallel, job["seed"], torch.float32)  # holds fp32 moments
        _save_moments(job["moments_directory"], module, optimizer, fp32)


def _save_trained(job: dict, parallel: Parallel, s: MegatronShape, module, optimizer, dtype: torch.dtype, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    for sharding, root in job["directories"].items():
        metadata = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        args = megatron_lm_args(s, parallel, job["steps"])
        args.dist_ckpt_optim_fully_reshardable = sharding == "fully_reshardable"
        args.overlap_grad_reduce, args.ddp_bucket_size = overlap, job["bucket_size"]
        args.bf16, args.params_dtype, args.adam_beta2, args.weight_decay = job["bf16"], dtype, 0.95, 0.01
        state = {"args": args, "checkpoint_version": 3.0, "iteration": job["steps"], "num_floating_point_operations_so_far": 0}
        state["model"] = module.sharded_state_dict(metadata=metadata)
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=metadata)
        state["rng_state"] = _rng_state(parallel)
        if dist.get_rank() == 0:
            os.makedirs(root, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, root, sharded_strategy=("torch_dist", 1), content_metadata=metadata)
        dist.barrier()


def _save_moments(root: str, module, optimizer, fp32) -> None:  # type: ignore[no-untyped-def]
    """Megatron's own view of each parameter's Adam state: the inner optimizer's state of every
    data-parallel rank's share of the parameter (found by the parameter itself, through the
    DistributedOptimizer's own range map), summed over the data-parallel group into the whole
    (tensor-parallel-local) parameter, copied into the parameter of `fp32` (the model itself, or
    its float32 twin for a bf16 model), and saved through that model's own sharded state dict,
    so `root/<state>/` holds the state under the model's checkpoint keys, laid out by Megatron
    (layers stacked, QKV and fc1 as the model's)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    assert len(inner) == 1, "one distributed optimizer expected"
    distributed = inner[0]
    group = parallel_state.get_data_parallel_group()
    params = [p for _, p in module.named_parameters()]
    gathered: dict[str, list[torch.Tensor]] = {"exp_avg": [], "exp_avg_sq": []}
    ranges = {
        p: m
        for gbuf in distributed.gbuf_ranges
        for by_dtype in gbuf.values()
        for bucket in by_dtype
        for p, m in bucket["param_map"].items()
    }
    for param in params:
        held = distributed._get_main_param_and_optimizer_states(param) if param in ranges else {}
        for state, found in gathered.items():
            whole = torch.zeros(param.numel(), dtype=torch.float32)
            if param in ranges:
                span = ranges[param]["param"]
                whole[span.start : span.end] = held[state].float()
            dist.all_reduce(whole, group=group)
            found.append(whole)
    targets = [p for _, p in fp32.named_parameters()]
    for state, found in gathered.items():
        with torch.no_grad():
            for param, whole in zip(targets, found, strict=True):
                param.copy_(whole.view_as(param))
        directory = os.path.join(root, state)
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": fp32.sharded_state_dict()}, directory, sharded_strategy=("torch_dist", 1))
        dist.barrier()


def _nemo2_state(model, step: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """NeMo 2's MegatronStrategy.save_checkpoint: Lightning's checkpoint dict with the Megatron
    module's sharded state dict under "module." (MegatronParallel's prefix for the wrapped model)."""
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.5.1",
        "state_dict": {},
        "sharded_state_dict": model.sharded_state_dict(prefix="module."),
        "loops": {},
        "callbacks": {},
        "hyper_parameters": {},
    }


def _checkpoint_dir(root: str, iteration: int | None) -> str:
    return root if iteration is None else os.path.join(root, f"iter_{iteration:07d}")


def _rng_state(parallel: Parallel):  # type: ignore[no-untyped-def]
    """Megatron-LM's rng_state ShardedObject (no CUDA generator on CPU, so no cuda_rng_state)."""
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    states = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}]
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    return ShardedObject("rng_state", states, (parallel.pp, parallel.tp), (pp_rank, tp_rank), replica_id=dp_rank)


def _job_load(job: dict, parallel: Parallel) -> torch.Tensor | None:
    _init_parallel(parallel)
    return _load_and_forward(job, parallel)


def _load_and_forward(job: dict, parallel: Parallel) -> torch.Tensor | None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = _build_model(MegatronShape(**job["shape"]), parallel, job["seed"])
    request = {"model": model.sharded_state_dict(prefix=job["prefix"])}
    loaded = dist_checkpointing.load(request, job["directory"], strict=StrictHandling.RAISE_UNEXPECTED)
    state = {key.removeprefix(job["prefix"]): value for key, value in loaded["model"].items()}
    model.load_state_dict(state, strict=True)
    return _forward(model, job["tokens"])


def _job_load_many(job: dict, parallel: Parallel) -> list[torch.Tensor | None] | None:
    _init_parallel(parallel)
    found = [_load_and_forward(entry, parallel) for entry in job["entries"]]
    return found if found[0] is not None else None  # the logits' rank alone writes the result


def _job_plain(job: dict, parallel: Parallel) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_plain_tensors(job["directory"]))


def _job_common(job: dict, parallel: Parallel) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_common_state_dict(job["directory"]))


_JOBS = {
    "train": _job_train,
    "save": _job_save,
    "save_many": _job_save_many,
    "save_then_load": _job_save_then_load,
    "forward": _job_forward,
    "load": _job_load,
    "load_many": _job_load_many,
    "plain": _job_plain,
    "common": _job_common,
}
