"""A discrete-event simulation of a pdserve stack: the router, the prefill pool, the decode pool.

Time jumps from event to event (no clocks, threads or model), so a run is deterministic:
the same profile, topology, requests and arrival times give the same timelines.

What runs is pdserve's own code where it can: every worker's scheduler and block manager
(``sim_engine``: chunked prefill, token budget, prefix cache, admission, preemption), the
router's routing policy on the router's own worker records (``router.policy``), the
conditional-disaggregation decision (``router.conditional``) and the prefill chunk sizing
(``chunking``). What is modelled: the forward pass (the profile's step cost), the serving
overheads and the KV handoff (the profile's), CPU sharing when a stack's workers have more
threads than the machine has cores (a step slows by busy threads / cores), and the router's
view of worker load, refreshed every stats interval as its health monitor does, beside its
own in-flight counts, which are always current.

A request's path, as in ``router.dispatch``: arrival; the first-token overhead; the policy
picks a decode worker and (disaggregated) a prefill worker, or conditional routing keeps the
prompt on the decode worker. Disaggregated: the decode worker reserves blocks (waiting while
none are free), the prefill worker prefills it (prefill only), the KV handoff and the extra
hop pass, then the first token reaches the client, the prefill worker frees its copy and the
decode worker admits the request into its batch. Every later token reaches the client at
the end of the step that produced it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from pdserve.bench.metrics import Timeline
from pdserve.bench.workloads import RequestSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.chunking import sizer_for
from pdserve.planner.profile import Profile
from pdserve.planner.sim_engine import SAMPLED_TOKEN, EngineLimits, SimEngine, StepOutput
from pdserve.planner.thresholds import conditional_config
from pdserve.router.conditional import ConditionalRouter
from pdserve.router.policy import make_policy
from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import PromptBlocks, Role, Worker

RESERVE_POLL_S = 0.02  # how often a decode worker retries a reservation (decode_worker.servicer)
RESERVE_WAIT_S = 30.0  # its lease: how long a reservation may wait for blocks
STRAGGLER_GRACE_S = 5.0  # as the load generator: a run's stragglers are cancelled this long after its limit
DEFAULT_KV_TOKENS = 64 * 2048  # KV capacity of a worker when neither the profile nor the config bounds it


@dataclass(frozen=True, slots=True)
class Topology:
    prefill: int = 1
    decode: int = 1
    colocated: bool = False
    conditional: bool = False
    policy: str = "kv_aware"
    chunked_prefill: bool = True
    prefill_degree: int | None = None  # threads / TP per prefill worker; None: as ``pdserve up`` gives them
    decode_degree: int | None = None

    def __post_init__(self) -> None:
        if self.decode < 1 or self.prefill < 0 or (not self.colocated and self.prefill < 1):
            raise ValueError(f"a topology needs >= 1 decode worker and, unless colocated, >= 1 prefill worker "
                             f"(got {self.prefill}P{self.decode}D)")
        if self.colocated and self.conditional:
            raise ValueError("conditional disaggregation needs a prefill pool; colocated has none")

    @property
    def label(self) -> str:
        base = "colocated" if self.colocated else f"{self.prefill}p{self.decode}d"
        return base + ("-conditional" if self.conditional else "")

    @property
    def num_workers(self) -> int:
        return self.decode + (0 if self.colocated else self.prefill)

    def degrees(self, profile: Profile, num_threads: int | None = None) -> tuple[int, int]:
        """(prefill, decode) degrees. On a shared CPU the launcher's rule: ``num_threads``, else
        the machine's cores split evenly over the workers."""
        default = profile.degrees[0]
        if profile.cores is not None:
            default = num_threads or max(1, profile.cores // self.num_workers)
        return self.prefill_degree or default, self.decode_degree or default

    def devices(self, profile: Profile) -> int:
        p, d = self.degrees(profile)
        return d * self.decode + (0 if self.colocated else p * self.prefill)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The engine and router settings of the simulated stack (``EngineConfig``/``RouterSettings``)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_tokens: int | None = None  # per worker; None: the profile's capacity at the worker's degree
    num_threads: int | None = None  # per worker (CPU); None: the launcher's rule
    slo_tpot_ms: float | None = None  # size prefill chunks from the profile for this TPOT (planner.chunking)
    conditional_threshold_tokens: int | None = None  # None: from the profile
    request_timeout_s: float = 120.0
    time_limit_s: float = 600.0
    max_concurrency: int | None = None


@dataclass
class SimRun:
    timelines: list[Timeline]
    duration: float
    counters: Counter = field(default_factory=Counter)


class SimWorker:
    """One worker: its engine, the router's record of it, and its step loop."""

    def __init__(self, sim: "Simulation", role: str, name: str, degree: int, limits: EngineLimits) -> None:
        self.sim, self.role, self.degree = sim, role, degree
        self.cost = sim.profile.step_cost(degree)
        self.engine = SimEngine(limits)
        self.record = Worker(name, Role.PREFILL if role == "prefill" else Role.DECODE, channel=None)
        self.handlers: dict[str, Callable[[StepOutput], None]] = {}
        self.prefill_rate = 0.0  # tokens/s of its recent prefill steps, as LLMEngine reports it
        self.schedule = None  # the step in progress
        self.work_ms = 0.0  # what is left of it, in ms at full speed
        self.version = 0  # bumped whenever its end is rescheduled (stale end events are dropped)
        self.charged_at = 0.0  # when work_ms was last brought up to date

    @property
    def busy(self) -> bool:
        return self.schedule is not None

    def kick(self) -> None:
        """Starts a step if the worker is idle and has something to run."""
        if self.busy or not self.engine.has_work():
            return
        schedule = self.engine.schedule()
        if schedule.empty:
            return  # waiting for blocks: a release or a finish kicks it again
        shape = self.engine.shape(schedule)
        overheads = self.sim.profile.overheads
        self.work_ms = self.cost.ms(shape) + overheads.step_ms + overheads.seq_ms * len(schedule.chunks)
        if schedule.prefills:
            rate = (shape.prefill_tokens + shape.decodes) / (self.work_ms / 1e3)
            self.prefill_rate = rate if not self.prefill_rate else 0.8 * self.prefill_rate + 0.2 * rate
        self.schedule = schedule
        self.sim.reshare(started=self)

    def step_done(self, version: int) -> None:
        if version != self.version:
            return  # rescheduled since
        schedule, self.schedule = self.schedule, None
        self.sim.reshare()
        for out in self.engine.finish_step(schedule):
            handler = self.handlers.get(out.request_id)
            if handler is not None:
                handler(out)
        self.kick()

    def publish_stats(self) -> None:
        self.record.update_stats(self.engine.stats(self.record.address, self.role, self.prefill_rate))


@dataclass(slots=True)
class _Request:
    rid: str
    spec: RequestSpec
    timeline: Timeline
    deadline: float = math.inf
    decode: SimWorker | None = None
    work: int = 0  # uncached tokens counted on the prefill worker (or the decode worker's local backlog)
    blocks: tuple[list[int], int] | None = None


class Simulation:
    def __init__(self, profile: Profile, topology: Topology, config: SimConfig | None = None) -> None:
        self.profile, self.topology = profile, topology
        self.config = config = config or SimConfig()
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self.counters: Counter = Counter()
        prefill_degree, decode_degree = topology.degrees(profile, config.num_threads)
        decode_role = "colocated" if topology.colocated else "decode"
        self.decode = [SimWorker(self, decode_role, f"decode-{i}", decode_degree, self._limits(decode_degree))
                       for i in range(topology.decode)]
        self.prefill = [] if topology.colocated else [
            SimWorker(self, "prefill", f"prefill-{i}", prefill_degree, self._limits(prefill_degree))
            for i in range(topology.prefill)]
        self.workers = self.decode + self.prefill
        self._by_record = {id(w.record): w for w in self.workers}
        self._speed = 1.0  # of every running step, while the busy set stays as it is
        self.policy = make_policy(topology.policy)
        self.conditional = None
        if topology.conditional:
            self.conditional = ConditionalRouter(conditional_config(
                profile, config.slo_tpot_ms, config.conditional_threshold_tokens, prefill_degree, decode_degree))
        if config.slo_tpot_ms is not None:
            for w in self.decode:  # the workers that may mix prompts into decode steps
                w.engine.scheduler.prefill_token_limit = sizer_for(profile, w.degree, config.slo_tpot_ms)
        self._pending = 0
        self._slots = config.max_concurrency
        self._queued: list[_Request] = []

    def _limits(self, degree: int) -> EngineLimits:
        c = self.config
        tokens = c.kv_cache_tokens or self.profile.kv_tokens(degree) or DEFAULT_KV_TOKENS
        return EngineLimits(
            num_blocks=max(1, tokens // c.block_size), block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, enable_chunked_prefill=self.topology.chunked_prefill,
            enable_prefix_caching=c.enable_prefix_caching, max_model_len=self.profile.max_model_len)

    def after(self, delay_s: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (self.now + max(0.0, delay_s), next(self._order), fn, args))

    def _wake(self, worker: SimWorker) -> None:
        """The worker's engine thread picks up new work after whatever else arrives at this
        instant (requests sent together share a step, as the engine loop drains its queue)."""
        self.after(0.0, worker.kick)

    def reshare(self, started: SimWorker | None = None) -> None:
        """Processor sharing on a CPU: while the busy workers' threads outnumber the machine's
        cores, each runs at cores / busy threads of its speed. Called whenever a step starts
        (``started``) or ends: charges every running step for the time since the last change
        at the speed it had, then reschedules its end at the new speed."""
        if not self.profile.cores:  # a worker per device: steps never slow each other
            if started is not None:
                started.version += 1
                self.after(started.work_ms / 1e3, started.step_done, started.version)
            return
        running = [w for w in self.workers if w.busy]
        for w in running:
            if w is not started:
                w.work_ms = max(0.0, w.work_ms - (self.now - w.charged_at) * 1e3 * self._speed)
            w.charged_at = self.now
        threads = sum(w.degree for w in running)
        self._speed = min(1.0, self.profile.cores / threads) if threads else 1.0
        for w in running:
            w.version += 1
            self.after(w.work_ms / self._speed / 1e3, w.step_done, w.version)

    # -- a run -----------------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec], offsets: list[float]) -> SimRun:
        """Simulates ``specs`` sent at ``offsets`` (seconds; ``arrivals.arrival_offsets``)."""
        if len(offsets) != len(specs):
            raise ValueError(f"{len(specs)} requests but {len(offsets)} arrival times")
        requests = [_Request(f"sim-{i}", s, Timeline(prompt_len=s.prompt_len, max_tokens=s.max_tokens))
                    for i, s in enumerate(specs)]
        for req, at in zip(requests, offsets):
            if at >= self.config.time_limit_s:
                req.timeline.error = "not sent before the run's time limit"
                continue
            self._pending += 1
            heapq.heappush(self._events, (at, next(self._order), self._arrive, (req,)))
        self.after(0.0, self._publish_stats)
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        self._close_stragglers(requests)
        timelines = [r.timeline for r in requests]
        ends = [t.end_time for t in timelines if t.end_time is not None] + [t.send_time for t in timelines]
        return SimRun(timelines, max(ends, default=0.0), self.counters)

    def _publish_stats(self) -> None:
        for w in self.workers:
            w.publish_stats()
        if self._pending:
            self.after(self.profile.overheads.stats_interval_s, self._publish_stats)

    # -- the router --------------------------------------------------------------------------------
    def _arrive(self, req: _Request) -> None:
        if self._slots is not None:
            if self._slots == 0:
                self._queued.append(req)
                return
            self._slots -= 1
        req.timeline.send_time = self.now
        req.deadline = self.now + min(self.config.request_timeout_s, max(0.0, self.config.time_limit_s - self.now))
        self.after(self.profile.overheads.first_token_ms / 1e3, self._route, req)

    def _route(self, req: _Request) -> None:
        tokens = list(req.spec.prompt_token_ids)
        request = ValidatedRequest(req.rid, tokens, SamplingParams(max_tokens=req.spec.max_tokens))
        decode = self._by_record[id(self.policy.pick_decode(request, [w.record for w in self.decode]))]
        if not decode.engine.fits(len(tokens) + req.spec.max_tokens - 1):
            self._fail(req, "INVALID_ARGUMENT: the prompt and max_tokens do not fit the model's context or KV cache")
            return
        prefill = None
        if self.prefill:
            prefill = self._by_record[id(self.policy.pick_prefill(request, [w.record for w in self.prefill]))]
            if self.conditional is not None and self.conditional.prefill_locally(
                    tokens, decode.record, [w.record for w in self.prefill]):
                prefill = None
        self.counters["prefill_remote" if prefill else "prefill_local"] += 1
        req.decode = decode
        decode.record.inflight += 1
        if prefill is None:
            if self.conditional is not None:
                req.work = self.conditional.begin_local(decode.record, tokens)
            decode.handlers[req.rid] = lambda out: self._token(req, out)
            decode.engine.add_request(req.rid, tokens, req.spec.max_tokens, self.now)
            self._wake(decode)
            return
        req.work = prefill.record.begin_prefill(PromptBlocks(tokens))
        self._reserve(req, prefill, self.now)

    def _reserve(self, req: _Request, prefill: SimWorker, since: float) -> None:
        tokens = list(req.spec.prompt_token_ids)
        req.blocks = req.decode.engine.reserve(tokens, len(tokens) + 1)
        if req.blocks is None:
            if self.now - since < RESERVE_WAIT_S and self.now < req.deadline:
                self.after(RESERVE_POLL_S, self._reserve, req, prefill, since)
                return
            prefill.record.end_prefill(req.work)
            req.decode.record.inflight -= 1
            self._fail(req, "RESOURCE_EXHAUSTED: decode worker has no room for the KV cache")
            return
        prefill.handlers[req.rid] = lambda out: self._prefilled(req, prefill, out)
        prefill.engine.add_request(req.rid, tokens, req.spec.max_tokens, self.now, prefill_only=True)
        self._wake(prefill)

    def _prefilled(self, req: _Request, prefill: SimWorker, out: StepOutput) -> None:
        prefill.record.end_prefill(req.work)
        del prefill.handlers[req.rid]
        block_ids, cached = req.blocks
        if out.finished:  # one-token request: the prefill worker answers, no handoff
            req.decode.engine.blocks.free_blocks(block_ids)
            self._deliver(req)
            self._finish(req)
            return
        handoff = self.profile.transfer_ms(req.spec.prompt_len - cached) + self.profile.overheads.handoff_ms
        self.after(handoff / 1e3, self._landed, req, prefill)

    def _landed(self, req: _Request, prefill: SimWorker) -> None:
        prefill.engine.release(req.rid)
        self._wake(prefill)
        self._deliver(req)
        decode, (block_ids, cached) = req.decode, req.blocks
        decode.handlers[req.rid] = lambda out: self._token(req, out)
        tokens = [*req.spec.prompt_token_ids, SAMPLED_TOKEN]
        if decode.engine.add_prefilled(req.rid, tokens, req.spec.prompt_len, req.spec.max_tokens, block_ids, cached, self.now):
            self._finish(req)
        else:
            self._wake(decode)

    def _token(self, req: _Request, out: StepOutput) -> None:
        if out.first and self.conditional is not None and req.work:
            self.conditional.end_local(req.decode.record, req.work)
            req.work = 0
        self._deliver(req)
        if out.finished:
            self._finish(req)

    # -- the client ----------------------------------------------------------------------------------
    def _deliver(self, req: _Request) -> None:
        req.timeline.chunk_times.append(self.now)
        req.timeline.chunk_tokens.append(1)

    def _finish(self, req: _Request) -> None:
        req.decode.handlers.pop(req.rid, None)
        req.decode.record.inflight -= 1
        req.timeline.end_time = self.now
        req.timeline.finish_reason = "length"
        if self.now > req.deadline:
            req.timeline.error = "DEADLINE_EXCEEDED: the request outlived its deadline"
        self._done()

    def _fail(self, req: _Request, error: str) -> None:
        req.timeline.error = error
        self.counters["failed"] += 1
        self._done()

    def _done(self) -> None:
        self._pending -= 1
        if self._slots is not None:
            self._slots += 1
            if self._queued:
                self._arrive(self._queued.pop(0))

    def _close_stragglers(self, requests: list[_Request]) -> None:
        limit = self.config.time_limit_s + STRAGGLER_GRACE_S
        for r in requests:
            t = r.timeline
            if not t.error and t.end_time is not None and t.end_time > limit:
                t.error = "cancelled at the run's time limit"


def simulate(profile: Profile, topology: Topology, specs: list[RequestSpec], offsets: list[float],
             config: SimConfig | None = None) -> SimRun:
    return Simulation(profile, topology, config).run(specs, offsets)
