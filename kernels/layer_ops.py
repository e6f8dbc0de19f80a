"""The decoder layer's elementwise ops: RMSNorm (with the residual add fused in) and SiLU-and-mul.

The torch versions compute exactly what Hugging Face's LLaMA does (same dtype rounding); the
C++ CPU kernels do the same in one pass over the data instead of five or six torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class LayerOps:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps): residual += x in place; returns rms_norm(residual)
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]  # [T, 2I] (gate | up) -> [T, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_LAYER_OPS = LayerOps("torch", rms_norm, add_rms_norm, silu_mul)


def select_layer_ops(device: torch.device) -> LayerOps:
    """The C++ kernels on CPU when they build here, else torch."""
    if device.type != "cpu":
        return TORCH_LAYER_OPS
    from pdserve.kernels import cpu_extension

    module = cpu_extension.load()
    if module is None:
        return TORCH_LAYER_OPS
    return LayerOps("cpu", module.rms_norm, module.add_rms_norm, module.silu_mul)
