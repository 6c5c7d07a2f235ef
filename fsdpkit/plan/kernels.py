"""Bytes that bandwidth-bound kernels move through device memory beside the model's own
operators (which fsdpkit.plan.flops counts): the optimizer step, the engine's casts and
gradient copies, and the loss. Pure arithmetic, per training step on one rank.

    optimizer   AdamW as torch runs it by default (one kernel per operation: a foreach kernel
                over every tensor on CUDA, a loop over tensors on CPU) reads and writes the
                fp32 parameter, gradient and two moments in eight passes; the fused kernel in
                one. Every parameter is charged the weight-decay pass.
    casts       an all-gather first casts the rank's fp32 chunk to a lower compute dtype; at
                shard factor 1 that copy is then copied into the unit's full buffer (none where the
                full buffer is the shard: fp32 without sharding). A reduction concatenates the
                parameters' gradients into the unit's flat gradient, casts it to the reduce
                dtype, and turns the reduced chunk into the fp32 sharded gradient and averages
                it. Under CPU offload the host side is charged as host copies instead.
    loss        cross-entropy on fp32 logits (as fsdpkit's step computes it): the cast of the
                logits to fp32, log-softmax, and in backward the one-hot gradient, log-softmax's
                backward and the cast back. A row of logits is re-read from cache, not memory.
"""

from __future__ import annotations

import enum

from ..models.recipe import Optimizer

FP32 = 4


class OptimizerKernel(enum.Enum):
    EAGER = "eager"  # torch's default: one kernel per operation
    FUSED = "fused"  # torch's fused=True: one kernel for the whole update


def optimizer_kernel_for(parameters_on_gpu: bool) -> OptimizerKernel:
    """The optimizer kernel `fsdpkit train` builds and the plan charges: torch's fused one where
    every parameter is on a GPU, its default otherwise (CPU, or --cpu-offload's host shards)."""
    return OptimizerKernel.FUSED if parameters_on_gpu else OptimizerKernel.EAGER


# (operation, tensors read, tensors written) per element, every tensor fp32
OPTIMIZER_PASSES: dict[tuple[Optimizer, OptimizerKernel], tuple[tuple[str, int, int], ...]] = {
    (Optimizer.ADAMW, OptimizerKernel.EAGER): (
        ("param *= 1 - lr * weight_decay", 1, 1),
        ("exp_avg.lerp_(grad)", 2, 1),
        ("exp_avg_sq *= beta2", 1, 1),
        ("exp_avg_sq.addcmul_(grad, grad)", 2, 1),
        ("denom = sqrt(exp_avg_sq)", 1, 1),
        ("denom /= bias_correction", 1, 1),
        ("denom += eps", 1, 1),
        ("param.addcdiv_(exp_avg, denom)", 3, 1),
    ),
    (Optimizer.ADAMW, OptimizerKernel.FUSED): (("fused AdamW: param, grad, exp_avg, exp_avg_sq", 4, 3),),
    (Optimizer.SGD, OptimizerKernel.EAGER): (("param.add_(grad, alpha=-lr)", 2, 1),),
    (Optimizer.SGD, OptimizerKernel.FUSED): (("param.add_(grad, alpha=-lr)", 2, 1),),
}


def optimizer_bytes_per_element(optimizer: Optimizer, kernel: OptimizerKernel) -> int:
    """Bytes one optimizer step reads and writes per parameter element."""
    return FP32 * sum(read + written for _, read, written in OPTIMIZER_PASSES[optimizer, kernel])


def gather_cast_bytes(padded: int, chunk: int, *, shard_factor: int, master: int, compute: int, offload: bool) -> int:
    """Bytes one all-gather of a unit (`padded` elements, this rank's `chunk`) moves through device
    memory beside the collective: the cast of the chunk to the compute dtype, and at shard factor 1
    the copy into the full buffer. 0 where the full buffer is the shard itself."""
    if shard_factor == 1 and compute == master and not offload:
        return 0
    # no cast in the master dtype (the chunk itself is sent); under offload the cast is the host copy
    cast = chunk * (master + compute) if compute != master and not offload else 0
    return cast + (2 * padded * compute if shard_factor == 1 else 0)


def reduce_cast_bytes(padded: int, chunk: int, *, master: int, compute: int, reduce: int, offload: bool) -> int:
    """Bytes one reduction of a unit's gradient moves through device memory beside the collective:
    the flat gradient concatenated from the parameters' own, its cast to the reduce dtype, and the
    reduced chunk cast to fp32 and averaged (on the host under offload: not charged here)."""
    concatenate = 2 * padded * compute
    to_reduce = padded * (compute + reduce) if reduce != compute else 0
    if offload:
        return concatenate + to_reduce
    to_master = chunk * (reduce + master) if reduce != master else 0
    return concatenate + to_reduce + to_master + 2 * chunk * master


def loss_bytes(tokens: int, vocab: int, *, compute: int) -> int:
    """Bytes the cross-entropy of `tokens` rows of `vocab` logits (computed in `compute` bytes per
    element) moves in forward and backward."""
    logits = tokens * vocab
    cast = 2 * logits * (compute + FP32) if compute != FP32 else 0  # to fp32, and the gradient back
    log_softmax = 2 * logits * FP32  # reads the logits, writes the log-probabilities
    one_hot = logits * FP32  # nll_loss's backward writes a full gradient, zero but at the targets
    log_softmax_backward = 3 * logits * FP32  # reads that gradient and its output, writes the logits' gradient
    return cast + log_softmax + one_hot + log_softmax_backward
