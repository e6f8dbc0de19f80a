"""Triton kernels for KV write and paged attention; drop-in for ``reference`` (same shapes and semantics).

Cache layout, one tensor per layer: ``kv[num_blocks, block_size, 2, num_kv_heads, head_dim]``, contiguous;
or, for 8-bit caches, ``uint8 [num_blocks, block_size, token_bytes]`` holding int8/fp8 codes and fp32
scales per token and head (``kernels.kv_format``): the kernels then read codes and scales through
typed views of the same bytes and dequantize in registers.

One attention kernel serves all three entry points. A program owns one KV head of one sequence and a
tile of query tokens, with every query head of that KV head's GQA group in the same tile: the tile's
rows are (query token, query head) pairs, so each K/V tile is loaded once for the whole group. Keys
are walked in tiles of ``TILE_N`` positions with an online (flash) softmax; each position finds its
slot through the block table, so K/V are read straight from the paged cache with no gather copy and
the tile size does not depend on the block size. ``PAGED=False`` reads fresh dense K/V instead.
Scores, softmax statistics and the output accumulate in fp32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.kernels import AttentionBackend
from pdserve.kernels.kv_format import KVFormat

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    kv_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    stride_kv,
    stride_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, kv head): a contiguous row of HEAD_DIM elements for K and for V.
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    # int64: slot * stride overflows int32 once a layer's cache passes 2**31 elements.
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    k = tl.load(k_ptr + tok.to(tl.int64) * stride_kt + head * stride_kh + d, mask=dmask)
    v = tl.load(v_ptr + tok.to(tl.int64) * stride_vt + head * stride_vh + d, mask=dmask)
    dst = kv_ptr + slot * stride_slot + head * stride_head + d
    tl.store(dst, k, mask=dmask)
    tl.store(dst + stride_kv, v, mask=dmask)


@triton.jit
def _write_kv_quant_kernel(
    codes_ptr,
    scales_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_code_slot,
    stride_scale_slot,
    v_code_offset,
    k_scale_offset,
    v_scale_offset,
    MAX_CODE: tl.constexpr,
    IS_FP8: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, kv head): quantize its K and V rows (scale = max|x| / MAX_CODE).
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    code_base = codes_ptr + slot * stride_code_slot + head * HEAD_DIM + d
    scale_base = scales_ptr + slot * stride_scale_slot + head
    for which in tl.static_range(2):
        if which == 0:
            x = tl.load(k_ptr + tok.to(tl.int64) * stride_kt + head * stride_kh + d, mask=dmask, other=0.0).to(
                tl.float32
            )
        else:
            x = tl.load(v_ptr + tok.to(tl.int64) * stride_vt + head * stride_vh + d, mask=dmask, other=0.0).to(
                tl.float32
            )
        amax = tl.max(tl.abs(x), axis=0)
        inv = tl.where(amax > 0.0, MAX_CODE / amax, 0.0)
        y = x * inv
        if IS_FP8:
            # Round to e4m3's grid (3 mantissa bits; subnormal step 2^-9) in fp32 first, so the cast
            # itself is exact: Triton's interpreter mis-rounds values that carry into the exponent.
            a = tl.abs(y)
            step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1.0e-30))), -6.0) - 3.0)
            r = tl.minimum(tl.floor(a / step + 0.5) * step, 448.0)
            codes = tl.where(y < 0.0, -r, r).to(tl.float8e4nv)
        else:
            # Round half away from zero (the torch reference rounds half to even: ties may differ by one step).
            codes = tl.where(y >= 0.0, tl.floor(y + 0.5), -tl.floor(0.5 - y)).to(tl.int8)
        if which == 0:
            tl.store(code_base, codes, mask=dmask)
            tl.store(scale_base + k_scale_offset, amax / MAX_CODE)
        else:
            tl.store(code_base + v_code_offset, codes, mask=dmask)
            tl.store(scale_base + v_scale_offset, amax / MAX_CODE)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    context_len,
    num_q,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    k_scale_ptr,
    v_scale_ptr,
    stride_ks,
    stride_vs,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    PER_SEQ_LEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    if PER_SEQ_LEN:
        ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    else:
        ctx = context_len

    # Row m of the tile is query token m // GROUP_PAD, query head m % GROUP_PAD of this group.
    # BLOCK_M may exceed BLOCK_Q * GROUP_PAD (tl.dot needs >= 16 rows): the extra rows are padding.
    rows = tl.arange(0, BLOCK_M)
    t_local = rows // GROUP_PAD
    t = q_block * BLOCK_Q + t_local
    head_in_group = rows % GROUP_PAD
    row_ok = (t_local < BLOCK_Q) & (t < num_q) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    # The queries are the last num_q positions of the context (a chunk, a decode token, or all of it).
    q_pos = ctx - num_q + t
    tok = (seq * num_q + t).to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)  # K, V and P follow q's dtype into the products.

    # Finite start for the running max: padding rows then see exp2(-inf - m) = 0, never inf - inf = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causal: no query of this tile sees past its last position, so later key tiles are skipped.
    kv_end = tl.minimum(ctx, ctx - num_q + (q_block + 1) * BLOCK_Q)
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        else:
            slot = pos.to(tl.int64)
        kv_mask = pos_ok[None, :] & dmask[:, None]
        # K is loaded transposed ([D, N]) so the score product needs no tl.trans.
        k = tl.load(k_ptr + slot[None, :] * stride_kt + kv_head * stride_kh + d[:, None], mask=kv_mask, other=0.0)
        if QUANT:  # 8-bit codes times each token's scale
            k_scale = tl.load(k_scale_ptr + slot * stride_ks + kv_head, mask=pos_ok, other=0.0)
            k = k.to(tl.float32) * k_scale[None, :]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * sm_scale_log2
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))

        # Online softmax in base 2 (the scale already carries log2(e)).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
            mask=pos_ok[:, None] & dmask[None, :],
            other=0.0,
        )
        if QUANT:
            v_scale = tl.load(v_scale_ptr + slot * stride_vs + kv_head, mask=pos_ok, other=0.0)
            v = v.to(tl.float32) * v_scale[:, None]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty context (context_len 0) gives zeros rather than 0 / 0.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dmask[None, :],
    )


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its head_dim rows are contiguous (any other strides are fine), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tile_config(dtype: torch.dtype, head_dim: int, group: int, *, decode: bool, on_cpu: bool) -> dict[str, Any]:
    """Compile-time tile sizes and launch options for one (dtype, head_dim, GQA group, mode)."""
    group_pad = triton.next_power_of_2(group)
    # tl.dot needs every dimension >= 16; other head dims are padded to a power of two and masked.
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Triton's interpreter (CPU tensors) multiplies bf16 dot operands as raw uint16 bits: upcast there.
    dot_fp32 = dtype == torch.float32 or (on_cpu and dtype == torch.bfloat16)
    # Wide rows (fp32, head_dim 256) get smaller tiles so K/V/P stay within registers and shared memory
    # (about 100 KiB on consumer GPUs): 16 KiB of K per key tile, fewer query rows for fp32 (no spills).
    row_bytes = block_d * (4 if dot_fp32 else 2)
    tile_n = min(64, max(16, 16384 // row_bytes))
    rows = min(64, max(16, (8192 if dot_fp32 else 16384) // row_bytes))
    # Decode has one query token per sequence; prefill packs query tokens into the tile's rows.
    block_q = 1 if decode else max(1, rows // group_pad)
    return dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * group_pad),
        TILE_N=tile_n,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        DOT_FP32=dot_fp32,
        # fp32 products at full precision (not TF32) so results match the reference.
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        num_warps=4 if row_bytes <= 128 else 8,
        num_stages=2,
    )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_seqs: int,
    num_q: int,
    block_tables: torch.Tensor | None,
    context_lens: torch.Tensor | None,
    context_len: int,
    block_size: int,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the attention kernel; ``k``/``v`` are [tokens_or_slots, Hkv, D] views (strided is fine),
    8-bit codes when ``scales`` ([slots, Hkv] views of their fp32 scales) are given."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    q = _unit_stride_rows(q)
    if scales is None:
        k, v = _unit_stride_rows(k), _unit_stride_rows(v)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    config = _tile_config(
        q.dtype, head_dim, num_q_heads // num_kv_heads, decode=context_lens is not None, on_cpu=q.device.type == "cpu"
    )
    paged = block_tables is not None
    dummy = q  # Pointer arguments the kernel never reads in this mode.
    grid = (triton.cdiv(num_q, config["BLOCK_Q"]), num_kv_heads, num_seqs)
    _attention_kernel[grid](
        q,
        k,
        v,
        out,
        block_tables if paged else dummy,
        context_lens if context_lens is not None else dummy,
        context_len,
        num_q,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        block_tables.stride(0) if paged and block_tables.dim() == 2 else 0,
        scales[0] if scales is not None else dummy,
        scales[1] if scales is not None else dummy,
        scales[0].stride(0) if scales is not None else 0,
        scales[1].stride(0) if scales is not None else 0,
        QUANT=scales is not None,
        BLOCK_SIZE=block_size,
        PAGED=paged,
        PER_SEQ_LEN=context_lens is not None,
        **config,
    )
    return out


def _cache_views(kv: torch.Tensor, fmt: KVFormat | None = None):
    """The cache as K and V slot views, [num_blocks * block_size, Hkv, D], sharing its storage, and,
    for an 8-bit cache, its K and V scales as [slots, Hkv] fp32 views (else None)."""
    if not kv.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    if fmt is None or not fmt.quantized:
        slots = kv.view(-1, *kv.shape[2:])
        return slots[:, 0], slots[:, 1], None
    heads, dim, width = fmt.num_kv_heads, fmt.head_dim, fmt.num_kv_heads * fmt.head_dim
    flat = kv.view(-1, fmt.token_bytes)
    codes = flat.view(torch.int8 if fmt.cache_dtype == "int8" else torch.float8_e4m3fn)
    floats = flat.view(torch.float32)  # token_bytes is a multiple of 4: the scales are aligned
    first = 2 * width // 4
    k_scales, v_scales = floats[:, first : first + heads], floats[:, first + heads : first + 2 * heads]
    return (
        codes[:, :width].view(-1, heads, dim),
        codes[:, width : 2 * width].view(-1, heads, dim),
        (k_scales, v_scales),
    )


def write_kv(
    kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, fmt: KVFormat | None = None
) -> None:
    """Store ``k``/``v`` ([T, H, D]) at ``slot_mapping`` ([T]) of one layer's cache."""
    if not kv.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if fmt is not None and fmt.quantized:
        k, v = _unit_stride_rows(k), _unit_stride_rows(v)
        flat = kv.view(-1, fmt.token_bytes)
        codes = flat.view(torch.int8 if fmt.cache_dtype == "int8" else torch.float8_e4m3fn)
        width = num_heads * head_dim
        _write_kv_quant_kernel[(num_tokens, num_heads)](
            codes, flat.view(torch.float32), k, v, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            fmt.token_bytes, fmt.token_bytes // 4, width, 2 * width // 4, 2 * width // 4 + num_heads,
            MAX_CODE=127.0 if fmt.cache_dtype == "int8" else 448.0, IS_FP8=fmt.cache_dtype == "fp8",
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2,
        )  # fmt: skip
        return
    # A dtype change (rare: the cache normally has the model's dtype) is done by torch, which rounds
    # to nearest even like the reference on every device; Triton's interpreter truncates fp32 -> bf16.
    k, v = _unit_stride_rows(k.to(kv.dtype)), _unit_stride_rows(v.to(kv.dtype))
    _write_kv_kernel[(num_tokens, num_heads)](
        kv,
        k,
        v,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 128 else 2,
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention over fresh tokens: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    num_tokens = q.shape[0]
    return _launch(
        q, k, v, num_seqs=1, num_q=num_tokens, block_tables=None, context_lens=None,
        context_len=num_tokens, block_size=1, scale=scale,
    )  # fmt: skip


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
    k, v, scales = _cache_views(kv, fmt)
    return _launch(
        q, k, v, num_seqs=1, num_q=q.shape[0], block_tables=block_table, context_lens=None,
        context_len=int(context_len), block_size=kv.shape[1], scale=scale, scales=scales,
    )  # fmt: skip


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
    k, v, scales = _cache_views(kv, fmt)
    return _launch(
        q, k, v, num_seqs=q.shape[0], num_q=1, block_tables=block_tables, context_lens=context_lens,
        context_len=0, block_size=kv.shape[1], scale=scale, scales=scales,
    )  # fmt: skip


def backend_for(fmt: KVFormat) -> AttentionBackend:
    """The Triton backend bound to an 8-bit cache format."""
    return AttentionBackend(
        name=f"triton+{fmt.cache_dtype}",
        write_kv=functools.partial(write_kv, fmt=fmt),
        causal_attention=causal_attention,
        prefill_attention=functools.partial(paged_prefill_attention, fmt=fmt),
        decode_attention=functools.partial(paged_decode_attention, fmt=fmt),
        kv_format=fmt,
    )


BACKEND = AttentionBackend(
    name="triton",
    write_kv=write_kv,
    causal_attention=causal_attention,
    prefill_attention=paged_prefill_attention,
    decode_attention=paged_decode_attention,
)
