"""Runs an ``LLMEngine`` on its own thread and serves it to asyncio code.

The engine thread is the only one that touches engine state. It loops: apply queued commands
(add, abort, anything else), run one step, hand each request's outputs to its asyncio queue,
publish a stats snapshot. With nothing to compute it sleeps until a command arrives, a KV
transfer reports its outcome (the connector wakes it), or the next deadline. A request's
stream ends with its last output; a consumer that goes away (client cancel, deadline) aborts
the request, freeing its blocks.

Workers build their engine on the engine thread itself (``EngineLoop.build``): on CPU every
thread that runs torch's parallel regions keeps an OpenMP pool of its own, and once a process
holds more pool threads than cores, libgomp stops spinning between regions, so each of a decode
step's few hundred regions waits for a futex wake-up (a batch-1 step on two threads measured
14.4 ms when built on another thread, 5.7 ms built on the one that steps it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import AsyncIterator, Callable, TypeVar

from pdserve.engine.engine_stats import EngineStats
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5  # longest sleep with nothing to do (nothing is missed: every event wakes the thread)
STATS_EVERY_S = 0.05  # how often a busy engine publishes its stats (the digest costs a pass over the cache)


class EngineError(RuntimeError):
    """The engine failed while running a request."""


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stats = engine.stats(with_digest=True)
        self._stats_at = time.monotonic()
        engine.connector.wake = self._wakeup.set
        engine.connector.deliver_early = self._deliver_soon
        self.steps = 0

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    async def build(cls, make: Callable[[], LLMEngine]) -> EngineLoop:
        """Runs ``make()`` on a new engine thread, then steps that engine on the same thread.
        ``make``'s errors (a bad model path, too little memory) are raised here."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future = loop.create_future()

        def build_then_run() -> None:
            try:
                engine_loop = cls(make())
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller, never a hang
                loop.call_soon_threadsafe(_settle, built, None, e)
                return
            engine_loop._loop, engine_loop._thread = loop, threading.current_thread()
            loop.call_soon_threadsafe(_settle, built, engine_loop, None)
            engine_loop._run()

        threading.Thread(target=build_then_run, name="engine", daemon=True).start()
        return await built

    def start(self) -> None:
        """Steps an engine built on another thread (tests, scripted engines) on a new thread."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # -- any thread ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The engine's stats as of its last iteration (prefix-cache digest included)."""
        return self._stats

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future:
        """Runs ``fn(engine)`` on the engine thread between steps; await the result."""
        future = self._loop.create_future()
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    def abort(self, request_id: str) -> None:
        self._commands.put((lambda e: e.abort(request_id), None))
        self._wakeup.set()

    def end_choices(self, request_id: str, indices: list[int]) -> asyncio.Future:
        """n > 1: ends some of a request's choices (``LLMEngine.end_choices``), their last
        outputs delivered in order with the engine's; resolves to how many still generated."""

        def end(engine: LLMEngine) -> int:
            outputs = engine.end_choices(request_id, indices)
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            return len(outputs)

        return self.call(end)

    # -- streams ------------------------------------------------------------------------------
    async def generate(self, request_id: str, start: Callable[[LLMEngine], object]) -> AsyncIterator[RequestOutput]:
        """Runs ``start(engine)`` (which adds the request) and yields its outputs until the last.

        ``start``'s errors (ValueError for bad input) propagate here, as does an output's
        ``error`` (``RequestRejected``, ``TransferFailed``) and ``EngineError``. If the consumer
        stops early, the request is aborted, also when its ``start`` is still queued: the abort
        then follows it on the engine thread, and only if this ``start`` added the request (a
        failed one may have met another request's id).
        """
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = _Stream()
        self._streams[request_id] = stream
        started = finished = False
        added = False  # written and read on the engine thread only
        pending = None  # an output taken off the queue while coalescing, not yet handed out

        def add(engine: LLMEngine) -> object:
            nonlocal added
            result = start(engine)
            added = True
            return result

        try:
            await self.call(add)
            started = True
            while True:
                item = pending if pending is not None else await stream.get()
                pending = None
                if isinstance(item, Exception):
                    finished = True
                    raise item
                # Tokens that piled up while the consumer was busy go out as one output, so a
                # slow stream catches up in one message instead of one per step.
                while _tokens_only(item) and not item.finished and not stream.empty():
                    following = stream.get_nowait()
                    if isinstance(following, RequestOutput) and _mergeable(item, following):
                        item = _merged(item, following)
                    else:
                        pending = following
                        break
                finished = item.finished
                if item.error is not None:
                    raise item.error
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if started and not finished:
                self.abort(request_id)
            elif not started:  # cancelled while ``start`` waited its turn, or ``start`` failed
                self._commands.put((lambda e: added and e.abort(request_id), None))
                self._wakeup.set()

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wakeup.clear()  # before looking for work: a wake-up from now on is not lost
            self._apply_commands()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - keep the worker alive, fail the batch
                log.exception("engine step failed; failing every running request")
                self._fail_all(EngineError(f"engine step failed: {e}"))
                continue
            self.steps += 1
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            idle = not outputs and not self.engine.scheduler.running
            if idle or time.monotonic() - self._stats_at >= STATS_EVERY_S:
                self._stats, self._stats_at = self.engine.stats(with_digest=True), time.monotonic()
            if idle:
                self._wakeup.wait(self._idle_wait())

    def _idle_wait(self) -> float:
        deadline = self.engine.next_deadline()
        if deadline is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.0, deadline - time.monotonic()) + 0.001)

    def _apply_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                result, error = None, e
            if future is not None:
                self._loop.call_soon_threadsafe(_settle, future, result, error)
            elif error is not None:
                log.warning("engine command failed: %s", error)

    def _deliver_soon(self, out: RequestOutput) -> None:
        """Hands a request's last output to its stream from any thread, after whatever the
        engine delivered before it. The engine's own copy follows at its next step: dropped if
        the stream has ended, else queued behind this one, where nobody reads it."""
        self._loop.call_soon_threadsafe(self._deliver_early, out)

    def _deliver_early(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if stream.delivered:
            stream.put_nowait(out)
        else:  # reported before the step that sampled the first token handed it over
            stream.held = out

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                stream.delivered = True
                if stream.held is not None:
                    stream.put_nowait(stream.held)
                    stream.held = None
            elif not out.finished:
                self.abort(out.request_id)  # nobody is waiting for it any more

    def _fail_all(self, error: Exception) -> None:
        ids = list(self.engine.requests)
        for rid in ids:
            self.engine.abort(rid)

        def notify() -> None:
            for rid in ids:
                if rid in self._streams:
                    self._streams[rid].put_nowait(error)

        self._loop.call_soon_threadsafe(notify)


def _tokens_only(out: RequestOutput) -> bool:
    return out.kv is None and out.error is None and out.first_tokens is None


def _mergeable(first: RequestOutput, then: RequestOutput) -> bool:
    """Consecutive token outputs of one choice (not past its finish), with logprobs on both or neither."""
    return (
        _tokens_only(then)
        and then.index == first.index
        and first.finish_reason is None
        and then.prompt_logprobs is None
        and (first.logprobs is None) == (then.logprobs is None)
    )


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    return replace(
        first,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        finish_reason=then.finish_reason,
        finished=then.finished,
        logprobs=first.logprobs + then.logprobs if first.logprobs is not None else None,
    )


class _Stream(asyncio.Queue):
    """One request's outputs, on their way from the engine thread to its consumer."""

    def __init__(self) -> None:
        super().__init__()
        self.delivered = False  # the engine has handed over an output
        self.held: RequestOutput | None = None  # a last output that came before the others


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
