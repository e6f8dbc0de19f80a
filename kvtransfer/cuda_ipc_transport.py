"""CUDA IPC: device-to-device copies into the decode worker's GPU pool (NVLink or PCIe peer
access) between GPUs of one node, via cupy; a WRITTEN frame then carries the checksum.

The decode worker's cache is one dedicated ``cudaMalloc`` (not a pool sub-allocation, whose
IPC handle would name the pool's whole block) exported by IPC handle, with the PCI bus id of
its GPU: ordinals differ between processes (CUDA_VISIBLE_DEVICES), bus ids do not. A prefill
worker that sees that GPU opens the handle once per process (reconnections reuse it; the
last user closes it) on its own device. Copies run on the cache's transfer stream after the
layer's compute event, and the sender waits for that unit's event only. Both sides hash on
the device (``integrity.device_checksum``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from pdserve.kvtransfer.integrity import device_checksum
from pdserve.kvtransfer.protocol import FrameHeader, FrameKind, ProtocolError
from pdserve.kvtransfer.transport_api import ReceiveContext, SendContext, Unit

IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def unavailable_reason(device) -> str | None:
    if getattr(device, "type", "cpu") != "cuda":
        return "CUDA IPC moves KV between GPUs; this worker's cache is on the CPU"
    try:
        import cupy
    except ImportError:
        return "CUDA IPC needs cupy: pip install 'pdserve[cuda]'"
    try:
        if not cupy.cuda.is_available():
            return "cupy sees no CUDA device"
    except Exception as e:  # noqa: BLE001 - cupy raises CUDARuntimeError and friends
        return f"cupy cannot use CUDA: {e}"
    return None


def pci_bus_id(ordinal: int) -> str:
    import cupy

    return cupy.cuda.runtime.deviceGetPCIBusId(ordinal).lower()


def sender_extra(device) -> dict:
    """What a prefill worker announces: the GPUs it can see, by PCI bus id."""
    import cupy

    return {"cuda_devices": [pci_bus_id(i) for i in range(cupy.cuda.runtime.getDeviceCount())]}


def usable_with(decode_extra: dict, prefill_extra: dict) -> bool:
    """CUDA IPC needs the decode worker's GPU to be visible to the prefill worker."""
    pool, visible = decode_extra.get("cuda_ipc"), prefill_extra.get("cuda_devices")
    return isinstance(pool, dict) and isinstance(visible, list) and pool.get("pci_bus_id") in visible


def make_pool(layout, num_blocks: int, device: torch.device) -> "CudaIpcPool":
    return CudaIpcPool(layout, num_blocks, device)


class CudaIpcPool:
    """A KV cache tensor in its own cudaMalloc, exported by IPC handle (decode side)."""

    def __init__(self, layout, num_blocks: int, device: torch.device) -> None:
        import cupy

        self.layout, self.num_blocks = layout, num_blocks
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.nbytes = layout.num_layers * num_blocks * layout.block_bytes
        with cupy.cuda.Device(ordinal):
            self._memory = cupy.cuda.Memory(self.nbytes)  # dedicated: the handle covers exactly the pool
            raw = cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(self._memory, 0))
            raw.fill(0)
        self.tensor = torch.from_dlpack(raw).view(layout.storage_dtype).view(layout.shape(num_blocks))
        self._handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr))
        self._pci_bus_id = pci_bus_id(ordinal)

    def describe(self) -> dict:
        return {
            "cuda_ipc": {
                "handle": self._handle.hex(),
                "nbytes": self.nbytes,
                "pci_bus_id": self._pci_bus_id,
                "num_layers": self.layout.num_layers,
            }
        }

    def close(self) -> None:
        pass  # the allocation lives as long as the engine's cache


class _OpenHandles:
    """IPC handles this process has opened: one mapping per handle, closed by its last user."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, int]] = {}  # handle -> (device pointer, users)
        self._lock = threading.Lock()

    def acquire(self, handle: str, ordinal: int) -> int:
        import cupy

        with self._lock:
            ptr, users = self._open.get(handle, (0, 0))
            if not users:
                with cupy.cuda.Device(ordinal):
                    ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(handle), IPC_LAZY_ENABLE_PEER_ACCESS)
            self._open[handle] = (ptr, users + 1)
            return ptr

    def release(self, handle: str) -> None:
        import cupy

        with self._lock:
            ptr, users = self._open[handle]
            if users > 1:
                self._open[handle] = (ptr, users - 1)
                return
            del self._open[handle]
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)


OPEN_HANDLES = _OpenHandles()


def open_pool(desc: dict, cache) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """A peer's pool as [slots, token_bytes] byte rows per layer, mapped on our own device,
    and how to let go of it."""
    import cupy

    ordinal = cache.device.index if cache.device.index is not None else torch.cuda.current_device()
    handle, nbytes = desc["handle"], int(desc["nbytes"])
    ptr = OPEN_HANDLES.acquire(handle, ordinal)
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=ordinal)
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    rows = torch.from_dlpack(raw).view(int(desc["num_layers"]), -1, cache.token_bytes).unbind(0)
    return list(rows), lambda: OPEN_HANDLES.release(handle)


def _on(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Sender:
    name = "cuda_ipc"
    max_span_bytes = 0  # one layer per unit: each is copied and hashed on the device

    def __init__(self, ctx: SendContext) -> None:
        self.ctx = ctx
        self.pool, self._close = open_pool(ctx.remote_extra["cuda_ipc"], ctx.cache)
        self.device = self.pool[0].device  # where destination slot indices must live

    def send(self, unit: Unit) -> None:
        cache, stream = self.ctx.cache, self.ctx.cache.stream
        dst = unit.dst
        with _on(stream):
            if unit.ready is not None:
                stream.wait_event(unit.ready)
            rows = cache.gather_on_device(unit.layer, unit.src)
            target = self.pool[unit.layer]
            if dst.contiguous:
                target[dst.first : dst.first + len(dst)].copy_(rows)
            else:
                target.index_copy_(0, dst.index, rows)
            if self.ctx.faults.take("corrupt"):
                target[dst.first, 0] ^= 0x5A  # a data byte of what landed
            digest = device_checksum(rows)  # waits for this stream's work so far, not the device's
            if stream is not None:
                copied = torch.cuda.Event()
                copied.record(stream)
                copied.synchronize()
        self.ctx.send_frame(
            FrameHeader(FrameKind.WRITTEN, unit.transfer_id, unit.layer, unit.start, unit.end, checksum=digest),
            defer=True,
        )

    def flush(self, transfer_id: int) -> None:
        pass  # each unit's copy has completed before its WRITTEN

    def close(self) -> None:
        self._close()


class Receiver:
    def __init__(self, ctx: ReceiveContext) -> None:
        self.ctx = ctx
        self.handlers = {FrameKind.WRITTEN: self._written}

    def hello_extra(self) -> dict:
        return {}

    def _written(self, h: FrameHeader) -> None:
        ledger, cache = self.ctx.ledger, self.ctx.cache
        if h.num_layers != 1:  # its sender never joins layers: each is copied and hashed on the device
            raise ProtocolError(f"a CUDA IPC unit covers one layer, not {h.num_layers}")
        grant = ledger.admit(h.transfer_id, h.layer, h.start, h.end, (h.end - h.start) * cache.token_bytes, "WRITTEN")
        if grant is None:
            return
        ok = None
        try:
            with _on(cache.stream):
                ok = device_checksum(cache.gather_on_device(h.layer, grant.slots(cache, h.start, h.end))) == h.checksum
        finally:
            ledger.end_write(grant, h.layer, h.start, h.end, ok)

    def close(self) -> None:
        pass
