"""The router process: tokenizer, worker registry, public gRPC server."""

from __future__ import annotations

import asyncio
import logging

from pdserve.engine.model_store import resolve_model
from pdserve.grpc_server import start_server
from pdserve.metrics import serve_metrics
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.router.completions import Completions
from pdserve.router.dispatch import Dispatcher
from pdserve.router.health_monitor import HealthMonitor
from pdserve.router.policy import make_policy
from pdserve.router.servicer import RouterService
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.workers import WorkerRegistry
from pdserve.settings import RouterSettings
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0


async def serve(settings: RouterSettings, model: str | None, cache_dir: str | None = None) -> None:
    decode = RouterSettings.split(settings.decode_workers)
    prefill = RouterSettings.split(settings.prefill_workers)
    if not decode:
        raise ValueError("the router needs at least one decode worker (--decode-workers host:port,...)")
    model_dir = await asyncio.to_thread(resolve_model, model, cache_dir)
    tokenizer = await asyncio.to_thread(RouterTokenizer, model_dir)
    registry = WorkerRegistry.connect(prefill, decode)
    completions = Completions(tokenizer, Dispatcher(registry, make_policy(settings.policy)), settings.request_timeout_s)
    service = RouterService(completions)
    monitor = HealthMonitor(registry)
    await monitor.probe_all()
    monitor.start()
    server = await start_server(
        [lambda s: pdserve_pb2_grpc.add_RouterServicer_to_server(service, s)], ["Router"], settings.host, settings.port
    )
    address = f"{settings.host}:{server.port}"
    metrics_address = f"{settings.host}:{serve_metrics(settings.host, settings.metrics_port)}" if settings.metrics_port is not None else None
    mode = "disaggregated" if prefill else "colocated"
    log.info("router serving on %s (%s: %d prefill, %d decode workers)", address, mode, len(prefill), len(decode))
    announce_ready("router", grpc=address, metrics=metrics_address)

    signal_name = await wait_for_shutdown_signal()
    log.info("%s: shutting down", signal_name)
    await server.stop(SHUTDOWN_GRACE_S)
    await monitor.stop()
    await registry.close()
