"""Prometheus metrics: request latencies at the router, engine and KV-transfer state at workers.

Router figures are recorded as requests flow. Worker figures are read at scrape time from
the engine and the transfer counters (a custom collector), so the hot path pays nothing. Each
role serves its own registry (with the process's own figures), so a worker never exports
the router's series as zeros, nor the router the workers'.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.addresses import join_host_port

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


ROUTER = _registry()
WORKER = _registry()

# -- router --------------------------------------------------------------------------------------
REQUESTS = Counter(
    "pdserve_requests",
    "Requests ended, by finish reason (cancelled: the client left)",
    ["finish_reason"],
    registry=ROUTER,
)
REJECTIONS = Counter("pdserve_request_rejections", "Requests refused or failed", ["reason"], registry=ROUTER)
TTFT = Histogram(
    "pdserve_time_to_first_token_seconds",
    "Time to first token, at the router",
    buckets=_LATENCY_BUCKETS,
    registry=ROUTER,
)
ITL = Histogram(
    "pdserve_inter_token_latency_seconds",
    "Time between streamed chunks, at the router",
    buckets=_ITL_BUCKETS,
    registry=ROUTER,
)
E2E = Histogram(
    "pdserve_e2e_request_latency_seconds",
    "Request latency, first byte in to last byte out",
    buckets=_LATENCY_BUCKETS,
    registry=ROUTER,
)
PROMPT_TOKENS = Counter(
    "pdserve_prompt_tokens", "Prompt tokens of requests that got their first token", registry=ROUTER
)
GENERATION_TOKENS = Counter("pdserve_generation_tokens", "Tokens streamed to clients", registry=ROUTER)
INFLIGHT = Gauge("pdserve_router_inflight_requests", "Requests the router is serving", registry=ROUTER)
MIGRATIONS = Counter(
    "pdserve_migrations",
    "Requests moved to another worker after a failure (retries: before their first token)",
    ["kind"],
    registry=ROUTER,
)
# The online planner (planner.online): what this router's share of the load needs. Sum over routers.
PLANNER_DESIRED_REPLICAS = Gauge(
    "pdserve_planner_desired_replicas",
    "Replicas this router's load needs per pool (unrounded; sum over routers)",
    ["role"],
    registry=ROUTER,
)
# In ROUTER from the planner's first decision: a 0 before it (or with no planner) reads as a
# forecast of no traffic.
PLANNER_REQUEST_RATE = Gauge(
    "pdserve_planner_request_rate", "Request rate the online planner forecasts (req/s)", registry=None
)
PLANNER_CORRECTION = Gauge(
    "pdserve_planner_latency_correction", "Measured over profile-predicted latency", ["metric"], registry=ROUTER
)


def set_planner_request_rate(rate: float) -> None:
    with contextlib.suppress(ValueError):  # registered at an earlier decision
        ROUTER.register(PLANNER_REQUEST_RATE)
    PLANNER_REQUEST_RATE.set(rate)


# -- prefill side of KV transfer ---------------------------------------------------------------------
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_duration_seconds",
    "From the end of prefill compute to the decode side's ack",
    ["transport"],
    buckets=_LATENCY_BUCKETS,
    registry=WORKER,
)


class WorkerCollector(Collector):
    """Engine and transfer state of one worker, read when Prometheus scrapes."""

    def __init__(
        self, role: str, engine_stats: Callable[[], object], kv_counters: Callable[[], Mapping[str, float]]
    ) -> None:
        self.role = role
        self.engine_stats = engine_stats
        self.kv_counters = kv_counters

    def collect(self) -> Iterable:
        s = self.engine_stats()
        labels = ["role"]
        for name, doc, value in (
            ("pdserve_kv_blocks", "KV cache blocks", s.blocks_total),
            ("pdserve_kv_blocks_free", "KV cache blocks free (cached prefixes included)", s.blocks_free),
            ("pdserve_kv_blocks_used", "KV cache blocks held by requests", s.blocks_total - s.blocks_free),
            ("pdserve_kv_blocks_cached", "Blocks holding reusable prefixes", s.blocks_cached),
            ("pdserve_running_batch_size", "Sequences in the running batch", s.running),
            ("pdserve_queue_depth", "Requests waiting for admission", s.waiting),
            (
                "pdserve_prefix_cache_hit_ratio",
                "Prompt blocks served from the prefix cache",
                s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self.role], float(value))
            yield family
        for name, doc, value in (
            ("pdserve_preemptions", "Sequences preempted for lack of blocks", s.preemptions),
            ("pdserve_prefix_cache_queries", "Prompt blocks looked up in the prefix cache", s.prefix_queries),
            ("pdserve_prefix_cache_hits", "Prompt blocks found in the prefix cache", s.prefix_hits),
            ("pdserve_prefix_cache_evictions", "Cached blocks reused for other content", s.evictions),
        ):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([self.role], float(value))
            yield family
        if s.spec is not None:
            yield from _spec_families(self.role, s.spec)
        yield from _kv_families(self.role, self.kv_counters())


def _spec_families(role: str, spec) -> Iterable:
    """Speculative decoding (vLLM's spec_decode counters, and the two ratios since start)."""
    for name, doc, value in (
        (
            "pdserve_spec_decode_drafts",
            "Verifications: decode steps of a sequence that carried proposed tokens",
            spec.drafts,
        ),
        ("pdserve_spec_decode_draft_tokens", "Proposed tokens", spec.draft_tokens),
        ("pdserve_spec_decode_accepted_tokens", "Proposed tokens the model kept", spec.accepted_tokens),
    ):
        family = CounterMetricFamily(name, doc, labels=["role"])
        family.add_metric([role], float(value))
        yield family
    for name, doc, value in (
        ("pdserve_spec_decode_acceptance_rate", "Accepted over proposed tokens, since start", spec.acceptance_rate),
        (
            "pdserve_spec_decode_mean_accepted_length",
            "Tokens emitted per verification (kept proposals + 1), since start",
            spec.mean_accepted_length,
        ),
    ):
        family = GaugeMetricFamily(name, doc, labels=["role"])
        family.add_metric([role], float(value))
        yield family


def _kv_families(role: str, counters: Mapping[str, float]) -> Iterable:
    transfers = CounterMetricFamily("pdserve_kv_transfers", "KV transfers completed", labels=["role", "transport"])
    nbytes = CounterMetricFamily("pdserve_kv_transfer_bytes", "KV bytes received", labels=["role", "transport"])
    events = CounterMetricFamily("pdserve_kv_transfer_events", "KV transfer problems", labels=["role", "event"])
    prefilled = CounterMetricFamily("pdserve_prompts_prefilled", "Prompts a prefill worker prefilled", labels=["role"])
    for key, value in counters.items():
        if key == "prompts_prefilled":  # the prefill worker's traffic, not a problem
            prefilled.add_metric([role], float(value))
        elif key.startswith("transfers_"):
            transfers.add_metric([role, key.removeprefix("transfers_")], float(value))
        elif key.startswith("bytes_"):
            nbytes.add_metric([role, key.removeprefix("bytes_")], float(value))
        else:
            events.add_metric([role, key], float(value))
    return transfers, nbytes, events, prefilled


def scrape_route(registry: CollectorRegistry):
    """``GET /metrics`` for an HTTP app: that exact path (a Mount answers it with a redirect)."""
    from starlette.responses import Response
    from starlette.routing import Route

    async def scrape(request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", scrape, methods=["GET"])


SCRAPE_IDLE_TIMEOUT_S = 10.0  # a /metrics connection silent this long is closed (each holds a thread)


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> int:
    """Starts the /metrics endpoint; returns the bound port (``port`` 0 picks a free one)."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"--metrics-port: could not bind {join_host_port(host, port)}: {e.strerror or e}") from None
    # prometheus_client gives every connection a thread and waits on it forever: bound the wait.
    server.RequestHandlerClass = _quiet_on_timeout(server.RequestHandlerClass)
    return server.server_port


def _quiet_on_timeout(handler: type) -> type:
    """``handler`` that closes a connection silent for SCRAPE_IDLE_TIMEOUT_S without a word (the
    server would print the timeout's traceback to stderr)."""

    class Handler(handler):
        timeout = SCRAPE_IDLE_TIMEOUT_S

        def handle(self) -> None:
            try:
                super().handle()
            except TimeoutError:
                self.close_connection = True

    return Handler


def start_worker_metrics(port: int | None, host: str, public_host: str, collector: WorkerCollector) -> str | None:
    """Registers a worker's collector and serves /metrics if ``port`` is set; returns its address."""
    if port is None:
        return None
    WORKER.register(collector)
    return join_host_port(public_host, serve_metrics(host, port, WORKER))
