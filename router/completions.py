"""One completion from a validated request to streamed chunks of text: the part of the
router that every front end (gRPC, the OpenAI-compatible HTTP API) shares."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from pdserve import metrics
from pdserve.request_rules import check_message_count, check_prompt_length
from pdserve.router.choice_ends import ChoiceEnds
from pdserve.router.dispatch import Dispatcher
from pdserve.router.request import CompletionRequest
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import InvalidRequest, ValidatedRequest, validate
from pdserve.router.worker_errors import DispatchError
from pdserve.v1 import pdserve_pb2 as pb

log = logging.getLogger(__name__)

VALIDATION_THREADS = 4  # requests tokenized at once, off the event loop
# The workers' calls outlive a client's own deadline by this much, so the client's deadline
# always ends the request at the router first (the client left): a worker's DEADLINE_EXCEEDED
# arriving at the same instant would race gRPC's cancellation of the handler.
CLIENT_DEADLINE_GRACE_S = 0.25


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    ttft_ms: float
    e2e_ms: float
    migrations: int = 0  # times the request moved to another worker mid-stream

    def to_proto(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            ttft_ms=self.ttft_ms,
            e2e_ms=self.e2e_ms,
            migrations=self.migrations,
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on each choice's last chunk: stop, length
    usage: Usage | None = None  # set on the completion's last chunk
    index: int = 0  # which choice (n > 1); the choices' chunks interleave
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: list[pb.TokenLogprob] | None = None  # on a choice's first chunk, when asked for


class Completions:
    def __init__(
        self, tokenizer: RouterTokenizer, dispatcher: Dispatcher, request_timeout_s: float, max_inflight: int
    ) -> None:
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.request_timeout_s = request_timeout_s
        self.max_inflight = max_inflight
        self.inflight = 0
        self.counters: Counter[str] = Counter()
        # Validation tokenizes, which takes seconds for a huge prompt: it runs on these threads,
        # never on the event loop that serves every other stream.
        self._validators = ThreadPoolExecutor(VALIDATION_THREADS, thread_name_prefix="validate")

    async def validate(self, request: CompletionRequest) -> ValidatedRequest:
        """Raises InvalidRequest naming the field."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._validators, validate, request, self.tokenizer)
        except InvalidRequest:
            self.count_invalid()
            raise

    def check_sizes(self, prompt_token_count: int, message_count: int) -> None:
        """What validation refuses by size alone, judged before a huge request is copied or
        walked on the event loop (millions of ids would stall every other stream for seconds)."""
        try:
            if prompt_token_count:
                check_prompt_length(prompt_token_count, max_model_len=self.tokenizer.max_model_len)
            check_message_count(message_count)
        except InvalidRequest:
            self.count_invalid()
            raise

    def count_invalid(self, reason: str = "invalid_argument") -> None:
        """A request refused for what it asked (here, or by a front end while parsing it)."""
        self.counters["rejected_invalid"] += 1
        metrics.REJECTIONS.labels(reason).inc()

    def close(self) -> None:
        self._validators.shutdown(wait=False, cancel_futures=True)

    def timeout(self, client_remaining_s: float | None) -> float:
        """How long the workers' calls may take: the router's limit, or just past the client's deadline."""
        if client_remaining_s is None:
            return self.request_timeout_s
        return min(client_remaining_s + CLIENT_DEADLINE_GRACE_S, self.request_timeout_s)

    async def stream(self, req: ValidatedRequest, timeout_s: float, prompt_only: bool = False) -> AsyncIterator[Chunk]:
        """Streams the completion; raises DispatchError when the workers cannot serve it.
        ``prompt_only``: the client gets the prompt's scoring alone (echo with max_tokens 0), not
        the token drawn for it, which is then not counted as generated."""
        if self.inflight >= self.max_inflight:
            self.counters["rejected_overloaded"] += 1
            metrics.REJECTIONS.labels("overloaded").inc()
            raise DispatchError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router is serving its limit of {self.max_inflight} requests; retry later",
                retry_after_ms=500,
            )
        async with contextlib.aclosing(self._stream(req, timeout_s)) as chunks:  # closed at once: cancels the RPCs
            if req.engine_sampling.n > req.sampling.n:  # best_of: the most likely choices, once all are done
                from pdserve.router.best_of import best_of  # it builds this module's Chunks

                chunks = best_of(chunks, req.sampling.n, req.sampling.logprobs is not None)
            async for chunk in chunks:
                if not prompt_only:  # what the client gets (best_of's discarded choices are not)
                    metrics.GENERATION_TOKENS.inc(len(chunk.token_ids))
                yield chunk

    async def _stream(self, req: ValidatedRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        n = req.engine_sampling.n
        last: list[float | None] = [None] * n  # each choice's latest message: its own inter-token gaps
        texts = [
            self.tokenizer.text_stream(req.sampling.stop, req.prompt_token_ids) for _ in range(n)
        ]  # each choice detokenized on its own
        done = [False] * n
        prompt_logprobs = req.sampling.prompt_logprobs is not None  # due with choice 0's first chunk
        completion_tokens, cached, ttft_ms = 0, 0, None
        ends = ChoiceEnds() if n > 1 else None  # n = 1: a stop string closes the call, which aborts it
        events = self.dispatcher.generate(req, timeout_s, ends=ends)
        metrics.INFLIGHT.inc()
        self.inflight += 1
        ended = False  # finished or failed: anything else that stops it is the client leaving
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    now = time.perf_counter()
                    if ttft_ms is None:
                        ttft_ms = (now - started) * 1e3
                        cached = event.cached_tokens
                        metrics.TTFT.observe(now - started)
                        metrics.PROMPT_TOKENS.inc(len(req.prompt_token_ids))
                    i = event.index
                    if not 0 <= i < n or done[i]:  # a choice stopped here by a stop string runs on until all are done
                        continue
                    if last[i] is not None:  # n > 1: choices' messages interleave; each is timed on its own
                        metrics.ITL.observe(now - last[i])
                    last[i] = now
                    text = texts[i]
                    # A stop token ends the choice but not its text (as vLLM; EOS, special, shows nothing).
                    stop_token = int(
                        event.finish_reason == "stop"
                        and bool(event.token_ids)
                        and event.token_ids[-1] in req.sampling.stop_token_ids
                    )
                    delta = text.push(event.token_ids[: len(event.token_ids) - stop_token])
                    if text.stopped or event.finish_reason is not None:
                        delta += text.flush()  # may find a stop string in what the decoder held
                    # None past the token that completes a stop string.
                    kept = text.consumed if text.stopped else len(event.token_ids)
                    token_ids, logprobs = event.token_ids[:kept], event.logprobs[:kept]
                    completion_tokens += len(token_ids)
                    finish = "stop" if text.stopped else event.finish_reason
                    first_logprobs = None
                    if prompt_logprobs and i == 0:
                        first_logprobs, prompt_logprobs = event.prompt_logprobs or [], False
                    if finish is None:
                        yield Chunk(token_ids, delta, index=i, logprobs=logprobs, prompt_logprobs=first_logprobs)
                        continue
                    done[i] = True
                    if event.finish_reason is None and ends is not None and not all(done):
                        ends.end(i)  # a stop string: the worker goes on with it unless told
                    usage = None
                    if all(done):
                        ended = True
                        self.counters[f"finished_{finish}"] += 1
                        metrics.REQUESTS.labels(finish).inc()
                        metrics.E2E.observe(now - started)
                        usage = Usage(
                            len(req.prompt_token_ids),
                            completion_tokens,
                            cached,
                            ttft_ms,
                            (now - started) * 1e3,
                            event.migrations,
                        )
                        log.debug("request %s finished (%s): %s", req.request_id, finish, usage)
                    yield Chunk(
                        token_ids,
                        delta,
                        finish,
                        usage,
                        index=i,
                        logprobs=logprobs,
                        prompt_logprobs=first_logprobs,
                    )
                    if usage is not None:
                        return
        except DispatchError as e:
            ended = True
            self.counters[f"failed_{e.code.name.lower()}"] += 1
            metrics.REJECTIONS.labels(e.code.name.lower()).inc()
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if not ended:  # the client went away (a disconnect, its deadline) before the end
                log.debug("request %s cancelled: the client went away", req.request_id)
                self.counters["cancelled"] += 1
                metrics.REQUESTS.labels("cancelled").inc()
            raise
        finally:
            metrics.INFLIGHT.dec()
            self.inflight -= 1
        raise DispatchError(grpc.StatusCode.INTERNAL, "the worker stream ended without a finish reason")
