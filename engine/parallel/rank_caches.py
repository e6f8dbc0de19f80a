"""Every rank's paged KV cache, and the view of all of them that the KV handoff uses.

Each rank holds only its KV heads, for its stage's layers, in a cache of its own. The KV
handoff numbers those caches as one list of *shard layers*, ``layer * tp + tp_rank`` (whatever
the stage), each a ``[num_blocks, block_size, slot]`` tensor with this rank's heads: a TP-1
worker's list is its cache's layers. On CPU all of them live in one named shared-memory
segment of that shape, created by rank 0 (or the decode worker's shared-memory transport pool,
which prefill workers write into directly) and mapped by the other ranks: rank 0's transports
then read and write every rank's K/V in place, and each rank's cache is a slice of it.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass, replace
from multiprocessing import shared_memory

import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kvtransfer.shm_transport import PREFIX, SHM_DIR


def shard_layout(layout: KVLayout, tp: int) -> KVLayout:
    """The layout of the shard layers: ``num_layers * tp`` of them, each with one rank's heads."""
    from pdserve.engine.parallel.layout import kv_heads_per_rank

    return replace(layout, num_layers=layout.num_layers * tp, num_kv_heads=kv_heads_per_rank(layout.num_kv_heads, tp))


@dataclass(frozen=True)
class KVShards:
    """The KV cache as the KV handoff sees it."""

    layers: list[torch.Tensor]  # shard layers, ``layer * tp_size + tp_rank``
    layout: KVLayout  # of one shard layer (``num_layers``: how many shard layers)
    tp_size: int = 1

    @property
    def token_bytes(self) -> int:
        return self.layout.token_bytes


class SharedSegment:
    """A named shared-memory segment: created here (the resource tracker unlinks it even if this
    process is killed) or mapped from the rank that created it."""

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.name, self.nbytes = name, nbytes
        self._shm = self._map = None
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            buffer = self._shm.buf
        else:  # a plain mmap: SharedMemory would have our tracker unlink the creator's segment
            fd = os.open(SHM_DIR / name, os.O_RDWR)
            try:
                if os.fstat(fd).st_size < nbytes:
                    raise ValueError(f"segment {name} is smaller than announced")
                self._map = buffer = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)

    @classmethod
    def create(cls, nbytes: int) -> "SharedSegment":
        return cls(f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}", nbytes, create=True)

    def tensor(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        return self.bytes.view(layout.storage_dtype).view(layout.shape(num_blocks))

    def close(self) -> None:
        self.bytes = None
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


def rank_cache(shards: torch.Tensor, tp: int, tp_rank: int, layers: range) -> torch.Tensor:
    """One rank's cache ``[len(layers), num_blocks, block_size, slot]`` within the shard-layer
    tensor: a strided view whose every layer is contiguous."""
    grid = shards.view(shards.shape[0] // tp, tp, *shards.shape[1:])
    return grid[layers.start : layers.stop, tp_rank]


def handoff_shards(engine) -> KVShards:
    """What a worker registers with its KV transports; ValueError when this engine's ranks'
    caches are out of its reach (each GPU of a multi-GPU worker holds its own)."""
    if engine.kv_shards is None:
        raise ValueError(
            "tensor/pipeline parallel on GPUs: the KV handoff needs every rank's cache mapped into the "
            "worker (CUDA IPC), which is not implemented yet; use tensor_parallel_size and "
            "pipeline_parallel_size 1 on GPUs"
        )
    return engine.kv_shards
