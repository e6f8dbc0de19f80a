"""A discrete-event simulation of a pdserve stack: the router, the prefill pool, the decode pool.

Time jumps from event to event (no clocks, threads or model), so a run is deterministic:
the same profile, topology, requests and arrival times give the same timelines.

What runs is pdserve's own code where it can: every worker's scheduler, block manager and
the engine's half of the KV connector (``sim_engine``: chunked prefill, token budget, prefix
cache, admission, preemption, block reservations for remote KV, blocks held until a handoff is
acknowledged), the router's routing policy on the router's own worker records
(``router.policy``), the conditional-disaggregation decision (``router.conditional``) and the
prefill chunk sizing (``chunking``). What is modelled: the forward pass (the profile's step
cost), the serving overheads and the KV transfer (the profile's), CPU sharing when a stack's
workers have more threads than the machine has cores (a step slows by busy threads / cores),
and the router's view of worker load, refreshed every stats interval as its health monitor
does, beside its own in-flight counts, which are always current.

A request's path, as in ``router.dispatch``: arrival; the first-token overhead; the policy
picks a decode worker and (disaggregated) a prefill worker, or conditional routing keeps the
prompt on the decode worker. Disaggregated: the decode worker's scheduler reserves blocks at
the start of a step (the request waits in its queue while none are free, up to its deadline),
the reservation goes to the prefill worker, which prefills the prompt and keeps its blocks
while the KV transfer and the extra hop pass; then the prefill worker answers the router with
the first token at once, which reaches the client, and both engines apply the outcome at their
next step: the prefill worker frees its copy, the decode worker admits the request into its
batch. Every later token reaches the client at the end of the step that produced it (after the
first). A single decode worker's decode-only steps with nothing waiting for remote KV run at
the whole machine's degree (``pdserve up``'s thread borrowing), and a prefill worker sharing
the machine's cores runs on those its busy neighbours leave (``share_cores``).
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
from pdserve.engine.kv_connector import KVReceive, KVSend, TransferOutcome
from pdserve.engine.request_output import KVReservation, KVSent, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.chunking import sizer_for
from pdserve.planner.profile import Profile
from pdserve.planner.sim_engine import EngineLimits, SimTransfer
from pdserve.planner.sim_topology import SimConfig, SimRun, Topology
from pdserve.planner.sim_worker import SimWorker
from pdserve.planner.thresholds import conditional_config
from pdserve.router.conditional import ConditionalRouter
from pdserve.router.policy import make_policy
from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import PromptBlocks

STRAGGLER_GRACE_S = 5.0  # as the load generator: a run's stragglers are cancelled this long after its limit
DEFAULT_KV_TOKENS = 64 * 2048  # KV capacity of a worker when neither the profile nor the config bounds it


@dataclass(slots=True)
class _Request:
    rid: str
    spec: RequestSpec
    timeline: Timeline
    deadline: float = math.inf
    decode: SimWorker | None = None
    local: bool = False  # prefilled on its decode worker
    work: int = 0  # uncached tokens counted on the prefill worker (or the decode worker's local backlog)
    reservation: KVReservation | None = None  # where the decode worker wants the K/V
    held: list[RequestOutput] = field(default_factory=list)  # decode outputs the router reads after the first token
    first_sent: bool = False  # the prefill worker's first token reached the client
    prefill: SimWorker | None = None  # the prefill worker of a disaggregated request
    prefilled: bool = False  # its Prefill call has answered
    ended: bool = False  # finished or failed


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
        borrow = topology.borrowed_degree(profile, config.num_threads)
        shared = topology.shared_prefill_degree(profile, config.num_threads)
        self.decode = [
            SimWorker(self, decode_role, f"decode-{i}", decode_degree, self._limits(decode_degree), borrow)
            for i in range(topology.decode)
        ]
        self.prefill = (
            []
            if topology.colocated
            else [
                SimWorker(
                    self,
                    "prefill",
                    f"prefill-{i}",
                    shared or prefill_degree,
                    self._limits(prefill_degree),
                    yields=bool(shared),
                )
                for i in range(topology.prefill)
            ]
        )
        self.workers = self.decode + self.prefill
        self._by_record = {id(w.record): w for w in self.workers}
        self.policy = make_policy(topology.policy)
        self.conditional = None
        if topology.conditional:
            self.conditional = ConditionalRouter(
                conditional_config(
                    profile, config.slo_tpot_ms, config.conditional_threshold_tokens, prefill_degree, decode_degree
                )
            )
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
            num_blocks=max(1, tokens // c.block_size),
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            enable_chunked_prefill=self.topology.chunked_prefill,
            enable_prefix_caching=c.enable_prefix_caching,
            max_model_len=self.profile.max_model_len,
        )

    def after(self, delay_s: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (self.now + max(0.0, delay_s), next(self._order), fn, args))

    def _wake(self, worker: SimWorker) -> None:
        """The worker's engine thread picks up new work after whatever else arrives at this
        instant (requests sent together share a step, as the engine loop drains its queue)."""
        self.after(0.0, worker.kick)

    def reshare(self, started: SimWorker | None = None) -> None:
        """Processor sharing on a CPU: a worker that yields (``share_cores``) runs on the cores
        the others' busy threads leave (at least one), at its step's cost for that many threads;
        while the threads still outnumber the cores, each runs at cores / threads of its speed.
        Called whenever a step starts (``started``) or ends: charges every running step for the
        time since the last change at the speed it had, then reschedules its end at the new one."""
        if not self.profile.cores:  # a worker per device: steps never slow each other
            if started is not None:
                started.version += 1
                self.after(started.work_ms / 1e3, started.step_done, started.version)
            return
        running = [w for w in self.workers if w.busy]
        for w in running:
            if w is not started:
                w.work_ms = max(0.0, w.work_ms - (self.now - w.charged_at) * 1e3 * w.speed)
            w.charged_at = self.now
        cores = self.profile.cores
        fixed = sum(w.degree for w in running if not w.yields)
        threads = {w: max(1, min(w.degree, cores - fixed)) if w.yields else w.degree for w in running}
        shared = min(1.0, cores / sum(threads.values())) if running else 1.0
        for w in running:
            w.speed = shared * self._thread_speed(w, threads[w])
            w.version += 1
            self.after(w.work_ms / w.speed / 1e3, w.step_done, w.version)

    def _thread_speed(self, w: SimWorker, threads: int) -> float:
        """How fast ``w``'s step runs on ``threads`` threads, relative to its own degree."""
        if threads >= w.degree or w.shape is None:
            return 1.0
        at_degree = self.profile.step_cost(w.degree).ms(w.shape)
        return at_degree / max(1e-9, self.profile.step_cost(threads).ms(w.shape))

    # -- a run -----------------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec], offsets: list[float]) -> SimRun:
        """Simulates ``specs`` sent at ``offsets`` (seconds; ``arrivals.arrival_offsets``)."""
        if len(offsets) != len(specs):
            raise ValueError(f"{len(specs)} requests but {len(offsets)} arrival times")
        requests = [
            _Request(f"sim-{i}", s, Timeline(prompt_len=s.prompt_len, max_tokens=s.max_tokens))
            for i, s in enumerate(specs)
        ]
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
        self.after(max(0.001, req.deadline - self.now), self._deadline_passed, req)

    def _route(self, req: _Request) -> None:
        if req.ended:
            return
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
                tokens, decode.record, [w.record for w in self.prefill]
            ):
                prefill = None
        self.counters["prefill_remote" if prefill else "prefill_local"] += 1
        req.decode = decode
        decode.record.inflight += 1
        if prefill is None:
            req.local = True
            if self.conditional is not None:
                req.work = self.conditional.begin_local(decode.record, tokens)
            decode.handlers[req.rid] = lambda out: self._token(req, out)
            decode.engine.add_request(req.rid, tokens, req.spec.max_tokens, self.now)
            self._wake(decode)
            return
        # The decode worker reserves blocks in its step loop, waiting up to the request's
        # deadline; the reservation is its stream's first message.
        req.prefill = prefill
        req.work = prefill.record.begin_prefill(PromptBlocks(tokens))
        decode.handlers[req.rid] = lambda out: self._decode_output(req, prefill, out)
        decode.engine.add_request(
            req.rid, tokens, req.spec.max_tokens, self.now, kv_receive=KVReceive(decode.engine.receiver)
        )
        # As a decode worker: a reservation waits for a batch slot and blocks until the deadline
        # (``_deadline_passed``).
        self._wake(decode)

    def _reservation_overdue(self, req: _Request, prefill: SimWorker) -> None:
        if not req.decode.engine.expire(req.rid):
            return  # reserved in time
        prefill.record.end_prefill(req.work)
        req.decode.handlers.pop(req.rid, None)
        req.decode.record.inflight -= 1
        self._fail(req, "RESOURCE_EXHAUSTED: decode worker could not start the request before its deadline")

    def _deadline_passed(self, req: _Request) -> None:
        """The client's deadline: the router cancels the request's calls, and the workers free
        what it holds (its work no longer takes capacity from the requests behind it)."""
        if req.ended:
            return
        error = "DEADLINE_EXCEEDED: the request outlived its deadline"
        decode = req.decode
        if decode is None:  # not routed yet
            self._fail(req, error)
            return
        if req.prefill is not None and req.reservation is None:  # still waiting for a decode slot
            self._reservation_overdue(req, req.prefill)  # refused as the decode worker refuses it
            if req.ended:
                return
        decode.handlers.pop(req.rid, None)
        decode.abort(req.rid)
        if req.prefill is not None and not req.prefilled:
            req.prefill.handlers.pop(req.rid, None)
            req.prefill.abort(req.rid)
            req.prefill.record.end_prefill(req.work)
            self._wake(req.prefill)
        elif req.local and self.conditional is not None and req.work:
            self.conditional.end_local(decode.record, req.work)
        self._wake(decode)
        self._end(req, error)

    def _decode_output(self, req: _Request, prefill: SimWorker, out: RequestOutput) -> None:
        if isinstance(out.kv, KVReservation):  # the router sends the prompt to the prefill worker
            req.reservation = out.kv
            prefill.record.prefill_sent(req.work)
            prefill.handlers[req.rid] = lambda o: self._prefill_output(req, prefill, o)
            # The simulated transfer always completes, so the connector's wall-clock deadline for the ack never matters.
            send = KVSend(SimTransfer(lambda transfer, token: self._ship(req, transfer, token)), ack_timeout_s=math.inf)
            prefill.engine.add_request(
                req.rid, list(req.spec.prompt_token_ids), req.spec.max_tokens, self.now, kv_send=send
            )
            self._wake(prefill)
        elif req.first_sent:
            self._token(req, out)
        else:  # the router relays the decode stream once the prefill worker has answered
            req.held.append(out)

    def _ship(self, req: _Request, transfer: SimTransfer, first_token_id: int) -> None:
        """The prefill worker sampled the first token: the K/V the decode worker lacks travel."""
        tokens = req.spec.prompt_len - req.reservation.num_cached_tokens
        handoff_ms = self.profile.transfer_ms(tokens) + self.profile.overheads.handoff_ms
        self.after(
            handoff_ms / 1e3, self._transferred, req, transfer, first_token_id, tokens * self.profile.kv_bytes_per_token
        )

    def _transferred(self, req: _Request, transfer: SimTransfer, first_token_id: int, nbytes: int) -> None:
        """The decode side verified the K/V and acknowledged them: both engines hear it."""
        if transfer.cancelled:
            return
        transport = self.profile.transport
        if req.decode.engine.receiver.land(req.reservation.transfer_id, first_token_id, transport, nbytes):
            transfer.report(TransferOutcome(True, transport=transport, nbytes=nbytes))
        else:
            transfer.report(TransferOutcome(False, "the decode worker cancelled the transfer"))

    def _prefill_output(self, req: _Request, prefill: SimWorker, out: RequestOutput) -> None:
        if not out.finished:
            return  # the first token: the Prefill call answers once the K/V are acknowledged
        prefill.handlers.pop(req.rid, None)
        prefill.record.end_prefill(req.work)
        req.prefilled = True
        if out.error is not None:
            req.decode.engine.abort(req.rid)
            self._end(req, f"prefill failed: {out.error}")
            return
        self._deliver(req)
        req.first_sent = True
        if not isinstance(out.kv, KVSent):  # the first token ended it: the router closes the decode stream
            req.decode.engine.abort(req.rid)
            self._finish(req)
            return
        held, req.held = req.held, []
        for o in held:
            self._token(req, o)

    def _token(self, req: _Request, out: RequestOutput) -> None:
        if out.error is not None:
            self._end(req, f"decode failed: {out.error}")
            return
        if out.new_token_ids:
            if req.local and self.conditional is not None and req.work and not req.timeline.chunk_times:
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
        req.ended = True
        self._done()

    def _end(self, req: _Request, error: str) -> None:
        """A request that had started fails (never in a simulation that models no faults)."""
        req.decode.handlers.pop(req.rid, None)
        req.decode.record.inflight -= 1
        self._fail(req, error)

    def _fail(self, req: _Request, error: str) -> None:
        req.ended = True
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


def simulate(
    profile: Profile,
    topology: Topology,
    specs: list[RequestSpec],
    offsets: list[float],
    config: SimConfig | None = None,
) -> SimRun:
    return Simulation(profile, topology, config).run(specs, offsets)
