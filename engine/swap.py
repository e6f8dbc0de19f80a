"""Host-memory swap space for preempted sequences' KV blocks (worth it on a GPU, where
recomputing a long context costs more than two PCIe copies; on a CPU, recompute)."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCache


class SwapSpace:
    def __init__(self, cache: KVCache, num_host_blocks: int) -> None:
        self.cache = cache
        pin = cache.tensor.device.type == "cuda"
        self.host = torch.empty(cache.layout.shape(num_host_blocks), dtype=cache.layout.storage_dtype, pin_memory=pin)
        self._free = list(range(num_host_blocks))
        self.swapped_out = 0
        self.swapped_in = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        """Copies blocks (all layers) to host slots; the caller frees the device blocks."""
        host_blocks = [self._free.pop() for _ in device_blocks]
        index = torch.tensor(device_blocks, device=self.cache.tensor.device)
        self.host[:, host_blocks] = self.cache.tensor[:, index].to("cpu")
        self.swapped_out += len(device_blocks)
        return host_blocks

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copies host slots back into (newly allocated) device blocks and frees the slots."""
        index = torch.tensor(device_blocks, device=self.cache.tensor.device)
        self.cache.tensor[:, index] = self.host[:, host_blocks].to(self.cache.tensor.device)
        self._free.extend(host_blocks)
        self.swapped_in += len(host_blocks)

    def release(self, host_blocks: list[int]) -> None:
        self._free.extend(host_blocks)
