"""Every KV transport in one process over real sockets (and real UCX / shared memory):
re-blocking between block sizes, prefix-aware partial transfers, the staged path a GPU cache
takes (forced here over host memory), corrupted data, stalls, bad units, UCX send errors,
cancelled receives and refused units never sent, and CUDA IPC's data path on CPU tensors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from kv_sides import LAYERS, TOKEN_BYTES, UCX_SKIP_REASON, Decode, Prefill, assert_same_tokens, peer, wait_until
from processes import can_mount_private_shm

from pdserve.kvtransfer import cuda_ipc_transport, receiver, ucx_transport, ucx_worker
from pdserve.kvtransfer.protocol import FrameHeader, FrameKind
from pdserve.kvtransfer.ucx_worker import UcxWorker

UCX = pytest.param("ucx", marks=pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON)))
TRANSPORTS = ["tcp", "shm", UCX]


@pytest.mark.parametrize("staging", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_lands_with_reblocking(transport, staging):
    """Prefill blocks of 16 tokens, decode blocks of 8, shuffled block ids, chunked sends."""
    decode = Decode(transport, block_size=8, force_staging=staging)
    prefill = Prefill(transport, block_size=16, force_staging=staging)
    try:
        conn = prefill.connect(decode.address)
        assert conn.name == transport
        n, dst, src = 45, [9, 3, 17, 4, 25, 0], [5, 2, 11]
        tid = decode.grant(dst, n)
        sent = prefill.ship(conn, tid, src, dst, 8, n, chunks=(0, 13, 30))
        assert sent.ok and sent.transport == transport and sent.nbytes == n * LAYERS * TOKEN_BYTES
        landed = decode.outcome(tid)
        assert landed.ok and landed.first_token_id == 42 and landed.transport == transport
        assert_same_tokens(prefill.layers, src, decode.layers, dst, n)
        assert decode.ledger.counters[f"transfers_{transport}"] == 1 and decode.ledger.num_active == 0
        conn.close()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("receiver", ["in-place", "staged"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layers_queued_together_travel_as_one_unit(transport, receiver, monkeypatch):
    """Sending after the prefill: the connection joins the queued layers into one unit (one
    frame, one checksum) and stops at DONE, which follows; the unit lands re-blocked, also in a
    staged (GPU-like) cache."""
    decode = Decode(transport, block_size=8, force_staging=receiver == "staged")
    prefill = Prefill(transport, block_size=16)
    try:
        conn = prefill.connect(decode.address)
        assert conn.max_span_bytes >= LAYERS * 45 * TOKEN_BYTES
        sent_units = []
        real_send = conn.sender.send
        monkeypatch.setattr(conn.sender, "send", lambda unit: (sent_units.append(unit.num_layers), real_send(unit)))
        n, dst, src = 45, [9, 3, 17, 4, 25, 0], [5, 2, 11]
        tid = decode.grant(dst, n)
        with conn.ctx.send_lock:  # the sender thread waits on its first frame while all is queued
            transfer = prefill.start(conn, tid, src, dst, 8, n)
            transfer.finish(42, prefill.outcomes.reporter(transfer))
            time.sleep(0.05)
        sent = prefill.outcomes.wait(transfer)
        assert sent.ok and sent.nbytes == n * LAYERS * TOKEN_BYTES and sent_units == [LAYERS]
        assert decode.outcome(tid).ok
        assert_same_tokens(prefill.layers, src, decode.layers, dst, n)
        conn.close()
    finally:
        prefill.close()
        decode.close()


def test_a_unit_of_several_layers_is_no_larger_than_the_transport_takes(monkeypatch):
    decode, prefill = Decode("tcp", block_size=8), Prefill("tcp", block_size=16)
    try:
        conn = prefill.connect(decode.address)
        conn.max_span_bytes = 2 * 45 * TOKEN_BYTES  # two layers of this transfer
        sent_units = []
        real_send = conn.sender.send
        monkeypatch.setattr(conn.sender, "send", lambda unit: (sent_units.append(unit.num_layers), real_send(unit)))
        tid = decode.grant([9, 3, 17, 4, 25, 0], 45)
        with conn.ctx.send_lock:
            transfer = prefill.start(conn, tid, [5, 2, 11], [9, 3, 17, 4, 25, 0], 8, 45)
            time.sleep(0.05)
        assert prefill.finish(transfer).ok and decode.outcome(tid).ok
        assert sent_units == [2, 1]
        conn.close()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_contiguous_blocks_travel_in_place(transport):
    decode, prefill = Decode(transport, block_size=16), Prefill(transport, block_size=16)
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([4, 5, 6], 40)
        assert prefill.ship(conn, tid, [1, 2, 3], [4, 5, 6], 16, 40).ok
        assert decode.outcome(tid).ok
        assert_same_tokens(prefill.layers, [1, 2, 3], decode.layers, [4, 5, 6], 40)
        conn.close()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cached_prefix_is_not_sent_again(transport):
    decode, prefill = Decode(transport), Prefill(transport)
    try:
        conn = prefill.connect(decode.address)
        marker = decode.layers[0][0].clone()
        tid = decode.grant([0, 1, 2], 20, skip_tokens=8)  # block 0 is a shared prefix: already here
        sent = prefill.ship(conn, tid, [3, 4], [0, 1, 2], 8, 20, skip_tokens=8)
        assert sent.ok and sent.nbytes == 12 * LAYERS * TOKEN_BYTES
        assert decode.outcome(tid).ok
        assert torch.equal(decode.layers[0][0], marker)  # untouched
        assert_same_tokens(prefill.layers, [3, 4], decode.layers, [0, 1, 2], 20, start=8)
        conn.close()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_data_is_detected_and_the_grant_fails(transport, caplog):
    """The fault flips a byte of the K/V themselves (after the checksum was taken)."""
    decode, prefill = Decode(transport), Prefill(transport, faults="corrupt=1")
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([1, 2], 10)
        sent = prefill.ship(conn, tid, [0], [1, 2], 8, 10)
        assert not sent.ok and sent.corrupted
        landed = decode.outcome(tid)
        assert not landed.ok and landed.corrupted and "checksum" in landed.reason
        assert decode.ledger.counters["checksum_mismatch"] == 1
        assert f"transfer {tid:016x}: checksum mismatch in layers 0-" in caplog.text  # an operator sees it
        assert torch.equal(prefill.layers[0][0], Prefill(transport).layers[0][0])  # our own cache was not touched
        tid2 = decode.grant([5], 8)  # the connection keeps working; the next transfer lands
        assert prefill.ship(conn, tid2, [3], [5], 8, 8).ok and decode.outcome(tid2).ok
        conn.close()
    finally:
        prefill.close()
        decode.close()


def test_a_payload_altered_on_the_wire_is_refused():
    """A DATA frame whose bytes differ from what its checksum covers, sent by hand."""
    decode, prefill = Decode("tcp"), Prefill("tcp")
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([1], 8)
        from pdserve.kvtransfer.integrity import checksum

        for layer in range(LAYERS):
            payload = bytearray(prefill.layers[layer][0, :8].numpy().tobytes())
            digest = checksum(bytes(payload))
            payload[100] ^= 1
            conn.ctx.send_frame(
                FrameHeader(FrameKind.DATA, tid, layer, 0, 8, payload_len=len(payload), checksum=digest), payload
            )
        transfer = conn.open(tid, [1], 8, 8)
        outcome = prefill.finish(transfer)
        assert not outcome.ok and outcome.corrupted and decode.outcome(tid).corrupted
    finally:
        prefill.close()
        decode.close()


def test_stalled_transfer_expires_and_late_data_is_refused():
    decode, prefill = Decode("tcp", lease_s=0.3), Prefill("tcp", faults="stall=1")
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([1, 2], 12)
        transfer = prefill.start(conn, tid, [0], [1, 2], 8, 12)
        transfer.finish(1, prefill.outcomes.reporter(transfer))  # the fault plan swallows this DONE
        deadline = time.monotonic() + 5
        while not decode.ledger.reap_expired() and time.monotonic() < deadline:
            time.sleep(0.05)
        landed = decode.outcome(tid)
        assert not landed.ok and "lease expired" in landed.reason
        assert decode.ledger.counters["lease_expired"] == 1 and decode.ledger.num_active == 0
        late = prefill.start(conn, tid, [0], [1, 2], 8, 12)  # a late unit for the dead transfer is refused
        tid2 = decode.grant([4], 8)
        assert prefill.ship(conn, tid2, [1], [4], 8, 8).ok
        assert decode.ledger.counters["units_refused"] >= 1
        late.cancel()
        conn.close()
    finally:
        prefill.close()
        decode.close()


def test_malformed_and_oversized_frames_drop_only_that_peer():
    decode, prefill = Decode("tcp"), Prefill("tcp")
    try:
        host, port = decode.address.split(":")
        garbage = socket.create_connection((host, int(port)))
        garbage.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
        assert garbage.recv(10) == b""  # dropped
        garbage.close()

        conn = prefill.connect(decode.address)
        tid = decode.grant([1], 8)
        conn.ctx.send_frame(FrameHeader(FrameKind.DATA, tid, 0, 0, 8, payload_len=1 << 40))  # bigger than any layer
        spans = prefill.connect(decode.address)
        too_big = FrameHeader(FrameKind.DATA, tid, 0, 0, 8, payload_len=(16 << 20) + 1, num_layers=2)
        spans.ctx.send_frame(too_big)  # refused before anything is allocated or read for it
        deadline = time.monotonic() + 5
        while decode.ledger.counters["protocol_errors"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert decode.ledger.counters["protocol_errors"] == 3

        good = prefill.connect(decode.address)
        tid2 = decode.grant([2], 8)
        assert prefill.ship(good, tid2, [0], [2], 8, 8).ok
        good.close()
    finally:
        prefill.close()
        decode.close()


def test_units_outside_the_grant_are_refused():
    decode, prefill = Decode("tcp"), Prefill("tcp")
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([1], 8)
        payload = bytes(8 * TOKEN_BYTES)
        for bad in (
            FrameHeader(FrameKind.DATA, tid, LAYERS + 5, 0, 8, payload_len=len(payload)),  # no such layer
            FrameHeader(FrameKind.DATA, tid, 0, 4, 12, payload_len=len(payload)),  # past the grant
            FrameHeader(FrameKind.DATA, 12345, 0, 0, 8, payload_len=len(payload)),  # not a transfer we granted
            FrameHeader(
                FrameKind.DATA, tid, LAYERS - 1, 0, 8, payload_len=2 * len(payload), num_layers=2
            ),  # past the last layer
        ):
            conn.ctx.send_frame(bad, payload * bad.num_layers)
        transfer = conn.open(tid, [1], 8, 8)
        transfer.send_layer(0, [0], 0, 8)
        transfer.send_layer(0, [0], 0, 8)  # the same tokens twice
        for layer in range(1, LAYERS):
            transfer.send_layer(layer, [0], 0, 8)
        assert prefill.finish(transfer).ok
        assert decode.ledger.counters["units_refused"] == 5 and decode.ledger.counters["protocol_errors"] == 0
        conn.close()
    finally:
        prefill.close()
        decode.close()


def test_a_bad_source_range_fails_only_that_transfer():
    decode, prefill = Decode("tcp"), Prefill("tcp")
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([1, 2], 16)
        transfer = prefill.start(conn, tid, [0], [1, 2], 8, 16, chunks=(0,))  # 16 tokens in one 16-token block: fine
        transfer.send_layer(0, [0], 10, 40)  # past the source table
        outcome = prefill.finish(transfer)
        assert outcome.ok  # tokens [10, 16) of layer 0 were already sent; the range is clipped to the grant
        tid2 = decode.grant([3, 4], 16)
        bad = conn.open(tid2, [3, 4], 8, 16)
        bad.send_layer(0, [], 0, 16)  # a source table that cannot hold the tokens
        outcome = prefill.finish(bad)
        assert not outcome.ok and "do not fit" in outcome.reason
        conn.close()
    finally:
        prefill.close()
        decode.close()


# -- UCX: send errors surface, cancelled receives really stop -----------------------------------------


@pytest.fixture
def ucx_pair(monkeypatch):
    """Makes a decode and a prefill side over UCX, both closed after the test. ``rendezvous``:
    messages over 1 KiB move only once a receive matches (read when the UCX contexts are made)."""
    made = []

    def make(rendezvous: bool = False):
        if rendezvous:
            monkeypatch.setenv("UCX_RNDV_THRESH", "1024")
        made.append((Decode("ucx"), Prefill("ucx")))
        return made[-1]

    yield make
    for decode, prefill in made:
        prefill.close()
        decode.close()


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_failed_ucx_send_fails_the_transfer(ucx_pair, monkeypatch):
    decode, prefill = ucx_pair()
    conn = prefill.connect(decode.address)
    real_send = prefill.ucx.send
    calls = []

    def failing(peer, buffer, tag, done):
        calls.append(tag)
        if len(calls) == 2:
            done(RuntimeError("simulated UCX error"))
        else:
            real_send(peer, buffer, tag, done)

    monkeypatch.setattr(prefill.ucx, "send", failing)
    tid = decode.grant([1, 2], 10)
    outcome = prefill.ship(conn, tid, [0], [1, 2], 8, 10, chunks=(0, 5))  # two units at least: the second fails
    assert len(calls) >= 2 and not outcome.ok and "UCX send failed" in outcome.reason


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_cancelled_ucx_receive_holds_its_blocks_until_ucx_lets_go(ucx_pair, monkeypatch):
    decode, prefill = ucx_pair()
    conn = prefill.connect(decode.address)
    conn.max_span_bytes = 0  # one receive per layer, however the layers are queued
    monkeypatch.setattr(prefill.ucx, "send", lambda peer, buffer, tag, done: done(None))  # announced, never sent
    tid = decode.grant([1, 2], 10)
    transfer = prefill.start(conn, tid, [0], [1, 2], 8, 10)
    deadline = time.monotonic() + 5
    grant = decode.ledger.lookup(tid)
    while grant.writers < LAYERS and time.monotonic() < deadline:  # three receives posted, none can complete
        time.sleep(0.01)
    assert grant.writers == LAYERS
    decode.ledger.cancel(tid, "request gone")
    landed = decode.outcome(tid)  # comes only once every posted receive has completed
    assert not landed.ok and grant.writers == 0 and decode.ledger.num_active == 0
    transfer.cancel()
    conn.close()


def watch_drains(monkeypatch, decode: Decode) -> list[int]:
    """The tags of the decode side's drains (receives into nothing) posted and not landed yet."""
    pending: list[int] = []
    real_recv = decode.ucx.recv

    def recv(buffer, tag, done, **kw):
        if len(buffer):
            return real_recv(buffer, tag, done, **kw)
        pending.append(tag)
        return real_recv(buffer, tag, lambda error: pending.remove(tag) or done(error), **kw)

    monkeypatch.setattr(decode.ucx, "recv", recv)
    return pending


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
@pytest.mark.parametrize("busy", [True, False], ids=["more-units", "then-quiet"])
def test_refused_ucx_units_never_sent_are_bounded_and_dropped(ucx_pair, monkeypatch, busy):
    """A peer announcing units the decode side refuses, and never sending their messages, has at
    most MAX_DRAINS receives posted for them; the connection ends once they have waited
    DRAIN_TIMEOUT_S without one landing (whether more units wait for room, or the peer goes
    quiet), and its drains are cancelled."""
    decode, prefill = ucx_pair()
    monkeypatch.setattr(ucx_transport, "MAX_DRAINS", 2)
    monkeypatch.setattr(ucx_transport, "DRAIN_TIMEOUT_S", 0.5)
    monkeypatch.setattr(receiver, "IO_TIMEOUT_S", 0.2)  # how often an idle connection is checked
    drains = watch_drains(monkeypatch, decode)
    conn = prefill.connect(decode.address)
    conn.max_span_bytes = 0
    monkeypatch.setattr(prefill.ucx, "send", lambda peer, buffer, tag, done: done(None))  # announced, never sent
    layers = LAYERS if busy else 1  # the third waits for room, or one and then silence
    transfer = conn.open(0x5EED, [1, 2], 8, 10)  # never granted: each unit is refused
    for layer in range(layers):
        transfer.send_layer(layer, [0], 0, 10)
    errors = decode.ledger.counters
    assert wait_until(lambda: len(drains) > 2 or errors["protocol_errors"] > 0)
    assert len(drains) <= 2 and errors["protocol_errors"] == 1 and errors["units_refused"] == layers
    assert wait_until(lambda: not drains), drains  # the connection's drains are cancelled
    transfer.cancel()
    conn.close()


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_refused_ucx_units_that_are_sent_drain_past_the_bound(ucx_pair, monkeypatch):
    """Refused units whose messages do come (a grant that ended mid-transfer) only wait for room:
    all of them drain (the sender's sends complete), and the connection carries the next transfer."""
    decode, prefill = ucx_pair(rendezvous=True)
    monkeypatch.setattr(ucx_transport, "MAX_DRAINS", 1)  # one at a time
    drains = watch_drains(monkeypatch, decode)
    conn = prefill.connect(decode.address)
    conn.max_span_bytes = 0
    late = prefill.ship(conn, 0x5EED, [0], [1, 2], 8, 10, chunks=(0, 5))  # never granted
    assert not late.ok and "UCX" not in late.reason and decode.ledger.counters["units_refused"] == 2 * LAYERS
    tid = decode.grant([3, 4], 10)
    assert prefill.ship(conn, tid, [0], [3, 4], 8, 10).ok and decode.outcome(tid).ok
    assert_same_tokens(prefill.layers, [0], decode.layers, [3, 4], 10)
    assert decode.ledger.counters["protocol_errors"] == 0 and drains == []
    conn.close()


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_message_arriving_after_its_receive_was_cancelled_is_drained(ucx_pair, monkeypatch):
    """A grant that fails while its receives are posted cancels them; the sender's messages that
    come later (rendezvous: they move only once matched) are still received, so its sends
    complete instead of hanging. Meanwhile the next transfer on the connection is not held up
    behind those drains."""
    decode, prefill = ucx_pair(rendezvous=True)
    drains = watch_drains(monkeypatch, decode)
    conn = prefill.connect(decode.address)
    conn.max_span_bytes = 0
    held, completed, holding = [], [], [True]
    real_send = prefill.ucx.send

    def hold(peer, buffer, tag, done):
        if not holding[0]:
            return real_send(peer, buffer, tag, done)
        held.append(lambda: real_send(peer, buffer, tag, lambda error: completed.append(error) or done(error)))

    monkeypatch.setattr(prefill.ucx, "send", hold)
    tid = decode.grant([1, 2], 10)
    transfer = prefill.start(conn, tid, [0], [1, 2], 8, 10)
    grant = decode.ledger.lookup(tid)
    assert wait_until(lambda: grant.writers == LAYERS and len(held) == LAYERS)
    decode.ledger.cancel(tid, "request gone")
    assert not decode.outcome(tid).ok
    assert wait_until(lambda: len(drains) == LAYERS)
    holding[0] = False
    after = decode.grant([3, 4], 10)
    assert prefill.ship(conn, after, [0], [3, 4], 8, 10).ok and decode.outcome(after).ok
    for send in held:  # the messages come after their receives were cancelled
        send()
    assert wait_until(lambda: len(completed) == LAYERS) and completed == [None] * LAYERS
    assert wait_until(lambda: not drains), drains
    transfer.cancel()
    conn.close()


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_refused_unit_behind_a_slow_transfer_drains_at_once(ucx_pair, monkeypatch):
    """A refused unit's message lands in its drain whatever the connection's earlier receives
    are doing: a transfer still arriving after DRAIN_TIMEOUT_S does not get the connection
    dropped, and completes."""
    decode, prefill = ucx_pair(rendezvous=True)
    monkeypatch.setattr(ucx_transport, "DRAIN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(receiver, "IO_TIMEOUT_S", 0.1)
    conn = prefill.connect(decode.address)
    conn.max_span_bytes = 0
    held, holding, real_send = [], [True], prefill.ucx.send
    monkeypatch.setattr(prefill.ucx, "send", lambda *args: held.append(args) if holding[0] else real_send(*args))
    tid = decode.grant([1, 2], 10)
    slow = prefill.start(conn, tid, [0], [1, 2], 8, 10)  # its messages wait
    grant = decode.ledger.lookup(tid)
    assert wait_until(lambda: grant.writers == LAYERS and len(held) == LAYERS)
    holding[0] = False
    refused = conn.open(0x5EED, [3, 4], 8, 10)  # never granted: refused, its message sent at once
    refused.send_layer(0, [0], 0, 10)
    assert wait_until(lambda: decode.ledger.counters["units_refused"] == 1)
    time.sleep(1.0)  # more than DRAIN_TIMEOUT_S, with the slow transfer's receives still posted
    assert decode.ledger.counters["protocol_errors"] == 0
    for args in held:
        real_send(*args)
    assert prefill.finish(slow).ok and decode.outcome(tid).ok
    refused.cancel()
    conn.close()


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_cancelled_grant_is_reported_while_an_earlier_transfer_still_waits(ucx_pair, monkeypatch):
    """Receives complete in their connection's order, but a cancelled one completes on our own
    message whenever we send it: its grant's failure does not wait for an earlier transfer's
    data."""
    decode, prefill = ucx_pair()
    conn = prefill.connect(decode.address)
    conn.max_span_bytes = 0
    held, real_send = [], prefill.ucx.send
    monkeypatch.setattr(prefill.ucx, "send", lambda *args: held.append(args))  # announced, sent later
    first, second = decode.grant([1, 2], 10), decode.grant([3, 4], 10)
    slow = prefill.start(conn, first, [0], [1, 2], 8, 10)
    gone = prefill.start(conn, second, [0], [3, 4], 8, 10)
    grants = decode.ledger.lookup(first), decode.ledger.lookup(second)
    assert wait_until(lambda: all(g.writers == LAYERS for g in grants))
    decode.ledger.cancel(second, "request gone")
    assert not decode.outcome(second, timeout=5).ok  # the first transfer's receives are still posted
    for args in held[:LAYERS]:
        real_send(*args)
    assert prefill.finish(slow).ok and decode.outcome(first).ok
    for args in held[LAYERS:]:  # the second transfer's messages come late: drains take them, its sends end
        real_send(*args)
    gone.cancel()
    conn.close()


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_send_stuck_on_a_dropped_connection_holds_up_no_other_connection(ucx_pair, monkeypatch):
    """A message that comes after its connection was dropped (and its drain cancelled) matches
    nothing, and its send never completes: later transfers to the same decode worker, on a new
    connection, still complete."""
    decode, prefill = ucx_pair(rendezvous=True)
    monkeypatch.setattr(ucx_transport, "DRAIN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(receiver, "IO_TIMEOUT_S", 0.1)
    conn = prefill.connect(decode.address)
    held, real_send = [], prefill.ucx.send
    monkeypatch.setattr(prefill.ucx, "send", lambda *args: held.append(args))
    transfer = conn.open(0x5EED, [1, 2], 8, 10)  # never granted: refused, drained
    transfer.send_layer(0, [0], 0, 10)
    assert wait_until(lambda: decode.ledger.counters["protocol_errors"] == 1)  # its message did not come
    monkeypatch.setattr(prefill.ucx, "send", real_send)
    ended = []
    for peer_address, buffer, tag, done in held:  # now it comes: nothing takes it
        real_send(peer_address, buffer, tag, lambda e, done=done: (ended.append(e), done(e)))
    transfer.cancel()
    conn.close()
    again = prefill.connect(decode.address)
    tid = decode.grant([3, 4], 10)
    assert prefill.ship(again, tid, [0], [3, 4], 8, 10).ok and decode.outcome(tid).ok
    again.close()
    # Still stuck, or, on a slow machine, taken by the old connection's drain before its cancel
    # completed (into scratch: nothing reaches the cache). Either way the new connection was not held up.
    assert ended in ([], [None] * len(held))
    # Stopping the decode side receives the stray message (ucxx's destructor would wait for it
    # for ever once its sender stops), so the stuck send ends and both workers can go.
    decode.close()
    assert wait_until(lambda: len(ended) == len(held)) and ended == [None] * len(held)
    assert not decode.ucx.kept_until_exit


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_worker_whose_send_cannot_end_is_kept_instead_of_destroyed(monkeypatch):
    """A rendezvous send that no receive takes never ends, and ucxx's destructor would wait for it
    for ever: the stop gives it a bounded time, then keeps that worker until the process exits."""
    monkeypatch.setenv("UCX_RNDV_THRESH", "1024")
    monkeypatch.setattr(ucx_worker, "SETTLE_S", 0.3)
    sender, peer = UcxWorker(), UcxWorker()
    sent = []
    sender.send(peer.address, bytearray(64 * 1024), 5, sent.append)
    sender.connect(peer.address).result(timeout=5)  # commands run in order: the send is posted
    started = time.monotonic()
    sender.close()
    assert sender.kept_until_exit and time.monotonic() - started < 5
    assert len(sent) == 1 and isinstance(sent[0], RuntimeError)
    peer.close()  # the message it never took: received at its stop, or its worker kept; either way it ends
    assert time.monotonic() - started < 10


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_a_stopped_ucx_worker_fails_what_it_is_asked_instead_of_dropping_it():
    """Whoever posts a receive or a send learns of its end, however late it comes: a completion
    that never came would keep a grant's blocks, or a drain's scratch, forever."""
    worker = UcxWorker()
    posted: list = []
    worker.recv(bytearray(16), 7, posted.append)  # queued or posted: ended by the stop either way
    worker.close()
    after: list = []
    worker.recv(bytearray(16), 8, after.append)
    worker.send(worker.address, bytearray(16), 9, after.append)
    assert wait_until(lambda: len(posted) == 1) and isinstance(posted[0], RuntimeError)
    assert len(after) == 2 and all(isinstance(e, RuntimeError) and "stopped" in str(e) for e in after)


@pytest.mark.skipif(UCX_SKIP_REASON is not None, reason=str(UCX_SKIP_REASON))
def test_the_ucx_sender_keeps_nothing_for_transfers_given_up_before_their_end():
    """A cancelled or failed transfer never flushes: once its sends complete, no entry is left."""
    import types

    import numpy as np

    from pdserve.kvtransfer.faults import FaultPlan
    from pdserve.kvtransfer.layout import HostBytes, slots_of
    from pdserve.kvtransfer.transport_api import Unit

    class Cache:  # one unit's bytes, already hashed
        def read_hashed(self, layer, slots, ready, num_layers):
            return HostBytes(np.zeros(64, np.uint8)), 0

    sender_worker, peer_worker = UcxWorker(), UcxWorker()
    try:
        ctx = types.SimpleNamespace(
            ucx=sender_worker,
            cache=Cache(),
            faults=FaultPlan(),
            remote_extra={"ucx_address": peer_worker.address.hex(), "ucx_tag": 5},
            send_frame=lambda *args, **kwargs: None,
        )
        sender = ucx_transport.Sender(ctx)
        landed: list = []
        for transfer_id in range(200):  # each sends one unit, then is given up (no flush)
            sequence = transfer_id  # the sender tags its n-th send with n
            peer_worker.recv(bytearray(64), (5 << ucx_transport.TAG_BITS) | sequence, landed.append)
            sender.send(Unit(transfer_id, 0, 0, 1, slots_of([0], 16, 0, 1), None))
        assert wait_until(lambda: len(landed) == 200) and not any(landed)
        assert wait_until(lambda: not sender._in_flight) and not sender._errors
    finally:
        sender_worker.close()
        peer_worker.close()


# -- CUDA IPC's data path, on CPU tensors (the pool "opened" by handle is the decode cache) -----------------


def test_cuda_ipc_path_on_cpu_tensors(monkeypatch):
    """The CUDA IPC sender and receiver on CPU tensors: gathers, scatters into the peer pool,
    and the device hash (a Triton kernel, run by its interpreter here)."""
    decode = Decode("tcp", block_size=8)
    monkeypatch.setattr(cuda_ipc_transport, "open_pool", lambda desc, cache: (decode.cache.rows, lambda: None))
    decode.receiver.local = peer(["cuda_ipc"], 8, extra={"cuda_ipc": {"pci_bus_id": "0000:01:00.0"}})
    prefill = Prefill("tcp", block_size=16, faults="")
    prefill.info = peer(["cuda_ipc"], 16, extra={"cuda_devices": ["0000:01:00.0"]})
    try:
        conn = prefill.connect(decode.address)
        assert conn.name == "cuda_ipc" and conn.one_sided
        n, dst, src = 21, [7, 2, 9], [3, 1]
        tid = decode.grant(dst, n)
        assert prefill.ship(conn, tid, src, dst, 8, n, chunks=(0, 5)).ok
        assert decode.outcome(tid).ok
        assert_same_tokens(prefill.layers, src, decode.layers, dst, n)

        prefill.faults = conn.ctx.faults = type(prefill.faults)("corrupt=1")
        tid = decode.grant([11, 12], 10)
        outcome = prefill.ship(conn, tid, [0], [11, 12], 8, 10)
        assert not outcome.ok and outcome.corrupted
        conn.close()
    finally:
        prefill.close()
        decode.close()


# -- one-sided writes land only in blocks the decode side still holds for them ----------------------
def test_a_one_sided_transfer_that_opens_after_its_lease_ended_writes_nothing():
    """The decode side let a grant go (its lease ended) and gave its blocks to another request:
    the late prefill's shared-memory writes must not land in them (its RENEW is answered HELD 0
    before any write), and it fails naming why."""
    decode, prefill = Decode("shm", lease_s=0.3, quarantine_s=0.2), Prefill("shm")
    try:
        conn = prefill.connect(decode.address)
        late = decode.grant([1, 2], 12)
        assert wait_until(lambda: decode.ledger.reap_expired() or decode.ledger.lookup(late) is None)
        assert not decode.outcome(late).ok  # reported after the quarantine: the blocks are free again
        reused = decode.grant([1, 2], 12)
        assert prefill.ship(conn, reused, [0], [1, 2], 8, 12).ok and decode.outcome(reused).ok
        landed = [layer[1:3].clone() for layer in decode.layers]
        outcome = prefill.ship(conn, late, [3], [1, 2], 8, 12)
        assert not outcome.ok and "no longer holds its blocks" in outcome.reason
        assert all(torch.equal(before, layer[1:3]) for before, layer in zip(landed, decode.layers))
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize(
    "dst_blocks, dst_block_size, skip_tokens",
    [([0, 1], 8, 8), ([10, 11, 12, 13], 4, 8), ([10], 16, 8), ([10, 11], 8, 0)],
)
def test_a_one_sided_writer_whose_target_names_other_blocks_writes_nothing(dst_blocks, dst_block_size, skip_tokens):
    """A prefill told to write a grant's tokens into other blocks than the grant's (a stale or
    mangled target: here another request's blocks, the grant's own ids read with another block
    size, or its shared prefix block, which the grant leaves alone) is refused before any write
    (HELD names the mismatch), and the blocks it named keep their bytes."""
    decode, prefill = Decode("shm", block_size=8, num_blocks=32), Prefill("shm", block_size=8)
    try:
        for layer in decode.layers:
            layer.fill_(7.0)
        before = [layer.clone() for layer in decode.layers]
        tid = decode.grant([10, 11], 16, skip_tokens=8)  # block 10: a prefix the decode side caches
        conn = prefill.connect(decode.address)
        outcome = prefill.ship(conn, tid, [0, 1], dst_blocks, dst_block_size, 16, skip_tokens=skip_tokens)
        assert not outcome.ok and "other blocks" in outcome.reason
        assert all(torch.equal(b, layer) for b, layer in zip(before, decode.layers)), "a misplaced write landed"
        retry = decode.grant([12, 13], 16)
        assert (
            prefill.ship(conn, retry, [0, 1], [12, 13], 8, 16).ok and decode.outcome(retry).ok
        )  # the link still works
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("when", ["queued", "mid-transfer"])
def test_a_one_sided_writer_writes_nothing_once_the_decode_side_ends_its_grant(when):
    """The decode side ends a grant (a decode-side cancel) while its prefill waits in a queue or
    computes: the writer is told at once (HELD 0), and writes nothing more into blocks that
    are the decode side's again after the quarantine."""
    decode, prefill = Decode("shm", quarantine_s=0.2), Prefill("shm")
    try:
        conn = prefill.connect(decode.address)
        tid = decode.grant([1, 2], 12)
        transfer = conn.open(tid, [1, 2], 8, 12)
        first = 0
        if when == "mid-transfer":
            transfer.send_layer(0, [0], 0, 12)
            assert wait_until(lambda: bool(decode.ledger.lookup(tid).landed[0].all()))
            first = 1
        assert wait_until(lambda: transfer.held)
        decode.ledger.cancel(tid, "request gone")
        assert not decode.outcome(tid).ok  # after the quarantine: the blocks serve another request now
        for layer in decode.layers:
            layer[1:3].zero_()
        for layer in range(first, LAYERS):
            transfer.send_layer(layer, [0], 0, 12)
        assert not prefill.finish(transfer).ok
        assert not any(layer[1:3].any() for layer in decode.layers), "a late write landed in blocks let go"
    finally:
        prefill.close()
        decode.close()


def test_a_hung_decode_worker_holds_up_no_other_and_is_reported_unreachable(monkeypatch):
    """A decode worker whose KV port accepts but never answers: its handshake times out as a
    connection error (the router retries elsewhere), and meanwhile a connection to a healthy
    decode worker opens at once."""
    from pdserve.kvtransfer import sender as sender_module

    monkeypatch.setattr(sender_module, "HANDSHAKE_TIMEOUT_S", 2.0)
    hung = socket.create_server(("127.0.0.1", 0))  # the backlog accepts; nobody answers HELLO
    decode, prefill = Decode("tcp"), Prefill("tcp")
    kv_sender = sender_module.KVSender(prefill.info, prefill.cache)
    errors = []
    try:
        hung_address = f"127.0.0.1:{hung.getsockname()[1]}"
        stuck = [threading.Thread(target=lambda: errors.append(_error_of(kv_sender.connection, hung_address)))]
        stuck[0].start()
        time.sleep(0.2)
        stuck += [threading.Thread(target=lambda: errors.append(_error_of(kv_sender.connection, hung_address)))]
        stuck[1].start()  # waits for the first attempt, and shares its failure: no second 2 s wait
        started = time.monotonic()
        kv_sender.connection(decode.address)
        assert time.monotonic() - started < 1.9  # not held up by the hung address's 2 s
        for thread in stuck:
            thread.join(10)
        assert time.monotonic() - started < 3.5
        assert len(errors) == 2 and all(isinstance(e, ConnectionError) and "broke off" in str(e) for e in errors)
    finally:
        kv_sender.close()
        decode.close()
        hung.close()


def _error_of(call, *args) -> BaseException | None:
    try:
        call(*args)
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e
    return None


def test_a_ucx_endpoint_that_never_comes_up_fails_as_an_os_error(monkeypatch):
    """The connection pool and the prefill worker handle OSError (a retryable failure); a
    concurrent.futures.TimeoutError is not one before Python 3.11."""
    import concurrent.futures
    from types import SimpleNamespace

    class NeverUp:
        def result(self, timeout=None):
            raise concurrent.futures.TimeoutError()

    monkeypatch.setattr(ucx_transport, "IO_TIMEOUT_S", 0.01)
    ctx = SimpleNamespace(
        ucx=SimpleNamespace(connect=lambda peer: NeverUp()), remote_extra={"ucx_address": "00", "ucx_tag": "1"}
    )
    with pytest.raises(OSError, match="UCX endpoint"):
        ucx_transport.Sender(ctx)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_connection_whose_peer_dies_lets_its_transport_go_at_once(transport, monkeypatch):
    """The send thread ends and closes its half (a shm sender unmaps the peer's cache) when the
    connection breaks, not at a next send that may never come."""
    decode = Decode(transport)
    prefill = Prefill(transport)
    try:
        conn = prefill.connect(decode.address)
        closed = threading.Event()
        real_close = conn.sender.close
        monkeypatch.setattr(conn.sender, "close", lambda: (closed.set(), real_close()))
        decode.receiver.stop()  # the decode worker is gone
        assert wait_until(lambda: conn.broken is not None)
        assert closed.wait(10)
    finally:
        prefill.close()
        decode.close()


def test_stale_segments_are_told_by_their_creators_lock_not_by_pid(monkeypatch):
    """A decode worker in another PID namespace sharing /dev/shm (a container with --ipc=host)
    has a pid this process cannot see: its live segment must stay. A segment nobody holds goes,
    whatever pid its name carries; another user's is not ours to judge (it cannot be unlinked)."""
    import fcntl

    from kv_sides import layout

    from pdserve.kvtransfer import shm_transport

    prefix = f"pdserve-kv-test{os.getpid()}y-"
    monkeypatch.setattr(shm_transport, "PREFIX", prefix)
    live = shm_transport.make_pool(layout(8), 4, torch.device("cpu"))
    unseen_pid, dead, foreign = (shm_transport.SHM_DIR / f"{prefix}{n}-0" for n in (2**22 + 7, os.getpid(), 1))
    holder = None
    try:
        for path in (unseen_pid, dead, foreign):
            path.write_bytes(b"x")
        holder = os.open(unseen_pid, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_SH)  # its creator, alive elsewhere
        as_root = os.geteuid() == 0  # only root can make a file another user owns
        if as_root:
            os.chown(foreign, 65534, 65534)
        assert shm_transport.remove_stale_segments(min_age_s=0) == (1 if as_root else 2)
        assert not dead.exists() and unseen_pid.exists() and foreign.exists() == as_root
        assert (shm_transport.SHM_DIR / live.name).exists()
    finally:
        if holder is not None:
            os.close(holder)
        live.close()
        for path in (unseen_pid, dead, foreign):
            path.unlink(missing_ok=True)


# A private /dev/shm of 8 MiB, whose room the script's cache and the "other program" share.
_ROOM_TAKEN_SCRIPT = """
import os, sys, torch
sys.path.insert(0, sys.argv[1])
from kv_sides import layout
from pdserve.kvtransfer import shm_transport

lay = layout(8)
blocks = (5 << 20) // (lay.num_layers * lay.block_bytes)  # a cache of about 5 MiB
pool = shm_transport.make_pool(lay, blocks, torch.device("cpu"))
try:
    shm_transport.make_pool(lay, blocks, torch.device("cpu"))  # a second one does not fit
except shm_transport.PoolUnavailable as e:
    print("refused:", e)
try:  # another program fills /dev/shm after the cache was made
    with open("/dev/shm/someone-else", "wb") as f:
        f.write(bytes(8 << 20))
except OSError:
    pass
pool.tensor.view(torch.uint8).fill_(7)  # every block written at last
print("written", int(pool.tensor.view(torch.uint8).sum()) == 7 * pool.nbytes)
"""


@pytest.mark.skipif(not can_mount_private_shm(), reason="a private /dev/shm needs unshare and CAP_SYS_ADMIN")
def test_a_shm_cache_takes_its_room_when_made_not_when_written():
    """tmpfs gives a page on first touch: a cache that only mapped its segment died of SIGBUS at
    its first write past what another program had since taken from /dev/shm."""
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [
            *("unshare", "-m", "--propagation", "private", "sh", "-c"),
            'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"',
            *("sh", sys.executable, "-c", _ROOM_TAKEN_SCRIPT, tests),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused: the KV cache needs 5 MiB of /dev/shm" in done.stdout and "MiB are free" in done.stdout
    assert "written True" in done.stdout


def test_a_peer_that_trickles_a_frame_times_out_within_the_io_timeout():
    """Each receive waits at most the socket's timeout, so a peer sending a byte now and then
    would never time out: the whole frame must arrive within it, or the blocks it fills stay
    pinned for as long as the peer likes."""
    from pdserve.kvtransfer.sockets import configure, recv_exact

    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    configure(ours, 0.5)
    stop = threading.Event()

    def trickle():
        for _ in range(40):  # at most 4 s, a byte every 0.1 s
            if stop.wait(0.1):
                return
            try:
                theirs.send(b"x")
            except OSError:
                return

    sender = threading.Thread(target=trickle)
    sender.start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="too slowly"):
            recv_exact(ours, bytearray(100))
        assert time.monotonic() - started < 2.5  # the timeout, give or take one more receive
    finally:
        stop.set()
        sender.join(5)
        ours.close()
        theirs.close()


def test_a_large_frame_on_a_slow_but_steady_link_arrives(monkeypatch):
    """The time a frame may take grows with its size: a unit of many MB over a slow link that
    keeps sending is carried, however much longer than the I/O timeout it takes."""
    from pdserve.kvtransfer import sockets

    monkeypatch.setattr(sockets, "MIN_FRAME_RATE_BYTES_S", 256 << 10)
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    sockets.configure(ours, 0.5)
    payload = bytes(range(256)) * 2048  # 512 KiB, sent at ~512 KiB/s: twice the I/O timeout

    def steady():
        for i in range(0, len(payload), 32 << 10):
            theirs.sendall(payload[i : i + (32 << 10)])
            time.sleep(0.0625)

    sender = threading.Thread(target=steady)
    sender.start()
    try:
        received = bytearray(len(payload))
        started = time.monotonic()
        sockets.recv_exact(ours, received)
        assert received == payload and time.monotonic() - started > 0.5
    finally:
        sender.join(10)
        ours.close()
        theirs.close()
