"""The public Router gRPC service: a thin shell around ``Completions``."""

from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from pdserve.grpc_server import RETRY_AFTER_KEY
from pdserve.router.completions import Completions
from pdserve.router.request import CompletionRequest
from pdserve.router.validation import InvalidRequest
from pdserve.router.worker_errors import DispatchError
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

log = logging.getLogger(__name__)


class RouterService(pdserve_pb2_grpc.RouterServicer):
    def __init__(self, completions: Completions) -> None:
        self.completions = completions

    async def Generate(
        self, request: pb.GenerateRequest | None, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if request is None:
            self.completions.count_invalid()
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid GenerateRequest (wire format or UTF-8)"
            )
        try:
            self.completions.check_sizes(len(request.prompt_token_ids), len(request.messages))
            req = await self.completions.validate(CompletionRequest.from_proto(request))
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for chunk in self.completions.stream(req, self.completions.timeout(context.time_remaining())):
                yield pb.GenerateResponse(
                    request_id=req.request_id,
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    finish_reason=chunk.finish_reason or "",
                    usage=chunk.usage.to_proto() if chunk.usage else None,
                    index=chunk.index,
                    logprobs=chunk.logprobs,
                    prompt_logprobs=chunk.prompt_logprobs or (),
                    prompt_token_ids=req.prompt_token_ids if chunk.prompt_logprobs is not None else (),
                )
        except DispatchError as e:
            log.info("request %s failed: %s %s", req.request_id, e.code.name, e.message)  # as the HTTP API says it
            hint = ((RETRY_AFTER_KEY, str(e.retry_after_ms)),) if e.retry_after_ms else ()
            await context.abort(e.code, e.message, trailing_metadata=hint)

    async def GetClusterStats(
        self, request: pb.ClusterStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClusterStats:
        dispatcher = self.completions.dispatcher
        counters = {**self.completions.counters, **dispatcher.counters}
        stats = pb.ClusterStats(counters={k: float(v) for k, v in counters.items()})
        for worker in dispatcher.registry.all():
            try:
                stub = worker.prefill_stub or worker.decode_stub
                ws = await stub.GetStats(pb.StatsRequest(), timeout=2.0, metadata=dispatcher.registry.metadata)
            except grpc.aio.AioRpcError:
                ws = pb.WorkerStats(address=worker.address, role=worker.role.value, healthy=False)
            stats.workers.append(ws)
        return stats


def _tolerant(message_cls):
    """A deserializer that yields None for bytes that do not parse (grpc would answer UNKNOWN)."""

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError:
            return None

    return parse


def add_router_service(service: RouterService, server: grpc.aio.Server) -> None:
    """Registers the Router service like the generated helper, but malformed requests reach the
    handler (as None) and get INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=_tolerant(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GetClusterStats": grpc.unary_unary_rpc_method_handler(
            service.GetClusterStats,
            request_deserializer=_tolerant(pb.ClusterStatsRequest),
            response_serializer=pb.ClusterStats.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Router", handlers),))
