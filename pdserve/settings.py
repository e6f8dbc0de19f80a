"""Settings of each process role (see ``config`` for how flags, env and files map onto them).

Each default is written once, here, and passed down: the classes that use a setting take it as
an argument instead of keeping a default of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.addresses import own_address
from pdserve.config import setting
from pdserve.kvtransfer.registry import TRANSPORT_CHOICES
from pdserve.placement import parse_devices
from pdserve.router.policy import POLICY_NAMES as ROUTING_POLICIES

KV_TRANSPORTS = TRANSPORT_CHOICES  # the one list lives in the transport registry
DEFAULT_ROUTER_PORT = 50051
DEFAULT_KV_LEASE_S = 30.0


@dataclass(frozen=True)
class WorkerSettings:
    host: str = setting("127.0.0.1", "address the worker's gRPC server binds")
    port: int = setting(0, "gRPC port (0: any free port)")
    advertise_host: str | None = setting(None, "address peers use to reach this worker (default: --host)")
    kv_port: int = setting(0, "KV transfer port of a decode worker (0: any free port)")
    kv_transport: str = setting("auto", "KV transport to use or require", choices=KV_TRANSPORTS)
    kv_lease_s: float = setting(DEFAULT_KV_LEASE_S, "seconds a decode worker keeps blocks reserved for a transfer")
    colocated: bool = setting(False, "decode worker that also prefills (no separate prefill pool)")
    cpus: str = setting("", "pin this process to these CPU cores, e.g. '0' or '2,3' (default: no pinning)")
    metrics_port: int | None = setting(None, "serve Prometheus /metrics on this port (0: any free port; unset: off)")
    max_queued_requests: int = setting(
        256, "requests waiting for this worker beyond which it answers RESOURCE_EXHAUSTED"
    )
    profile: str | None = setting(
        None,
        "a profile (pdserve profile --output FILE); with --slo-tpot-ms, a worker that "
        "mixes prefill into decode steps sizes prefill chunks from it",
    )
    slo_tpot_ms: float | None = setting(None, "TPOT SLO in ms: one step that mixes prefill and decode stays within it")

    def __post_init__(self) -> None:
        _check_slo("slo_tpot_ms", self.slo_tpot_ms)
        _check_ports(self, "port", "kv_port", "metrics_port")
        _check_seconds("kv_lease_s", self.kv_lease_s)
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        self.cpu_set()  # validates

    def public_host(self) -> str:
        """The address peers use: --advertise-host, else --host, else (bound to all interfaces)
        this machine's own address, so a container advertises its own IP, never localhost."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return own_address(ipv6=self.host == "::")
        return self.host

    def cpu_set(self) -> set[int]:
        try:
            cores = {int(c) for c in self.cpus.split(",") if c.strip()}
        except ValueError:
            raise ValueError(f"cpus must be a comma-separated list of core numbers, got {self.cpus!r}") from None
        if any(c < 0 for c in cores):
            raise ValueError(f"cpus must be core numbers >= 0, got {self.cpus!r}")
        return cores


@dataclass(frozen=True)
class RouterSettings:
    host: str = setting("127.0.0.1", "address the router binds")
    port: int = setting(DEFAULT_ROUTER_PORT, "router gRPC port", short="-p")
    prefill_workers: str = setting("", "comma-separated prefill worker addresses host:port")
    decode_workers: str = setting("", "comma-separated decode (or colocated) worker addresses host:port")
    policy: str = setting("kv_aware", "routing policy", choices=ROUTING_POLICIES)
    request_timeout_s: float = setting(600.0, "upper bound on a request's life when the client sets no deadline")
    model: str | None = setting(None, "model folder or .gguf, for the tokenizer (default: SmolLM2-135M-Instruct)")
    cache_dir: str | None = setting(None, "where converted models are kept (default ~/.cache/pdserve)")
    max_model_len: int | None = setting(
        None, "the context (prompt + output) in tokens, at most the model's own; as the workers' (default: the model's)"
    )
    served_model_name: str | None = setting(None, "the model name clients send (default: derived from the model)")
    max_migrations: int = setting(3, "times a request may move to other workers after failures")
    worker_wait_s: float = setting(5.0, "how long a request waits for a worker to come back when every one is down")
    worker_failure_threshold: int = setting(
        2, "failures in a row (health probes or requests) that take a worker out of rotation until a probe succeeds"
    )
    http_port: int | None = setting(None, "serve the OpenAI-compatible HTTP API (and /metrics) on this port")
    metrics_port: int | None = setting(
        None, "also serve Prometheus /metrics on this port (the HTTP port serves it too)"
    )
    max_inflight_requests: int = setting(1024, "requests in flight beyond which new ones get RESOURCE_EXHAUSTED")
    conditional: bool = setting(
        False,
        "conditional disaggregation: a decode worker with headroom prefills short prompts "
        "(and any, while the prefill pool is backed up) itself",
    )
    conditional_threshold_tokens: int | None = setting(
        None,
        "uncached prompt tokens a decode worker always prefills itself under --conditional (default: from --profile, else 128)",
    )
    profile: str | None = setting(
        None, "a profile (pdserve profile --output FILE): conditional threshold and the online planner"
    )
    slo_ttft_ms: float | None = setting(None, "TTFT SLO in ms, for the online planner")
    slo_tpot_ms: float | None = setting(None, "TPOT SLO in ms, for the online planner and conditional routing")
    autoscale_interval_s: float = setting(
        30.0, "how often the online planner (needs --profile) updates its replica gauges"
    )
    autoscale_window_s: float = setting(120.0, "the online planner forecasts load from the arrivals of this window")

    def __post_init__(self) -> None:
        _check_slo("slo_ttft_ms", self.slo_ttft_ms)
        _check_slo("slo_tpot_ms", self.slo_tpot_ms)
        if self.conditional_threshold_tokens is not None and self.conditional_threshold_tokens < 0:
            raise ValueError(f"conditional_threshold_tokens must be >= 0, got {self.conditional_threshold_tokens}")
        _check_ports(self, "port", "http_port", "metrics_port")
        _check_seconds("autoscale_interval_s", self.autoscale_interval_s)
        _check_seconds("autoscale_window_s", self.autoscale_window_s)
        _check_seconds("request_timeout_s", self.request_timeout_s)
        _check_seconds("worker_wait_s", self.worker_wait_s, zero_ok=True)
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {self.max_inflight_requests}")
        if self.worker_failure_threshold < 1:
            raise ValueError(f"worker_failure_threshold must be >= 1, got {self.worker_failure_threshold}")

    @staticmethod
    def split(addresses: str) -> list[str]:
        return [a.strip() for a in addresses.split(",") if a.strip()]


@dataclass(frozen=True)
class ClusterSettings:
    prefill: int = setting(1, "prefill workers to start")
    decode: int = setting(1, "decode workers to start")
    colocated: bool = setting(False, "one worker doing prefill and decode instead of separate pools")
    pin_cores: bool = setting(False, "pin each worker process to its own CPU core(s)")
    startup_timeout_s: float = setting(300.0, "seconds to wait for every process to become ready")
    metrics: bool = setting(False, "Prometheus /metrics on every process (free ports, listed when ready)")
    max_worker_restarts: int = setting(10, "times pdserve up restarts a worker that died, before giving up")
    prefill_devices: str = setting(
        "", "devices of the prefill workers, e.g. 'cuda:0,cuda:1' (default: a GPU each, round robin)"
    )
    decode_devices: str = setting(
        "", "devices of the decode (or colocated) workers, e.g. 'cuda:2,cuda:3' (default: as above)"
    )
    prefill_tp: int | None = setting(
        None, "tensor_parallel_size of each prefill worker (default: --tensor-parallel-size)"
    )
    decode_tp: int | None = setting(
        None, "tensor_parallel_size of each decode (or colocated) worker (default: --tensor-parallel-size)"
    )
    prefill_pp: int | None = setting(
        None, "pipeline_parallel_size of each prefill worker (default: --pipeline-parallel-size)"
    )
    decode_pp: int | None = setting(
        None, "pipeline_parallel_size of each decode (or colocated) worker (default: --pipeline-parallel-size)"
    )

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need --decode >= 1 and --prefill >= 0, got prefill={self.prefill} decode={self.decode}")
        _check_seconds("startup_timeout_s", self.startup_timeout_s)
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")
        for name in ("prefill_tp", "decode_tp", "prefill_pp", "decode_pp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.role_devices()  # validates

    def role_parallelism(self, role: str, tensor_parallel_size: int, pipeline_parallel_size: int) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes of a ``role`` worker: the pool's own, else the engine's."""
        tp, pp = (self.prefill_tp, self.prefill_pp) if role == "prefill" else (self.decode_tp, self.decode_pp)
        return tp or tensor_parallel_size, pp or pipeline_parallel_size

    def role_devices(self) -> dict[str, list[str]]:
        return {
            "prefill": parse_devices(self.prefill_devices, "prefill_devices"),
            "decode": parse_devices(self.decode_devices, "decode_devices"),
        }


def _check_slo(name: str, value: float | None) -> None:
    if value is not None and not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")


def _check_seconds(name: str, value: float, zero_ok: bool = False) -> None:
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):  # NaN fails both
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, got {value}")


def _check_ports(settings, *names: str) -> None:
    """Each a TCP port, and no fixed port given to two of them (0 picks a free one each)."""
    taken: dict[int, str] = {}
    for name in names:
        value = getattr(settings, name)
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"{name} must be a TCP port in [0, 65535], got {value}")
        if value:
            if value in taken:
                raise ValueError(f"{name}: {value} is {taken[value]} too (each needs a port of its own)")
            taken[value] = name
