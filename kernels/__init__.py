"""Paged attention and KV write/gather: a torch reference, a C++ CPU decode kernel, Triton kernels (GPU)."""

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


def cpu_backend() -> AttentionBackend | None:
    """The reference with decode attention replaced by the C++ kernel, if it builds here."""
    from pdserve.kernels import cpu_extension

    module = cpu_extension.load()
    if module is None:
        return None
    return AttentionBackend(
        name="cpu",
        write_kv=reference.write_kv,
        causal_attention=reference.causal_attention,
        prefill_attention=reference.paged_prefill_attention,
        decode_attention=module.paged_decode_attention,
    )


BACKENDS = ("auto", "torch", "cpu", "triton")


def select_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """``auto``: Triton on CUDA when installed; the C++ kernel on CPU when it builds; else the torch reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        backend = cpu_backend()
        if backend is None and name == "cpu":
            raise ValueError("attention backend 'cpu' could not be built (needs a C++ compiler and ninja)")
        return backend or TORCH_BACKEND
    use_triton = name == "triton" or (name == "auto" and device.type == "cuda" and triton_available())
    if not use_triton:
        return TORCH_BACKEND
    if not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package: pip install 'pdserve[triton]'")
    from pdserve.kernels import triton_attention

    return triton_attention.BACKEND
