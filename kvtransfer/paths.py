"""How the prefill side moves one unit (tokens [start, end) of one layer) to the decode side.

A data path runs on the connection's sender thread. Every path sends a small header on the
TCP control channel; TCP carries the bytes right behind it, UCX carries them as tagged
messages cut along the decode side's block runs (so each lands in place), and the one-sided
paths (shared memory, CUDA IPC) write straight into the decode worker's pool first.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.integrity import checksum, device_checksum
from pdserve.kvtransfer.layout import CacheLayers, run_views, slot_runs
from pdserve.kvtransfer.protocol import FrameHeader, FrameKind
from pdserve.kvtransfer.sockets import send_buffers


@dataclass(frozen=True, slots=True)
class Unit:
    transfer_id: int
    layer: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    dst_block_size: int
    start: int
    end: int


class DataPath(Protocol):
    name: str

    def send(self, unit: Unit) -> None: ...


def _checksum(value: int, faults: FaultPlan) -> int:
    return value ^ 0x5A if faults.take("corrupt") else value


class TcpPath:
    name = "tcp"

    def __init__(self, sock: socket.socket, cache: CacheLayers, faults: FaultPlan) -> None:
        self.sock, self.cache, self.faults = sock, cache, faults

    def send(self, unit: Unit) -> None:
        views = self.cache.read(unit.layer, unit.src_block_ids, unit.start, unit.end)
        header = FrameHeader(
            FrameKind.DATA, unit.transfer_id, unit.layer, unit.start, unit.end,
            payload_len=sum(len(v) for v in views), checksum=_checksum(checksum(views), self.faults),
        )
        send_buffers(self.sock, [header.pack(), *views])


class ShmPath:
    """One-sided writes into the decode worker's shared-memory pool, then WRITTEN."""

    name = "shm"

    def __init__(self, sock: socket.socket, cache: CacheLayers, faults: FaultPlan, pool_layers: list[np.ndarray]) -> None:
        self.sock, self.cache, self.faults = sock, cache, faults
        self.pool_layers = pool_layers

    def send(self, unit: Unit) -> None:
        src = self.cache.read(unit.layer, unit.src_block_ids, unit.start, unit.end)
        runs = slot_runs(unit.dst_block_ids, unit.dst_block_size, unit.start, unit.end)
        dst = run_views(self.pool_layers[unit.layer], runs, self.cache.token_bytes)
        copy_stream(src, dst)
        header = FrameHeader(FrameKind.WRITTEN, unit.transfer_id, unit.layer, unit.start, unit.end,
                             checksum=_checksum(checksum(src), self.faults))
        send_buffers(self.sock, [header.pack()])


class UcxPath:
    """The header on TCP, the bytes as UCX tagged messages, one per decode-side run."""

    name = "ucx"

    def __init__(self, sock: socket.socket, cache: CacheLayers, faults: FaultPlan, ucx, peer_address: bytes, tag: int) -> None:
        self.sock, self.cache, self.faults = sock, cache, faults
        self.ucx, self.peer_address, self.tag = ucx, peer_address, tag
        self.sequence = 0

    def send(self, unit: Unit) -> None:
        src = self.cache.read(unit.layer, unit.src_block_ids, unit.start, unit.end)
        runs = slot_runs(unit.dst_block_ids, unit.dst_block_size, unit.start, unit.end)
        pieces = split_stream(src, [n * self.cache.token_bytes for _, n in runs])
        first = self.sequence
        self.sequence += len(pieces)
        header = FrameHeader(FrameKind.UCX_DATA, unit.transfer_id, unit.layer, unit.start, unit.end,
                             aux=first, checksum=_checksum(checksum(src), self.faults))
        send_buffers(self.sock, [header.pack()])
        mask = (1 << 40) - 1
        self.ucx.send(self.peer_address, [(p, (self.tag << 40) | ((first + i) & mask)) for i, p in enumerate(pieces)])


class CudaIpcPath:
    """Device-to-device copies into the decode worker's GPU pool (opened by IPC handle), then WRITTEN."""

    name = "cuda_ipc"

    def __init__(self, sock: socket.socket, cache: CacheLayers, faults: FaultPlan, pool_layers: list) -> None:
        self.sock, self.cache, self.faults = sock, cache, faults
        self.pool_layers = pool_layers

    def send(self, unit: Unit) -> None:
        import torch

        rows = self.cache.device_rows(unit.layer, unit.src_block_ids, unit.start, unit.end)
        runs = slot_runs(unit.dst_block_ids, unit.dst_block_size, unit.start, unit.end)
        dst = self.pool_layers[unit.layer].flatten(0, 1)
        slots = torch.cat([torch.arange(s, s + n, device=dst.device) for s, n in runs])
        dst.index_copy_(0, slots, rows.to(dst.device))
        torch.cuda.current_stream(dst.device).synchronize()
        header = FrameHeader(FrameKind.WRITTEN, unit.transfer_id, unit.layer, unit.start, unit.end,
                             checksum=_checksum(device_checksum(rows), self.faults))
        send_buffers(self.sock, [header.pack()])


def copy_stream(src: list[memoryview], dst: list[memoryview]) -> None:
    """Copies the concatenation of ``src`` into the concatenation of ``dst`` (same total size)."""
    si = di = so = do = 0
    while si < len(src):
        n = min(len(src[si]) - so, len(dst[di]) - do)
        np.copyto(np.frombuffer(dst[di], np.uint8, n, do), np.frombuffer(src[si], np.uint8, n, so))
        so, do = so + n, do + n
        if so == len(src[si]):
            si, so = si + 1, 0
        if di < len(dst) and do == len(dst[di]):
            di, do = di + 1, 0


def split_stream(src: list[memoryview], lengths: list[int]):
    """Cuts the concatenation of ``src`` into pieces of ``lengths``; a piece inside one view is
    that view's slice (no copy), one that spans views is joined into a new buffer."""
    pieces, si, so = [], 0, 0
    for length in lengths:
        if len(src[si]) - so >= length:
            pieces.append(src[si][so : so + length])
            so += length
        else:
            parts, need = [], length
            while need:
                n = min(need, len(src[si]) - so)
                parts.append(src[si][so : so + n])
                need, so = need - n, so + n
                if so == len(src[si]):
                    si, so = si + 1, 0
            pieces.append(np.concatenate([np.frombuffer(p, np.uint8) for p in parts]))
        if si < len(src) and so == len(src[si]):
            si, so = si + 1, 0
    return pieces
