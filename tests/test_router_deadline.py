"""A client's own deadline ends its request at the router as the client leaving, never as a
worker failure: the workers' calls run a little past it (real gRPC, a fake dispatcher)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdserve.client import build_request
from pdserve.router.completions import CLIENT_DEADLINE_GRACE_S, Completions
from pdserve.router.servicer import RouterService, add_router_service
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.worker_errors import DispatchError
from pdserve.v1 import pdserve_pb2_grpc

# A worker whose clock runs a little ahead answers DEADLINE_EXCEEDED just before its deadline.
WORKER_EARLY_S = 0.02


class DeadlineDispatcher:
    """Stands for workers that never answer: each call ends in DEADLINE_EXCEEDED at its deadline."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []
        self.closed_before_deadline = 0

    async def generate(self, req, timeout_s: float, ends=None):
        self.timeouts.append(timeout_s)
        try:
            await asyncio.sleep(timeout_s - WORKER_EARLY_S)
        except asyncio.CancelledError:
            self.closed_before_deadline += 1
            raise
        raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED, "decode worker: Deadline Exceeded")
        yield  # an async generator, as the real dispatcher's


@pytest.fixture(scope="module")
def tok(model_dir) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


def test_workers_get_the_client_deadline_plus_grace_within_the_router_limit(tok):
    completions = Completions(tok, None, request_timeout_s=5.0, max_inflight=1)
    assert completions.timeout(None) == 5.0
    assert completions.timeout(1.0) == pytest.approx(1.0 + CLIENT_DEADLINE_GRACE_S)
    assert completions.timeout(30.0) == 5.0


async def test_a_client_deadline_counts_as_the_client_leaving_and_logs_no_error(tok, caplog):
    dispatcher = DeadlineDispatcher()
    completions = Completions(tok, dispatcher, request_timeout_s=5.0, max_inflight=8)
    server = grpc.aio.server()
    add_router_service(RouterService(completions), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    caplog.set_level(logging.ERROR)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(build_request("hi", max_tokens=4), timeout=0.3):
                        pass
                assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):  # the handlers' cancellations land just after the clients' deadlines
            if completions.inflight == 0:
                break
            await asyncio.sleep(0.02)
    finally:
        await server.stop(None)
    assert completions.inflight == 0
    assert completions.counters["cancelled"] == 3, completions.counters
    assert completions.counters["failed_deadline_exceeded"] == 0, completions.counters
    assert dispatcher.closed_before_deadline == 3
    assert all(t > 0.3 for t in dispatcher.timeouts), dispatcher.timeouts
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


class FailingDispatcher:
    async def generate(self, req, timeout_s: float, ends=None):
        raise DispatchError(grpc.StatusCode.UNAVAILABLE, "decode worker 127.0.0.1:9: gone")
        yield  # an async generator, as the real dispatcher's


async def test_a_failed_grpc_request_is_logged_as_an_http_one_is(tok, caplog):
    completions = Completions(tok, FailingDispatcher(), request_timeout_s=5.0, max_inflight=8)
    server = grpc.aio.server()
    add_router_service(RouterService(completions), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    caplog.set_level(logging.INFO, logger="pdserve.router.servicer")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                request = build_request("hi", max_tokens=4, request_id="client-7")
                async for _ in pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=10):
                    pass
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
    assert "request client-7 failed: UNAVAILABLE decode worker 127.0.0.1:9: gone" in caplog.text
