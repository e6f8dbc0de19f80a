"""The router's health probes against a real gRPC health service on loopback."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.router.health_monitor import HealthMonitor
from pdserve.router.workers import Role, Worker, WorkerRegistry
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc


async def test_a_worker_of_the_other_role_leaves_the_rotation_at_its_first_probe():
    """A decode worker listed as a prefill worker answers the prefill health check NOT_FOUND:
    it will not start serving that role, so it is out at once, not after the failure threshold
    (requests sent to it meanwhile got UNIMPLEMENTED)."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("pdserve.v1.DecodeWorker", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        worker = Worker(f"127.0.0.1:{port}", Role.PREFILL, channel, prefill_stub=pb_grpc.PrefillWorkerStub(channel))
        registry = WorkerRegistry(prefill=[worker], specs={Role.PREFILL: [worker.address], Role.DECODE: []})
        await HealthMonitor(registry, failure_threshold=3).probe_all()
        assert not worker.healthy
        assert "does not serve pdserve.v1.PrefillWorker (a worker of the other role?" in worker.last_error
    finally:
        await channel.close()
        await server.stop(None)
