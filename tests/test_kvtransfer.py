"""KV transfer in one process over real sockets (and real UCX / shared memory): every
transport, re-blocking between block sizes, checksums, leases, stalls, bad peers."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace

import pytest
import torch

from pdserve.engine.kv_cache import KVLayout
from pdserve.kvtransfer import negotiate
from pdserve.kvtransfer.client import KVConnection
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.layout import CacheLayers
from pdserve.kvtransfer.peer import HandshakeError, PeerInfo, host_id
from pdserve.kvtransfer.protocol import AckStatus, FrameHeader, FrameKind
from pdserve.kvtransfer.receiver import KVReceiver, TransferFailed
from pdserve.kvtransfer.server import KVServer
from pdserve.kvtransfer.shm import SharedKVPool
from pdserve.kvtransfer.ucx import UcxWorkerThread, ucx_available
from pdserve.kernels.reference import gather_kv

LAYERS, HEADS, DIM = 3, 2, 8
TRANSPORTS = ["tcp", "shm"] + (["ucx"] if ucx_available() else [])


def peer(transports, block_size, **kw) -> PeerInfo:
    return PeerInfo(model_fingerprint="m", dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                    block_size=block_size, transports=tuple(transports), host_id=host_id(), **kw)


class Decode:
    """A decode side: a cache (in shared memory for shm), a receiver, a KV server."""

    def __init__(self, transport: str, block_size: int = 8, num_blocks: int = 32, lease_s: float = 10.0, auth: str = "", dtype="float32"):
        layout = KVLayout(LAYERS, HEADS, DIM, block_size, torch.float32)
        self.pool = SharedKVPool(layout, num_blocks) if transport == "shm" else None
        tensor = self.pool.tensor if self.pool else torch.zeros(layout.shape(num_blocks))
        self.layers = list(tensor.unbind(0))
        self.freed: list[int] = []
        self.receiver = KVReceiver(CacheLayers(self.layers, block_size), asyncio.get_running_loop(),
                                   self.freed.extend, lease_s=lease_s)
        self.ucx = UcxWorkerThread() if transport == "ucx" else None
        extra = {**(self.pool.describe() if self.pool else {}), **({"ucx_address": self.ucx.address.hex()} if self.ucx else {})}
        info = peer([transport], block_size, auth_token=auth, extra=extra)
        self.server = KVServer(self.receiver, replace(info, dtype=dtype),
                               "127.0.0.1", 0, max_tokens=num_blocks * block_size, ucx=self.ucx)
        self.server.start()
        self.address = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.server.stop()
        if self.ucx:
            self.ucx.close()
        if self.pool:
            self.pool.close()


class Prefill:
    def __init__(self, transport: str, block_size: int = 16, num_blocks: int = 16, faults: str = "", auth: str = ""):
        torch.manual_seed(0)
        self.layers = list(torch.randn(LAYERS, num_blocks, block_size, 2, HEADS, DIM).unbind(0))
        self.block_size = block_size
        self.ucx = UcxWorkerThread() if transport == "ucx" else None
        self.info = peer([transport], block_size, auth_token=auth)
        self.faults = FaultPlan(faults)

    def connect(self, address: str) -> KVConnection:
        return KVConnection(address, self.info, CacheLayers(self.layers, self.block_size), ucx=self.ucx, faults=self.faults)

    def close(self) -> None:
        if self.ucx:
            self.ucx.close()


async def ship(conn: KVConnection, grant, src_blocks: list[int], dst_block_size: int, num_tokens: int, chunks=(0,)):
    out = conn.open(grant.transfer_id, grant.block_ids, dst_block_size, num_tokens)
    bounds = [*chunks, num_tokens]
    for start, end in zip(bounds, bounds[1:]):
        for layer in range(LAYERS):
            out.send_layer(layer, src_blocks, start, end)
    return await asyncio.wrap_future(out.finish(first_token_id=42))


def assert_same_tokens(src_layers, src_blocks, dst_layers, dst_blocks, n):
    for src, dst in zip(src_layers, dst_layers):
        k1, v1 = gather_kv(src, torch.tensor(src_blocks), n)
        k2, v2 = gather_kv(dst, torch.tensor(dst_blocks), n)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_transfer_lands_with_reblocking(transport):
    """Prefill blocks of 16 tokens, decode blocks of 8, shuffled block ids, chunked sends."""
    decode, prefill = Decode(transport, block_size=8), Prefill(transport, block_size=16)
    try:
        conn = await asyncio.to_thread(prefill.connect, decode.address)
        assert conn.name == transport
        n = 45
        grant = decode.receiver.grant([9, 3, 17, 4, 25, 0], n)
        src_blocks = [5, 2, 11]
        status = await ship(conn, grant, src_blocks, 8, n, chunks=(0, 13, 30))
        assert status is AckStatus.OK
        result = await decode.receiver.wait(grant)
        assert result.first_token_id == 42 and result.transport == transport
        assert decode.receiver.take(grant) == [9, 3, 17, 4, 25, 0]
        assert_same_tokens(prefill.layers, src_blocks, decode.layers, grant.block_ids, n)
        assert decode.receiver.counters[f"transfers_{transport}"] == 1 and not decode.freed
        conn.close()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_corruption_is_detected_and_blocks_freed(transport):
    decode, prefill = Decode(transport), Prefill(transport, faults="corrupt=1")
    try:
        conn = await asyncio.to_thread(prefill.connect, decode.address)
        grant = decode.receiver.grant([1, 2], 10)
        assert await ship(conn, grant, [0], 8, 10) is AckStatus.CHECKSUM_MISMATCH
        with pytest.raises(TransferFailed, match="checksum"):
            await decode.receiver.wait(grant)
        await asyncio.sleep(0.05)
        assert sorted(decode.freed) == [1, 2]
        assert decode.receiver.counters["checksum_mismatch"] == 1
        # The connection keeps working: the next transfer (no fault left) lands.
        grant2 = decode.receiver.grant([5], 8)
        assert await ship(conn, grant2, [3], 8, 8) is AckStatus.OK
        conn.close()
    finally:
        prefill.close()
        decode.close()


async def test_lease_expiry_frees_reserved_blocks():
    decode = Decode("tcp", lease_s=0.3)
    try:
        grant = decode.receiver.grant([7, 8, 9], 20)
        with pytest.raises(TransferFailed, match="lease expired"):
            await decode.receiver.wait(grant)
        await asyncio.sleep(0.05)
        assert sorted(decode.freed) == [7, 8, 9]
        assert decode.receiver.counters["lease_expired"] == 1
        assert decode.receiver.num_active == 0
    finally:
        decode.close()


async def test_stalled_transfer_times_out_and_late_data_is_refused():
    decode, prefill = Decode("tcp", lease_s=0.5), Prefill("tcp", faults="stall=1")
    try:
        conn = await asyncio.to_thread(prefill.connect, decode.address)
        grant = decode.receiver.grant([1, 2], 12)
        out = conn.open(grant.transfer_id, grant.block_ids, 8, 12)
        for layer in range(LAYERS):
            out.send_layer(layer, [0], 0, 12)
        ack = out.finish(1)  # the fault plan swallows this DONE: the transfer stalls
        with pytest.raises(TransferFailed, match="lease expired"):
            await decode.receiver.wait(grant)
        assert not ack.done()
        await asyncio.sleep(0.05)
        assert sorted(decode.freed) == [1, 2]
        # A late unit for the dead transfer is refused; the connection survives it.
        out.send_layer(0, [0], 0, 12)
        grant2 = decode.receiver.grant([4], 8)
        assert await ship(conn, grant2, [1], 8, 8) is AckStatus.OK
        assert decode.receiver.counters["units_refused"] >= 1
        conn.close()
    finally:
        prefill.close()
        decode.close()


async def test_handshake_refuses_another_layout_and_bad_credentials():
    decode = Decode("tcp", dtype="bfloat16")
    try:
        with pytest.raises(HandshakeError, match="dtype"):
            await asyncio.to_thread(Prefill("tcp").connect, decode.address)
        assert decode.receiver.counters["handshakes_refused"] == 1
    finally:
        decode.close()
    decode = Decode("tcp", auth="s3cret")
    try:
        with pytest.raises(HandshakeError, match="unauthenticated"):
            await asyncio.to_thread(Prefill("tcp", auth="wrong").connect, decode.address)
        conn = await asyncio.to_thread(Prefill("tcp", auth="s3cret").connect, decode.address)
        conn.close()
    finally:
        decode.close()


async def test_malformed_and_oversized_frames_drop_only_that_peer():
    decode, prefill = Decode("tcp"), Prefill("tcp")
    try:
        host, port = decode.address.split(":")
        garbage = socket.create_connection((host, int(port)))
        garbage.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
        assert garbage.recv(10) == b""  # dropped
        garbage.close()

        conn = await asyncio.to_thread(prefill.connect, decode.address)
        grant = decode.receiver.grant([1], 8)
        huge = FrameHeader(FrameKind.DATA, grant.transfer_id, 0, 0, 8, payload_len=1 << 40)
        conn.sock.sendall(huge.pack())  # bigger than any grant: the decode side hangs up
        await asyncio.sleep(0.3)
        assert decode.receiver.counters["protocol_errors"] == 2

        good = await asyncio.to_thread(prefill.connect, decode.address)
        grant2 = decode.receiver.grant([2], 8)
        assert await ship(good, grant2, [0], 8, 8) is AckStatus.OK
        good.close()
    finally:
        prefill.close()
        decode.close()


async def test_units_outside_the_grant_are_refused():
    decode, prefill = Decode("tcp"), Prefill("tcp")
    try:
        conn = await asyncio.to_thread(prefill.connect, decode.address)
        grant = decode.receiver.grant([1], 8)
        payload = bytes(8 * 2 * HEADS * DIM * 4)
        for bad in (
            FrameHeader(FrameKind.DATA, grant.transfer_id, LAYERS + 5, 0, 8, payload_len=len(payload)),  # no such layer
            FrameHeader(FrameKind.DATA, grant.transfer_id, 0, 4, 12, payload_len=len(payload)),  # past the grant
            FrameHeader(FrameKind.DATA, 12345, 0, 0, 8, payload_len=len(payload)),  # not a transfer we granted
        ):
            conn.sock.sendall(bad.pack() + payload)
        out = conn.open(grant.transfer_id, grant.block_ids, 8, 8)
        out.send_layer(0, [0], 0, 8)
        out.send_layer(0, [0], 0, 8)  # the same tokens twice
        for layer in range(1, LAYERS):
            out.send_layer(layer, [0], 0, 8)
        assert await asyncio.wrap_future(out.finish(0)) is AckStatus.OK
        assert decode.receiver.counters["units_refused"] == 4
        assert decode.receiver.counters["protocol_errors"] == 0
        conn.close()
    finally:
        prefill.close()
        decode.close()


def test_negotiation_order_and_host_rules():
    cpu, gpu_like = peer(["ucx", "shm", "tcp"], 16), peer(["cuda_ipc", "ucx", "shm", "tcp"], 16)
    assert negotiate.choose(cpu, peer(["shm", "tcp"], 16)) == "shm"
    assert negotiate.choose(cpu, cpu) == "ucx"
    assert negotiate.choose(gpu_like, gpu_like) == "cuda_ipc"
    far = replace(peer(["shm", "tcp"], 16), host_id="elsewhere")
    assert negotiate.choose(cpu, far) == "tcp"  # shared memory needs one host
    with pytest.raises(HandshakeError, match="no common KV transport"):
        negotiate.choose(peer(["shm"], 16), far)


def test_forcing_an_unavailable_transport_fails_with_a_reason(monkeypatch):
    with pytest.raises(ValueError, match="cuda_ipc.*CPU"):
        negotiate.local_transports("cuda_ipc", torch.device("cpu"))
    monkeypatch.setattr(negotiate, "ucx_available", lambda: False)
    with pytest.raises(ValueError, match="pip install 'pdserve\\[ucx\\]'"):
        negotiate.local_transports("ucx", torch.device("cpu"))
    assert negotiate.local_transports("auto", torch.device("cpu")) == ("shm", "tcp")
    with pytest.raises(ValueError, match="kv_transport"):
        negotiate.local_transports("carrier-pigeon", torch.device("cpu"))


def test_fault_plan_parsing():
    plan = FaultPlan("corrupt=2,stall=1")
    assert [plan.take("corrupt") for _ in range(3)] == [True, True, False]
    assert plan.take("stall") and not plan.take("stall")
    with pytest.raises(ValueError):
        FaultPlan("explode=1")
