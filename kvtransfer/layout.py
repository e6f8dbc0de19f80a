"""Maps token ranges of a request onto byte ranges of a paged cache layer, without copies.

A cache layer is ``[num_blocks, block_size, 2, kv_heads, head_dim]``: each token's K and V
are ``token_bytes`` contiguous bytes, so tokens ``[start, end)`` of a request are a few runs
of consecutive slots, one per block (merged when block ids are consecutive). Each side maps
the same token range with its own block ids and block size: that is the re-blocking.
"""

from __future__ import annotations

import numpy as np
import torch


def slot_runs(block_ids: list[int], block_size: int, start: int, end: int) -> list[tuple[int, int]]:
    """Runs ``(first_slot, num_slots)`` holding tokens ``[start, end)``."""
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(f"tokens [{start}, {end}) do not fit {len(block_ids)} blocks of {block_size}")
    runs: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        n = min(block_size - offset, end - pos)
        slot = block_ids[block] * block_size + offset
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((slot, n))
        pos += n
    return runs


def host_bytes(layer: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a CPU cache layer (shares memory)."""
    if layer.device.type != "cpu":
        raise ValueError("host_bytes needs a CPU tensor")
    return layer.view(torch.uint8).reshape(-1).numpy()


def run_views(layer_bytes: np.ndarray, runs: list[tuple[int, int]], token_bytes: int) -> list[memoryview]:
    return [memoryview(layer_bytes[s * token_bytes : (s + n) * token_bytes]) for s, n in runs]


class CacheLayers:
    """Byte access to a cache's layers for a transport.

    On CPU the views alias the cache (zero copy both ways). On a GPU, bytes pass through a
    host copy; the CUDA IPC and UCX transports avoid that path.
    """

    def __init__(self, layers: list[torch.Tensor], block_size: int) -> None:
        self.layers = layers
        self.block_size = block_size
        first = layers[0]
        self.token_bytes = first[0, 0].numel() * first.element_size()
        self.on_host = first.device.type == "cpu"
        self._host = [host_bytes(layer) for layer in layers] if self.on_host else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def read(self, layer: int, block_ids: list[int], start: int, end: int) -> list[memoryview]:
        runs = slot_runs(block_ids, self.block_size, start, end)
        if self.on_host:
            return run_views(self._host[layer], runs, self.token_bytes)
        slots = self._slots(runs)
        rows = self.layers[layer].flatten(0, 1).index_select(0, slots).cpu()
        return [memoryview(host_bytes(rows))]

    def write_target(self, layer: int, block_ids: list[int], start: int, end: int):
        """Returns (views to fill, commit()) for tokens [start, end) of ``layer``."""
        runs = slot_runs(block_ids, self.block_size, start, end)
        if self.on_host:
            return run_views(self._host[layer], runs, self.token_bytes), lambda: None
        target = self.layers[layer]
        staging = torch.empty((end - start, *target.shape[2:]), dtype=target.dtype, pin_memory=True)
        slots = self._slots(runs)

        def commit() -> None:
            target.flatten(0, 1).index_copy_(0, slots, staging.to(target.device, non_blocking=False))

        return [memoryview(host_bytes(staging))], commit

    def device_rows(self, layer: int, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of a layer as a tensor on the cache's device (a gathered copy)."""
        slots = self._slots(slot_runs(block_ids, self.block_size, start, end))
        return self.layers[layer].flatten(0, 1).index_select(0, slots)

    def _slots(self, runs: list[tuple[int, int]]) -> torch.Tensor:
        device = self.layers[0].device
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in runs])
