"""A grpc.aio server with what every pdserve server carries: health checking, reflection,
message-size limits."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pdserve.addresses import join_host_port
from pdserve.v1 import pdserve_pb2

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata on RESOURCE_EXHAUSTED: when to try again
# Trailing metadata of a failed Prefill: "decode", its peer's fault (the decode worker's KV endpoint
# is unreachable); "pair", the two workers cannot exchange K/V (either may be the odd one out);
# "transfer", the handoff broke after the K/V left (either side's: neither is charged).
PEER_FAULT_KEY = "pdserve-peer-fault"


async def abort_overloaded(context: grpc.aio.ServicerContext, message: str, retry_after_ms: int = 1000) -> None:
    """RESOURCE_EXHAUSTED with a retry hint (like HTTP's Retry-After)."""
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED, message, trailing_metadata=((RETRY_AFTER_KEY, str(retry_after_ms)),)
    )


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: HealthServicer
    services: tuple[str, ...]

    async def set_serving(self, serving: bool = True, services: Sequence[str] | None = None) -> None:
        """``services``: which to set (default: the server, "", and every service it serves)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services) if services is None else services:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


async def start_server(
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    host: str,
    port: int,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RunningServer:
    # No SO_REUSEPORT (gRPC's default on Linux): a second server on a taken port must fail to
    # bind, not quietly share the port and split the clients between two clusters.
    options = [*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    for add in register:
        add(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    full_names = tuple(pdserve_pb2.DESCRIPTOR.services_by_name[n].full_name for n in service_names)
    reflection.enable_server_reflection(
        (*full_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = join_host_port(host, port)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio's words for a bind that failed
        bound = 0
    if bound == 0:
        await server.stop(None)
        raise OSError(f"could not bind {address} (in use, or not an address of this machine)")
    await server.start()
    running = RunningServer(server, bound, health, full_names)
    await running.set_serving(True)
    return running
