"""Same-host shared memory: the decode worker's KV cache lives in a POSIX shared-memory
segment that prefill workers on the same machine map and write into directly.

The decode side creates the segment (``SharedKVPool``); Python's resource tracker unlinks it
even if the worker is killed. The prefill side maps it by name with a plain ``mmap`` (not
``SharedMemory``, whose tracker would unlink the decode worker's segment when the prefill
worker exits).
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.kv_cache import KVLayout

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"


def shm_supported() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedKVPool:
    """A KV cache tensor backed by a named shared-memory segment (decode side)."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        nbytes = layout.num_layers * num_blocks * layout.block_bytes
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.tensor = flat.view(layout.storage_dtype).view(layout.shape(num_blocks))

    @property
    def nbytes(self) -> int:
        return self._shm.size

    def describe(self) -> dict:
        """What a peer needs to map the pool (sent in the handshake)."""
        return {"shm_name": self.name, "shm_bytes": self.nbytes, "num_blocks": self.num_blocks,
                "block_size": self.layout.block_size}

    def close(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        try:
            self._shm.close()
        except BufferError:
            pass  # the engine still holds views; the mapping goes away with the process


class MappedKVPool:
    """A peer's ``SharedKVPool`` mapped into this process (prefill side): per-layer byte views."""

    def __init__(self, name: str, nbytes: int, num_layers: int) -> None:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"not a pdserve KV segment: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError(f"segment {name} is smaller than announced")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        flat = np.frombuffer(self._map, dtype=np.uint8)
        self.layers = np.split(flat, num_layers)

    def close(self) -> None:
        self.layers = []
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process


def remove_stale_segments() -> int:
    """Unlinks segments whose creating process is gone (left by a killed decode worker)."""
    removed = 0
    if not SHM_DIR.is_dir():
        return 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed += 1
    return removed
