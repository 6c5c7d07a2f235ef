"""What each unit computes, counted on a fake-tensor model (meta storage, nothing allocated;
CPU kernels chosen, so attention is the fused kernel a real run uses, not the decomposition
the meta device falls back to), for its forward and its backward:

    flops   torch's FLOP counter: matrix products and attention
    bytes   the memory every other operator reads and writes (elementwise, norms, softmax,
            casts, embeddings): eager PyTorch runs each as its own kernel, bound by memory
            bandwidth, not by the FLOP rate. Views move nothing and are not counted.
    ops     the operators dispatched (matrix products too, views not): eager PyTorch pays a
            fixed cost for each (dispatch, autograd bookkeeping, a kernel launch)
    activations  the bytes the forward's operators write (an upper bound of what autograd
            keeps for the backward), and the floating-point inputs of each unit (what
            activation checkpointing keeps instead)

The loss is not counted here: the backward starts from a gradient of the logits, and the
cross-entropy's bytes (fp32, whatever the compute dtype) are fsdpkit.plan.kernels.loss_bytes
of the logits' width, which the root's work carries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

from ..engine.wrapping import UnitSpec
from ..models.source import ModelSource

aten = torch.ops.aten
_COUNTED_AS_FLOPS = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten.convolution,
    aten.convolution_backward,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's counter knows the GPU attention kernels; the CPU one does the same work.
_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
_ATTENTION = {op for op in _COUNTED_AS_FLOPS if "attention" in str(op)}
_NOT_RUN = {aten._unsafe_view, aten.alias, aten.detach, aten.lift_fresh}
_NOT_MOVING = _COUNTED_AS_FLOPS | _NOT_RUN


@dataclass(frozen=True)
class UnitWork:
    forward_flops: int
    backward_flops: int
    forward_bytes: int
    backward_bytes: int
    forward_ops: int = 0  # operators dispatched (independent of the batch)
    backward_ops: int = 0
    forward_attention_flops: int = 0  # the part of forward_flops in attention kernels
    activation_bytes: int = 0  # written by the forward's operators
    input_bytes: int = 0  # the unit's floating-point inputs
    logits: int = 0  # the root's: logits per token, that the loss reads (0 for the other units)


class _ByteCounter(TorchDispatchMode):
    """Bytes read and written by operators that are not matrix products, and operators run, per module."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = ModuleTracker()
        self.bytes: dict[str, int] = defaultdict(int)
        self.ops: dict[str, int] = defaultdict(int)
        self.written: dict[str, int] = defaultdict(int)
        self.counting = True

    def __enter__(self) -> _ByteCounter:
        self.tracker.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting or func.is_view or func.overloadpacket in _NOT_RUN or func.namespace == "prim":
            return out
        written = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        for parent in set(self.tracker.parents):
            self.ops[parent] += 1
            self.written[parent] += written
        if func.overloadpacket in _COUNTED_AS_FLOPS:
            return out
        if func.overloadpacket is aten.embedding:
            moved = 2 * out.numel() * out.element_size()  # reads the rows it returns, not the table
        else:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in tensors)
        for parent in set(self.tracker.parents):
            self.bytes[parent] += moved
        return out


def _per_module(source: ModelSource, model: nn.Module, shape: tuple[int, int], *, backward: bool) -> tuple[list[dict[str, int]], int]:
    """(the counts per module, the logits' width)."""
    # Fake token ids too: code that would read a value (transformers' mask checks) sees a trace and skips it.
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter, _ByteCounter() as traffic:
        tokens = torch.zeros(shape, dtype=torch.long)
        logits = source.logits(model, tokens[:, :-1])
        if backward:
            traffic.counting = False  # the loss's gradient: kernels.loss_bytes charges the loss
            gradient = torch.empty_like(logits)
            traffic.counting = True
            logits.backward(gradient)
    by_module = counter.get_flop_counts().items()
    flops = {name: sum(by_op.values()) for name, by_op in by_module}
    attention = {name: sum(n for op, n in by_op.items() if op in _ATTENTION) for name, by_op in by_module}
    counts = [_by_member(model, counts) for counts in (flops, traffic.bytes, traffic.ops, attention, traffic.written)]
    return counts, logits.shape[-1]


def _by_member(model: nn.Module, counts: dict[str, int]) -> dict[str, int]:
    """Keyed by module name ("" for the whole model), as the counters key them by class-qualified path."""
    prefix = type(model).__name__
    keyed = {"": counts.get("Global", 0)}
    for name, value in counts.items():
        if name.startswith(prefix + "."):
            keyed[name[len(prefix) + 1 :]] = value
    return keyed


def _exclusive(plans: Sequence[UnitSpec], counts: dict[str, int]) -> list[int]:
    """Each unit's count less those of the units nested in it (the root: the whole model)."""
    inclusive = [sum(counts.get(member, 0) for member in plan.members) for plan in plans]

    def parent(index: int) -> int | None:
        best, length = None, -1
        for other, plan in enumerate(plans):
            for member in plan.members:
                for own in plans[index].members:
                    nested = member == "" or own.startswith(member + ".")
                    if other != index and nested and len(member) > length:
                        best, length = other, len(member)
        return best

    exclusive = list(inclusive)
    for index in range(len(plans)):
        above = parent(index)
        if above is not None:
            exclusive[above] -= inclusive[index]
    return exclusive


def unit_work(source: ModelSource, plans: Sequence[UnitSpec], batch: int, seq_len: int) -> list[UnitWork]:
    """Each unit's work for `batch` sequences of `seq_len` tokens (`plans`: the units of the model `source` builds)."""
    shape = (batch, seq_len + 1)
    with FakeTensorMode():
        model = source.build(device="cpu", seed=0)
        inputs = _input_bytes(model, plans)
        forward_counts, width = _per_module(source, model, shape, backward=False)
        forward = [_exclusive(plans, counts) for counts in forward_counts]
        for handle in inputs.pop():
            handle.remove()
        total = [_exclusive(plans, counts) for counts in _per_module(source, model, shape, backward=True)[0]]
    return [
        UnitWork(ff, tf - ff, fb, tb - fb, fo, to - fo, fa, fw, inp, width if index == 0 else 0)
        for index, (ff, fb, fo, tf, tb, to, fa, fw, inp) in enumerate(zip(*forward[:3], *total[:3], *forward[3:], inputs[0], strict=True))
    ]


def _input_bytes(model: nn.Module, plans: Sequence[UnitSpec]) -> list:
    """[bytes per unit, filled by the next forward; the hook handles]: the floating-point
    tensors each unit's first member is called with (the root: none)."""
    counts = [0] * len(plans)
    modules = dict(model.named_modules())
    handles = []
    for index, plan in enumerate(plans):
        if plan.members[0] == "":
            continue

        def record(module, args, kwargs, index=index) -> None:
            tensors = tree_flatten((args, kwargs))[0]
            counts[index] += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())

        handles.append(modules[plan.members[0]].register_forward_pre_hook(record, with_kwargs=True))
    return [counts, handles]
