"""Roles started one by one (as on several hosts): unreachable workers and refused handshakes
give clear errors, never hangs."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import Proc

try:
    import httpx
except ImportError:  # newer openai SDKs depend on httpx2 instead
    import httpx2 as httpx

from pdserve.client import build_request
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = pytest.mark.e2e


def start(*args: str) -> tuple[Proc, dict]:
    (started,) = start_together(args)
    return started


def start_together(*commands: tuple[str, ...]) -> list[tuple[Proc, dict]]:
    """Starts the processes at once (each loads its model while the others do) and waits for all."""
    procs = [Proc(list(args)) for args in commands]
    try:
        return [(proc, proc.wait_ready()) for proc in procs]
    except Exception:
        for proc in procs:
            proc.stop()
        raise


async def generate(address: str, request: pb.GenerateRequest, timeout: float = 60.0):
    async with grpc.aio.insecure_channel(address) as channel:
        return [m async for m in pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout)]


async def test_no_reachable_worker_is_unavailable_not_a_hang():
    held = socket.socket()  # bound, never listening: connections are refused, and nobody else takes the port
    held.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{held.getsockname()[1]}"
    router, info = start(
        "router", "--port", "0", "--http-port", "0", "--decode-workers", dead, "--prefill-workers", dead
    )
    try:
        # Alive (the server, /health), not ready (the Router service, /ready) once its health checks
        # have failed (twice): a readiness probe takes it out.
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(info["grpc"]) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            deadline = time.monotonic() + 20
            while (
                await check(health_pb2.HealthCheckRequest(service="pdserve.v1.Router"), timeout=10)
            ).status != not_serving:
                assert time.monotonic() < deadline, "the router never reported itself not ready"
                await asyncio.sleep(0.1)
            alive = await check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert alive.status == health_pb2.HealthCheckResponse.SERVING
        async with httpx.AsyncClient(base_url=f"http://{info['http']}") as http:
            alive_http, ready_http = await http.get("/health"), await http.get("/ready")
        assert alive_http.status_code == 200
        assert ready_http.status_code == 503 and ready_http.json()["reason"] == "no healthy decode worker"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(info["grpc"], build_request("hello", max_tokens=4), timeout=120)
        # A hang would end in DEADLINE_EXCEEDED; the router gives up on its own (worker_wait_s).
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert dead in err.value.details()
    finally:
        held.close()
        assert router.stop() == 0


async def test_a_worker_listed_under_the_wrong_role_is_named_as_such():
    """A decode worker given as --prefill-workers answers the prefill health check NOT_FOUND
    with no details: the router says what that means instead of 'NOT_FOUND: '."""
    ((decode, d_info),) = start_together(("decode", "--port", "0", "--kv-cache-memory", "64MiB", "--num-threads", "1"))
    router, r_info = start(
        "router", "--port", "0", "--prefill-workers", d_info["grpc"], "--decode-workers", d_info["grpc"]
    )
    try:
        assert await asyncio.to_thread(router.saw, lambda line: "does not serve pdserve.v1.PrefillWorker" in line)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(r_info["grpc"], build_request("hello", max_tokens=2), timeout=60)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "a worker of the other role?" in err.value.details(), err.value.details()
    finally:
        for proc in (router, decode):
            assert proc.stop() == 0


async def test_a_router_holds_requests_to_the_smallest_context_its_workers_report():
    """Router at the model's context, worker at --max-model-len 96: a request without max_tokens
    gets the worker's room (it was refused, naming a max_tokens the client never sent), and the
    router says why."""
    worker_flags = ("--colocated", "--port", "0", "--kv-cache-memory", "64MiB", "--num-threads", "1")
    ((decode, d_info),) = start_together(("decode", *worker_flags, "--max-model-len", "96"))
    router, r_info = start("router", "--port", "0", "--decode-workers", d_info["grpc"])
    try:
        held = f"held to a context of 96 tokens, what {d_info['grpc']} report(s)"
        assert await asyncio.to_thread(router.saw, lambda line: held in line)
        request = build_request("Count from one:", temperature=0.0, ignore_eos=True)
        messages = await generate(r_info["grpc"], request, timeout=120)
        prompt_len = messages[-1].usage.prompt_tokens
        assert messages[-1].finish_reason == "length"
        assert sum(len(m.token_ids) for m in messages) == 96 - prompt_len
    finally:
        for proc in (router, decode):
            assert proc.stop() == 0


@pytest.mark.parametrize(
    "prefill_flags, decode_flags",
    [
        (("--dtype", "float32"), ("--dtype", "bfloat16")),  # another model dtype
        (("--dtype", "bfloat16", "--kv-cache-dtype", "int8"), ("--dtype", "bfloat16")),  # another KV cache format
        # The same KV slots computed by other weights: int8-quantized, or fp32 into an 8-bit cache.
        (("--dtype", "float32", "--quantization", "int8"), ("--dtype", "float32")),
        (("--dtype", "float32", "--kv-cache-dtype", "int8"), ("--dtype", "bfloat16", "--kv-cache-dtype", "int8")),
    ],
    ids=["dtype", "kv-cache-dtype", "quantization", "dtype-into-8-bit-cache"],
)
async def test_handshake_mismatch_is_refused_cleanly(prefill_flags, decode_flags):
    """A decode worker whose KV slots hold something else refuses the prefill worker's KV handshake."""
    common = ("--port", "0", "--kv-cache-memory", "64MiB", "--num-threads", "1")
    (prefill, p_info), (decode, d_info) = start_together(
        ("prefill", *common, *prefill_flags), ("decode", *common, *decode_flags)
    )
    router, r_info = start(
        "router", "--port", "0", "--prefill-workers", p_info["grpc"], "--decode-workers", d_info["grpc"]
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(r_info["grpc"], build_request("hello there", max_tokens=4), timeout=60)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "refused the KV handshake" in err.value.details()
        assert ("quantization" if "--quantization" in prefill_flags else "dtype") in err.value.details()
        decode.wait_for(lambda line: "KV handshake" in line and "refused" in line, timeout=60)

        async with grpc.aio.insecure_channel(d_info["grpc"]) as channel:
            stub = pdserve_pb2_grpc.DecodeWorkerStub(channel)
            deadline = time.monotonic() + 60
            while True:  # the refused transfer's blocks come back (polled, bounded)
                stats = await stub.GetStats(pb.StatsRequest(), timeout=10)
                if stats.blocks_free == stats.blocks_total and stats.reserved_transfers == 0:
                    break
                assert time.monotonic() < deadline, f"blocks still held: {stats}"
                await asyncio.sleep(0.2)
        assert stats.counters["kv_handshakes_refused"] >= 1
    finally:
        for proc in (router, prefill, decode):
            assert proc.stop() == 0


async def test_a_router_told_to_stop_refuses_new_streams_and_finishes_the_running_ones():
    """SIGTERM: not ready at once, no new stream on either front end, and the streams already
    running (HTTP and gRPC alike) drain to their end within the grace period."""
    ((worker, winfo),) = start_together(
        (
            "decode",
            "--colocated",
            "--port",
            "0",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "64MiB",
            "--num-threads",
            "1",
        )
    )
    router, info = start("router", "--port", "0", "--http-port", "0", "--decode-workers", winfo["grpc"])
    try:
        body = {"prompt": "Count to a hundred:", "max_tokens": 12, "ignore_eos": True, "stream": True, "logprobs": 0}
        async with httpx.AsyncClient(base_url=f"http://{info['http']}", timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines, received = response.aiter_lines(), 0
                while received < 9:  # signalled with 3 tokens to go: they end well within the 5 s grace
                    line = await anext(lines)
                    if line.startswith("data: {"):
                        received += len(json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]["tokens"])
                router.process.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(router.saw, lambda line: "SIGTERM: shutting down" in line)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # a new stream is not started
                    await generate(info["grpc"], build_request("hello", max_tokens=2), timeout=10)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
                rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)  # drained to its end
        events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # all 12 tokens came
        assert await asyncio.to_thread(router.process.wait, 30) == 0
    finally:
        router.stop()
        worker.stop()
