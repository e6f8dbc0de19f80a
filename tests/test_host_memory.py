"""The CPU KV cache asks for 2 MB pages (engine/host_memory.py)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from pdserve.engine.host_memory import HUGE_PAGE, host_arena, host_bytes, host_zeros
from pdserve.engine.kv_cache import KVCache, KVLayout
from pdserve.kvtransfer.layout import StagingPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advised_huge(address: int) -> bool:
    """Whether the mapping holding ``address`` was advised to use huge pages (``hg`` in its
    VmFlags: MADV_HUGEPAGE, whatever the machine's THP mode)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping with VmFlags holds {address:#x}")


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((4, 1000, 16, 768), torch.uint8)])
def test_zeroed_with_the_shape_and_dtype_asked_for(shape, dtype):
    tensor = host_zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    tensor.view(-1)[-1] = 1  # every byte is writable, to the last
    assert tensor.sum() == 1


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_zeros_take_no_memory_until_written_and_give_it_back_when_dropped():
    before = resident_bytes()
    tensor = host_zeros((256, 2**20), torch.uint8)  # 256 MiB: a worker's cache is never touched whole at start
    assert resident_bytes() - before < 16 * 2**20
    tensor[:64] = 1  # what is written is backed
    assert resident_bytes() - before >= 60 * 2**20
    del tensor
    assert resident_bytes() - before < 16 * 2**20


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off on this machine"
)
def test_a_cpu_kv_cache_is_on_memory_the_kernel_may_back_with_huge_pages():
    layout = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = KVCache(layout, 512, torch.device("cpu"))  # 4 layers x 512 blocks x 6 KiB = 12 MiB
    address = cache.tensor.data_ptr()
    assert address % HUGE_PAGE == 0
    assert advised_huge(address) and advised_huge(address + cache.nbytes - 1)
    assert not cache.tensor.any()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off on this machine"
)
def test_staging_buffers_of_two_megabytes_and_up_are_too():
    big = StagingPool().take(2_300_000)  # a 4 MiB buffer: one layer's share of a 64 MiB handoff
    assert big.numel() == 4 << 20 and big.data_ptr() % HUGE_PAGE == 0 and advised_huge(big.data_ptr())
    small = host_bytes(1 << 20)  # under 2 MB: ordinary pages (a huge one would be half empty)
    assert small.numel() == 1 << 20 and not advised_huge(small.data_ptr())


def test_an_arena_holds_equal_copies_end_to_end_on_64_byte_boundaries():
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=generator),
        torch.randint(0, 255, (1_500_000,), generator=generator, dtype=torch.uint8),
        torch.randn(700, 1000, generator=generator).to(torch.bfloat16),
    ]
    copies = host_arena(tensors)
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % 64 == 0 and copy.data_ptr() != original.data_ptr()
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= nxt.data_ptr() < end + 64 for end, nxt in zip(ends, copies[1:]))  # no gaps but padding
    if THP.exists() and "[never]" not in THP.read_text():
        assert copies[0].data_ptr() % HUGE_PAGE == 0 and advised_huge(copies[-1].data_ptr())
    copies[1][0] ^= 1  # copies, not views of the originals
    assert not torch.equal(copies[1], tensors[1])


def test_an_arena_refuses_tensors_off_the_cpu():
    with pytest.raises(ValueError, match="CPU tensors only"):
        host_arena([torch.zeros(4), torch.zeros(4, device="meta")])


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="this platform's mmap has no MADV_HUGEPAGE to refuse")
def test_a_kernel_that_refuses_huge_pages_still_gets_its_memory(monkeypatch):
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)  # advice no kernel knows: madvise fails (EINVAL)
    tensor = host_zeros((4, 2**20), torch.uint8)
    assert tensor.shape == (4, 2**20) and not tensor.any()
    assert host_bytes(4 << 20).numel() == 4 << 20
