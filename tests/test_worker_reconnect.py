"""A worker that comes back on its address after a long absence is reachable again at once:
the router's channels retry the connection every second, not after gRPC's growing backoff
(which reaches tens of seconds, during which every call fails without trying)."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.router.workers import Role, _connect

DOWN_S = 12.0  # gRPC's default backoff would wait ~6.5 s from here before its next attempt
BACK_WITHIN_S = 3.0  # one capped backoff (1 s, jittered) and a probe, with room for a busy machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _probe(channel: grpc.aio.Channel) -> bool:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        return True
    except grpc.aio.AioRpcError:
        return False


async def test_a_worker_back_after_a_long_absence_is_reached_within_seconds():
    port = _free_port()
    worker = _connect(f"127.0.0.1:{port}", Role.DECODE, None)
    server = None
    try:
        down_until = time.monotonic() + DOWN_S
        while time.monotonic() < down_until:  # probed once a second, as the health monitor does
            assert not await _probe(worker.channel)
            await asyncio.sleep(1.0)
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        back = time.monotonic()
        while not await _probe(worker.channel):
            assert time.monotonic() - back < BACK_WITHIN_S, "the channel is still backing off"
            await asyncio.sleep(0.2)
    finally:
        await worker.channel.close()
        if server is not None:
            await server.stop(None)
