"""XXH64 of many fixed-size chunks at once, on the device that holds them (Triton).

A program hashes ``BLOCK_C`` chunks side by side; each chunk keeps XXH64's four lane
accumulators in one row of a ``[BLOCK_C, 4]`` tile and walks its 32-byte stripes. The result
is bit-for-bit ``xxhash.xxh64_intdigest`` of each chunk (seed 0). Runs on CPU tensors under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotl(x, r):
    return (x << r) | (x >> (64 - r))


@triton.jit
def xxh64_chunks(words_ptr, out_ptr, consts_ptr, num_words, num_chunks, WORDS: tl.constexpr, BLOCK_C: tl.constexpr):
    p1 = tl.load(consts_ptr + 0).to(tl.uint64, bitcast=True)
    p2 = tl.load(consts_ptr + 1).to(tl.uint64, bitcast=True)
    p3 = tl.load(consts_ptr + 2).to(tl.uint64, bitcast=True)
    p4 = tl.load(consts_ptr + 3).to(tl.uint64, bitcast=True)
    chunks = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    lanes = tl.arange(0, 4)
    word0 = chunks[:, None].to(tl.int64) * WORDS + lanes[None, :]
    zero = tl.zeros([BLOCK_C, 4], dtype=tl.uint64)
    # Lane seeds (seed 0): P1 + P2, P2, 0, -P1.
    acc = tl.where(
        lanes[None, :] == 0,
        zero + p1 + p2,
        tl.where(lanes[None, :] == 1, zero + p2, tl.where(lanes[None, :] == 2, zero, zero - p1)),
    )
    for stripe in range(WORDS // 4):
        index = word0 + stripe * 4
        x = tl.load(words_ptr + index, mask=index < num_words, other=0).to(tl.uint64, bitcast=True)
        acc = _rotl(acc + x * p2, 31) * p1
    rot = tl.where(lanes == 0, 1, tl.where(lanes == 1, 7, tl.where(lanes == 2, 12, 18))).to(tl.uint64)
    h = tl.sum((acc << rot[None, :]) | (acc >> (64 - rot[None, :])), axis=1)
    merged = _rotl(acc * p2, 31) * p1  # round(0, lane)
    for lane in tl.static_range(4):
        h = (h ^ tl.sum(tl.where(lanes[None, :] == lane, merged, 0), axis=1)) * p1 + p4
    h = h + WORDS * 8
    h = (h ^ (h >> 33)) * p2
    h = (h ^ (h >> 29)) * p3
    h = h ^ (h >> 32)
    tl.store(out_ptr + chunks, h.to(tl.int64, bitcast=True), mask=chunks < num_chunks)
