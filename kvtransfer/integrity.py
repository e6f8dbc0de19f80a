"""Checksums of transferred K/V: one function of the bytes, wherever they are.

A unit's bytes (tokens in order) are cut into ``CHUNK``-byte chunks, the last one
zero-padded; each chunk gets its standard XXH64 (seed 0), and the chunk digests and the
length are folded with xxh3. Chunks make the hash parallel: on the host the C++ kernel hashes
eight side by side (AVX-512) in the same pass that copies the unit (``host_chunk_digests``),
on a GPU a Triton kernel hashes every chunk at once (CUDA IPC, where copying to the host only
to hash would cost more than the transfer). Without the C++ kernels numpy computes the same
digests. Every implementation is checked against ``xxhash.xxh64`` (the Triton one under its
interpreter on CPU).
"""

from __future__ import annotations

import contextlib
import functools
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
    """The checksum of a contiguous host buffer (a numpy array, memoryview, bytes)."""
    flat = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    return fold(host_chunk_digests(flat.reshape(1, -1), _ONE_ROW), flat.size)


def fold(digests: np.ndarray, nbytes: int) -> int:
    """The checksum of ``nbytes`` bytes from their chunk digests."""
    return xxhash.xxh3_64_intdigest(digests.tobytes() + nbytes.to_bytes(8, "little"))


def host_chunk_digests(
    src: np.ndarray,
    src_slots: np.ndarray,
    dst: np.ndarray | None = None,
    dst_slots: np.ndarray | None = None,
    stream: bool = False,
) -> np.ndarray:
    """The chunk digests of rows ``src_slots`` of host rows ``src`` [slots, token_bytes], in
    that order, copied into rows ``dst_slots`` of ``dst`` on the way when given (``stream``:
    with stores that bypass this core's caches). The C++ kernel makes it one pass with the
    GIL released; numpy takes two."""
    native = _native()
    if native is not None:
        if dst is None:
            return native.copy_rows_hashed(_tensor(src), _tensor(src_slots)).numpy()
        tensors = _tensor(src), _tensor(src_slots), _tensor(dst), _tensor(dst_slots)
        return native.copy_rows_hashed(*tensors, stream).numpy()
    data = src[src_slots]
    if dst is not None:
        dst[dst_slots] = data
    return numpy_chunk_digests(data)


def numpy_chunk_digests(data: np.ndarray) -> np.ndarray:
    """XXH64 of each zero-padded ``CHUNK``-byte chunk of ``data``, vectorized over chunks."""
    flat = data.reshape(-1).view(np.uint8)
    num_chunks = max(1, -(-flat.size // CHUNK))
    padded = np.zeros(num_chunks * CHUNK, dtype=np.uint8)
    padded[: flat.size] = flat
    words = padded.view("<u8").reshape(num_chunks, CHUNK // 32, 4)
    p1, p2, p3, p4 = (np.uint64(p) for p in (_P1, _P2, _P3, _P4))
    with np.errstate(over="ignore"):
        acc = np.tile(np.array([(_P1 + _P2) & _M64, _P2, 0, -_P1 & _M64], dtype=np.uint64), (num_chunks, 1))
        for stripe in range(CHUNK // 32):
            acc = _rotl(acc + words[:, stripe] * p2, 31) * p1
        h = _rotl(acc[:, 0], 1) + _rotl(acc[:, 1], 7) + _rotl(acc[:, 2], 12) + _rotl(acc[:, 3], 18)
        for lane in range(4):
            h = (h ^ (_rotl(acc[:, lane] * p2, 31) * p1)) * p1 + p4
        h = h + np.uint64(CHUNK)
        h = (h ^ (h >> np.uint64(33))) * p2
        h = (h ^ (h >> np.uint64(29))) * p3
        return h ^ (h >> np.uint64(32))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


_ONE_ROW = np.zeros(1, dtype=np.int64)


def _tensor(array: np.ndarray) -> torch.Tensor:
    if not array.flags.writeable:  # bytes from the wire, say: torch wants writable memory
        array = array.copy()
    return torch.from_numpy(array)


@functools.cache
def _native():
    """The C++ kernels' module, or None (then numpy computes the same digests)."""
    from pdserve.kernels import cpu_extension

    return cpu_extension.load()


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
    return fold(digests.cpu().numpy(), n)


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
