"""Paged attention and KV write/gather: a torch reference (CPU) and Triton kernels (GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.kernels import reference


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The attention entry points the model calls; see ``reference`` for shapes."""

    name: str
    write_kv: Callable[..., None]
    causal_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]


TORCH_BACKEND = AttentionBackend(
    name="torch",
    write_kv=reference.write_kv,
    causal_attention=reference.causal_attention,
    prefill_attention=reference.paged_prefill_attention,
    decode_attention=reference.paged_decode_attention,
)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """``auto`` picks Triton on CUDA when it is installed, the torch reference otherwise."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention backend must be auto, torch or triton, not {name!r}")
    use_triton = name == "triton" or (name == "auto" and device.type == "cuda" and triton_available())
    if not use_triton:
        return TORCH_BACKEND
    if not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package: pip install 'pdserve[triton]'")
    from pdserve.kernels import triton_attention

    return triton_attention.BACKEND
