"""Paged attention and KV write/gather in plain PyTorch: the reference, and the fallback path.

Cache layout, one tensor per layer: ``kv[num_blocks, block_size, 2, num_kv_heads, head_dim]``,
or ``uint8 [num_blocks, block_size, token_bytes]`` for 8-bit caches (``kv_format``). Either way
a token's K and V sit next to each other, so any run of consecutive slots (a block, part of a
block, or several blocks with consecutive ids) is one contiguous byte range: the unit the KV
transports move without staging copies.

A *slot* is ``block_id * block_size + offset``. ``fmt`` (a ``KVFormat``) is only needed for
8-bit caches; without it a cache holds plain values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.kv_format import KVFormat


def write_kv(
    kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, fmt: KVFormat | None = None
) -> None:
    """Store ``k``/``v`` ([T, H, D]) at ``slot_mapping`` ([T]) of one layer's cache."""
    slots = kv.view(-1, *kv.shape[2:])
    if fmt is not None and fmt.quantized:
        slots.index_copy_(0, slot_mapping, fmt.encode(k, v))
    else:
        slots.index_copy_(0, slot_mapping, torch.stack((k, v), dim=1).to(kv.dtype))


def _decode_slots(tokens: torch.Tensor, fmt: KVFormat | None) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt is not None and fmt.quantized:
        return fmt.decode(tokens)
    return tokens[..., 0, :, :], tokens[..., 1, :, :]


def gather_kv(
    kv: torch.Tensor, block_table: torch.Tensor, num_tokens: int, fmt: KVFormat | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` tokens of one sequence as dense ``k, v`` ([num_tokens, H, D])."""
    block_size = kv.shape[1]
    num_blocks = -(-num_tokens // block_size)
    tokens = kv.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:num_tokens]
    return _decode_slots(tokens, fmt)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **mask) -> torch.Tensor:
    """SDPA on token-major tensors: q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        **mask,
    )
    return out.squeeze(0).transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention over fresh tokens: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    return _attention(q, k, v, scale, is_causal=True)


def paged_prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    fmt: KVFormat | None = None,
) -> torch.Tensor:
    """Attention for a chunk of one sequence whose K/V (earlier context included) are in the cache.

    q: [Tq, Hq, D], the last Tq positions of a context of ``context_len`` tokens.
    """
    k, v = gather_kv(kv, block_table, context_len, fmt)
    num_q = q.shape[0]
    # Query i sits at position context_len - num_q + i and sees keys up to that position.
    q_pos = torch.arange(context_len - num_q, context_len, device=q.device)
    mask = q_pos[:, None] >= torch.arange(context_len, device=q.device)[None, :]
    return _attention(q, k, v, scale, attn_mask=mask)


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    fmt: KVFormat | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached context.

    q: [B, Hq, D]; block_tables: [B, max_blocks] (padding entries may hold any valid block id);
    context_lens: [B], tokens each query attends to (its own included). Returns [B, Hq, D].
    """
    batch, max_blocks = block_tables.shape
    block_size = kv.shape[1]
    # One gather for the whole batch; positions past each context are masked out.
    tokens = kv.index_select(0, block_tables.reshape(-1)).view(batch, max_blocks * block_size, *kv.shape[2:])
    k, v = _decode_slots(tokens, fmt)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
    positions = torch.arange(max_blocks * block_size, device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(2)
