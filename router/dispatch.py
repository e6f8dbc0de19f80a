"""Drives one request through the workers and yields its tokens.

Disaggregated: open the decode stream (the decode worker reserves blocks and answers with
where the KV must go), run the prefill on a prefill worker (which ships the KV there and
returns the first token), then relay the decode stream. Colocated: one decode worker does
both. Closing the generator cancels whatever RPC is in flight, so the workers free the
request's blocks on client cancel, deadline or stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from pdserve.router.policy import NoWorkerAvailable, RoutingPolicy
from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import Worker, WorkerRegistry
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.wire import sampling_to_proto


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0


class DispatchError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _worker_error(worker: Worker, error: grpc.aio.AioRpcError) -> DispatchError:
    code = error.code()
    if code is grpc.StatusCode.CANCELLED:
        return DispatchError(code, "request cancelled")
    return DispatchError(code, f"{worker.role.value} worker {worker.address}: {error.details()}")


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy) -> None:
        self.registry = registry
        self.policy = policy

    async def generate(self, req: ValidatedRequest, timeout_s: float) -> AsyncIterator[TokenEvent]:
        deadline = time.monotonic() + timeout_s
        try:
            decode = self.policy.pick_decode(req, self.registry.decode)
            prefill = self.policy.pick_prefill(req, self.registry.prefill) if self.registry.disaggregated else None
        except NoWorkerAvailable as e:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        stream = self._disaggregated(req, prefill, decode, deadline) if prefill else self._colocated(req, decode, deadline)
        async for event in stream:
            yield event

    async def _colocated(self, req: ValidatedRequest, decode: Worker, deadline: float) -> AsyncIterator[TokenEvent]:
        call = decode.decode_stub.Decode(_decode_request(req, prefill_locally=True), timeout=_left(deadline))
        decode.inflight += 1
        try:
            async for event in call:
                yield TokenEvent(list(event.tokens.token_ids), event.tokens.finish_reason or None, event.tokens.num_cached_tokens)
        except grpc.aio.AioRpcError as e:
            raise _worker_error(decode, e) from None
        finally:
            call.cancel()
            decode.inflight -= 1

    async def _disaggregated(
        self, req: ValidatedRequest, prefill: Worker, decode: Worker, deadline: float
    ) -> AsyncIterator[TokenEvent]:
        call = decode.decode_stub.Decode(_decode_request(req, prefill_locally=False), timeout=_left(deadline))
        decode.inflight += 1
        try:
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                raise _worker_error(decode, e) from None
            if first is grpc.aio.EOF or not first.HasField("reservation"):
                raise DispatchError(grpc.StatusCode.INTERNAL, f"decode worker {decode.address} sent no reservation")

            prefill.inflight += 1
            try:
                response = await prefill.prefill_stub.Prefill(
                    pb.PrefillRequest(
                        request_id=req.request_id, token_ids=req.prompt_token_ids,
                        sampling=sampling_to_proto(req.sampling), priority=req.priority,
                        target=first.reservation.target,
                    ),
                    timeout=_left(deadline),
                )
            except grpc.aio.AioRpcError as e:
                raise _worker_error(prefill, e) from None
            finally:
                prefill.inflight -= 1
            yield TokenEvent([response.first_token_id], response.finish_reason or None, response.num_cached_tokens)
            if response.finish_reason:
                return
            try:
                while (event := await call.read()) is not grpc.aio.EOF:
                    yield TokenEvent(list(event.tokens.token_ids), event.tokens.finish_reason or None)
            except grpc.aio.AioRpcError as e:
                raise _worker_error(decode, e) from None
        finally:
            call.cancel()
            decode.inflight -= 1


def _decode_request(req: ValidatedRequest, prefill_locally: bool) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=req.request_id, token_ids=req.prompt_token_ids, sampling=sampling_to_proto(req.sampling),
        priority=req.priority, prefill_locally=prefill_locally,
    )


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())
