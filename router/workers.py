"""The router's view of its workers: where they are, their channels, load and health.

Workers are given as ``host:port`` or as ``dns:NAME:PORT``; a DNS entry stands for every
address the name resolves to and is re-resolved periodically, so a docker-compose service
scaled with ``--scale`` or a Kubernetes headless Service is followed as it grows and shrinks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import socket
import time
from dataclasses import dataclass, field

import grpc

from pdserve.addresses import join_host_port
from pdserve.grpc_server import channel_options
from pdserve.prefix_hash import block_hashes
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# Why a worker answers its role's health check NOT_FOUND or its calls UNIMPLEMENTED.
WRONG_ROLE_HINT = "(a worker of the other role? check --prefill-workers and --decode-workers)"


@dataclass(eq=False)
class PrefillWork:
    """A prompt bound for a prefill worker, from ``begin_prefill`` until ``end_prefill``."""

    tokens: int  # what it computes there: its tokens past the worker's cached prefix
    hashes: list[int]  # its blocks, expected in that worker's cache
    sent_at: float | None = None  # when its Prefill call went out (it may first wait for a reservation)


@dataclass(eq=False)
class Worker:
    address: str
    role: Role
    channel: grpc.aio.Channel
    prefill_stub: pdserve_pb2_grpc.PrefillWorkerStub | None = None
    decode_stub: pdserve_pb2_grpc.DecodeWorkerStub | None = None
    healthy: bool = True
    consecutive_failures: int = 0
    last_error: str = ""  # why its last health check or call failed (for logs and "no healthy worker")
    inflight: int = 0  # requests this router has on the worker right now
    inflight_tokens: int = 0  # prompt tokens (past its cached prefix) this router sent it to prefill, not yet done
    last_stats: pb.WorkerStats | None = None
    cached_hashes: set[int] = field(default_factory=set)  # its prefix-cache digest (KV-aware routing)
    # Blocks of prompts this router sent here, by when: expected in its cache before a digest says so.
    _expected: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _prefilling: set[PrefillWork] = field(default_factory=set, init=False, repr=False)
    open_calls: set["OpenCall"] = field(default_factory=set, init=False, repr=False)  # this router's, on it now

    def digest_mark(self) -> float:
        """Take it when asking for stats: every prompt sent here before it has finished its
        prefill, so the answer's digest is the truth about its blocks (the oldest prompt still
        in prefill bounds it; a busy worker's mark still moves on as prompts finish, and a
        prompt still waiting for its decode reservation holds nothing up)."""
        sent = (work.sent_at for work in self._prefilling if work.sent_at is not None)
        return min(sent, default=time.monotonic())

    def update_stats(self, stats: pb.WorkerStats, mark: float | None = None) -> None:
        """``mark``: ``digest_mark()`` taken when these stats were asked for. Blocks sent since
        then stay expected, so a digest that left the worker before a prompt was cached does not
        make the router forget where it just sent that prompt."""
        self.last_stats = stats
        if mark is not None:
            self._expected = {h: t for h, t in self._expected.items() if t >= mark}
        self.cached_hashes = set(stats.cached_block_hashes) | self._expected.keys()

    @property
    def block_size(self) -> int | None:
        """Its KV block size, known from its first stats on."""
        return self.last_stats.block_size if self.last_stats and self.last_stats.block_size else None

    def uncached_tokens(self, prompt: "PromptBlocks") -> int:
        """Prompt tokens this worker would compute: all but the longest prefix it caches."""
        if self.block_size is None:
            return len(prompt.token_ids)
        cached = prefix_overlap(prompt.hashes(self.block_size), self.cached_hashes) * self.block_size
        return len(prompt.token_ids) - cached

    def begin_prefill(self, prompt: "PromptBlocks") -> PrefillWork:
        """Counts a prompt sent here to prefill and expects its blocks cached here from now on
        (the next digest confirms it); returns what to hand back to ``end_prefill``."""
        hashes = prompt.hashes(self.block_size) if self.block_size is not None else []
        work = PrefillWork(self.uncached_tokens(prompt), hashes)
        self.cached_hashes.update(hashes)
        self._expected.update(dict.fromkeys(hashes, math.inf))  # no digest can have them before it is sent
        self._prefilling.add(work)
        self.inflight += 1
        self.inflight_tokens += work.tokens
        return work

    def prefill_sent(self, work: PrefillWork) -> None:
        """Its Prefill call goes out now: digests asked for from now on may hold its blocks."""
        work.sent_at = time.monotonic()
        self._expected.update(dict.fromkeys(work.hashes, work.sent_at))

    def end_prefill(self, work: PrefillWork) -> None:
        if work.sent_at is None:  # never sent (no reservation): the next digest decides about its blocks
            self._expected.update(dict.fromkeys(work.hashes, time.monotonic()))
        self._prefilling.discard(work)
        self.inflight -= 1
        self.inflight_tokens -= work.tokens

    @property
    def load(self) -> float:
        queued = self.last_stats.waiting if self.last_stats else 0
        return self.inflight + queued

    def record_failure(self, threshold: int, reason: str = "") -> None:
        """Opens the circuit after ``threshold`` failures in a row; the health monitor closes it."""
        self.consecutive_failures += 1
        self.last_error = reason or self.last_error
        if self.healthy and self.consecutive_failures >= threshold:
            log.warning(
                "%s worker %s taken out of rotation after %d failures%s",
                self.role.value,
                self.address,
                self.consecutive_failures,
                f" (last: {self.last_error})" if self.last_error else "",
            )
            self.healthy = False

    def abandon_quiet_calls(self, quiet_s: float) -> int:
        """Cancels the calls that have heard nothing for ``quiet_s`` (call it once the worker
        fails its health checks: a paused or wedged worker keeps its connections open, and its
        requests would wait out their deadlines); returns how many."""
        now = time.monotonic()
        quiet = [call for call in self.open_calls if now - call.heard_at >= quiet_s]
        for call in quiet:
            call.abandon(self)
        return len(quiet)

    def record_success(self) -> None:
        if not self.healthy:
            log.info("%s worker %s is healthy again; back in rotation", self.role.value, self.address)
        self.consecutive_failures = 0
        self.healthy = True
        self.last_error = ""


class OpenCall:
    """One attempt's RPCs (its Decode stream, its Prefill) as the workers it waits on see it:
    registered in their ``open_calls`` while it waits on them, heard from at each message."""

    __slots__ = ("rpcs", "heard_at", "abandoned_by")

    def __init__(self, *rpcs) -> None:
        self.rpcs = list(rpcs)  # grpc.aio calls: anything with cancel()
        self.heard_at = time.monotonic()
        self.abandoned_by: Worker | None = None  # the worker that stopped answering, once cancelled for it

    def add(self, rpc) -> None:
        self.rpcs.append(rpc)

    def heard(self) -> None:
        self.heard_at = time.monotonic()

    def abandon(self, worker: Worker) -> None:
        if self.abandoned_by is None:
            self.abandoned_by = worker
            for rpc in self.rpcs:
                rpc.cancel()


class PromptBlocks:
    """A prompt's chained block hashes, computed once per block size (workers may differ)
    however many workers are weighed."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return self._hashes[block_size]


def prefix_overlap(request_hashes: list[int], cached: set[int]) -> int:
    """Leading blocks of the request found in a worker's cache (chained hashes: stop at the first miss)."""
    n = 0
    for h in request_hashes:
        if h not in cached:
            break
        n += 1
    return n


# A worker back on its address must be seen by the next probe: gRPC's default backoff between
# reconnection attempts grows to 2 minutes, and until it ends every call fails at once. (Not
# grpc.min_reconnect_backoff_ms: it is also each attempt's connect timeout, 20 s by default.)
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _connect(address: str, role: Role, credentials: grpc.ChannelCredentials | None) -> Worker:
    options = [*channel_options(), *RECONNECT_OPTIONS]
    channel = (
        grpc.aio.secure_channel(address, credentials, options)
        if credentials
        else grpc.aio.insecure_channel(address, options)
    )
    if role is Role.PREFILL:
        return Worker(address, role, channel, prefill_stub=pdserve_pb2_grpc.PrefillWorkerStub(channel))
    return Worker(address, role, channel, decode_stub=pdserve_pb2_grpc.DecodeWorkerStub(channel))


def parse_spec(spec: str) -> tuple[str, str, int]:
    """'host:port' -> ('static', host, port); 'dns:name:port' -> ('dns', name, port)."""
    kind = "dns" if spec.startswith("dns:") else "static"
    rest = spec[4:] if kind == "dns" else spec
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"worker address must be host:port or dns:name:port, got {spec!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"worker address {spec!r}: port must be in [1, 65535]")
    return kind, host.strip("[]"), int(port)


@dataclass
class WorkerRegistry:
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)
    specs: dict[Role, list[str]] = field(default_factory=dict)
    credentials: grpc.ChannelCredentials | None = None  # TLS to the workers
    metadata: tuple[tuple[str, str], ...] = ()  # the cluster credential, sent with every call
    retired: list[Worker] = field(default_factory=list)  # gone from DNS: closed once their calls end

    @classmethod
    def connect(
        cls,
        prefill: list[str],
        decode: list[str],
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> "WorkerRegistry":
        for spec in (*prefill, *decode):
            parse_spec(spec)  # fail at start on a malformed address
        registry = cls(
            specs={Role.PREFILL: list(prefill), Role.DECODE: list(decode)}, credentials=credentials, metadata=metadata
        )
        for role in Role:
            registry._pool(role).extend(
                _connect(join_host_port(host, port), role, credentials)
                for kind, host, port in map(parse_spec, registry.specs[role])
                if kind == "static"
            )
        return registry

    @property
    def disaggregated(self) -> bool:
        return bool(self.specs.get(Role.PREFILL))

    @property
    def dynamic(self) -> bool:
        return any(spec.startswith("dns:") for specs in self.specs.values() for spec in specs)

    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def unready_reason(self) -> str | None:
        """Why no request could be served now (a pool with no healthy worker); None when one can."""
        for role in (Role.DECODE, Role.PREFILL) if self.disaggregated else (Role.DECODE,):
            if not any(w.healthy for w in self._pool(role)):
                return f"no healthy {role.value} worker"
        return None

    def _pool(self, role: Role) -> list[Worker]:
        return self.prefill if role is Role.PREFILL else self.decode

    async def resolve(self) -> None:
        """Re-resolves DNS entries: adds new addresses, drops ones that are gone."""
        loop = asyncio.get_running_loop()
        for role in Role:
            wanted: set[str] = set()
            for kind, host, port in map(parse_spec, self.specs[role]):
                if kind == "static":
                    wanted.add(join_host_port(host, port))
                    continue
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except socket.gaierror as e:
                    log.warning("cannot resolve %s workers at %s: %s", role.value, host, e)
                    wanted |= {w.address for w in self._pool(role)}  # keep what we had
                    continue
                wanted |= {join_host_port(info[4][0], port) for info in infos}
            pool = self._pool(role)
            known = {w.address for w in pool}
            for address in sorted(wanted - known):
                log.info("discovered %s worker %s", role.value, address)
                pool.append(_connect(address, role, self.credentials))
            for worker in [w for w in pool if w.address not in wanted]:
                log.info("%s worker %s is gone from DNS", role.value, worker.address)
                pool.remove(worker)
                self.retired.append(worker)
        # A worker leaving DNS (a pod terminating) may still be finishing calls: its channel
        # closes once they have ended, so none is cut and none is kept for ever.
        for worker in [w for w in self.retired if not w.open_calls]:
            self.retired.remove(worker)
            await worker.channel.close()

    async def close(self) -> None:
        for worker in self.all() + self.retired:
            await worker.channel.close()
