"""Triton kernels against the torch reference. Without CUDA they run in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.kernels import reference, select_backend  # noqa: E402
from pdserve.kernels import triton_attention as tri  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 must match tightly; bf16/fp16 are compared with the reference computed in fp32 on the same inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _cache(gen: torch.Generator, num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype):
    # Every slot holds random data, so reading a wrong or out-of-context slot changes the result.
    return _randn(gen, num_blocks, block_size, 2, heads, dim, dtype=dtype)


def _block_table(gen: torch.Generator, num_blocks_total: int, needed: int, extra: int = 0) -> torch.Tensor:
    """Distinct, shuffled block ids; ``extra`` padding entries hold arbitrary valid ids."""
    ids = torch.randperm(num_blocks_total, generator=gen)[:needed]
    pad = torch.randint(0, num_blocks_total, (extra,), generator=gen)
    return torch.cat((ids, pad)).to(dtype=torch.int32, device=DEVICE)


def _assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_backend_is_selectable() -> None:
    backend = select_backend(DEVICE, "triton")
    assert backend is tri.BACKEND and backend.name == "triton"
    assert backend.prefill_attention is tri.paged_prefill_attention
    assert backend.decode_attention is tri.paged_decode_attention


@pytest.mark.parametrize(
    ("block_size", "heads", "dim", "dtype", "src_dtype"),
    [
        (8, 2, 64, torch.float32, torch.float32),
        (16, 3, 64, torch.bfloat16, torch.bfloat16),
        (16, 1, 128, torch.float16, torch.float16),
        (8, 2, 64, torch.bfloat16, torch.float32),  # cast on store, as the reference does
    ],
)
def test_write_kv_matches_reference(block_size: int, heads: int, dim: int, dtype, src_dtype) -> None:
    gen = _gen(block_size * 10 + heads)
    num_blocks, num_tokens = 6, 19
    kv = _cache(gen, num_blocks, block_size, heads, dim, dtype)
    # k and v as strided views of one fused projection, like a model's qkv split.
    fused = _randn(gen, num_tokens, 3 * heads, dim, dtype=src_dtype)
    k, v = fused[:, heads : 2 * heads], fused[:, 2 * heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)

    expected = kv.clone()
    reference.write_kv(expected, k, v, slots)
    tri.write_kv(kv, k, v, slots)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize(
    ("num_tokens", "q_heads", "kv_heads", "dim", "dtype"),
    [
        (1, 2, 2, 64, torch.float32),
        (37, 3, 1, 64, torch.float32),
        (70, 2, 2, 64, torch.float32),  # several query tiles
        (150, 1, 1, 64, torch.float32),  # several key tiles: online-softmax rescaling
        (21, 6, 2, 64, torch.bfloat16),
        (9, 2, 2, 128, torch.float16),
    ],
)
def test_causal_attention(num_tokens: int, q_heads: int, kv_heads: int, dim: int, dtype) -> None:
    gen = _gen(num_tokens * 7 + q_heads)
    scale = dim**-0.5
    qkv = _randn(gen, num_tokens, q_heads + 2 * kv_heads, dim, dtype=dtype)
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)  # non-contiguous views
    out = tri.causal_attention(q, k, v, scale)
    expected = reference.causal_attention(q.float(), k.float(), v.float(), scale)
    _assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    ("context_len", "num_q", "block_size", "q_heads", "kv_heads", "dim", "dtype"),
    [
        (1, 1, 8, 2, 2, 64, torch.float32),
        (13, 13, 8, 3, 1, 64, torch.float32),  # whole prompt, GQA 3
        (45, 7, 16, 2, 2, 64, torch.float32),  # chunk at the end of a longer context
        (40, 40, 16, 2, 2, 64, torch.float32),  # context a multiple of the block size
        (160, 9, 16, 3, 1, 64, torch.float32),  # several key tiles before the chunk
        (30, 11, 8, 6, 2, 64, torch.bfloat16),
        (20, 5, 16, 2, 1, 128, torch.float32),
    ],
)
def test_paged_prefill_attention(
    context_len: int, num_q: int, block_size: int, q_heads: int, kv_heads: int, dim: int, dtype
) -> None:
    gen = _gen(context_len * 31 + num_q)
    scale = dim**-0.5
    num_blocks = 12
    kv = _cache(gen, num_blocks, block_size, kv_heads, dim, dtype)
    needed = -(-context_len // block_size)
    block_table = _block_table(gen, num_blocks, needed, extra=2)
    q = _randn(gen, num_q, q_heads, dim, dtype=dtype)

    out = tri.paged_prefill_attention(q, kv, block_table, context_len, scale)
    expected = reference.paged_prefill_attention(q.float(), kv.float(), block_table.long(), context_len, scale)
    _assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    ("context_lens", "block_size", "q_heads", "kv_heads", "dim", "dtype"),
    [
        ([1], 8, 2, 2, 64, torch.float32),
        ([5, 16, 33], 8, 3, 1, 64, torch.float32),
        ([1, 17, 64, 9, 40], 16, 6, 2, 64, torch.float32),
        ([200, 3, 129], 8, 2, 2, 64, torch.float32),  # several key tiles
        ([7, 70, 1], 16, 6, 2, 64, torch.bfloat16),
        ([3, 24], 8, 2, 2, 128, torch.float32),
        ([12, 31], 16, 3, 1, 64, torch.float16),
    ],
)
def test_paged_decode_attention(
    context_lens: list[int], block_size: int, q_heads: int, kv_heads: int, dim: int, dtype
) -> None:
    gen = _gen(sum(context_lens) * 13 + block_size)
    scale = dim**-0.5
    batch = len(context_lens)
    max_blocks = -(-max(context_lens) // block_size) + 1
    num_blocks = max_blocks * batch + 2
    kv = _cache(gen, num_blocks, block_size, kv_heads, dim, dtype)
    # Each sequence owns distinct shuffled blocks; the rest of its row is padding with valid ids.
    owned = torch.randperm(num_blocks, generator=gen).to(DEVICE)
    rows = []
    for i, length in enumerate(context_lens):
        needed = -(-length // block_size)
        pad = torch.randint(0, num_blocks, (max_blocks - needed,), generator=gen).to(DEVICE)
        rows.append(torch.cat((owned[i * max_blocks : i * max_blocks + needed], pad)))
    block_tables = torch.stack(rows).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(gen, batch, q_heads, dim, dtype=dtype)

    out = tri.paged_decode_attention(q, kv, block_tables, lens, scale)
    expected = reference.paged_decode_attention(q.float(), kv.float(), block_tables.long(), lens.long(), scale)
    _assert_close(out, expected, dtype)


def test_int64_indices_and_strided_inputs() -> None:
    """int64 block tables / lengths / slots, and q whose head_dim is not the innermost stride."""
    gen = _gen(7)
    block_size, kv_heads, q_heads, dim, scale = 16, 2, 6, 64, 0.125
    kv = _cache(gen, 10, block_size, kv_heads, dim, torch.float32)
    lens = torch.tensor([33, 5], device=DEVICE)
    block_tables = torch.randperm(10, generator=gen)[:6].view(2, 3).to(DEVICE)
    q = _randn(gen, dim, 2, q_heads).permute(1, 2, 0)  # [B, Hq, D] with stride(-1) != 1
    out = tri.paged_decode_attention(q, kv, block_tables, lens, scale)
    _assert_close(out, reference.paged_decode_attention(q, kv, block_tables, lens, scale), torch.float32)

    out = tri.paged_prefill_attention(q, kv, block_tables[0], 33, scale)
    _assert_close(out, reference.paged_prefill_attention(q, kv, block_tables[0], 33, scale), torch.float32)

    k, v = _randn(gen, dim, 4, kv_heads).permute(1, 2, 0), _randn(gen, 4, kv_heads, dim)
    slots = torch.tensor([3, 40, 41, 150], device=DEVICE)
    expected = kv.clone()
    reference.write_kv(expected, k, v, slots)
    tri.write_kv(kv, k, v, slots)
    assert torch.equal(kv, expected)


def test_write_then_read_round_trip() -> None:
    """A prefill written with write_kv is what decode and prefill attention read back."""
    gen = _gen(99)
    block_size, kv_heads, q_heads, dim, num_tokens = 8, 1, 3, 64, 21
    scale = dim**-0.5
    kv = torch.zeros(8, block_size, 2, kv_heads, dim, device=DEVICE)
    block_table = _block_table(gen, 8, -(-num_tokens // block_size), extra=1)
    positions = torch.arange(num_tokens, device=DEVICE)
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    q = _randn(gen, num_tokens, q_heads, dim)
    k, v = _randn(gen, num_tokens, kv_heads, dim), _randn(gen, num_tokens, kv_heads, dim)

    tri.write_kv(kv, k, v, slots)
    dense = tri.causal_attention(q, k, v, scale)
    paged = tri.paged_prefill_attention(q, kv, block_table, num_tokens, scale)
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE)
    last = tri.paged_decode_attention(q[-1:], kv, block_table[None], lens, scale)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, dense[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [2, 3])  # 3: the default model's, whose 408 bytes of fields are padded
@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_cache_write_and_attention_match_reference(cache_dtype: str, dtype, heads: int) -> None:
    """Codes and scales written by the Triton kernel decode to what the reference stores (within one
    quantization step), and both attention kernels read 8-bit caches like the reference does (on a
    GPU, unpadded 3-head slots made both fail with a misaligned address)."""
    from pdserve.kernels.kv_format import KVFormat

    gen = _gen(11)
    q_heads, dim, block_size, num_blocks = 3 * heads, 64, 8, 12
    fmt = KVFormat(cache_dtype, heads, dim, dtype)
    tokens = num_blocks * block_size
    k, v = _randn(gen, tokens, heads, dim, dtype=dtype), _randn(gen, tokens, heads, dim, dtype=dtype)
    slots = torch.randperm(tokens, generator=gen).to(DEVICE)
    ours = torch.zeros(num_blocks, block_size, *fmt.slot_shape(), dtype=torch.uint8, device=DEVICE)
    theirs = ours.clone()
    backend = select_backend(DEVICE, "triton", fmt)
    assert backend.name == f"triton+{cache_dtype}"
    backend.write_kv(ours, k, v, slots)
    reference.write_kv(theirs, k, v, slots, fmt)
    got_k, got_v = reference.gather_kv(ours, torch.arange(num_blocks, device=DEVICE), tokens, fmt)
    want_k, want_v = reference.gather_kv(theirs, torch.arange(num_blocks, device=DEVICE), tokens, fmt)
    step = dict(atol=0.05, rtol=0) if cache_dtype == "int8" else dict(atol=0.02, rtol=0.13)
    torch.testing.assert_close(got_k.float(), want_k.float(), **step)
    torch.testing.assert_close(got_v.float(), want_v.float(), **step)

    # Attention over the same (reference-written) cache: decode and a prefill chunk.
    q = _randn(gen, 3, q_heads, dim, dtype=dtype)
    tables = _block_table(gen, num_blocks, 9).view(3, 3)
    lens = torch.tensor([5, 17, 24], dtype=torch.int32, device=DEVICE)
    scale = dim**-0.5
    expected = reference.paged_decode_attention(
        q.float(), theirs, tables.long(), lens.long(), scale, KVFormat(cache_dtype, heads, dim, torch.float32)
    )
    _assert_close(backend.decode_attention(q, theirs, tables, lens, scale), expected.to(dtype), dtype)
    chunk = _randn(gen, 7, q_heads, dim, dtype=dtype)
    expected = reference.paged_prefill_attention(
        chunk.float(), theirs, tables[1].long(), 17, scale, KVFormat(cache_dtype, heads, dim, torch.float32)
    )
    _assert_close(backend.prefill_attention(chunk, theirs, tables[1], 17, scale), expected.to(dtype), dtype)
