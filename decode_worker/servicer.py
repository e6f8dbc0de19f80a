"""The decode worker's gRPC service: reserve blocks, await the KV, decode in the batch."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from pdserve.engine.engine_loop import EngineError, EngineLoop
from pdserve.grpc_server import abort_overloaded
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import FinishReason
from pdserve.kvtransfer.protocol import AckStatus
from pdserve.kvtransfer.receiver import KVReceiver, TransferFailed
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc
from pdserve.wire import sampling_from_proto, transfer_key, worker_stats

log = logging.getLogger(__name__)


def token_event(token_ids: list[int], finish: FinishReason | None, cached: int = 0) -> pb.DecodeEvent:
    return pb.DecodeEvent(tokens=pb.TokenBatch(token_ids=token_ids, finish_reason=finish.value if finish else "", num_cached_tokens=cached))


class DecodeService(pdserve_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, loop: EngineLoop, receiver: KVReceiver, kv_address: str, role: str, address: str,
                 max_queued_requests: int = 256) -> None:
        self.loop = loop
        self.engine: LLMEngine = loop.engine
        self.receiver = receiver
        self.kv_address = kv_address
        self.role = role
        self.address = address
        self.max_queued_requests = max_queued_requests
        self.waiting_reservations = 0  # disaggregated requests waiting for free KV blocks
        self.queued = 0  # colocated requests accepted but not yet started

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeEvent]:
        rid = request.request_id
        token_ids = [int(t) for t in request.token_ids]
        try:
            sampling = sampling_from_proto(request.sampling)
            self.engine.validate(token_ids, sampling, request.num_prior_output_tokens)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prior = request.num_prior_output_tokens
        budget_s = request.ttft_budget_ms / 1e3 if request.ttft_budget_ms > 0 else None

        if request.prefill_locally:
            if self.queued >= self.max_queued_requests:
                await abort_overloaded(context, f"{self.role} worker queue is full ({self.max_queued_requests} waiting)")
            start = lambda e: e.add_request(  # noqa: E731
                rid, token_ids, sampling, priority=request.priority, num_prior_output_tokens=prior, ttft_budget_s=budget_s)
        else:
            wait_s = min(budget_s or self.receiver.lease_s, context.time_remaining() or self.receiver.lease_s)
            block_ids, cached = await self._reserve(token_ids, context, wait_s)
            grant = self.receiver.grant(block_ids, len(token_ids), skip_tokens=cached)
            try:
                yield pb.DecodeEvent(reservation=pb.Reservation(target=pb.KvTarget(
                    transfer_id=transfer_key(grant.transfer_id), kv_address=self.kv_address, block_ids=block_ids,
                    block_size=self.engine.config.block_size, num_tokens=len(token_ids), skip_tokens=cached,
                )))
                result = await self.receiver.wait(grant)
            except TransferFailed as e:
                code = grpc.StatusCode.DATA_LOSS if e.status is AckStatus.CHECKSUM_MISMATCH else grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"KV transfer failed: {e}")
            finally:
                self.receiver.fail(grant, "request ended before its KV cache arrived")  # no-op once complete
            blocks = self.receiver.take(grant)
            first = result.first_token_id
            start = lambda e: e.add_prefilled(  # noqa: E731
                rid, token_ids + [first], len(token_ids), sampling, blocks, priority=request.priority,
                num_prior_output_tokens=prior, num_cached_tokens=cached)

        waiting = request.prefill_locally  # counts against the queue bound until its first token
        self.queued += waiting
        try:
            async for out in self.loop.generate(rid, start):
                if waiting:
                    self.queued, waiting = self.queued - 1, False
                if out.finish_reason is FinishReason.REJECTED:
                    await abort_overloaded(context, "request could not start within its ttft_budget_ms")
                yield token_event(out.new_token_ids, out.finish_reason, out.num_cached_tokens)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except MemoryError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker is out of KV blocks")
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            self.queued -= waiting

    async def _reserve(self, token_ids: list[int], context: grpc.aio.ServicerContext, wait_s: float) -> tuple[list[int], int]:
        """Admission control lives here: the decode worker knows its own free blocks. A request
        waits (in a bounded queue) up to ``wait_s`` for blocks to free up. The reservation
        includes room for the first generated token, so admitting the request into the batch
        once its KV has landed cannot fail for lack of blocks."""
        if self.waiting_reservations >= self.max_queued_requests:
            await abort_overloaded(context, f"decode worker queue is full ({self.max_queued_requests} waiting for KV blocks)")
        self.waiting_reservations += 1
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    return self.engine.reserve_blocks(token_ids, len(token_ids) + 1)
                except MemoryError:
                    if time.monotonic() >= deadline:
                        await abort_overloaded(
                            context, f"decode worker has no room for {len(token_ids)} tokens of KV cache; retry later")
                    await asyncio.sleep(0.02)
        finally:
            self.waiting_reservations -= 1

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.WorkerStats:
        stats = worker_stats(self.engine.stats(with_digest=True), self.role, self.address, self.receiver.num_active,
                             self.receiver.counters, self.engine.config.block_size, self.engine.config.max_num_seqs)
        stats.waiting = max(stats.waiting, self.queued) + self.waiting_reservations
        return stats
