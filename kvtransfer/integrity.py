"""Checksums of transferred K/V.

Host bytes: xxh3-64 (tens of GB/s per core here: far below the cost of moving the bytes).
GPU bytes (CUDA IPC, where copying to the host only to hash would cost more than the
transfer): the unit is cut into ``CHUNK``-byte chunks (the last one zero-padded), a Triton
kernel computes the standard XXH64 of every chunk in parallel, and the host folds the chunk
digests and the length with xxh3. Both sides of a CUDA IPC transfer use the same function,
and the kernel is checked against ``xxhash.xxh64`` under the Triton interpreter on CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import torch
import xxhash

CHUNK = 1024  # bytes hashed by one XXH64 (a multiple of its 32-byte stripe)
_CHUNKS_PER_PROGRAM = 32
_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63
# Triton's interpreter (CPU tests) patches its language module while a kernel runs, and copies
# each argument's whole storage in and back out: one launch at a time, on private copies.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH_LOCK = threading.Lock() if _INTERPRETED else contextlib.nullcontext()


def checksum(data) -> int:
    """xxh3-64 of a host buffer (a numpy array, memoryview, bytes)."""
    return xxhash.xxh3_64_intdigest(data)


def device_checksum(rows: torch.Tensor) -> int:
    """A hash of ``rows``' bytes computed where they live (see the module docstring)."""
    flat = rows.contiguous().view(torch.uint8).reshape(-1)
    n = flat.numel()
    num_chunks = max(1, -(-n // CHUNK))
    if n % 8 or n == 0:  # whole 64-bit words only: pad a copy
        padded = torch.zeros(num_chunks * CHUNK, dtype=torch.uint8, device=flat.device)
        padded[:n] = flat
        flat = padded
    elif _INTERPRETED:
        flat = flat.clone()
    digests = chunk_digests(flat.view(torch.int64), num_chunks)
    return xxhash.xxh3_64_intdigest(digests.cpu().numpy().tobytes() + n.to_bytes(8, "little"))


def chunk_digests(words: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """XXH64 (seed 0) of each ``CHUNK``-byte chunk of ``words`` (int64), missing words read as zero."""
    from pdserve.kvtransfer.xxh64_kernel import xxh64_chunks

    out = torch.empty(num_chunks, dtype=torch.int64, device=words.device)
    consts = torch.tensor([_signed(c) for c in (_P1, _P2, _P3, _P4)], dtype=torch.int64, device=words.device)
    grid = (-(-num_chunks // _CHUNKS_PER_PROGRAM),)
    with _LAUNCH_LOCK:
        xxh64_chunks[grid](words, out, consts, words.numel(), num_chunks, WORDS=CHUNK // 8, BLOCK_C=_CHUNKS_PER_PROGRAM)
    return out


def reference_chunk_digests(data: bytes) -> np.ndarray:
    """What ``chunk_digests`` computes, with the xxhash library (for tests)."""
    n_chunks = max(1, -(-len(data) // CHUNK))
    padded = data.ljust(n_chunks * CHUNK, b"\0")
    return np.array(
        [xxhash.xxh64_intdigest(padded[i * CHUNK : (i + 1) * CHUNK]) for i in range(n_chunks)], dtype=np.uint64
    )


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
