"""Drives one request through the workers and yields its tokens.

Disaggregated: open the decode stream (the decode worker reserves blocks and answers with
where the KV must go), run the prefill on a prefill worker (which ships the KV there and
returns the first token), then relay the decode stream. Colocated: one decode worker does
both. Closing the generator cancels whatever RPC is in flight, so the workers free the
request's blocks on client cancel, deadline or stop string.

An attempt that fails in a retryable way (a KV transfer that arrived corrupted or never
arrived, a worker that went away) is retried on other workers. Tokens already sent to the
client become part of the prompt of the next attempt, which continues where the stream
stopped: the same mechanism re-prefills a failed handoff and migrates a request off a dead
decode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Iterator

import grpc

from pdserve import metrics
from pdserve.router.choice_ends import ChoiceEnds
from pdserve.router.choice_migration import continue_choices
from pdserve.router.conditional import ConditionalRouter
from pdserve.router.policy import NoWorkerAvailable, RoutingPolicy
from pdserve.router.validation import ValidatedRequest
from pdserve.router.worker_errors import DispatchError, prefill_error, worker_error
from pdserve.router.workers import OpenCall, PromptBlocks, Role, Worker, WorkerRegistry
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.wire import sampling_to_proto

log = logging.getLogger(__name__)
DEFAULT_MAX_ATTEMPTS = 4
END_CHOICES_TIMEOUT_S = 5.0  # a decode worker's EndChoices answer (the request's end frees them anyway)
MISMATCH_MEMORY_S = 30.0  # how long a pair that refused each other's KV handshake is kept apart


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None = None  # ends choice ``index``
    cached_tokens: int = 0
    index: int = 0  # which choice (n > 1)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: list[pb.TokenLogprob] | None = None  # with the first token, when asked for
    migrations: int = 0  # times the request had moved to another worker mid-stream when this came

    @classmethod
    def from_batch(cls, batch: pb.TokenBatch) -> "TokenEvent":
        return cls(
            list(batch.token_ids),
            batch.finish_reason or None,
            batch.num_cached_tokens,
            batch.index,
            list(batch.logprobs),
            list(batch.prompt_logprobs) or None,
        )


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one try sends: the original prompt plus the tokens the client already has.
    ``key`` is the router's own id for the try, unique in the cluster: the workers key their
    state on it (a client's request_id need not be unique; it is passed along for logs)."""

    request: ValidatedRequest
    prior: list[int]
    ends: ChoiceEnds | None = None  # n > 1: the choices the router ends (stop strings), told where they run
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    blocks: PromptBlocks = field(init=False)  # its tokens' block hashes, computed once however often weighed

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", PromptBlocks(self.request.prompt_token_ids + self.prior))

    @property
    def token_ids(self) -> list[int]:
        return self.blocks.token_ids


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        policy: RoutingPolicy,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        failure_threshold: int = 2,
        worker_wait_s: float = 5.0,
    ) -> None:
        self.worker_wait_s = worker_wait_s
        self.registry = registry
        self.policy = policy
        self.max_attempts = max_attempts  # 1 + retries/migrations per request
        self.failure_threshold = failure_threshold
        self.counters: Counter[str] = Counter()
        self.conditional: ConditionalRouter | None = None  # prefill short prompts on the decode worker
        self.observer = None  # planner.online.OnlinePlanner: sees arrivals, first tokens and ends
        # (prefill, decode) addresses that refused each other's KV handshake -> until when they are
        # not paired again (a restarted worker may match by then).
        self.mismatched: dict[tuple[str, str], float] = {}
        self._telling: set[asyncio.Future] = set()  # EndChoices calls under way

    async def generate(
        self, req: ValidatedRequest, timeout_s: float, prior: list[int] | None = None, ends: ChoiceEnds | None = None
    ) -> AsyncIterator[TokenEvent]:
        """``prior``: tokens the client already has (a choice continuing on its own). ``ends``:
        n > 1, the choices the caller ends before the others (a stop string)."""
        deadline = time.monotonic() + timeout_s
        prior = list(prior or [])
        failed: set[str] = set()
        n, ended = req.engine_sampling.n, set()  # choices, and those that have finished
        priors: dict[int, list[int]] = {}  # n > 1: each choice's tokens so far
        watch = self._watch(req) if self.observer is not None and not prior else None
        moved = 0
        resuming: str | None = None  # "retries"/"migrations": counted once the request runs again
        attempt = 0
        while True:
            attempt += 1
            try:
                # Closed as soon as the request ends, not whenever the generator is collected:
                # that cancels the worker call and releases its in-flight count at once.
                async with contextlib.aclosing(
                    self._attempt(Attempt(req, list(prior), ends), deadline, failed)
                ) as events:
                    async for event in events:
                        if resuming:
                            moved += self._count_resumed(resuming)
                            resuming = None
                        prior += event.token_ids
                        priors.setdefault(event.index, []).extend(event.token_ids)
                        watch = _tell_planner(watch, event)
                        yield replace(event, migrations=moved) if moved else event
                        if event.finish_reason:
                            ended.add(event.index)
                            if len(ended) == n:
                                return
                raise DispatchError(grpc.StatusCode.UNAVAILABLE, "the worker stream ended without a finish reason")
            except DispatchError as e:
                if e.worker is not None and e.code is grpc.StatusCode.UNAVAILABLE and e.charged and not e.elsewhere:
                    e.worker.record_failure(self.failure_threshold, e.message)  # a peer's word is no proof
                if e.also is not None:  # a mismatched pair: the pair is out, not its workers
                    self.mismatched[(e.also.address, e.worker.address)] = time.monotonic() + MISMATCH_MEMORY_S
                    attempt -= 1  # not a try of the request's: bounded by the pairs left to rule out
                if not e.retryable or attempt == self.max_attempts or time.monotonic() >= deadline:
                    raise
                if e.also is not None:
                    if not self._matching_pairs(failed):
                        if not self._matching_pairs(set()):
                            raise  # its words say more than "no worker left" would
                        failed.clear()  # each matching pair holds a worker that failed this request: try again
                elif e.worker is not None:
                    failed.add(e.worker.address)
                    if e.elsewhere and not self._another(e.worker, failed):
                        raise

                kind = resuming = "migrations" if prior else "retries"
                how = "continues" if kind == "migrations" else "is retried"
                log.info("request %s: %s; it %s (attempt %d)", req.request_id, e.message, how, attempt + 1)
                if n > 1 and prior:  # several choices under way: each continues on its own
                    async with contextlib.aclosing(continue_choices(self, req, priors, ended, deadline, ends)) as rest:
                        async for event in rest:
                            if resuming:
                                moved += self._count_resumed(resuming)
                                resuming = None
                            watch = _tell_planner(watch, event)
                            yield replace(event, migrations=moved + event.migrations)
                    return
                if e.code is grpc.StatusCode.DATA_LOSS:
                    self.counters["reprefills_after_corruption"] += 1
                answered = e.code is grpc.StatusCode.RESOURCE_EXHAUSTED or e.also is not None  # full, or mismatched
                if not answered:
                    # Back off a little: a worker that just died takes its peers' health checks a moment to notice.
                    await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 2.0, max(0.0, deadline - time.monotonic())))

    def _count_resumed(self, kind: str) -> int:
        """A retry or migration counts once the request runs again, not when tried; 1 for a
        migration (the request's usage counts those), else 0."""
        self.counters[kind] += 1
        metrics.MIGRATIONS.labels(kind).inc()
        return int(kind == "migrations")

    def _matching_pairs(self, failed: set[str]) -> set[tuple[str, str]]:
        """(prefill, decode) addresses of healthy workers, not failed for this request, that have
        not recently refused each other's KV handshake."""
        now = time.monotonic()
        for pair in [pair for pair, until in self.mismatched.items() if until <= now]:
            del self.mismatched[pair]
        up = lambda pool: [w.address for w in pool if w.healthy and w.address not in failed]  # noqa: E731
        return {
            (p, d) for p in up(self.registry.prefill) for d in up(self.registry.decode) if (p, d) not in self.mismatched
        }

    def _another(self, worker: Worker, failed: set[str]) -> bool:
        pool = self.registry.decode if worker.role is Role.DECODE else self.registry.prefill
        return any(w.healthy and w.address not in failed for w in pool)

    def _watch(self, req: ValidatedRequest):
        """The online planner's watch on a request, or None if the planner fails (it only advises)."""
        try:
            return self.observer.watch(req)
        except Exception:  # noqa: BLE001
            log.exception("the online planner failed on an arriving request; it does not watch it")
            return None

    async def _pick(self, attempt: Attempt, deadline: float, failed: set[str]) -> tuple[Worker, Worker | None]:
        """(decode, prefill) workers; while every worker of a role is down (restarting), waits
        up to ``worker_wait_s`` for one to come back before giving up with UNAVAILABLE."""
        give_up = min(deadline, time.monotonic() + self.worker_wait_s)
        while True:
            try:
                if not self.registry.disaggregated:
                    return self.policy.pick_decode(attempt.request, self.registry.decode, exclude=failed), None
                # Among pairs not known to refuse each other's KV handshake; with none such, any
                # (what the router remembers may be stale: a worker restarted with other settings).
                pairs = self._matching_pairs(failed)
                paired = {d for _, d in pairs}
                unpaired = {w.address for w in self.registry.decode if w.address not in paired}
                decode = self.policy.pick_decode(
                    attempt.request, self.registry.decode, exclude=failed | (unpaired if pairs else set())
                )
                apart = {w.address for w in self.registry.prefill if (w.address, decode.address) not in pairs}
                prefill = self.policy.pick_prefill(
                    attempt.request, self.registry.prefill, exclude=failed | (apart if pairs else set())
                )
                return decode, prefill
            except NoWorkerAvailable as e:
                if time.monotonic() >= give_up:
                    raise DispatchError(grpc.StatusCode.UNAVAILABLE, str(e), final=True) from None
            await asyncio.sleep(0.1)

    async def _attempt(self, attempt: Attempt, deadline: float, failed: set[str]) -> AsyncIterator[TokenEvent]:
        decode, prefill = await self._pick(attempt, deadline, failed)
        local = (
            prefill is not None
            and self.conditional is not None
            and self.conditional.prefill_locally(attempt.token_ids, decode, self.registry.prefill)
        )
        if local:
            prefill = None
            self.counters["conditional_local_prefills"] += 1
        log.debug(
            "request %s: try %s on prefill worker %s, decode worker %s",
            attempt.request.request_id,
            attempt.key,
            prefill.address if prefill else "(none: prefilled on the decode worker)",
            decode.address,
        )
        if attempt.request.ttft_budget_ms is not None and not attempt.prior:
            self._check_ttft_budget(attempt, prefill or decode)
        stream = (
            self._disaggregated(attempt, prefill, decode, deadline)
            if prefill
            else self._colocated(attempt, decode, deadline)
        )
        if local:
            stream = self.conditional.track(decode, attempt.token_ids, stream)
        async with contextlib.aclosing(stream):
            async for event in stream:
                yield event

    def _check_ttft_budget(self, attempt: Attempt, worker: Worker) -> None:
        """Rejects at once a request whose prefill cannot start within its TTFT budget, judged
        by the work already queued on the chosen worker and its recent prefill speed."""
        stats = worker.last_stats
        if stats is None or stats.prefill_tokens_per_s <= 0:
            return
        # Only what it would compute: a prompt whose prefix it caches is that much shorter.
        queued = stats.queued_prefill_tokens + worker.inflight_tokens + worker.uncached_tokens(attempt.blocks)
        expected_ms = queued / stats.prefill_tokens_per_s * 1e3
        budget = attempt.request.ttft_budget_ms
        if expected_ms > budget:
            self.counters["rejected_ttft_budget"] += 1
            raise DispatchError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"ttft_budget_ms: the first token would take ~{expected_ms:.0f} ms (budget {budget:.0f} ms); retry later",
                retry_after_ms=int(min(expected_ms - budget, 60_000)) + 100,
            )

    async def _colocated(self, attempt: Attempt, decode: Worker, deadline: float) -> AsyncIterator[TokenEvent]:
        call = decode.decode_stub.Decode(
            _decode_request(attempt, prefill_locally=True), timeout=_left(deadline), metadata=self.registry.metadata
        )
        open_call = OpenCall(call)
        decode.inflight += 1
        try:
            with _waiting_on(open_call, decode), self._ending_choices(attempt, decode):
                while (event := await call.read()) is not grpc.aio.EOF:
                    open_call.heard()
                    yield TokenEvent.from_batch(event.tokens)
        except grpc.aio.AioRpcError as e:
            raise worker_error(decode, e) from None
        finally:
            call.cancel()
            decode.inflight -= 1

    async def _disaggregated(
        self, attempt: Attempt, prefill: Worker, decode: Worker, deadline: float
    ) -> AsyncIterator[TokenEvent]:
        call = decode.decode_stub.Decode(
            _decode_request(attempt, prefill_locally=False), timeout=_left(deadline), metadata=self.registry.metadata
        )
        open_call = OpenCall(call)
        decode.inflight += 1
        # Counted on the prefill worker from the moment it is picked (no await since), so a
        # burst of requests sees each other's work.
        work = prefill.begin_prefill(attempt.blocks)
        try:
            with _waiting_on(open_call, decode), self._ending_choices(attempt, decode):
                try:
                    with _waiting_on(open_call, prefill):
                        target = await _reservation(call, decode)
                        prefill.prefill_sent(work)
                        prefilled = prefill.prefill_stub.Prefill(
                            _prefill_request(attempt, target), timeout=_left(deadline), metadata=self.registry.metadata
                        )
                        open_call.add(prefilled)
                        response = await prefilled
                except grpc.aio.AioRpcError as e:
                    raise prefill_error(prefill, decode, e) from None
                finally:
                    prefill.end_prefill(work)
                open_call.heard()
                choices = response.choices or [
                    pb.FirstToken(token_id=response.first_token_id, finish_reason=response.finish_reason)
                ]
                for i, first in enumerate(choices):
                    yield TokenEvent(
                        [first.token_id],
                        first.finish_reason or None,
                        response.num_cached_tokens,
                        index=i,
                        logprobs=[first.logprob] if first.HasField("logprob") else [],
                        prompt_logprobs=list(response.prompt_logprobs) if i == 0 else None,
                    )
                if all(first.finish_reason for first in choices):
                    return
                try:
                    while (event := await call.read()) is not grpc.aio.EOF:
                        open_call.heard()
                        yield TokenEvent.from_batch(event.tokens)
                except grpc.aio.AioRpcError as e:
                    raise worker_error(decode, e) from None
        finally:
            call.cancel()
            decode.inflight -= 1

    def _ending_choices(self, attempt: Attempt, decode: Worker) -> contextlib.AbstractContextManager:
        """While the try runs on ``decode``, the choices the router ends are ended there too."""
        if attempt.ends is None:
            return contextlib.nullcontext()

        def end(indices: set[int]) -> None:
            request = pb.EndChoicesRequest(request_id=attempt.key, indices=sorted(indices))
            call = decode.decode_stub.EndChoices(
                request, timeout=END_CHOICES_TIMEOUT_S, metadata=self.registry.metadata
            )
            task = asyncio.ensure_future(call)
            self._telling.add(task)  # held until done: the event loop keeps only weak references
            task.add_done_callback(self._told)

        return attempt.ends.listening(end)

    def _told(self, task: asyncio.Future) -> None:
        self._telling.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the request's end frees them anyway
            log.debug("ending choices failed: %s", task.exception())


def _tell_planner(watch, event: TokenEvent):
    """Reports ``event`` to the online planner's watch; a planner that fails stops watching the
    request (returns None) and never fails it: it only advises."""
    if watch is None:
        return None
    try:
        watch.token(len(event.token_ids), event.finish_reason, event.index)
        return watch
    except Exception:  # noqa: BLE001
        log.exception("the online planner failed on a request's token; it stops watching it")
        return None


@contextlib.contextmanager
def _waiting_on(open_call: OpenCall, worker: Worker) -> Iterator[None]:
    """Registers ``open_call`` with ``worker`` while the attempt waits on it; the health monitor
    cancels it there if the worker stops answering, and the attempt then fails over (UNAVAILABLE)."""
    worker.open_calls.add(open_call)
    try:
        yield
    except asyncio.CancelledError:
        stopped = open_call.abandoned_by
        cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
        if stopped is None or (cancelling is not None and cancelling()):  # a real cancellation (client, deadline)
            raise
        raise DispatchError(
            grpc.StatusCode.UNAVAILABLE,
            f"{stopped.role.value} worker {stopped.address} stopped answering (it fails its health checks)",
            stopped,
        ) from None
    finally:
        worker.open_calls.discard(open_call)


async def _reservation(call, decode: Worker) -> pb.KvTarget:
    """Where the decode worker wants the KV: the first message of its Decode stream."""
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as e:
        raise worker_error(decode, e) from None
    if first is grpc.aio.EOF or not first.HasField("reservation"):
        raise DispatchError(grpc.StatusCode.UNAVAILABLE, f"decode worker {decode.address} sent no reservation", decode)
    return first.reservation.target


def _remaining_budget_ms(attempt: Attempt) -> float:
    """What is left of the request's TTFT budget (0 = none; a continuation has started already)."""
    req = attempt.request
    if req.ttft_budget_ms is None or attempt.prior:
        return 0.0
    return max(1.0, req.ttft_budget_ms - (time.monotonic() - req.arrival) * 1e3)


def _decode_request(attempt: Attempt, prefill_locally: bool) -> pb.DecodeRequest:
    req = attempt.request
    return pb.DecodeRequest(
        request_id=attempt.key,
        client_request_id=req.request_id,
        token_ids=attempt.token_ids,
        sampling=sampling_to_proto(req.engine_sampling),
        priority=req.priority,
        prefill_locally=prefill_locally,
        num_prior_output_tokens=len(attempt.prior),
        ttft_budget_ms=_remaining_budget_ms(attempt),
    )


def _prefill_request(attempt: Attempt, target: pb.KvTarget) -> pb.PrefillRequest:
    req = attempt.request
    return pb.PrefillRequest(
        request_id=attempt.key,
        client_request_id=req.request_id,
        token_ids=attempt.token_ids,
        sampling=sampling_to_proto(req.engine_sampling),
        priority=req.priority,
        num_prior_output_tokens=len(attempt.prior),
        target=target,
        ttft_budget_ms=_remaining_budget_ms(attempt),
    )


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())
