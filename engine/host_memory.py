"""Host memory for large, long-lived tensors (the KV cache), on 2 MB pages where Linux allows it.

With transparent huge pages in their common ``madvise`` mode, memory is backed by 2 MB pages
only where a process asks. The KV cache should: another process reading it through the
kernel (UCX's shared-memory path copies with process_vm_readv, which walks and pins every page
it reads) does one walk per 2 MB instead of 512, and the attention kernels' scattered block
reads miss the TLB less. The KV handoff's staging buffers are read the same way. Where the
advice is refused (another OS, THP off), the memory is ordinary.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def trim_heap() -> None:
    """Hands the heap's free memory back to the OS (glibc keeps freed blocks of a few MB, such
    as weights that were copied elsewhere, in the process)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _mapped(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor on a private anonymous mapping of its own, at a 2 MB boundary and advised
    to use 2 MB pages where the kernel allows (refused: 4 KB pages); None where there are no
    such mappings (not POSIX). It reads as zeros, and no page is backed until written: a
    worker's 2 GiB cache costs neither start-up time nor memory until its blocks are used.
    The mapping lives as long as any view of the tensor, and its memory goes back to the OS
    with the last one."""
    if not hasattr(mmap, "MAP_PRIVATE"):
        return None
    span = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, span)
        except OSError:  # a kernel built without transparent huge pages: 4 KB pages, not a failed start
            pass
    return raw[offset : offset + nbytes]


def host_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor, on 2 MB pages where the kernel allows (from 2 MB up:
    a smaller buffer would hold a whole 2 MB page). Whatever touches it first backs it."""
    mapped = _mapped(nbytes) if nbytes >= HUGE_PAGE else None
    return mapped if mapped is not None else torch.empty(nbytes, dtype=torch.uint8)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, on 2 MB pages where the kernel allows, untouched until written
    (``_mapped``)."""
    mapped = _mapped(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    return mapped.view(dtype).view(shape) if mapped is not None else torch.zeros(shape, dtype=dtype)


def host_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` laid end to end in one ``host_bytes`` allocation, each at a
    64-byte boundary: weights that every decode step streams, in one run of 2 MB pages (one TLB
    entry per 2 MB instead of per 4 KB) rather than in separate 4 KB-page allocations."""
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("host_arena holds CPU tensors only")
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // 64) * 64)
    arena = host_bytes(offsets[-1])
    return [
        arena[offset : offset + size].view(t.dtype).view(t.shape).copy_(t)
        for t, offset, size in zip(tensors, offsets, sizes)
    ]
