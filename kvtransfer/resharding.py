"""Re-sharding K/V between tensor-parallel layouts, on the prefill side of a connection.

Both workers number their caches as *shard layers*, ``layer * tp + tp_rank``, each holding one
rank's KV heads (``engine/parallel/rank_caches.py``). Units travel in the decode worker's
numbering, so each decode rank receives exactly its heads, whatever the prefill layout: when
the two tensor-parallel sizes differ, the connection reads through a ``ReshardedView``, which
assembles each unit of a decode shard from the prefill shards holding its heads. Within a
token's slot every field (K values, V values and, in 8-bit caches, their K and V scales) is
stored head-major, so a run of consecutive heads is one byte range per field: re-sharding is a
few column copies per unit, after the usual gather of its token rows (the re-blocking between
block sizes is unchanged).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.parallel.layout import kv_heads_of, kv_heads_per_rank, kv_split_problem
from pdserve.kernels.kv_format import padded_slot
from pdserve.kvtransfer.integrity import checksum
from pdserve.kvtransfer.layout import HostBytes, KVCacheView, Slots

_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
_QUANTIZED = ("int8", "fp8")
MAX_TP = 512


def head_fields(stored_as: str, num_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(offset of head 0, bytes per head) of each field of a token slot with ``num_heads`` heads
    (the slot layouts of ``kernels/kv_format.py``)."""
    row = head_dim * _VALUE_BYTES[stored_as]
    fields = [(0, row), (num_heads * row, row)]  # K values, V values
    if stored_as in _QUANTIZED:  # then fp32 scales: K scales, V scales
        fields += [(2 * num_heads * row, 4), (2 * num_heads * row + 4 * num_heads, 4)]
    return fields


def slot_bytes(stored_as: str, fields_bytes: int) -> int:
    """A token slot's bytes: its fields', and for 8-bit caches the padding after them."""
    return padded_slot(fields_bytes) if stored_as in _QUANTIZED else fields_bytes


def mapping_problem(num_kv_heads: int, src_tp: int, dst_tp: int, stored_as: str) -> str | None:
    """Why K/V cannot be re-sharded from ``src_tp`` to ``dst_tp`` ranks, or None."""
    for side, tp in (("prefill", src_tp), ("decode", dst_tp)):
        if not 1 <= tp <= MAX_TP:
            return f"the {side} side's tensor-parallel size {tp} is outside [1, {MAX_TP}]"
        problem = kv_split_problem(num_kv_heads, tp)
        if problem is not None:
            return f"the {side} side's layout cannot hold the model's KV heads: {problem}"
    if src_tp != dst_tp and stored_as not in _VALUE_BYTES:
        return f"cannot re-shard KV stored as {stored_as!r} between tensor-parallel sizes {src_tp} and {dst_tp}"
    return None


def plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[tuple[int, int, int, int]]:
    """(source rank, first head there, first head in the destination shard, heads) runs that
    fill decode rank ``dst_rank``'s shard. A head held by several source ranks (replicated) is
    read from one of them, spread by destination rank."""
    runs: list[list[int]] = []
    for j, head in enumerate(kv_heads_of(dst_rank, num_kv_heads, dst_tp)):
        holders = [r for r in range(src_tp) if head in kv_heads_of(r, num_kv_heads, src_tp)]
        src = holders[dst_rank % len(holders)]
        local = head - kv_heads_of(src, num_kv_heads, src_tp).start
        last = runs[-1] if runs else None
        if last and last[0] == src and last[1] + last[3] == local and last[2] + last[3] == j:
            last[3] += 1
        else:
            runs.append([src, local, j, 1])
    return [tuple(run) for run in runs]


class ReshardedView:
    """A prefill cache (``source``, its shard layers) read as a decode worker's shard layers:
    the part of ``KVCacheView`` that senders use."""

    on_host = False  # units are assembled, never read in place
    flat = None  # nor several layers at once

    def __init__(
        self, source: KVCacheView, stored_as: str, num_kv_heads: int, head_dim: int, src_tp: int, dst_tp: int
    ) -> None:
        problem = mapping_problem(num_kv_heads, src_tp, dst_tp, stored_as)
        if problem is not None:
            raise ValueError(problem)
        self.source, self.src_tp, self.dst_tp = source, src_tp, dst_tp
        self.block_size, self.device, self.stream = source.block_size, source.device, source.stream
        self.host_staging = source.host_staging
        self.num_layers = source.num_layers // src_tp * dst_tp
        src_fields = head_fields(stored_as, kv_heads_per_rank(num_kv_heads, src_tp), head_dim)
        dst_fields = head_fields(stored_as, kv_heads_per_rank(num_kv_heads, dst_tp), head_dim)
        self._used = sum(size for _, size in dst_fields) * kv_heads_per_rank(num_kv_heads, dst_tp)  # then padding
        self.token_bytes = slot_bytes(stored_as, self._used)
        # Per decode rank: per source rank, the (source offset, destination offset, bytes) column copies.
        self._copies: list[list[tuple[int, list[tuple[int, int, int]]]]] = []
        for d in range(dst_tp):
            by_source: dict[int, list[tuple[int, int, int]]] = {}
            for src, src_head, dst_head, count in plan(num_kv_heads, src_tp, dst_tp, d):
                for (src_base, size), (dst_base, _) in zip(src_fields, dst_fields):
                    by_source.setdefault(src, []).append(
                        (src_base + src_head * size, dst_base + dst_head * size, count * size)
                    )
            self._copies.append(sorted(by_source.items()))

    def slots(self, block_ids: list[int], start: int, end: int) -> Slots:
        return self.source.slots(block_ids, start, end)

    def _split(self, layer: int) -> tuple[int, list[tuple[int, list[tuple[int, int, int]]]]]:
        model_layer, dst_rank = divmod(layer, self.dst_tp)
        return model_layer * self.src_tp, self._copies[dst_rank]

    def read(self, layer: int, slots: Slots, ready=None) -> HostBytes:
        """Decode shard layer ``layer``'s tokens of ``slots`` as host bytes."""
        first, copies = self._split(layer)
        n = len(slots)
        buffer = self.host_staging.take(n * self.token_bytes)
        out = buffer[: n * self.token_bytes].numpy().reshape(n, self.token_bytes)
        for src, columns in copies:
            part = self.source.read(first + src, slots, ready)
            rows = np.asarray(part.data).reshape(n, -1)
            for src_at, dst_at, size in columns:
                out[:, dst_at : dst_at + size] = rows[:, src_at : src_at + size]
            part.release()
        out[:, self._used :] = 0  # the staging buffer held another unit's bytes
        return HostBytes(out.reshape(-1), self.host_staging, buffer)

    def read_hashed(self, layer: int, slots: Slots, ready=None, num_layers: int = 1) -> tuple[HostBytes, int]:
        if num_layers != 1:  # it has no ``flat`` rows, so its connection never joins layers
            raise ValueError("a resharded cache is sent one layer at a time")
        data = self.read(layer, slots, ready)
        return data, checksum(data.data)

    def gather_on_device(self, layer: int, slots: Slots) -> torch.Tensor:
        """The same, assembled where the cache is (device-to-device transports)."""
        first, copies = self._split(layer)
        out = torch.zeros((len(slots), self.token_bytes), dtype=torch.uint8, device=self.device)
        for src, columns in copies:
            rows = self.source.gather_on_device(first + src, slots)
            for src_at, dst_at, size in columns:
                out[:, dst_at : dst_at + size] = rows[:, src_at : src_at + size]
        return out
