"""The dispatcher on fake workers (no servers, no model): the disaggregated and colocated paths,
retries after a corrupted or missing KV handoff, migration off a dead decode worker without a
lost or repeated token, the circuit breaker, TTFT budgets and waiting for a worker to return.
Each fake stub plays a scripted worker and records what it was sent."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.request_rules import choice_seed
from pdserve.router.choice_ends import ChoiceEnds
from pdserve.router.choice_migration import continue_choices
from pdserve.router.dispatch import Dispatcher, TokenEvent
from pdserve.router.policy import RoundRobin
from pdserve.router.validation import ValidatedRequest
from pdserve.router.worker_errors import DispatchError
from pdserve.router.workers import PromptBlocks, Role, Worker, WorkerRegistry
from pdserve.v1 import pdserve_pb2 as pb

PROMPT = list(range(100, 140))


def rpc_error(
    code: grpc.StatusCode,
    details: str = "injected",
    retry_after_ms: int | None = None,
    decode_fault: bool = False,
    pair_fault: bool = False,
    transfer_fault: bool = False,
) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(
        *((("retry-after-ms", str(retry_after_ms)),) if retry_after_ms else ()),
        *((("pdserve-peer-fault", "decode"),) if decode_fault else ()),
        *((("pdserve-peer-fault", "pair"),) if pair_fault else ()),
        *((("pdserve-peer-fault", "transfer"),) if transfer_fault else ()),
    )
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


HANG = object()  # a worker that stops answering (paused): the call waits until it is cancelled


class FakeCall:
    """A server-streaming call: yields ``events`` (DecodeEvents, an exception to raise, or HANG)."""

    def __init__(self, events: list) -> None:
        self.events = list(events)
        self.cancelled = False
        self._cancel = asyncio.Event()

    def cancel(self) -> bool:
        self.cancelled = True
        self._cancel.set()
        return True

    async def read(self):
        await asyncio.sleep(0)
        if not self.events:
            return grpc.aio.EOF
        event = self.events.pop(0)
        if event is HANG:
            await self._cancel.wait()
            raise asyncio.CancelledError()  # as grpc.aio raises for a call cancelled on this side
        if isinstance(event, BaseException):
            raise event
        return event


class FakeUnaryCall(FakeCall):
    """A unary call: awaited, it gives its one answer (or raises it, or HANGs)."""

    def __await__(self):
        return self.read().__await__()


@dataclass
class FakeDecode:
    """Scripted Decode streams, one script per call: a list of generated token batches, an
    exception to raise after them, or a reservation first when the router prefills elsewhere."""

    scripts: list[tuple[list[list[int]], BaseException | None]]
    requests: list[pb.DecodeRequest] = field(default_factory=list)
    calls: list[FakeCall] = field(default_factory=list)

    def Decode(self, request: pb.DecodeRequest, timeout=None, metadata=()) -> FakeCall:
        self.requests.append(request)
        batches, error = self.scripts.pop(0)
        events = (
            []
            if request.prefill_locally
            else [
                pb.DecodeEvent(
                    reservation=pb.Reservation(
                        target=pb.KvTarget(
                            transfer_id=f"{len(self.requests):016x}", kv_address="kv:1", block_ids=[1, 2, 3]
                        )
                    )
                )
            ]
        )
        # A disaggregated stream carries what follows the prefill's first token.
        for n, batch in enumerate(batches):
            last = n == len(batches) - 1 and error is None
            events.append(pb.DecodeEvent(tokens=pb.TokenBatch(token_ids=batch, finish_reason="length" if last else "")))
        if error is not None:
            events.append(error)
        call = FakeCall(events)
        self.calls.append(call)
        return call


@dataclass
class FakePrefill:
    """Scripted Prefill answers, one per call: a first token id, an exception to raise, or HANG."""

    answers: list
    requests: list[pb.PrefillRequest] = field(default_factory=list)
    calls: list[FakeUnaryCall] = field(default_factory=list)

    def Prefill(self, request: pb.PrefillRequest, timeout=None, metadata=()) -> FakeUnaryCall:
        self.requests.append(request)
        answer = self.answers.pop(0)
        call = FakeUnaryCall([pb.PrefillResponse(first_token_id=answer) if isinstance(answer, int) else answer])
        self.calls.append(call)
        return call


def decode_worker(name: str, stub: FakeDecode) -> Worker:
    return Worker(name, Role.DECODE, channel=None, decode_stub=stub)


def prefill_worker(name: str, stub: FakePrefill) -> Worker:
    return Worker(name, Role.PREFILL, channel=None, prefill_stub=stub)


def registry(prefill: list[Worker], decode: list[Worker]) -> WorkerRegistry:
    return WorkerRegistry(
        prefill=prefill,
        decode=decode,
        specs={Role.PREFILL: [w.address for w in prefill], Role.DECODE: [w.address for w in decode]},
    )


def dispatcher(reg: WorkerRegistry, **kwargs) -> Dispatcher:
    kwargs = {"max_attempts": 4, "failure_threshold": 2, "worker_wait_s": 0.2, **kwargs}
    return Dispatcher(reg, RoundRobin(), **kwargs)


def request(max_tokens: int = 6, ttft_budget_ms: float | None = None) -> ValidatedRequest:
    return ValidatedRequest(
        "client-id", list(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0), ttft_budget_ms=ttft_budget_ms
    )


async def collect(d: Dispatcher, req: ValidatedRequest, timeout_s: float = 30.0) -> tuple[list[int], str | None]:
    ids, finish = [], None
    async for event in d.generate(req, timeout_s):
        ids += event.token_ids
        finish = event.finish_reason
    return ids, finish


def idle(*workers: Worker) -> bool:
    return all(w.inflight == 0 and w.inflight_tokens == 0 for w in workers)


async def test_colocated_streams_the_decode_workers_tokens():
    stub = FakeDecode([([[1, 2], [3], [4, 5, 6]], None)])
    d = decode_worker("d", stub)
    ids, finish = await collect(dispatcher(registry([], [d])), request())
    assert (ids, finish) == ([1, 2, 3, 4, 5, 6], "length")
    (sent,) = stub.requests
    assert sent.prefill_locally and list(sent.token_ids) == PROMPT and sent.num_prior_output_tokens == 0
    assert sent.sampling.max_tokens == 6
    assert all(call.cancelled for call in stub.calls) and idle(d)  # the stream is closed once done


async def test_disaggregated_first_token_from_prefill_then_decode_stream():
    decode = FakeDecode([([[8, 9], [10]], None)])
    prefill = FakePrefill([7])
    p, d = prefill_worker("p", prefill), decode_worker("d", decode)
    ids, finish = await collect(dispatcher(registry([p], [d])), request(max_tokens=4))
    assert (ids, finish) == ([7, 8, 9, 10], "length")
    (to_decode,), (to_prefill,) = decode.requests, prefill.requests
    assert not to_decode.prefill_locally and list(to_prefill.token_ids) == PROMPT
    assert to_prefill.target.transfer_id == "0000000000000001"  # where the decode worker reserved the KV
    assert idle(p, d)


async def test_a_corrupted_handoff_is_prefilled_again_elsewhere(caplog):
    caplog.set_level("INFO", logger="pdserve.router.dispatch")
    decode = FakeDecode([([], None), ([[8]], None)])
    bad, good = FakePrefill([rpc_error(grpc.StatusCode.DATA_LOSS, "checksum mismatch")]), FakePrefill([7])
    p1, p2, d = prefill_worker("p1", bad), prefill_worker("p2", good), decode_worker("d", decode)
    disp = dispatcher(registry([p1, p2], [d]))
    ids, finish = await collect(disp, request(max_tokens=2))
    assert (ids, finish) == ([7, 8], "length")
    assert disp.counters["retries"] == 1 and disp.counters["reprefills_after_corruption"] == 1
    assert "p1: checksum mismatch; it is retried (attempt 2)" in caplog.text  # said, not only counted
    assert len(decode.calls) == 2 and all(call.cancelled for call in decode.calls)  # the failed attempt's too
    assert idle(p1, p2, d)


async def test_a_dead_decode_worker_is_migrated_from_without_losing_or_repeating_a_token():
    dying = FakeDecode([([[1, 2], [3]], rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"))])
    healthy = FakeDecode([([[4, 5], [6]], None)])
    d1, d2 = decode_worker("d1", dying), decode_worker("d2", healthy)
    disp = dispatcher(registry([], [d1, d2]))
    events = [event async for event in disp.generate(request(max_tokens=6), 30.0)]
    assert [t for e in events for t in e.token_ids] == [1, 2, 3, 4, 5, 6] and events[-1].finish_reason == "length"
    assert [e.migrations for e in events] == [0, 0, 1, 1]  # the request's usage reports the move
    (resumed,) = healthy.requests  # the prompt plus the three tokens the client already has
    assert list(resumed.token_ids) == PROMPT + [1, 2, 3] and resumed.num_prior_output_tokens == 3
    assert disp.counters["migrations"] == 1 and d1.consecutive_failures == 1
    assert idle(d1, d2)


async def test_a_move_counts_once_the_request_resumes_not_for_each_try():
    """usage.migrations and the migrations counter agree: a worker that refused the resumed
    request before it ran (failed to connect) is not a move."""
    dying = FakeDecode([([[1, 2], [3]], rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"))])
    refusing = FakeDecode([([], rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect"))])
    healthy = FakeDecode([([[4, 5], [6]], None)])
    d1, d2, d3 = decode_worker("d1", dying), decode_worker("d2", refusing), decode_worker("d3", healthy)
    disp = dispatcher(registry([], [d1, d3, d2]))  # round robin without the failed: d1, then d2, then d3
    events = [event async for event in disp.generate(request(max_tokens=6), 30.0)]
    assert [t for e in events for t in e.token_ids] == [1, 2, 3, 4, 5, 6] and len(refusing.requests) == 1
    assert events[-1].migrations == 1 and disp.counters["migrations"] == 1
    assert idle(d1, d2, d3)


async def test_errors_that_retrying_cannot_fix_are_raised_at_once():
    stub = FakeDecode([([], rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: bad")), ([[1]], None)])
    d = decode_worker("d", stub)
    disp = dispatcher(registry([], [d]))
    with pytest.raises(DispatchError) as err:
        await collect(disp, request())
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids: bad" in err.value.message
    assert len(stub.requests) == 1 and not disp.counters and idle(d)


async def test_attempts_are_bounded_and_failures_open_the_circuit():
    unavailable = [([], rpc_error(grpc.StatusCode.UNAVAILABLE, f"down {i}")) for i in range(3)]
    stub = FakeDecode(list(unavailable))
    d = decode_worker("d", stub)
    disp = dispatcher(registry([], [d]), max_attempts=2)
    with pytest.raises(DispatchError) as err:
        await collect(disp, request())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and len(stub.requests) == 2
    assert not d.healthy and d.consecutive_failures == 2  # two in a row: out of rotation
    assert not disp.counters  # it was tried again, but never ran on: no retry counted
    with pytest.raises(DispatchError) as err:  # nothing healthy left: give up after worker_wait_s
        await collect(disp, request())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and "no healthy decode worker" in err.value.message
    assert len(stub.requests) == 2


async def test_a_request_waits_for_a_worker_that_comes_back():
    stub = FakeDecode([([[1]], None)])
    d = decode_worker("d", stub)
    d.healthy = False
    disp = dispatcher(registry([], [d]), worker_wait_s=30.0)

    async def recover():
        await asyncio.sleep(0.05)
        d.record_success()  # as the health monitor does when a probe succeeds again

    ids, _ = (await asyncio.gather(collect(disp, request(max_tokens=1)), recover()))[0]
    assert ids == [1]


async def test_a_ttft_budget_the_queue_cannot_meet_is_refused_before_any_worker_call():
    decode, prefill = FakeDecode([]), FakePrefill([])
    p, d = prefill_worker("p", prefill), decode_worker("d", decode)
    p.update_stats(pb.WorkerStats(address="p", block_size=16, queued_prefill_tokens=10_000, prefill_tokens_per_s=1_000))
    disp = dispatcher(registry([p], [d]))
    with pytest.raises(DispatchError) as err:
        await collect(disp, request(ttft_budget_ms=500))
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_ms > 0
    assert "ttft_budget_ms" in err.value.message and disp.counters["rejected_ttft_budget"] == 1
    assert not decode.requests and not prefill.requests and idle(p, d)


async def test_a_ttft_budget_counts_only_the_tokens_the_worker_would_compute():
    """A prompt whose prefix the prefill worker caches is that much shorter to prefill: the
    budget check counts its uncached tokens only (40 tokens at 100/s miss 250 ms; 8 meet it)."""
    decode, prefill = FakeDecode([([[8]], None)]), FakePrefill([7])
    p, d = prefill_worker("p", prefill), decode_worker("d", decode)
    p.update_stats(pb.WorkerStats(address="p", block_size=16, prefill_tokens_per_s=100))
    disp = dispatcher(registry([p], [d]))
    with pytest.raises(DispatchError) as err:
        await collect(disp, request(max_tokens=2, ttft_budget_ms=250))
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    cached = PromptBlocks(PROMPT).hashes(16)  # both full blocks: 8 of 40 tokens left to compute
    p.update_stats(pb.WorkerStats(address="p", block_size=16, prefill_tokens_per_s=100, cached_block_hashes=cached))
    assert await collect(disp, request(max_tokens=2, ttft_budget_ms=250)) == ([7, 8], "length")


async def test_the_deadline_bounds_every_attempt():
    unavailable = [([], rpc_error(grpc.StatusCode.UNAVAILABLE)) for _ in range(4)]
    d1, d2 = decode_worker("d1", FakeDecode(list(unavailable))), decode_worker("d2", FakeDecode(list(unavailable)))
    disp = dispatcher(registry([], [d1, d2]), max_attempts=4)
    started = time.monotonic()
    with pytest.raises(DispatchError):
        await collect(disp, request(), timeout_s=0.05)
    assert time.monotonic() - started < 30  # backs off no longer than the deadline allows (generous: loaded machines)
    assert len(d1.decode_stub.requests) + len(d2.decode_stub.requests) <= 2


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_a_decode_worker_that_stops_answering_is_left_once_its_health_checks_fail():
    paused = FakeDecode([([[1, 2]], HANG)])  # connection open, nothing more comes (SIGSTOP)
    healthy = FakeDecode([([[3, 4]], None)])
    d1, d2 = decode_worker("d1", paused), decode_worker("d2", healthy)
    disp = dispatcher(registry([], [d1, d2]))
    task = asyncio.create_task(collect(disp, request(max_tokens=4)))
    await until(lambda: d1.open_calls and not paused.calls[0].events)  # waiting on the paused worker
    assert d1.abandon_quiet_calls(quiet_s=60.0) == 0  # it only just heard from it: left alone
    d1.healthy = False  # what the health monitor does after failed probes, then:
    assert d1.abandon_quiet_calls(quiet_s=0.0) == 1
    assert await asyncio.wait_for(task, 5.0) == ([1, 2, 3, 4], "length")
    (resumed,) = healthy.requests
    assert list(resumed.token_ids) == PROMPT + [1, 2] and disp.counters["migrations"] == 1
    assert paused.calls[0].cancelled and not d1.open_calls and idle(d1, d2)


async def test_a_prefill_worker_that_stops_answering_is_left_and_the_prompt_prefilled_elsewhere():
    decode = FakeDecode([([], None), ([[8]], None)])
    paused, good = FakePrefill([HANG]), FakePrefill([7])
    p1, p2, d = prefill_worker("p1", paused), prefill_worker("p2", good), decode_worker("d", decode)
    disp = dispatcher(registry([p1, p2], [d]))
    task = asyncio.create_task(collect(disp, request(max_tokens=2)))
    await until(lambda: paused.calls)
    assert p1.open_calls and d.open_calls  # the attempt waits on both
    p1.healthy = False
    assert p1.abandon_quiet_calls(quiet_s=0.0) == 1
    assert await asyncio.wait_for(task, 5.0) == ([7, 8], "length")
    assert disp.counters["retries"] == 1 and paused.calls[0].cancelled and decode.calls[0].cancelled
    assert not p1.open_calls and not d.open_calls and idle(p1, p2, d)


async def test_a_client_cancel_while_waiting_on_a_worker_stays_a_cancel():
    d = decode_worker("d", FakeDecode([([[1]], HANG)]))
    task = asyncio.create_task(collect(dispatcher(registry([], [d])), request()))
    await until(lambda: d.open_calls)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not d.open_calls and idle(d)


async def test_a_planner_that_fails_never_fails_the_request():
    class BrokenWatch:
        def token(self, count, finish_reason, index=0):
            raise ZeroDivisionError("a profile that prices nothing")

    class BrokenPlanner:
        def __init__(self, watch_fails: bool) -> None:
            self.watch_fails = watch_fails

        def watch(self, req):
            if self.watch_fails:
                raise ZeroDivisionError("a profile that prices nothing")
            return BrokenWatch()

    for watch_fails in (True, False):
        d = decode_worker("d", FakeDecode([([[1, 2], [3]], None)]))
        disp = dispatcher(registry([], [d]))
        disp.observer = BrokenPlanner(watch_fails)
        assert await collect(disp, request(max_tokens=3)) == ([1, 2, 3], "length")


async def test_a_worker_gone_from_dns_keeps_its_channel_until_its_calls_end(monkeypatch):
    registry = WorkerRegistry.connect(prefill=[], decode=["dns:workers.test:50053"])
    loop = asyncio.get_running_loop()
    answers = {"workers.test": [(None, None, None, "", ("127.0.0.7", 50053))]}

    async def getaddrinfo(host, port, **kwargs):
        return answers[host]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    await registry.resolve()
    (worker,) = [w for w in registry.decode if w.address == "127.0.0.7:50053"]
    call = object()
    worker.open_calls.add(call)  # a stream still running on it

    answers["workers.test"] = []  # the pod is terminating: out of DNS
    await registry.resolve()
    assert worker not in registry.decode and registry.retired == [worker]
    assert worker.channel.get_state() is not grpc.ChannelConnectivity.SHUTDOWN  # not cut

    worker.open_calls.discard(call)
    await registry.resolve()
    assert registry.retired == [] and worker.channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN
    await registry.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION])
async def test_a_decode_worker_whose_kv_endpoint_fails_is_the_one_avoided(code):
    """The prefill worker could not reach (or handshake with) the decode worker's KV endpoint:
    the decode worker is blamed and skipped, the prefill worker is not."""
    bad, good = FakeDecode([([], None)]), FakeDecode([([[7, 8]], None)])
    p = FakePrefill([rpc_error(code, "cannot reach decode worker KV endpoint", decode_fault=True), 5])
    d1, d2, p1 = decode_worker("d1", bad), decode_worker("d2", good), prefill_worker("p1", p)
    disp = dispatcher(registry([p1], [d1, d2]))
    ids, finish = await collect(disp, request())
    assert (ids, finish) == ([5, 7, 8], "length")
    assert [len(stub.requests) for stub in (bad, good)] == [1, 1] and len(p.requests) == 2  # the same prefill worker
    assert p1.consecutive_failures == 0 and p1.healthy
    assert d1.consecutive_failures == 0  # skipped for this request; its own health checks judge it

    # With no other decode worker, the refusal itself reaches the client (not "no worker left").
    alone = dispatcher(registry([p1], [decode_worker("d3", FakeDecode([([], None)]))]))
    p.answers.append(rpc_error(code, "refused the KV handshake", decode_fault=True))
    with pytest.raises(DispatchError) as err:
        await collect(alone, request())
    assert err.value.code is code and "refused the KV handshake" in err.value.message


async def test_a_handoff_that_broke_after_the_kv_left_charges_neither_worker():
    """A decode worker killed mid-transfer: the prefill worker's call fails first, saying the
    handoff broke. Several such failures took the healthy prefill worker out of rotation; now
    neither is charged, the request moves to another decode worker, and alone it is tried again
    on the same pair (a lease that expired on a stalled transfer, a decode worker restarted)."""
    broken = rpc_error(grpc.StatusCode.UNAVAILABLE, "KV connection lost: Connection reset by peer", transfer_fault=True)
    p = FakePrefill([broken, 5, broken, 6])
    p1 = prefill_worker("p1", p)
    d1, d2 = decode_worker("d1", FakeDecode([([], None)])), decode_worker("d2", FakeDecode([([[7]], None)]))
    disp = dispatcher(registry([p1], [d1, d2]), failure_threshold=1)
    assert await collect(disp, request(max_tokens=2)) == ([5, 7], "length")
    assert len(d2.decode_stub.requests) == 1  # moved to the other decode worker
    assert (p1.consecutive_failures, d1.consecutive_failures) == (0, 0) and p1.healthy and d1.healthy

    d3 = decode_worker("d3", FakeDecode([([], None), ([[8]], None)]))
    alone = dispatcher(registry([p1], [d3]), failure_threshold=1)
    assert await collect(alone, request(max_tokens=2)) == ([6, 8], "length")
    assert p1.healthy and d3.healthy and alone.counters["retries"] == 1


async def test_a_pair_that_refuses_each_others_kv_handshake_is_kept_apart():
    """One prefill worker of two runs other weights than the only decode worker: every request
    still succeeds (on the other prefill worker), neither worker is blamed or left, the pair is
    not tried again, and alone the refusal names both workers."""
    refused = rpc_error(
        grpc.StatusCode.FAILED_PRECONDITION, "refused the KV handshake: model mismatch", pair_fault=True
    )
    odd, fine = FakePrefill([refused]), FakePrefill([5, 5, 5])
    p1, p2 = prefill_worker("p1", odd), prefill_worker("p2", fine)
    d1 = decode_worker("d1", FakeDecode([([], None)] + [([[7]], None)] * 3))
    disp = dispatcher(registry([p1, p2], [d1]))
    for _ in range(3):
        assert await collect(disp, request(max_tokens=2)) == ([5, 7], "length")
    assert len(odd.requests) == 1 and len(fine.requests) == 3  # tried once, then kept apart from d1
    assert p1.healthy and d1.healthy and p1.consecutive_failures == d1.consecutive_failures == 0

    alone = dispatcher(
        registry([prefill_worker("p3", FakePrefill([refused]))], [decode_worker("d3", FakeDecode([([], None)]))])
    )
    with pytest.raises(DispatchError) as err:
        await collect(alone, request())
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "prefill worker p3 and decode worker d3 cannot exchange K/V" in err.value.message


class MatchingPrefill:
    """A prefill worker that refuses every decode worker's KV handshake but one's."""

    def __init__(self, match: str) -> None:
        self.match, self.targets = match, []

    def Prefill(self, request: pb.PrefillRequest, timeout=None, metadata=()) -> FakeUnaryCall:
        self.targets.append(request.target.kv_address)
        if request.target.kv_address == self.match:
            return FakeUnaryCall([pb.PrefillResponse(first_token_id=5)])
        refused = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "model mismatch", pair_fault=True)
        return FakeUnaryCall([refused])


class NamedDecode(FakeDecode):
    """A decode worker whose reservations name its own KV address."""

    def __init__(self, name: str, n: int) -> None:
        super().__init__([([[7]], None)] * n)
        self.name = name

    def Decode(self, request, timeout=None, metadata=()):
        call = super().Decode(request, timeout, metadata)
        for event in call.events:
            if isinstance(event, pb.DecodeEvent) and event.HasField("reservation"):
                event.reservation.target.kv_address = self.name
        return call


async def test_a_refused_pair_sends_the_request_back_to_a_matching_pair_that_failed_it_once():
    """p2 fails the request once (a restart), p1 then refuses d1's handshake: the only matching
    pair is p2's, which this request saw fail. It is tried again rather than the request failed."""
    down = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")
    p1, p2 = prefill_worker("p1", MatchingPrefill("nowhere")), prefill_worker("p2", FakePrefill([down, 5]))
    d1 = decode_worker("d1", NamedDecode("d1", 3))
    disp = dispatcher(registry([p2, p1], [d1]))
    assert await collect(disp, request(max_tokens=2)) == ([5, 7], "length")
    assert p1.prefill_stub.targets == ["d1"] and len(p2.prefill_stub.requests) == 2


async def test_two_deployments_behind_one_router_each_request_finds_a_matching_pair():
    """(p1, d1) and (p2, d2) match, the cross pairs refuse each other: a refused pair rules out
    the pair, not its two workers, so no request fails while a matching pair is up."""
    p1, p2 = prefill_worker("p1", MatchingPrefill("d1")), prefill_worker("p2", MatchingPrefill("d2"))
    d1, d2 = decode_worker("d1", NamedDecode("d1", 20)), decode_worker("d2", NamedDecode("d2", 20))
    disp = dispatcher(registry([p2, p1], [d1, d2]))
    for _ in range(6):
        assert await collect(disp, request(max_tokens=2)) == ([5, 7], "length")
    refused = [t for p, stub in (("d1", p1.prefill_stub), ("d2", p2.prefill_stub)) for t in stub.targets if t != p]
    assert len(refused) <= 2  # each cross pair tried at most once, then kept apart


async def test_refused_pairs_do_not_use_up_the_requests_tries():
    """Two odd decode workers (other weights) beside one that matches: without migrations (one
    try), a request still reaches the matching pair after up to four refusals."""
    p1, p2 = prefill_worker("p1", MatchingPrefill("d3")), prefill_worker("p2", MatchingPrefill("d3"))
    decodes = [decode_worker(name, NamedDecode(name, 20)) for name in ("d1", "d2", "d3")]
    disp = dispatcher(registry([p1, p2], decodes), max_attempts=1)
    for _ in range(3):
        assert await collect(disp, request(max_tokens=2)) == ([5, 7], "length")
    refused = [t for stub in (p1.prefill_stub, p2.prefill_stub) for t in stub.targets if t != "d3"]
    assert len(refused) == 4  # each odd pair once, then kept apart


async def test_a_full_worker_sends_the_request_to_a_sibling_and_alone_it_answers_with_its_hint():
    full = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker queue is full (2 waiting)", retry_after_ms=1000)
    busy, idle_stub = FakeDecode([([], full)]), FakeDecode([([[1, 2]], None)])
    d1, d2 = decode_worker("d1", busy), decode_worker("d2", idle_stub)
    disp = dispatcher(registry([], [d1, d2]))
    assert await collect(disp, request(max_tokens=2)) == ([1, 2], "length")
    assert d1.healthy and d1.consecutive_failures == 0  # full is not broken
    assert idle(d1, d2)

    alone = dispatcher(registry([], [decode_worker("d3", FakeDecode([([], full)]))]))
    with pytest.raises(DispatchError) as err:
        await collect(alone, request())
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_ms == 1000


async def test_a_prefill_workers_own_trouble_reaching_a_decode_worker_is_its_own():
    """Out of file descriptors, no route out: not the decode worker's fault (no peer-fault
    trailer), so the request moves to another prefill worker, and the decode worker is kept."""
    own = rpc_error(
        grpc.StatusCode.UNAVAILABLE, "cannot reach decode worker KV endpoint kv:1: [Errno 24] Too many open files"
    )
    p1, p2 = prefill_worker("p1", FakePrefill([own])), prefill_worker("p2", FakePrefill([5]))
    d1 = decode_worker("d1", FakeDecode([([], None), ([[7]], None)]))
    assert await collect(dispatcher(registry([p1, p2], [d1])), request(max_tokens=2)) == ([5, 7], "length")
    assert p1.consecutive_failures == 1 and d1.consecutive_failures == 0


async def test_a_message_too_large_for_grpc_is_not_sent_to_every_sibling():
    too_big = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max")  # no retry hint
    first, second = FakeDecode([([], too_big)]), FakeDecode([([[1]], None)])
    disp = dispatcher(registry([], [decode_worker("d1", first), decode_worker("d2", second)]))
    with pytest.raises(DispatchError) as err:
        await collect(disp, request())
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not second.requests


def test_the_prefill_worker_blames_the_decode_worker_only_for_what_is_on_its_side():
    import errno
    import socket

    from pdserve.kvtransfer.handshake import HandshakeError
    from pdserve.prefill_worker.servicer import decode_side

    assert decode_side(HandshakeError("decode worker refused the KV handshake: dtype"))
    assert decode_side(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert decode_side(ConnectionError("KV handshake with kv:1 broke off: no answer in time"))
    assert decode_side(TimeoutError("timed out"))
    assert decode_side(OSError(errno.EHOSTUNREACH, "No route to host"))  # its host is gone
    assert decode_side(socket.gaierror(-2, "Name or service not known"))  # its advertised name
    assert not decode_side(OSError(errno.EMFILE, "Too many open files"))
    assert not decode_side(OSError(errno.ENETUNREACH, "Network is unreachable"))


def test_a_cluster_mismatch_is_a_503_over_http_not_the_clients_fault():
    """FAILED_PRECONDITION comes from two workers refusing each other's KV handshake: a 400
    (invalid_request_error) told the client its request was wrong and not to retry it."""
    from pdserve.router.openai_protocol import APIError

    refused = DispatchError(grpc.StatusCode.FAILED_PRECONDITION, "prefill worker p and decode worker d cannot ...")
    api = APIError.from_dispatch(refused)
    assert api.status == 503 and api.body()["error"]["type"] == "service_unavailable_error"


async def test_a_worker_of_the_other_role_is_named_and_the_request_goes_elsewhere():
    """Asked before its health checks showed it serves another role, a worker answers
    UNIMPLEMENTED ('Method not found!'): a misconfigured worker, not a call the client made wrong."""
    wrong_role = rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    p1, p2 = prefill_worker("p1", FakePrefill([wrong_role])), prefill_worker("p2", FakePrefill([5]))
    d1 = decode_worker("d1", FakeDecode([([], None), ([[7]], None)]))
    assert await collect(dispatcher(registry([p1, p2], [d1])), request(max_tokens=2)) == ([5, 7], "length")
    assert p1.consecutive_failures == 1 and "a worker of the other role?" in p1.last_error

    alone = prefill_worker("p3", FakePrefill([wrong_role] * 4))
    disp = dispatcher(registry([alone], [decode_worker("d2", FakeDecode([([], None)] * 4))]))
    with pytest.raises(DispatchError) as err:
        await collect(disp, request())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and "a worker of the other role?" in err.value.message


class ChoiceByChoiceDispatcher:
    """Streams each one-choice continuation (told apart by its seed) a token every 10 ms."""

    def __init__(self) -> None:
        self.closed_after: dict[int, int] = {}  # seed -> tokens sent when its stream closed

    async def generate(self, req, timeout_s, prior=None, ends=None):
        sent = 0
        try:
            for k in range(10):
                await asyncio.sleep(0.01)
                sent += 1
                yield TokenEvent([k], "length" if k == 9 else None)
        finally:
            self.closed_after[req.sampling.seed] = sent


async def test_a_continued_choice_the_router_ends_is_closed_while_the_others_go_on():
    req = ValidatedRequest("client-id", list(PROMPT), SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3))
    dispatcher, ends = ChoiceByChoiceDispatcher(), ChoiceEnds()
    got: dict[int, list[int]] = {}
    stream = continue_choices(dispatcher, req, {}, ended={2}, deadline=time.monotonic() + 30, ends=ends)
    async for event in stream:
        got.setdefault(event.index, []).extend(event.token_ids)
        if event.index == 1 and len(got[1]) == 2:
            ends.end(1)  # a stop string in choice 1
    assert got[0] == list(range(10)) and 2 not in got
    seeds = {choice_seed(3, i): i for i in range(3)}
    closed = {seeds[seed]: sent for seed, sent in dispatcher.closed_after.items()}
    assert closed[0] == 10 and closed[1] < 10
