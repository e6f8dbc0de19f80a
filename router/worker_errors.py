"""What a worker's failed call means to the router: whose fault it is, and whether another
worker (or another pair) may do."""

from __future__ import annotations

import grpc

from pdserve.grpc_server import PEER_FAULT_KEY, RETRY_AFTER_KEY
from pdserve.router.workers import WRONG_ROLE_HINT, Worker

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED}


class DispatchError(Exception):
    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        worker: Worker | None = None,
        retry_after_ms: int | None = None,
        final: bool = False,
        elsewhere: bool = False,
        also: Worker | None = None,
        charged: bool = True,
    ) -> None:
        super().__init__(message)
        self.charged = charged  # whether an UNAVAILABLE counts against ``worker``'s circuit breaker
        self.final = final  # retrying cannot help (e.g. we already waited for a worker to come back)
        self.elsewhere = elsewhere  # this worker's fault whatever the code: another of its role may do
        self.code = code
        self.message = message
        self.worker = worker
        self.also = also  # the other worker of a pair that cannot work together
        self.retry_after_ms = retry_after_ms  # for RESOURCE_EXHAUSTED: when the client may try again

    @property
    def retryable(self) -> bool:
        return not self.final and (self.code in RETRYABLE or self.elsewhere)


def prefill_error(prefill: Worker, decode: Worker, error: grpc.aio.AioRpcError) -> DispatchError:
    """A failed Prefill call: the prefill worker's fault, the decode worker's when the prefill
    worker says its KV endpoint could not be reached, or the pair's when the two refused each
    other's KV handshake (a mismatch: another pair may match)."""
    fault = dict(error.trailing_metadata() or ()).get(PEER_FAULT_KEY)
    if fault == "pair":
        return DispatchError(
            error.code(),
            f"prefill worker {prefill.address} and decode worker {decode.address} cannot exchange K/V: "
            f"{error.details()}",
            decode,
            elsewhere=True,
            also=prefill,
        )
    if fault == "decode":
        return worker_error(decode, error, elsewhere=True)
    if fault == "transfer":  # broke after the K/V left: charge neither; their own calls and probes judge them
        return DispatchError(
            error.code(),
            f"the K/V handoff from prefill worker {prefill.address} to decode worker {decode.address} failed: "
            f"{error.details()}",
            decode,
            charged=False,
        )
    return worker_error(prefill, error)


def worker_error(worker: Worker, error: grpc.aio.AioRpcError, elsewhere: bool = False) -> DispatchError:
    """``elsewhere``: this worker's fault whatever the code (another of its role may do)."""
    code = error.code()
    if code is grpc.StatusCode.CANCELLED:
        return DispatchError(code, "request cancelled", worker)
    if code is grpc.StatusCode.INVALID_ARGUMENT:  # the worker's words name the field (a grammar that does not compile)
        return DispatchError(code, error.details(), worker)
    if code is grpc.StatusCode.UNIMPLEMENTED:  # asked before its health checks showed it serves another role
        return DispatchError(
            grpc.StatusCode.UNAVAILABLE,
            f"{worker.role.value} worker {worker.address} does not serve its role's calls {WRONG_ROLE_HINT}",
            worker,
        )
    retry = dict(error.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
    return DispatchError(
        code,
        f"{worker.role.value} worker {worker.address}: {error.details()}",
        worker,
        retry_after_ms=int(retry) if retry and str(retry).isdigit() else None,
        # Its own overload answer (it says when to come back): a sibling may have room. Not
        # gRPC's message-size refusal, which every worker would repeat.
        elsewhere=elsewhere or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and retry is not None),
    )
