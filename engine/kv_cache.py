"""The paged KV cache: one preallocated tensor for all layers, sized from a memory budget."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.engine.engine_config import parse_memory
from pdserve.engine.host_memory import host_zeros
from pdserve.engine.model_config import ModelConfig
from pdserve.kernels.kv_format import KVFormat


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a cache; two workers may exchange K/V when their layouts agree on all but block_size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's compute dtype
    cache_dtype: str = "auto"  # how K/V are stored: auto (= dtype), int8, fp8 (see kernels.kv_format)

    @classmethod
    def for_model(
        cls, config: ModelConfig, block_size: int, dtype: torch.dtype, cache_dtype: str = "auto"
    ) -> "KVLayout":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype, cache_dtype)

    @property
    def format(self) -> KVFormat:
        return KVFormat(self.cache_dtype, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def stored_as(self) -> str:
        """What a slot's values are, as peers compare it: the model dtype's name, or int8 / fp8."""
        return self.cache_dtype if self.format.quantized else str(self.dtype).removeprefix("torch.")

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.format.storage_dtype

    @property
    def token_bytes(self) -> int:
        """K and V of one token in one layer (with their scales, for 8-bit caches)."""
        return self.format.token_bytes

    @property
    def block_bytes(self) -> int:
        """One block in one layer."""
        return self.block_size * self.token_bytes

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, self.block_size, *self.format.slot_shape())


class KVCache:
    def __init__(
        self, layout: KVLayout, num_blocks: int, device: torch.device, tensor: torch.Tensor | None = None
    ) -> None:
        """``tensor`` lets the caller supply the storage (shared memory, for instance)."""
        self.layout = layout
        self.num_blocks = num_blocks
        if tensor is None and device.type == "cpu":
            tensor = host_zeros(layout.shape(num_blocks), layout.storage_dtype)
        elif tensor is None:
            tensor = torch.zeros(layout.shape(num_blocks), dtype=layout.storage_dtype, device=device)
        if tuple(tensor.shape) != layout.shape(num_blocks) or tensor.dtype != layout.storage_dtype:
            raise ValueError("KV cache storage does not match the layout")
        self.tensor = tensor
        self.layers = list(tensor.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def free_memory(device: torch.device) -> int:
    """Free memory on the device; on CPU, the machine's available memory or, inside a
    container with a memory limit (cgroup v2), what is left under that limit."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(available, 0)


def num_blocks_for_budget(
    layout: KVLayout, budget: str | int | float, device: torch.device, extra_block_bytes: int = 0
) -> int:
    """Blocks that fit the budget ('auto': 90% of free GPU memory, or min(2 GiB, 25% of RAM) on CPU).
    ``extra_block_bytes``: what else each block costs (a speculative draft's cache keeps one block per block)."""
    if budget == "auto":
        free = free_memory(device)
        nbytes = int(free * 0.9) if device.type == "cuda" else min(2 * 2**30, free // 4)
    else:
        nbytes, fraction = parse_memory(budget)
        if fraction is not None:
            nbytes = int(free_memory(device) * fraction)
    block_bytes = layout.block_bytes * layout.num_layers + extra_block_bytes
    num_blocks = nbytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv cache memory budget {budget!r} holds no block of {block_bytes} bytes")
    return num_blocks
