"""Re-sharding K/V between tensor-parallel layouts: every decode rank gets exactly its KV heads,
from the prefill ranks that hold them, over real sockets; the handshake refuses what it cannot map."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from kv_sides import Outcomes

from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.parallel.layout import kv_heads_of, kv_heads_per_rank
from pdserve.engine.parallel.rank_caches import shard_layout
from pdserve.kernels.kv_format import KVFormat
from pdserve.kvtransfer import shm_transport
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.kvtransfer.handshake import HandshakeError, PeerInfo, host_id
from pdserve.kvtransfer.layout import KVCacheView
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.resharding import ReshardedView, head_fields, plan, slot_bytes
from pdserve.kvtransfer.sender import KVConnection

LAYERS, DIM, BLOCK = 2, 8, 4


@pytest.mark.parametrize(
    "cache_dtype, dtype",
    [("auto", torch.float32), ("auto", torch.bfloat16), ("int8", torch.float32), ("fp8", torch.bfloat16)],
)
def test_head_fields_follow_the_slot_layout(cache_dtype, dtype):
    heads, tokens = 3, 5
    k, v = torch.randn(tokens, heads, DIM, dtype=dtype), torch.randn(tokens, heads, DIM, dtype=dtype)
    whole = KVFormat(cache_dtype, heads, DIM, dtype).encode(k, v).reshape(tokens, -1).view(torch.uint8)
    stored_as = cache_dtype if cache_dtype != "auto" else str(dtype).removeprefix("torch.")
    for h in range(heads):  # head h alone, encoded as a one-head slot, is head h's fields of the whole slot
        alone = (
            KVFormat(cache_dtype, 1, DIM, dtype)
            .encode(k[:, h : h + 1], v[:, h : h + 1])
            .reshape(tokens, -1)
            .view(torch.uint8)
        )
        fields, one = head_fields(stored_as, heads, DIM), head_fields(stored_as, 1, DIM)
        for (base, size), (base1, _) in zip(fields, one):
            assert torch.equal(whole[:, base + h * size : base + (h + 1) * size], alone[:, base1 : base1 + size])
        assert slot_bytes(stored_as, sum(size for _, size in fields) * heads) == whole.shape[1]  # and 8-bit padding


@pytest.mark.parametrize(
    "heads, src_tp, dst_tp", [(3, 1, 3), (3, 3, 1), (3, 3, 9), (3, 9, 1), (4, 2, 4), (4, 4, 2), (4, 8, 2), (2, 1, 8)]
)
def test_each_decode_rank_gets_each_of_its_heads_once_from_a_rank_holding_it(heads, src_tp, dst_tp):
    for d in range(dst_tp):
        got = []
        for src, src_head, dst_head, count in plan(heads, src_tp, dst_tp, d):
            held = kv_heads_of(src, heads, src_tp)
            for i in range(count):
                got.append((dst_head + i, held[src_head + i]))
        assert got == list(enumerate(kv_heads_of(d, heads, dst_tp)))


def shards_of(full: torch.Tensor, heads: int, tp: int) -> list[torch.Tensor]:
    """A plain cache [layers, blocks, block, 2, heads, dim] as shard layers ``layer * tp + rank``."""
    return [
        full[layer, :, :, :, kv_heads_of(r, heads, tp).start : kv_heads_of(r, heads, tp).stop].contiguous()
        for layer in range(full.shape[0])
        for r in range(tp)
    ]


@pytest.mark.parametrize("heads, src_tp, dst_tp", [(3, 1, 3), (3, 3, 1), (3, 3, 9), (4, 4, 2), (4, 1, 8)])
def test_resharded_view_reads_the_decode_layout(heads, src_tp, dst_tp):
    full = torch.randn(LAYERS, 6, BLOCK, 2, heads, DIM)
    src = shards_of(full, heads, src_tp)
    token_bytes = 2 * kv_heads_per_rank(heads, src_tp) * DIM * 4
    view = ReshardedView(KVCacheView(src, BLOCK, token_bytes), "float32", heads, DIM, src_tp, dst_tp)
    expected = shards_of(full, heads, dst_tp)
    assert view.num_layers == len(expected)
    slots = view.slots([5, 1, 3], 2, 11)  # a fragmented range, starting mid-block
    for layer, want in enumerate(expected):
        rows = want.view(torch.uint8).reshape(-1, view.token_bytes)[torch.from_numpy(slots.array)]
        got = view.read(layer, slots)
        assert got.data.tobytes() == rows.numpy().tobytes()
        got.release()
        assert torch.equal(view.gather_on_device(layer, slots), rows)


class ShardedSide:
    """One worker's caches as shard layers (random on the prefill side, zeros and a KV receiver on the decode side)."""

    def __init__(self, heads: int, tp: int, block_size: int, num_blocks: int, transport: str, decode: bool) -> None:
        whole = KVLayout(LAYERS, heads, DIM, block_size, torch.float32)
        self.layout = shard_layout(whole, tp)
        self.pool = (
            shm_transport.make_pool(self.layout, num_blocks, torch.device("cpu"))
            if decode and transport == "shm"
            else None
        )
        self.full = (
            torch.zeros(LAYERS, num_blocks, block_size, 2, heads, DIM)
            if decode
            else torch.randn(LAYERS, num_blocks, block_size, 2, heads, DIM)
        )
        if self.pool is not None:
            self.layers = list(self.pool.tensor.unbind(0))
        else:
            self.layers = shards_of(self.full, heads, tp)
        self.cache = KVCacheView(self.layers, block_size, self.layout.token_bytes)
        self.info = PeerInfo(
            model_fingerprint="m",
            dtype="float32",
            num_layers=LAYERS,
            num_kv_heads=heads,
            head_dim=DIM,
            block_size=block_size,
            transports=(transport,),
            host_id=host_id(),
            token_bytes=whole.token_bytes,
            role="decode" if decode else "prefill",
            tp_size=tp,
            extra=self.pool.describe() if self.pool else {},
        )
        self.receiver = None
        if decode:
            self.ledger = GrantLedger(self.layout.num_layers, self.layout.token_bytes)
            self.receiver = KVReceiver(self.ledger, self.cache, self.info, "127.0.0.1", 0)
            self.receiver.start()
            self.address = f"127.0.0.1:{self.receiver.port}"

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
        if self.pool is not None:
            self.pool.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("src_tp, dst_tp", [(1, 3), (3, 1), (3, 3)])
def test_a_transfer_between_layouts_lands_every_head_where_the_decode_ranks_hold_it(transport, src_tp, dst_tp):
    heads, tokens = 3, 13
    prefill = ShardedSide(heads, src_tp, block_size=8, num_blocks=4, transport=transport, decode=False)
    decode = ShardedSide(heads, dst_tp, block_size=4, num_blocks=8, transport=transport, decode=True)
    src_blocks, dst_blocks = [2, 0], [7, 1, 4, 6]  # different block sizes too: re-blocked and re-sharded
    try:
        outcomes = Outcomes()
        transfer_id = decode.ledger.grant(dst_blocks, tokens, 0, outcomes.reporter("grant"))
        conn = KVConnection(decode.address, prefill.info, prefill.cache)
        transfer = conn.open(transfer_id, dst_blocks, 4, tokens)
        for layer in range(LAYERS):  # what the engine's per-layer hook does
            transfer.send_layer(layer, src_blocks, 0, tokens)
        transfer.finish(7, outcomes.reporter("send"))
        assert outcomes.wait("grant").ok and outcomes.wait("send").ok
        conn.close()
        sent = prefill.full[:, src_blocks].reshape(LAYERS, -1, 2, heads, DIM)[:, :tokens]
        landed = torch.stack(
            [torch.stack(decode.layers[layer * dst_tp : (layer + 1) * dst_tp]) for layer in range(LAYERS)]
        )
        for layer in range(LAYERS):
            for d in range(dst_tp):
                rows = landed[layer, d][dst_blocks].reshape(-1, 2, kv_heads_per_rank(heads, dst_tp), DIM)[:tokens]
                held = kv_heads_of(d, heads, dst_tp)
                assert torch.equal(rows, sent[layer, :, :, held.start : held.stop])
    finally:
        decode.close()


def test_the_handshake_refuses_a_layout_it_cannot_map():
    prefill = ShardedSide(2, 1, block_size=4, num_blocks=2, transport="tcp", decode=False)
    decode = ShardedSide(2, 1, block_size=4, num_blocks=2, transport="tcp", decode=True)
    bad = replace(prefill.info, tp_size=3)  # 3 ranks cannot share 2 KV heads
    try:
        with pytest.raises(HandshakeError, match=r"prefill tensor parallel 3.*2 KV heads"):
            KVConnection(decode.address, bad, prefill.cache)
        assert decode.ledger.counters["handshakes_refused"] == 1
        with pytest.raises(HandshakeError, match="outside"):
            KVConnection(decode.address, replace(prefill.info, tp_size=0), prefill.cache)
    finally:
        decode.close()


def test_a_resharded_8bit_slot_is_padded_with_zeros_not_another_units_bytes():
    """Units are built in reused staging buffers: the padding after a slot's scales must be zeros
    (as the format says), not codes of an earlier unit (another request's K/V) sent along."""
    heads, dim, block_size, num_blocks = 3, 64, 16, 8
    fmt = KVFormat("int8", heads, dim, torch.bfloat16)
    layers = [torch.zeros(num_blocks, block_size, fmt.token_bytes, dtype=torch.uint8) for _ in range(2)]
    for layer in layers:
        noise = torch.randn(num_blocks * block_size, heads, dim) * 3
        layer.view(-1, fmt.token_bytes).copy_(fmt.encode(noise, -noise))
    view = ReshardedView(KVCacheView(layers, block_size, fmt.token_bytes), "int8", heads, dim, 1, 3)
    fields = 2 * dim + 2 * 4  # one head's codes and scales per decode rank
    assert view.token_bytes == 144
    view.read(0, view.slots(list(range(num_blocks)), 0, num_blocks * block_size)).release()  # dirties the buffer
    slots = view.slots([3, 1], 0, 2 * block_size)
    for layer in range(3):
        unit = view.read(layer, slots)
        rows = np.asarray(unit.data).reshape(len(slots), view.token_bytes)
        assert not rows[:, fields:].any()
        unit.release()
        assert not view.gather_on_device(layer, slots)[:, fields:].any()
