"""Mixed-precision details around the units: normalisation layers that must stay in fp32."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

FP32_MODULE_CLASSES: tuple[type[nn.Module], ...] = (_BatchNorm,)


def keep_in_fp32(module: nn.Module, compute_dtype: torch.dtype) -> list[Any]:
    """Run batch norms in fp32 under mixed precision (torch FSDP's choice: their statistics
    are unsafe in 16-bit): inputs and parameters upcast, outputs cast back. Returns handles."""
    handles = []
    for sub in module.modules():
        if isinstance(sub, FP32_MODULE_CLASSES):
            handles.append(sub.register_forward_pre_hook(_upcast_inputs_and_params))
            handles.append(sub.register_forward_hook(_cast_output(compute_dtype)))
    return handles


def _upcast_inputs_and_params(module: nn.Module, args: tuple) -> tuple:
    for name, param in module._parameters.items():
        if param is not None and param.is_floating_point() and param.dtype != torch.float32 and param.dim() > 0:
            module._parameters[name] = param.float()  # type: ignore[assignment]  # a plain fp32 tensor; torch's stubs allow Parameter only
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _cast_output(dtype: torch.dtype):
    def cast(module: nn.Module, args: tuple, output: Any) -> Any:
        return output.to(dtype) if isinstance(output, torch.Tensor) and output.is_floating_point() else output

    return cast
