"""The decode worker's gRPC service: reserve blocks, await the KV, decode in the batch.

A disaggregated request enters the engine with a ``KVReceive``: the scheduler reserves its
blocks when they are free (admission control lives here: this worker knows its own memory),
the stream's first output is the reservation, which goes back to the router, and the request
joins the running batch once a prefill worker has filled the blocks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from pdserve.engine.engine_loop import EngineError, EngineLoop
from pdserve.engine.kv_connector import KVReceive
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import KVReservation, RequestOutput, RequestRejected, TransferFailed
from pdserve.grpc_server import abort_overloaded
from pdserve.kvtransfer.grants import GrantLedger
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc
from pdserve.wire import logprob_to_proto, sampling_from_proto, transfer_key, worker_stats

log = logging.getLogger(__name__)


def token_event(out: RequestOutput) -> pb.DecodeEvent:
    return pb.DecodeEvent(
        tokens=pb.TokenBatch(
            token_ids=out.new_token_ids,
            finish_reason=out.finish_reason.value if out.finish_reason else "",
            num_cached_tokens=out.num_cached_tokens,
            index=out.index,
            logprobs=[logprob_to_proto(lp) for lp in out.logprobs or ()],
            prompt_logprobs=[logprob_to_proto(lp) for lp in out.prompt_logprobs or ()],
        )
    )


class DecodeService(pdserve_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        ledger: GrantLedger,
        kv_address: str,
        role: str,
        address: str,
        max_queued_requests: int = 256,
    ) -> None:
        self.loop = loop
        self.engine: LLMEngine = loop.engine
        self.ledger = ledger
        self.kv_address = kv_address
        self.role = role
        self.address = address
        self.max_queued_requests = max_queued_requests
        self.queued = 0  # requests accepted and not yet started (reserved, or prefilled here)

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        rid = request.request_id
        token_ids = [int(t) for t in request.token_ids]
        try:
            if not rid:
                raise ValueError("request_id: the router's key for the request is missing")
            log.debug(
                "request %s (client %s): %d prompt tokens, %s",
                rid,
                request.client_request_id,
                len(token_ids),
                "prefilled here" if request.prefill_locally else "K/V from a prefill worker",
            )
            sampling = sampling_from_proto(request.sampling)
            self.engine.validate(token_ids, sampling, request.num_prior_output_tokens)
            await asyncio.to_thread(
                self.engine.compile_constraint, sampling
            )  # off the event loop and the engine thread
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.queued >= self.max_queued_requests:
            await abort_overloaded(context, f"{self.role} worker queue is full ({self.max_queued_requests} waiting)")
        budget_s = request.ttft_budget_ms / 1e3 if request.ttft_budget_ms > 0 else None
        kv = None
        by_deadline = False  # the wait for a reservation ends at the call's deadline, not the budget
        if not request.prefill_locally:  # wait for a batch slot and free blocks as a colocated request does
            remaining = context.time_remaining()
            if remaining is not None and (budget_s is None or remaining < budget_s):
                budget_s, by_deadline = max(0.001, remaining), True  # rejected in time for a clear answer
            kv = KVReceive(self.ledger)
        start = lambda e: e.add_request(  # noqa: E731
            rid,
            token_ids,
            sampling,
            priority=request.priority,
            num_prior_output_tokens=request.num_prior_output_tokens,
            ttft_budget_s=budget_s,
            kv_receive=kv,
        )

        waiting = True  # counts against the queue bound until it has started
        self.queued += 1
        try:
            async for out in self.loop.generate(rid, start):
                if waiting:
                    self.queued, waiting = self.queued - 1, False
                if isinstance(out.kv, KVReservation):
                    yield pb.DecodeEvent(
                        reservation=pb.Reservation(
                            target=pb.KvTarget(
                                transfer_id=transfer_key(out.kv.transfer_id),
                                kv_address=self.kv_address,
                                block_ids=out.kv.block_ids,
                                block_size=self.engine.config.block_size,
                                num_tokens=out.kv.num_tokens,
                                skip_tokens=out.kv.num_cached_tokens,
                            )
                        )
                    )
                    continue
                yield token_event(out)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestRejected:
            if by_deadline:
                await abort_overloaded(
                    context,
                    f"{self.role} worker could not start the request before its deadline (a batch slot and KV "
                    f"blocks for {len(token_ids)} tokens); retry later",
                )
            await abort_overloaded(context, "request could not start within its ttft_budget_ms")
        except TransferFailed as e:
            code = grpc.StatusCode.DATA_LOSS if e.corrupted else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"KV transfer failed: {e}")
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            self.queued -= waiting

    async def EndChoices(self, request: pb.EndChoicesRequest, context: grpc.aio.ServicerContext) -> pb.EndChoicesReply:
        return pb.EndChoicesReply(ended=await self.loop.end_choices(request.request_id, list(request.indices)))

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.WorkerStats:
        return worker_stats(
            self.loop.stats(),
            self.role,
            self.address,
            self.ledger.num_active,
            self.ledger.counters.snapshot(),
            self.engine.config.block_size,
            self.engine.config.max_num_seqs,
            self.engine.max_model_len,
        )
