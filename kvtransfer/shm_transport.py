"""Same-host shared memory: the decode worker's KV cache lives in a POSIX shared-memory
segment that prefill workers on the same machine map and write into directly (the CPU
analogue of a one-sided RDMA write); a WRITTEN frame then carries the checksum.

Sender: one pass of the C++ kernel copies the unit from its slots (in every layer it covers)
into the destination slots (streaming stores: the bytes are for another process) and hashes
it on the way. Receiver: hashes what landed. One pass over the bytes on each side, the GIL
released for both.

The decode side creates the segment; Python's resource tracker unlinks it even if the worker
is killed. The prefill side maps it by name with a plain ``mmap`` (not ``SharedMemory``,
whose tracker would unlink the decode worker's segment when the prefill worker exits).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import shutil
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from pdserve.kvtransfer.integrity import fold, host_chunk_digests
from pdserve.kvtransfer.layout import Slots, copy_and_hash, scatter, span_rows
from pdserve.kvtransfer.protocol import FrameHeader, FrameKind
from pdserve.kvtransfer.transport_api import PoolUnavailable, ReceiveContext, SendContext, Unit

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
STALE_AFTER_S = 60.0  # a segment younger than this may not be locked by its creator yet


def unavailable_reason(device) -> str | None:
    if getattr(device, "type", "cpu") != "cpu":
        return "shared memory needs a CPU KV cache"
    if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)):
        return "shared memory needs a writable /dev/shm"
    return None


def make_pool(layout, num_blocks: int, device) -> "SharedKVPool":
    remove_stale_segments()
    return SharedKVPool(layout, num_blocks)


class SharedKVPool:
    """A KV cache tensor backed by a named shared-memory segment (decode side)."""

    def __init__(self, layout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        nbytes = layout.num_layers * num_blocks * layout.block_bytes
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        self._alive = None
        try:
            _take_room(self.name, nbytes)
            self._alive = os.open(SHM_DIR / self.name, os.O_RDONLY)  # held while this process lives
            fcntl.flock(self._alive, fcntl.LOCK_SH)
        except BaseException:
            self.close()
            raise
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.tensor = flat.view(layout.storage_dtype).view(layout.shape(num_blocks))

    @property
    def nbytes(self) -> int:
        return self._shm.size

    def describe(self) -> dict:
        """What a peer needs to map the pool (sent in the handshake)."""
        return {"shm_name": self.name, "shm_bytes": self.layout.num_layers * self.num_blocks * self.layout.block_bytes}

    def close(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None
        try:
            self._shm.close()
        except BufferError:
            pass  # the engine still holds views; the mapping goes away with the process


def _take_room(name: str, nbytes: int) -> None:
    """tmpfs gives a page on first touch: a segment larger than what is free maps fine, and the
    worker dies of SIGBUS at its first write past it, perhaps hours later when another program
    has filled /dev/shm. Every page is taken now, or the pool is refused (a container's
    /dev/shm is 64 MiB)."""
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(SHM_DIR).free
        raise PoolUnavailable(
            f"the KV cache needs {nbytes / 2**20:.0f} MiB of {SHM_DIR} and {free / 2**20:.0f} MiB are free "
            "(give the container more, e.g. docker's --shm-size)"
        ) from None
    finally:
        os.close(fd)


class MappedKVPool:
    """A peer's ``SharedKVPool`` mapped into this process (prefill side): [slots, token_bytes] per layer."""

    def __init__(self, name: str, nbytes: int, num_layers: int, token_bytes: int) -> None:
        if not isinstance(name, str) or not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"not a pdserve KV segment: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError(f"segment {name} is smaller than announced")
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.flat = np.frombuffer(self._map, dtype=np.uint8).reshape(-1, token_bytes)  # every layer's rows
        self.layers = list(self.flat.reshape(num_layers, -1, token_bytes))

    def span_rows(self, layer: int, slots: Slots, num_layers: int) -> np.ndarray:
        return span_rows(slots, layer, num_layers, len(self.layers), self.layers[0].shape[0])

    def close(self) -> None:
        self.layers = []
        self.flat = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process


def remove_stale_segments(min_age_s: float = STALE_AFTER_S) -> int:
    """Unlinks this user's segments whose creator is gone (a killed decode worker). A live
    creator holds a shared lock on its segment; a pid says nothing across PID namespaces that
    share /dev/shm (containers with --ipc=host), so locks decide, not /proc."""
    removed = 0
    if not SHM_DIR.is_dir():
        return 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            st = path.lstat()
            if st.st_uid != os.getuid() or time.time() - st.st_ctime < min_age_s:
                continue  # another user's (not ours to judge), or still being made (not locked yet)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its creator holds it
        else:
            path.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    return removed


class Sender:
    name = "shm"

    def __init__(self, ctx: SendContext) -> None:
        self.ctx = ctx
        extra = ctx.remote_extra
        self.pool = MappedKVPool(extra["shm_name"], extra["shm_bytes"], ctx.cache.num_layers, ctx.cache.token_bytes)

    device = None  # it writes host memory

    max_span_bytes = 1 << 20  # small layers join; larger ones pipeline (copy, verify) one by one

    def send(self, unit: Unit) -> None:
        cache, pool, layer, num_layers = self.ctx.cache, self.pool, unit.layer, unit.num_layers
        if cache.on_host and num_layers == 1:
            digest = copy_and_hash(cache.host_rows(layer), unit.src, pool.layers[layer], unit.dst, stream=True)
        elif cache.flat is not None:  # several layers: one pass over all of them
            src, dst = cache.span_rows(layer, unit.src, num_layers), pool.span_rows(layer, unit.dst, num_layers)
            digest = fold(host_chunk_digests(cache.flat, src, pool.flat, dst, True), len(src) * cache.token_bytes)
        else:  # a staged copy (a GPU cache, or a test forcing that path)
            data, digest = cache.read_hashed(layer, unit.src, unit.ready, num_layers)
            size = len(unit.src) * cache.token_bytes
            for i in range(num_layers):
                scatter(pool.layers[layer + i], unit.dst, data.data[i * size : (i + 1) * size])
            data.release()
        if self.ctx.faults.take("corrupt"):
            pool.layers[layer][unit.dst.first, 0] ^= 0x5A  # a data byte of what landed, never our own cache
        self.ctx.send_frame(
            FrameHeader(
                FrameKind.WRITTEN, unit.transfer_id, layer, unit.start, unit.end, checksum=digest, num_layers=num_layers
            ),
            defer=True,
        )

    def flush(self, transfer_id: int) -> None:
        pass  # the copies are done when send returns

    def close(self) -> None:
        self.pool.close()


class Receiver:
    def __init__(self, ctx: ReceiveContext) -> None:
        self.ctx = ctx
        self.handlers = {FrameKind.WRITTEN: self._written}

    def hello_extra(self) -> dict:
        return {}

    def _written(self, h: FrameHeader) -> None:
        """The peer wrote a unit into our shared pool; verify it."""
        ledger, cache = self.ctx.ledger, self.ctx.cache
        nbytes = (h.end - h.start) * cache.token_bytes * h.num_layers
        grant = ledger.admit(h.transfer_id, h.layer, h.start, h.end, nbytes, "WRITTEN", h.num_layers)
        if grant is None:
            return
        ok = None
        try:
            ok = cache.hash_landed(h.layer, grant.slots(cache, h.start, h.end), h.num_layers) == h.checksum
        finally:
            ledger.end_write(grant, h.layer, h.start, h.end, ok, num_layers=h.num_layers)

    def close(self) -> None:
        pass
