"""The public Router service: validate, dispatch, detokenize, stream."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import AsyncIterator

import grpc

from pdserve.router.dispatch import DispatchError, Dispatcher
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import InvalidRequest, validate
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)


class RouterService(pdserve_pb2_grpc.RouterServicer):
    def __init__(self, tokenizer: RouterTokenizer, dispatcher: Dispatcher, request_timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.request_timeout_s = request_timeout_s
        self.counters: Counter[str] = Counter()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        started = time.perf_counter()
        try:
            req = validate(request, self.tokenizer)
        except InvalidRequest as e:
            self.counters["rejected_invalid"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        remaining = context.time_remaining()
        timeout = min(remaining, self.request_timeout_s) if remaining is not None else self.request_timeout_s

        text = self.tokenizer.text_stream(req.sampling.stop)
        completion_tokens = 0
        ttft_ms = None
        cached = 0
        events = self.dispatcher.generate(req, timeout)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if ttft_ms is None:
                        ttft_ms = (time.perf_counter() - started) * 1e3
                        cached = event.cached_tokens
                    completion_tokens += len(event.token_ids)
                    delta = text.push(event.token_ids)
                    finish = "stop" if text.stopped else event.finish_reason
                    if finish is None:
                        yield pb.GenerateResponse(request_id=req.request_id, token_ids=event.token_ids, text=delta)
                        continue
                    self.counters[f"finished_{finish}"] += 1
                    usage = pb.Usage(
                        prompt_tokens=len(req.prompt_token_ids), completion_tokens=completion_tokens,
                        cached_prompt_tokens=cached, ttft_ms=ttft_ms, e2e_ms=(time.perf_counter() - started) * 1e3,
                    )
                    yield pb.GenerateResponse(
                        request_id=req.request_id, token_ids=event.token_ids, text=delta + text.flush(),
                        finish_reason=finish, usage=usage,
                    )
                    return
        except DispatchError as e:
            self.counters[f"failed_{e.code.name.lower()}"] += 1
            await context.abort(e.code, e.message)
        await context.abort(grpc.StatusCode.INTERNAL, "the worker stream ended without a finish reason")

    async def GetClusterStats(self, request: pb.ClusterStatsRequest, context: grpc.aio.ServicerContext) -> pb.ClusterStats:
        counters = {**self.counters, **self.dispatcher.counters}
        stats = pb.ClusterStats(counters={k: float(v) for k, v in counters.items()})
        for worker in self.dispatcher.registry.all():
            try:
                stub = worker.prefill_stub or worker.decode_stub
                ws = await stub.GetStats(pb.StatsRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                ws = pb.WorkerStats(address=worker.address, role=worker.role.value, healthy=False)
            stats.workers.append(ws)
        return stats
