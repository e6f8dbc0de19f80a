"""Keeps the router's worker list current: DNS discovery, health probes, load figures.

Every interval each worker gets a grpc.health check and a stats call (which also feeds the
load-aware policies). A worker that fails ``failure_threshold`` probes in a row (or requests
in a row, counted by the dispatcher) leaves the rotation; the next successful probe brings
it back. The requests waiting on a worker out of rotation that have heard nothing from it for
``QUIET_S`` are cancelled there and move on (a paused worker's connections stay open).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.workers import WRONG_ROLE_HINT, Worker, WorkerRegistry
from pdserve.v1 import pdserve_pb2 as pb

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
QUIET_S = 2.0  # a call on an unhealthy worker that heard nothing for this long is moved elsewhere


class HealthMonitor:
    def __init__(self, registry: WorkerRegistry, failure_threshold: int, interval_s: float = 1.0) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.failure_threshold = failure_threshold
        self._task: asyncio.Task | None = None
        self._readiness: Callable[[bool], Awaitable[None]] | None = None
        self._ready: bool | None = None
        # Told the smallest context healthy workers report (None: none does) and which workers.
        self.on_context: Callable[[int | None, list[str]], None] | None = None

    async def report_readiness(self, to: Callable[[bool], Awaitable[None]]) -> None:
        """Tells ``to`` whether the router can serve (every pool it needs has a healthy worker)
        now and whenever that changes: its gRPC health status, the readiness probes read."""
        self._readiness, self._ready = to, None
        await self._report()

    async def _report(self) -> None:
        ready = self.registry.unready_reason() is None
        if self._readiness is not None and ready != self._ready:
            self._ready = ready
            await self._readiness(ready)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        if self.registry.dynamic:
            await self.registry.resolve()
        await asyncio.gather(*(self._probe(w) for w in self.registry.all()))
        if self.on_context is not None:
            contexts = {
                w.address: w.last_stats.max_model_len
                for w in self.registry.all()
                if w.healthy and w.last_stats and w.last_stats.max_model_len > 0
            }
            smallest = min(contexts.values(), default=None)
            self.on_context(smallest, sorted(a for a, c in contexts.items() if c == smallest))
        await self._report()

    async def _probe(self, worker: Worker) -> None:
        service = "pdserve.v1.PrefillWorker" if worker.prefill_stub else "pdserve.v1.DecodeWorker"
        try:
            health = await health_pb2_grpc.HealthStub(worker.channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=PROBE_TIMEOUT_S
            )
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                raise ConnectionError(
                    f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}"
                )
            stub = worker.prefill_stub or worker.decode_stub
            mark = worker.digest_mark()
            stats = await stub.GetStats(pb.StatsRequest(), timeout=PROBE_TIMEOUT_S, metadata=self.registry.metadata)
            worker.update_stats(stats, mark)
        except (grpc.aio.AioRpcError, ConnectionError) as e:
            # The details say why (a wrong cluster token, a TLS mismatch), not only the code.
            reason = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            unknown_service = isinstance(e, grpc.aio.AioRpcError) and e.code() is grpc.StatusCode.NOT_FOUND
            if unknown_service:  # its health service knows no such role
                reason = f"it does not serve {service} {WRONG_ROLE_HINT}"
            if worker.healthy:
                log.info("probe of %s worker %s failed: %s", worker.role.value, worker.address, reason)
            # A worker of the other role will not become this one: out at once, not after retries.
            worker.record_failure(1 if unknown_service else self.failure_threshold, reason)
            if not worker.healthy and (moved := worker.abandon_quiet_calls(QUIET_S)):
                log.warning(
                    "%s worker %s does not answer: %d of its requests move to other workers",
                    worker.role.value,
                    worker.address,
                    moved,
                )
            return
        worker.record_success()
