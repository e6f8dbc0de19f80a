"""The router process: tokenizer, worker registry and health, gRPC and HTTP front ends."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import re

from pdserve import metrics
from pdserve.addresses import join_host_port
from pdserve.engine.model_store import resolve_model
from pdserve.grpc_server import start_server
from pdserve.metrics import scrape_route, serve_metrics
from pdserve.planner.router_setup import attach_planner
from pdserve.process import announce_ready, wait_for_shutdown_signal
from pdserve.router.completions import Completions
from pdserve.router.dispatch import Dispatcher
from pdserve.router.health_monitor import HealthMonitor
from pdserve.router.http_server import http_port, serve_http
from pdserve.router.openai_api import create_app
from pdserve.router.policy import make_policy
from pdserve.router.servicer import RouterService, add_router_service
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.workers import WorkerRegistry
from pdserve.security import SecuritySettings, TokenAuth, is_loopback
from pdserve.settings import RouterSettings

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0


def served_name(model_dir: str, override: str | None) -> str:
    """The model name clients use: --served-model-name, else the folder name without the
    converted-cache suffix (SmolLM2-135M-Instruct.Q4_1-b179c9523d0e -> SmolLM2-135M-Instruct)."""
    if override:
        return override
    name = re.sub(r"-[0-9a-f]{12}$", "", model_dir.rstrip("/").rsplit("/", 1)[-1])
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)


def _return_freed_heap() -> None:
    """Loading a tokenizer parses megabytes of JSON; glibc keeps the freed heap (~30 MiB for
    SmolLM2's) unless asked to hand it back. Elsewhere this does nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


async def serve(settings: RouterSettings, security: SecuritySettings) -> None:
    decode = RouterSettings.split(settings.decode_workers)
    prefill = RouterSettings.split(settings.prefill_workers)
    if not decode:
        raise ValueError("the router needs at least one decode worker (--decode-workers host:port,...)")
    model_dir = await asyncio.to_thread(resolve_model, settings.model, settings.cache_dir)
    tokenizer = await asyncio.to_thread(RouterTokenizer, model_dir, settings.max_model_len)
    _return_freed_heap()
    registry = WorkerRegistry.connect(prefill, decode, security.channel_credentials(), security.cluster_metadata())
    dispatcher = Dispatcher(
        registry,
        make_policy(settings.policy),
        max_attempts=1 + settings.max_migrations,
        failure_threshold=settings.worker_failure_threshold,
        worker_wait_s=settings.worker_wait_s,
    )
    planner = await asyncio.to_thread(attach_planner, dispatcher, settings, bool(prefill), str(model_dir))
    completions = Completions(tokenizer, dispatcher, settings.request_timeout_s, settings.max_inflight_requests)
    service = RouterService(completions)
    monitor = HealthMonitor(registry, settings.worker_failure_threshold)
    monitor.on_context = tokenizer.hold_to
    await monitor.probe_all()
    monitor.start()
    if planner is not None:
        planner.start()

    server = await start_server(
        [lambda s: add_router_service(service, s)],
        ["Router"],
        settings.host,
        settings.port,
        credentials=security.server_credentials(),
        interceptors=[TokenAuth(security.api_token, ["pdserve.v1.Router"])],
    )
    # Liveness is the server (""); readiness is the Router service, SERVING while it has workers.
    await monitor.report_readiness(lambda ready: server.set_serving(ready, ["pdserve.v1.Router"]))
    address = join_host_port(settings.host, server.port)
    http_server = http_task = http_address = None
    try:  # a failure after the gRPC server started (an HTTP port in use) still stops it
        if settings.http_port is not None:
            app = create_app(
                completions,
                served_name(str(model_dir), settings.served_model_name),
                extra_routes=[scrape_route(metrics.ROUTER)],
                api_token=security.api_token,
            )
            http_server, http_task = await serve_http(app, settings.host, settings.http_port, security=security)
            http_address = join_host_port(settings.host, http_port(http_server))
        metrics_address = None
        if settings.metrics_port is not None:
            metrics_address = join_host_port(
                settings.host, serve_metrics(settings.host, settings.metrics_port, metrics.ROUTER)
            )
        if security.api_token and not security.tls and not is_loopback(settings.host):
            log.warning(
                "the public API takes a bearer token on %s without TLS: it crosses the network in clear "
                "(set --tls-cert/--tls-key)",
                settings.host,
            )
        mode = "disaggregated" if prefill else "colocated"
        log.info(
            "router serving gRPC on %s%s (%s, policy %s)",
            address,
            f", HTTP on {http_address}" if http_address else "",
            mode,
            settings.policy,
        )
        announce_ready("router", grpc=address, http=http_address, metrics=metrics_address)

        signal_name = await wait_for_shutdown_signal()
        log.info("%s: shutting down", signal_name)
    finally:
        # Not ready at once (a balancer stops sending), then both front ends drain together:
        # gRPC took new streams while HTTP drained first.
        await server.set_serving(False)
        if http_server is not None:
            http_server.should_exit = True
        await asyncio.gather(server.stop(SHUTDOWN_GRACE_S), *([http_task] if http_task is not None else []))
        if planner is not None:
            await planner.stop()
        await monitor.stop()
        await registry.close()
        completions.close()
