"""The prefill worker's gRPC service: prefill a prompt, ship its KV, return the first token.

The request enters the engine with a ``KVSend`` bound to its transfer: the engine ships each
layer as the forward pass computes it and holds the blocks until the decode worker has
acknowledged them; the stream yields the first token, then ends with that acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time

import grpc

from pdserve import metrics
from pdserve.engine.engine_loop import EngineError, EngineLoop
from pdserve.engine.kv_connector import KVSend
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import KVSent, RequestRejected, TransferFailed
from pdserve.event_counts import EventCounts
from pdserve.grpc_server import PEER_FAULT_KEY, abort_overloaded
from pdserve.kvtransfer.handshake import HandshakeError
from pdserve.kvtransfer.sender import KVSender
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc
from pdserve.wire import logprob_to_proto, parse_transfer_key, sampling_from_proto, worker_stats

log = logging.getLogger(__name__)
ACK_GRACE_S = 2.0  # past the decode side's lease, so its verdict (and its lease expiry) comes first


def decode_side(error: Exception) -> bool:
    """Whether a failure to open a KV connection is the decode worker's: a refused handshake, a
    refused or broken connection, no answer in time, its host gone or its name unknown. Ours
    (out of file descriptors or buffers, no route out at all) stay ours."""
    if isinstance(error, (HandshakeError, ConnectionError, TimeoutError, socket.gaierror)):
        return True
    return isinstance(error, OSError) and error.errno in (errno.EHOSTUNREACH, errno.EHOSTDOWN)


class PrefillService(pdserve_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        sender: KVSender,
        address: str = "",
        lease_s: float = 30.0,
        max_queued_requests: int = 256,
    ) -> None:
        self.max_queued_requests = max_queued_requests
        self._waiting: set[str] = set()  # requests accepted and not yet prefilled (not those whose KV travels)
        self.loop = loop
        self.lease_s = lease_s  # the decode side's lease: past it without an ack, our copy is of no use
        self.engine: LLMEngine = loop.engine
        self.sender = sender
        self.address = address
        self.counters = EventCounts()  # read by the metrics scrape's thread

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        token_ids = [int(t) for t in request.token_ids]
        target = request.target
        try:
            if not request.request_id:
                raise ValueError("request_id: the router's key for the request is missing")
            log.debug(
                "request %s (client %s): %d prompt tokens, K/V to %s",
                request.request_id,
                request.client_request_id,
                len(token_ids),
                target.kv_address,
            )
            sampling = sampling_from_proto(request.sampling)
            self.engine.validate(token_ids, sampling, request.num_prior_output_tokens, generates=False)
            transfer_id = parse_transfer_key(target.transfer_id)
            if target.num_tokens != len(token_ids):
                raise ValueError(
                    f"target.num_tokens: {target.num_tokens} does not match the {len(token_ids)} prompt tokens"
                )
            if not 0 <= target.skip_tokens <= target.num_tokens:
                raise ValueError(f"target.skip_tokens: {target.skip_tokens} is outside [0, {target.num_tokens}]")
            block_size = target.block_size or self.engine.config.block_size
            if not 0 < block_size <= 1024 or len(target.block_ids) * block_size < target.num_tokens:
                raise ValueError(
                    f"target.block_ids: {len(target.block_ids)} blocks of {block_size} tokens cannot hold "
                    f"{target.num_tokens} tokens"
                )
            if any(block < 0 for block in target.block_ids):
                raise ValueError("target.block_ids: block ids cannot be negative")
            await asyncio.to_thread(
                self.engine.compile_constraint, sampling
            )  # off the event loop and the engine thread
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.queued >= self.max_queued_requests:
            await abort_overloaded(context, f"prefill worker queue is full ({self.max_queued_requests} waiting)")
        self._waiting.add(request.request_id)
        try:
            return await self._serve(request, context, token_ids, sampling, transfer_id)
        finally:
            self._waiting.discard(request.request_id)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def _serve(self, request, context, token_ids, sampling, transfer_id) -> pb.PrefillResponse:
        rid, target = request.request_id, request.target
        blame = ((PEER_FAULT_KEY, "decode"),)  # the router then tries another decode worker
        try:
            conn = await asyncio.to_thread(self.sender.connection, target.kv_address)
        except HandshakeError as e:  # a mismatch: this worker or the decode worker is the odd one out
            log.warning("request %s (client id %r): %s", rid, request.client_request_id, e)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, str(e), trailing_metadata=((PEER_FAULT_KEY, "pair"),)
            )
        except (OSError, ValueError) as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot reach decode worker KV endpoint {target.kv_address}: {e}",
                trailing_metadata=blame if decode_side(e) else (),
            )

        transfer = conn.open(
            transfer_id,
            list(target.block_ids),
            target.block_size or self.engine.config.block_size,
            len(token_ids),
            skip_tokens=target.skip_tokens,
        )
        budget_s = request.ttft_budget_ms / 1e3 if request.ttft_budget_ms > 0 else None
        start = lambda e: e.add_request(  # noqa: E731
            rid,
            token_ids,
            sampling,
            priority=request.priority,
            num_prior_output_tokens=request.num_prior_output_tokens,
            ttft_budget_s=budget_s,
            kv_send=KVSend(transfer, ack_timeout_s=self.lease_s + ACK_GRACE_S),
        )
        started = time.perf_counter()
        first = sent = None
        try:
            async with contextlib.aclosing(self.loop.generate(rid, start)) as outputs:
                async for out in outputs:
                    if first is None:
                        first, prefill_ms = out, (time.perf_counter() - started) * 1e3
                        self._waiting.discard(rid)  # prefilled: no longer waiting for the engine
                    if out.finished:
                        sent = out.kv
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestRejected:
            await abort_overloaded(context, "prefill could not start within its ttft_budget_ms")
        except TransferFailed as e:
            self.counters.add("transfer_checksum_mismatch" if e.corrupted else "transfer_failed")
            log.warning("request %s: KV transfer failed: %s", request.request_id, e)
            if e.corrupted:  # the router prefills it again (its own counter), whoever damaged it
                await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
            # The K/V left this worker: a reset, an expired lease or a refusal may be either
            # side's (a decode worker killed mid-transfer is the common one). Neither is charged.
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), trailing_metadata=((PEER_FAULT_KEY, "transfer"),))
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            transfer.close()
        if first is None or not first.new_token_ids:
            await context.abort(grpc.StatusCode.INTERNAL, "prefill ended without a token")
        self.counters.add("prompts_prefilled")
        response = _first_tokens(first)
        if first.finished:  # the first token already ends the request (every choice of it): no handoff
            response.num_cached_tokens, response.prefill_ms = first.num_cached_tokens, prefill_ms
            return response
        if not isinstance(sent, KVSent):
            await context.abort(grpc.StatusCode.INTERNAL, "prefill ended without the KV acknowledgement")
        transfer_ms = (time.perf_counter() - started) * 1e3 - prefill_ms
        self.counters.add(f"transfers_{sent.transport}")
        metrics.KV_TRANSFER_SECONDS.labels(sent.transport).observe(transfer_ms / 1e3)
        response.MergeFrom(
            pb.PrefillResponse(
                num_cached_tokens=first.num_cached_tokens,
                transport=sent.transport,
                prefill_ms=prefill_ms,
                transfer_ms=transfer_ms,
            )
        )
        return response

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.WorkerStats:
        return worker_stats(
            self.loop.stats(),
            "prefill",
            self.address,
            0,
            self.counters.snapshot(),
            self.engine.config.block_size,
            self.engine.config.max_num_seqs,
            self.engine.max_model_len,
        )


def _first_tokens(first) -> pb.PrefillResponse:
    """The first token of every choice, with its logprobs and the prompt's (when asked for)."""
    token_id = first.new_token_ids[0]
    reason = first.finish_reason.value if first.finish_reason is not None else ""
    if first.first_tokens is not None:  # n > 1
        choices = [
            pb.FirstToken(
                token_id=t.token_id,
                finish_reason=t.finish_reason.value if t.finish_reason else "",
                logprob=logprob_to_proto(t.logprob) if t.logprob is not None else None,
            )
            for t in first.first_tokens
        ]
    else:
        logprob = logprob_to_proto(first.logprobs[0]) if first.logprobs else None
        choices = [pb.FirstToken(token_id=token_id, finish_reason=reason, logprob=logprob)]
    prompt = [logprob_to_proto(lp) for lp in first.prompt_logprobs] if first.prompt_logprobs is not None else []
    return pb.PrefillResponse(first_token_id=token_id, finish_reason=reason, choices=choices, prompt_logprobs=prompt)
