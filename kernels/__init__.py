"""Paged attention, KV writes and fused layer ops: a torch reference, C++ CPU kernels, Triton (GPU).

``select_backend`` binds the attention entry points to a cache's ``KVFormat`` (plain or 8-bit);
``select_layer_ops`` picks the norm and activation kernels. The model calls only these.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine.engine_config import ATTENTION_BACKENDS
from pdserve.kernels import reference
from pdserve.kernels.kv_format import KV_CACHE_DTYPES, KVFormat
from pdserve.kernels.layer_ops import TORCH_LAYER_OPS, LayerOps, select_layer_ops

__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "KV_CACHE_DTYPES",
    "KVFormat",
    "LayerOps",
    "TORCH_LAYER_OPS",
    "select_backend",
    "select_layer_ops",
]

# (qkv [T, (Hq + 2 Hkv) D], positions [T], rope, kv layer, slot_mapping [T], Hq, Hkv, D) -> q, k, v
RopeWriteKV = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The attention entry points the model calls; see ``reference`` for shapes."""

    name: str
    write_kv: Callable[..., None]
    causal_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    rope_write_kv: RopeWriteKV | None = None  # fused RoPE + cache write; None: rope, then write_kv
    cpu_kernels: object | None = None  # the compiled CPU module behind this backend (for the C++ decode loop)
    kv_format: KVFormat | None = None


def rope_then_write(
    backend: AttentionBackend,
    qkv: torch.Tensor,
    positions: torch.Tensor,
    rope,
    kv: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
):
    """Splits q/k/v, applies RoPE and stores k/v: the backend's fused kernel, or the same in steps."""
    if backend.rope_write_kv is not None:
        return backend.rope_write_kv(qkv, positions, rope, kv, slot_mapping, num_heads, num_kv_heads, head_dim)
    tokens = qkv.shape[0]
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    q, k = rope(positions, q.reshape(tokens, num_heads, head_dim), k.reshape(tokens, num_kv_heads, head_dim))
    v = v.reshape(tokens, num_kv_heads, head_dim)
    backend.write_kv(kv, k, v, slot_mapping)
    return q, k, v


def _bind(backend: AttentionBackend, fmt: KVFormat) -> AttentionBackend:
    """The reference backend with an 8-bit cache format bound into every cache access."""
    return AttentionBackend(
        name=f"{backend.name}+{fmt.cache_dtype}",
        write_kv=functools.partial(reference.write_kv, fmt=fmt),
        causal_attention=backend.causal_attention,
        prefill_attention=functools.partial(reference.paged_prefill_attention, fmt=fmt),
        decode_attention=functools.partial(reference.paged_decode_attention, fmt=fmt),
    )


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


def cpu_backend(fmt: KVFormat | None = None) -> AttentionBackend | None:
    """The C++ kernels (decode attention, fused RoPE + cache write) over the reference, if they build here."""
    from pdserve.kernels import cpu_extension

    module = cpu_extension.load()
    if module is None:
        return None
    fmt = fmt or KVFormat("auto", 0, 0, torch.float32)
    base = _bind(TORCH_BACKEND, fmt) if fmt.quantized else TORCH_BACKEND

    def decode_attention(q, kv, block_tables, context_lens, scale):
        heads = fmt.num_kv_heads or (kv.shape[3] if kv.dim() == 5 else 0)
        return module.paged_decode_attention(q, kv, block_tables, context_lens, scale, fmt.kind, heads)

    def causal_attention(q, k, v, scale):
        if not module.has_prefill_attention(q.shape[-1]):
            return base.causal_attention(q, k, v, scale)
        return module.prefill_attention(q, k, v, scale, 0)

    def prefill_attention(q, kv, block_table, context_len, scale):
        if not module.has_prefill_attention(q.shape[-1]):
            return base.prefill_attention(q, kv, block_table, context_len, scale)
        k, v = reference.gather_kv(kv, block_table, context_len, fmt if fmt.quantized else None)
        return module.prefill_attention(q, k.contiguous(), v.contiguous(), scale, context_len - q.shape[0])

    def rope_write_kv(qkv, positions, rope, kv, slot_mapping, num_heads, num_kv_heads, head_dim):
        qkv = qkv.contiguous()
        module.rope_write_kv(
            qkv, positions, rope.cos, rope.sin, num_heads, num_kv_heads, head_dim, kv, slot_mapping, fmt.kind
        )
        tokens, q_width, kv_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_width].view(tokens, num_heads, head_dim)
        k = qkv[:, q_width : q_width + kv_width].view(tokens, num_kv_heads, head_dim)
        v = qkv[:, q_width + kv_width :].view(tokens, num_kv_heads, head_dim)
        return q, k, v

    return AttentionBackend(
        name="cpu" if not fmt.quantized else f"cpu+{fmt.cache_dtype}",
        write_kv=base.write_kv,
        causal_attention=causal_attention,
        prefill_attention=prefill_attention,
        decode_attention=decode_attention,
        rope_write_kv=rope_write_kv,
        cpu_kernels=module,
        kv_format=fmt,
    )


BACKENDS = ATTENTION_BACKENDS


def select_backend(device: torch.device, name: str = "auto", fmt: KVFormat | None = None) -> AttentionBackend:
    """``auto``: Triton on CUDA when installed; the C++ kernels on CPU when they build; else the
    torch reference. ``fmt``: the cache's format (default: plain values in the model dtype)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    quantized = fmt is not None and fmt.quantized
    if name == "torch":
        return _bind(TORCH_BACKEND, fmt) if quantized else TORCH_BACKEND
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        backend = cpu_backend(fmt)
        if backend is None and name == "cpu":
            raise ValueError("attention backend 'cpu' could not be built (needs a C++ compiler and ninja)")
        return backend or (_bind(TORCH_BACKEND, fmt) if quantized else TORCH_BACKEND)
    use_triton = name == "triton" or (name == "auto" and device.type == "cuda" and triton_available())
    if not use_triton:
        return _bind(TORCH_BACKEND, fmt) if quantized else TORCH_BACKEND
    if not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package: pip install 'pdserve[triton]'")
    from pdserve.kernels import triton_attention

    return triton_attention.backend_for(fmt) if quantized else triton_attention.BACKEND
