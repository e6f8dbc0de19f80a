"""The KV cache as transports see it: per layer, ``token_bytes`` bytes per token slot.

Whatever the cache's element type (floats, or quantized values with their scales packed into
each token), one token's K and V in one layer are ``token_bytes`` contiguous bytes, slots are
ordered block by block, and tokens ``[start, end)`` of a request are the slots its block table
maps them to. Each side maps the same token range with its own block ids and block size:
that is the re-blocking. Everything here works on a whole unit (one token range of one or
more layers) with vectorized index operations over rows of whole blocks where it can: Python
work per unit, never per block.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.host_memory import host_bytes
from pdserve.kvtransfer.integrity import checksum, fold, host_chunk_digests

# Units from this size are gathered and scattered with streaming stores: they do not stay in a
# core's L2 anyway, and a cached store first reads every line it overwrites (UCX: 12% faster).
STREAM_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Slots:
    """The cache slots holding tokens [start, end) of a request, in token order."""

    array: np.ndarray  # int64 slot numbers
    first: int  # the first slot
    contiguous: bool  # slots first, first + 1, ...: the unit is one byte range of the layer
    # The same slots as rows of ``g`` consecutive, aligned tokens: (g, row numbers in a
    # [num_slots / g, g, token_bytes] view), in token order. Whole-block rows when the range
    # starts on a block boundary: host gathers and scatters then copy blocks, not tokens.
    runs: tuple[tuple[int, np.ndarray], ...] = ()
    index: torch.Tensor | None = None  # ``array`` on the cache's device (for gathers there)

    def __len__(self) -> int:
        return len(self.array)


def slots_of(block_ids: list[int], block_size: int, start: int, end: int, device: torch.device | None = None) -> Slots:
    """Where tokens [start, end) of a request live, given its block table (``ValueError`` if
    they do not fit it, or it names a negative block: numpy would wrap it around to the cache's
    end); ``device``: also as a tensor there."""
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(f"tokens [{start}, {end}) do not fit {len(block_ids)} blocks of {block_size}")
    positions = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    if len(blocks) and blocks.min() < 0:
        raise ValueError(f"negative block id {blocks.min()} in a block table")
    array = blocks * block_size + positions % block_size
    contiguous = bool(len(array)) and bool((np.diff(array) == 1).all())
    g = math.gcd(block_size, start)  # rows of g tokens never cross a block (g divides the block size)
    body = len(array) - len(array) % g
    runs = ((g, array[:body:g] // g),) if body else ()
    if body < len(array):
        runs += ((1, array[body:]),)
    index = torch.from_numpy(array).to(device) if device is not None else None
    return Slots(array, int(array[0]) if len(array) else 0, contiguous, runs, index)


def gather(rows: np.ndarray, slots: Slots) -> np.ndarray:
    """The tokens of ``slots`` in host ``rows`` [num_slots, token_bytes], token-ordered: a view
    when they are contiguous, else one vectorized copy per run of rows."""
    if slots.contiguous:
        return rows[slots.first : slots.first + len(slots)]
    token_bytes = rows.shape[1]
    parts = [rows.reshape(-1, g, token_bytes)[index].reshape(-1, token_bytes) for g, index in slots.runs]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def scatter(rows: np.ndarray, slots: Slots, data: np.ndarray) -> None:
    """Writes token-ordered bytes ``data`` into ``slots`` of host ``rows``."""
    token_bytes = rows.shape[1]
    data = data.reshape(-1, token_bytes)
    if slots.contiguous:
        np.copyto(rows[slots.first : slots.first + len(slots)], data)
        return
    at = 0
    for g, index in slots.runs:
        count = len(index) * g
        rows.reshape(-1, g, token_bytes)[index] = data[at : at + count].reshape(-1, g, token_bytes)
        at += count


def copy_and_hash(src: np.ndarray, src_slots: Slots, dst: np.ndarray, dst_slots: Slots, stream: bool = False) -> int:
    """Copies the tokens of ``src_slots`` to ``dst_slots`` (host rows); returns the checksum
    of the bytes, taken in the same pass. ``stream``: past this core's caches (the
    destination is another process's)."""
    digests = host_chunk_digests(src, src_slots.array, dst, dst_slots.array, stream)
    return fold(digests, len(src_slots) * src.shape[1])


def hash_rows(rows: np.ndarray, slots: Slots) -> int:
    """The checksum of the tokens of ``slots`` in host ``rows``."""
    return fold(host_chunk_digests(rows, slots.array), len(slots) * rows.shape[1])


@functools.lru_cache(maxsize=8)
def identity(n: int) -> np.ndarray:
    """Slots 0..n-1: a staging buffer's rows, in order (shared: read it, never write it)."""
    return np.arange(n, dtype=np.int64)


def span_rows(slots: Slots, layer: int, num_layers: int, total_layers: int, slots_per_layer: int) -> np.ndarray:
    """The rows holding ``slots`` in layers [layer, layer + num_layers) of a cache whose layers
    are stored one after another, layer after layer (``ValueError`` if they are not all there)."""
    if layer < 0 or num_layers < 1 or layer + num_layers > total_layers:
        raise ValueError(f"layers [{layer}, {layer + num_layers}) are outside the cache's {total_layers}")
    if len(slots) and not (0 <= slots.array.min() and slots.array.max() < slots_per_layer):
        raise IndexError(f"slots outside a layer's {slots_per_layer}")  # would land in another layer
    layers = np.arange(layer, layer + num_layers, dtype=np.int64)
    return (layers[:, None] * slots_per_layer + slots.array).reshape(-1)


def stacked_rows(layers: list[np.ndarray]) -> np.ndarray | None:
    """``layers`` (equal [slots, token_bytes] arrays) as one array of all their rows, when each
    starts where the one before ends; else None."""
    first = layers[0]
    if any(
        not layer.flags.c_contiguous
        or layer.shape != first.shape
        or layer.ctypes.data != first.ctypes.data + i * first.nbytes
        for i, layer in enumerate(layers)
    ):
        return None
    shape = (len(layers) * first.shape[0], first.shape[1])
    return np.lib.stride_tricks.as_strided(first, shape, first.strides)


class StagingPool:
    """Reusable byte buffers for units that cannot be read or written in place (a fragmented
    range, a GPU cache behind a host transport): no allocation per unit. Pinned when the
    cache is on a GPU. Thread-safe."""

    MIN_BYTES = 1 << 16
    MAX_KEPT_BYTES = 256 << 20

    def __init__(self, pinned: bool = False, device: torch.device | None = None) -> None:
        self.pinned = pinned
        self.device = device or torch.device("cpu")
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (slice it); hand it back with ``give``."""
        size = max(self.MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        if self.device.type == "cpu" and not self.pinned:
            return host_bytes(size)  # 2 MB pages from 2 MB up: UCX's shared-memory path reads it page by page
        pin = self.pinned and self.device.type == "cpu"
        return torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=pin)

    def give(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            if self._kept + size <= self.MAX_KEPT_BYTES:
                self._free.setdefault(size, []).append(buffer)
                self._kept += size


class KVCacheView:
    """Byte access to a cache's layers for the transports (registered once per worker).

    On a CPU cache, units of one layer are read and written in place when their slots are
    contiguous, and other units gathered/scattered through a staging buffer (several layers in
    one pass over ``flat``). On a GPU cache, host transports go
    through pinned staging buffers. ``force_staging`` takes the staged path on a CPU cache too
    (how the GPU path is tested without a GPU).
    """

    def __init__(
        self, layers: list[torch.Tensor], block_size: int, token_bytes: int, *, force_staging: bool = False
    ) -> None:
        self.block_size = block_size
        self.token_bytes = token_bytes
        self.device = layers[0].device
        self.rows = [layer.view(torch.uint8).reshape(-1, token_bytes) for layer in layers]
        self.on_host = self.device.type == "cpu" and not force_staging
        self.host_staging = StagingPool(pinned=self.device.type == "cuda")
        self.device_staging = StagingPool(device=self.device)
        self._numpy = [rows.numpy() for rows in self.rows] if self.device.type == "cpu" else None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Every layer's rows as one [num_layers * slots_per_layer, token_bytes] array, when the
        # layers lie one after another in memory (an engine's cache, a shared pool): a unit of
        # several layers is then one set of rows, copied and hashed in one pass.
        self.slots_per_layer = self.rows[0].shape[0]
        self.flat = stacked_rows(self._numpy) if self._numpy is not None and self.on_host else None

    @property
    def num_layers(self) -> int:
        return len(self.rows)

    def slots(self, block_ids: list[int], start: int, end: int) -> Slots:
        return slots_of(block_ids, self.block_size, start, end, self.device)

    def host_rows(self, layer: int) -> np.ndarray:
        """Layer ``layer`` as a [num_slots, token_bytes] numpy array (CPU caches)."""
        return self._numpy[layer]

    def span_rows(self, layer: int, slots: Slots, num_layers: int) -> np.ndarray:
        """The rows of ``flat`` holding ``slots`` in layers [layer, layer + num_layers), layer after layer."""
        return span_rows(slots, layer, num_layers, self.num_layers, self.slots_per_layer)

    def hash_landed(self, layer: int, slots: Slots, num_layers: int = 1) -> int:
        """The checksum of ``slots`` in layers [layer, layer + num_layers), read where they are."""
        if num_layers == 1 and self.on_host:
            return hash_rows(self._numpy[layer], slots)
        if self.flat is not None:
            return fold(
                host_chunk_digests(self.flat, self.span_rows(layer, slots, num_layers)), self._nbytes(slots, num_layers)
            )
        data, digest = self.read_hashed(layer, slots, num_layers=num_layers)
        data.release()
        return digest

    def _nbytes(self, slots: Slots, num_layers: int = 1) -> int:
        return len(slots) * self.token_bytes * num_layers

    # -- reading (sender side; the receiver verifying what landed) -------------------------------
    def read(self, layer: int, slots: Slots, ready=None) -> "HostBytes":
        """Tokens of ``slots`` in ``layer`` as host bytes; ``ready``: a CUDA event the data waits for."""
        if self.device.type == "cpu":
            rows = self._numpy[layer]
            if slots.contiguous and self.on_host:
                return HostBytes(rows[slots.first : slots.first + len(slots)].reshape(-1))
            # numpy, not torch: one thread (torch's thread pool would fight the engine's for the cores)
            data = gather(rows, slots)
            return HostBytes((data.copy() if slots.contiguous else data).reshape(-1), staged=True)
        nbytes = len(slots) * self.token_bytes
        host = self.host_staging.take(nbytes)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            rows = self.gather_on_device(layer, slots)
            host[:nbytes].view(-1, self.token_bytes).copy_(rows, non_blocking=True)
            self.stream.synchronize()
        return HostBytes(host[:nbytes].numpy(), self.host_staging, host)

    def read_hashed(self, layer: int, slots: Slots, ready=None, num_layers: int = 1) -> tuple["HostBytes", int]:
        """``read`` (of ``num_layers`` layers from ``layer``, one after another), with the
        checksum of the bytes taken in the pass that gathers them."""
        if num_layers > 1:
            return self._read_span_hashed(layer, slots, ready, num_layers)
        if self.device.type != "cpu":
            data = self.read(layer, slots, ready)
            return data, checksum(data.data)
        rows, n = self._numpy[layer], len(slots)
        if slots.contiguous and self.on_host:
            return HostBytes(rows[slots.first : slots.first + n].reshape(-1)), hash_rows(rows, slots)
        buffer = self.host_staging.take(n * self.token_bytes)
        staged = buffer[: n * self.token_bytes].numpy().reshape(n, self.token_bytes)
        try:
            stream = n * self.token_bytes >= STREAM_BYTES
            digest = fold(host_chunk_digests(rows, slots.array, staged, identity(n), stream), n * self.token_bytes)
        except BaseException:
            self.host_staging.give(buffer)
            raise
        return HostBytes(staged.reshape(-1), self.host_staging, buffer), digest

    def _read_span_hashed(self, layer: int, slots: Slots, ready, num_layers: int) -> tuple["HostBytes", int]:
        total = self._nbytes(slots, num_layers)
        buffer = self.host_staging.take(total)
        staged = buffer[:total].numpy()
        try:
            if self.flat is not None:  # one gathering pass over every layer, hashed on the way
                rows = staged.reshape(-1, self.token_bytes)
                span = self.span_rows(layer, slots, num_layers)
                digests = host_chunk_digests(self.flat, span, rows, identity(len(rows)), total >= STREAM_BYTES)
                return HostBytes(staged, self.host_staging, buffer), fold(digests, total)
            size = self._nbytes(slots)
            for i in range(num_layers):  # a staged cache (a GPU's): layer by layer into one buffer
                part = self.read(layer + i, slots, ready)
                staged[i * size : (i + 1) * size] = part.data
                part.release()
        except BaseException:
            self.host_staging.give(buffer)
            raise
        return HostBytes(staged, self.host_staging, buffer), checksum(staged)

    def gather_on_device(self, layer: int, slots: Slots) -> torch.Tensor:
        if slots.contiguous:
            return self.rows[layer][slots.first : slots.first + len(slots)]
        return self.rows[layer].index_select(0, slots.index)

    # -- writing (receiver side) -----------------------------------------------------------------
    def write_target(self, layer: int, slots: Slots, num_layers: int = 1) -> "WriteTarget":
        """Where to put the bytes of ``slots`` in ``num_layers`` layers from ``layer``: in place
        (one contiguous range of one layer), or a staging buffer that ``commit`` scatters into the cache."""
        if self.on_host and slots.contiguous and num_layers == 1:
            return WriteTarget(
                self, layer, slots, self._numpy[layer][slots.first : slots.first + len(slots)].reshape(-1)
            )
        if num_layers > 1 and layer + num_layers > self.num_layers:
            raise ValueError(f"layers [{layer}, {layer + num_layers}) are outside the cache's {self.num_layers}")
        total = self._nbytes(slots, num_layers)
        host = self.host_staging.take(total)
        return WriteTarget(self, layer, slots, host[:total].numpy(), host, num_layers)

    def scatter(self, layer: int, slots: Slots, data: np.ndarray) -> None:
        """Copies token-ordered bytes into the slots of ``layer``."""
        rows = data.reshape(-1, self.token_bytes)
        if self.device.type == "cpu":
            scatter(self._numpy[layer], slots, rows)
            return
        with torch.cuda.stream(self.stream):
            staged = torch.from_numpy(rows).to(self.device, non_blocking=True)
            if slots.contiguous:
                self.rows[layer][slots.first : slots.first + len(slots)].copy_(staged)
            else:
                self.rows[layer].index_copy_(0, slots.index, staged)
            self.stream.synchronize()


class HostBytes:
    """A unit's bytes in host memory (a view of the cache, a gathered copy, or a staging buffer
    to give back)."""

    __slots__ = ("data", "staged", "_pool", "_buffer")

    def __init__(
        self,
        data: np.ndarray,
        pool: StagingPool | None = None,
        buffer: torch.Tensor | None = None,
        staged: bool = False,
    ) -> None:
        self.data, self._pool, self._buffer = data, pool, buffer
        self.staged = staged or buffer is not None  # a copy: the cache itself is not exposed

    def release(self) -> None:
        if self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer = None


class WriteTarget:
    """A buffer to receive one unit into, and how it reaches the cache."""

    __slots__ = ("view", "layer", "slots", "data", "_buffer", "num_layers")

    def __init__(
        self,
        view: KVCacheView,
        layer: int,
        slots: Slots,
        data: np.ndarray,
        buffer: torch.Tensor | None = None,
        num_layers: int = 1,
    ) -> None:
        self.view, self.layer, self.slots, self.data, self._buffer = view, layer, slots, data, buffer
        self.num_layers = num_layers

    @property
    def in_place(self) -> bool:
        return self._buffer is None

    def commit(self) -> None:
        """Scatters a staged unit into the cache (nothing to do in place)."""
        if self._buffer is None:
            return
        size = len(self.slots) * self.view.token_bytes
        for i in range(self.num_layers):
            self.view.scatter(self.layer + i, self.slots, self.data[i * size : (i + 1) * size])

    def commit_hashed(self) -> int:
        """``commit``, returning the checksum of the unit's bytes, taken in the same pass."""
        view = self.view
        if self._buffer is None or view.device.type != "cpu" or (self.num_layers > 1 and view.flat is None):
            digest = checksum(self.data)
            self.commit()
            return digest
        staged = self.data.reshape(-1, view.token_bytes)
        if self.num_layers > 1:
            rows, index = view.flat, view.span_rows(self.layer, self.slots, self.num_layers)
        else:
            rows, index = view.host_rows(self.layer), self.slots.array
        stream = staged.nbytes >= STREAM_BYTES
        return fold(host_chunk_digests(staged, identity(len(staged)), rows, index, stream), staged.size)

    def release(self) -> None:
        if self._buffer is not None:
            self.view.host_staging.give(self._buffer)
            self._buffer = None
