"""A worker that comes back on its address after a long absence is reachable again at once:
the router's channels retry the connection at least every second, not after gRPC's growing
backoff (which reaches tens of seconds, during which every call fails without trying), and a
connection that takes a while to set up still gets through."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.router.workers import Role, _connect

WATCH_S = 10.0  # gRPC's default backoff tries 5 times in this long (1 s, then x1.6 each), ours >= 9
SLOW_HANDSHAKE_S = 1.5


async def _probe(channel: grpc.aio.Channel) -> bool:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        return True
    except grpc.aio.AioRpcError:
        return False


async def test_an_unreachable_worker_is_retried_every_second():
    attempts = 0

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal attempts  # a host that accepts and hangs up: each connection is one attempt
        attempts += 1
        writer.close()

    listener = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    worker = _connect(f"127.0.0.1:{port}", Role.DECODE, None)
    try:
        end = time.monotonic() + WATCH_S
        while time.monotonic() < end:  # probed as the health monitor does, more often
            assert not await _probe(worker.channel)
            await asyncio.sleep(0.25)
    finally:
        await worker.channel.close()
        listener.close()
    # ~9 expected; 7 still tells them apart from gRPC's 5 on a loaded machine.
    assert attempts >= 7, f"{attempts} connection attempts in {WATCH_S:.0f} s: the channel backs off"


async def test_a_worker_whose_connection_is_slow_to_set_up_is_still_reached():
    """Each attempt may take as long as the handshake needs (the backoff is not its timeout)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    target = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def slow_relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(SLOW_HANDSHAKE_S)  # a far or busy host: the bytes come late
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    relay = await asyncio.start_server(slow_relay, "127.0.0.1", 0)
    worker = _connect(f"127.0.0.1:{relay.sockets[0].getsockname()[1]}", Role.DECODE, None)
    try:
        for _ in range(15):
            if await _probe(worker.channel):
                break
            await asyncio.sleep(1.0)
        else:
            raise AssertionError("never reached through a handshake of 1.5 s")
    finally:
        await worker.channel.close()
        relay.close()
        await server.stop(None)
