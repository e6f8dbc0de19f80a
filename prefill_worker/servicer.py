"""The prefill worker's gRPC service: prefill a prompt, ship its KV, return the first token."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

import grpc

from pdserve import metrics
from pdserve.engine.engine_loop import EngineError, EngineLoop
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.grpc_server import abort_overloaded
from pdserve.kvtransfer.peer import HandshakeError
from pdserve.kvtransfer.protocol import AckStatus
from pdserve.kvtransfer.sender import KVConnections
from pdserve.prefill_worker.kv_shipper import KVShipper
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc
from pdserve.wire import parse_transfer_key, sampling_from_proto, worker_stats

log = logging.getLogger(__name__)


class PrefillService(pdserve_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, loop: EngineLoop, connections: KVConnections, shipper: KVShipper, address: str = "",
                 ack_timeout_s: float = 30.0, max_queued_requests: int = 256) -> None:
        self.max_queued_requests = max_queued_requests
        self.queued = 0  # requests accepted and not yet answered
        self.loop = loop
        self.ack_timeout_s = ack_timeout_s  # the decode side's lease: past it our copy is useless
        self.engine: LLMEngine = loop.engine
        self.connections = connections
        self.shipper = shipper
        self.address = address
        self.counters: Counter[str] = Counter()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        rid = request.request_id
        token_ids = [int(t) for t in request.token_ids]
        target = request.target
        try:
            sampling = sampling_from_proto(request.sampling)
            self.engine.validate(token_ids, sampling, request.num_prior_output_tokens)
            transfer_id = parse_transfer_key(target.transfer_id)
            if target.num_tokens != len(token_ids):
                raise ValueError(f"target.num_tokens: {target.num_tokens} does not match the {len(token_ids)} prompt tokens")
            if not 0 <= target.skip_tokens <= target.num_tokens:
                raise ValueError(f"target.skip_tokens: {target.skip_tokens} is outside [0, {target.num_tokens}]")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.queued >= self.max_queued_requests:
            await abort_overloaded(context, f"prefill worker queue is full ({self.max_queued_requests} waiting)")
        self.queued += 1
        try:
            return await self._serve(request, context, rid, token_ids, sampling, target, transfer_id)
        finally:
            self.queued -= 1

    async def _serve(self, request, context, rid, token_ids, sampling, target, transfer_id) -> pb.PrefillResponse:
        try:
            conn = await asyncio.to_thread(self.connections.get, target.kv_address)
        except HandshakeError as e:
            log.warning("request %s: %s", rid, e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (OSError, ValueError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach decode worker KV endpoint {target.kv_address}: {e}")

        started = time.perf_counter()
        transfer = conn.open(transfer_id, list(target.block_ids), target.block_size or self.engine.config.block_size,
                             len(token_ids), skip_tokens=target.skip_tokens)
        self.shipper.transfers[rid] = transfer
        acked = False
        try:
            first = await self._prefill(rid, token_ids, sampling, request, context)
            prefill_ms = (time.perf_counter() - started) * 1e3
            if first.finish_reason is FinishReason.REJECTED:
                await abort_overloaded(context, "prefill could not start within its ttft_budget_ms")
            if first.finish_reason is not FinishReason.PREFILLED:
                # The first token already ends the request: the decode worker is not needed.
                return pb.PrefillResponse(first_token_id=first.new_token_ids[0], finish_reason=first.finish_reason.value,
                                          num_cached_tokens=first.num_cached_tokens, prefill_ms=prefill_ms)
            if not self.shipper.pipelined:
                await self.loop.call(lambda e: self._ship_all(e, rid, transfer))
            ack = await asyncio.wait_for(asyncio.wrap_future(transfer.finish(first.new_token_ids[0])), self.ack_timeout_s)
            acked = True
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker did not acknowledge the KV transfer in time")
        except (ConnectionError, ValueError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        finally:
            if not acked:
                transfer.cancel()
            self.shipper.transfers.pop(rid, None)
            self.loop.call(lambda e: e.release(rid))

        transfer_ms = (time.perf_counter() - started) * 1e3 - prefill_ms
        self.counters[f"transfers_{conn.name}"] += 1
        metrics.KV_TRANSFER_SECONDS.labels(conn.name).observe(transfer_ms / 1e3)
        if ack is not AckStatus.OK:
            self.counters[f"transfer_{ack.name.lower()}"] += 1
            code = grpc.StatusCode.DATA_LOSS if ack is AckStatus.CHECKSUM_MISMATCH else grpc.StatusCode.ABORTED
            await context.abort(code, f"decode worker refused the KV transfer: {ack.name}")
        return pb.PrefillResponse(
            first_token_id=first.new_token_ids[0], num_cached_tokens=first.num_cached_tokens,
            transport=conn.name, prefill_ms=prefill_ms, transfer_ms=transfer_ms,
        )

    async def _prefill(self, rid, token_ids, sampling, request, context) -> RequestOutput:
        budget_s = request.ttft_budget_ms / 1e3 if request.ttft_budget_ms > 0 else None
        start = lambda e: e.add_request(  # noqa: E731
            rid, token_ids, sampling, priority=request.priority, prefill_only=True,
            num_prior_output_tokens=request.num_prior_output_tokens, ttft_budget_s=budget_s)
        try:
            async with contextlib.aclosing(self.loop.generate(rid, start)) as outputs:
                async for out in outputs:
                    return out  # the first (and only) output: the first token
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        await context.abort(grpc.StatusCode.INTERNAL, "prefill ended without a token")

    @staticmethod
    def _ship_all(engine: LLMEngine, rid: str, transfer) -> None:
        """Send-after-prefill (the non-pipelined baseline): every layer once the prompt is done."""
        kv = engine.take_prefilled(rid)
        for layer in range(engine.model_config.num_layers):
            transfer.send_layer(layer, kv.block_ids, 0, transfer.num_tokens)

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.WorkerStats:
        return worker_stats(self.engine.stats(with_digest=True), "prefill", self.address, 0, self.counters,
                            self.engine.config.block_size, self.engine.config.max_num_seqs)
