"""CUDA IPC (NVLink / PCIe peer copies) between GPUs of one node, via cupy.

The decode worker allocates its KV pool with cupy (one allocation, so the IPC handle covers
exactly the pool) and shares the handle in the handshake; a prefill worker on the same node
opens it and copies K/V device-to-device. Only used when both caches are on CUDA devices.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVLayout


class CudaIpcPool:
    """A KV cache tensor in a cupy allocation whose IPC handle peers can open (decode side)."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        import cupy

        self.layout, self.num_blocks = layout, num_blocks
        nbytes = layout.num_layers * num_blocks * layout.block_bytes
        with cupy.cuda.Device(device.index or 0):
            self._memory = cupy.cuda.alloc(nbytes)
            raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=self._memory)
            raw.fill(0)
        self.tensor = torch.from_dlpack(raw).view(layout.storage_dtype).view(layout.shape(num_blocks))
        self._handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
        self._raw = raw

    def describe(self) -> dict:
        return {
            "cuda_ipc": {
                "handle": bytes(self._handle).hex(), "nbytes": self._raw.nbytes, "device": self.tensor.device.index or 0,
                "num_layers": self.layout.num_layers, "num_blocks": self.num_blocks,
                "block_size": self.layout.block_size, "num_kv_heads": self.layout.num_kv_heads,
                "head_dim": self.layout.head_dim, "dtype": str(self.layout.dtype).removeprefix("torch."),
            }
        }


def open_pool(desc: dict) -> list[torch.Tensor]:
    """A peer's pool, opened by IPC handle, as per-layer tensors (prefill side)."""
    import cupy

    ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(desc["handle"]))
    memory = cupy.cuda.UnownedMemory(ptr, desc["nbytes"], owner=None, device_id=desc["device"])
    raw = cupy.ndarray((desc["nbytes"],), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    dtype = getattr(torch, desc["dtype"])
    shape = (desc["num_layers"], desc["num_blocks"], desc["block_size"], 2, desc["num_kv_heads"], desc["head_dim"])
    return list(torch.from_dlpack(raw).view(dtype).view(shape).unbind(0))
