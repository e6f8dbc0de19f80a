"""Worker death, overload and cancellations on a real cluster: no lost request, no wrong
token, no leaked block."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import pytest
from conftest import PROMPTS
from processes import Stack
from test_stack_e2e import assert_blocks_all_free, cluster_stats, collect

from pdserve.client import build_request
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = pytest.mark.e2e
ARGS = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--kv-transport", "tcp")
MAX_NEW = 32


LONG_CONTEXT = " ".join(
    f"Note {i}: the ferry left the harbour at {i} o'clock with {i * 7} passengers." for i in range(20)
)


def expected(hf_reference, prompt: str, n: int = MAX_NEW) -> list[int]:
    return hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, n)


async def stream_tokens(channel, prompt: str, progress: dict, key: int, max_tokens: int = MAX_NEW) -> list[int]:
    ids = []
    async for msg in pdserve_pb2_grpc.RouterStub(channel).Generate(
        build_request(prompt, max_tokens=max_tokens, temperature=0), timeout=240
    ):
        ids += msg.token_ids
        progress[key] = len(ids)
    return ids


def pid_of(stack: Stack, name: str) -> int:
    return next(p["pid"] for p in stack.processes if p["name"] == name)


async def wait_until_busy(stack: Stack, name: str, timeout: float = 120.0) -> None:
    """Until the worker ``name`` reports prompts queued or running, or blocks held for a
    transfer (a short prompt's prefill can finish between two stats snapshots; polled, bounded)."""
    address = next(p["grpc"] for p in stack.processes if p["name"] == name)
    deadline = time.monotonic() + timeout
    while True:
        stats = await cluster_stats(stack.address)
        worker = next(w for w in stats.workers if w.address == address)
        if worker.running or worker.waiting or worker.blocks_free < worker.blocks_total:
            return
        assert time.monotonic() < deadline, f"{name} never had work in flight"
        await asyncio.sleep(0.02)


async def signal_mid_stream(stack: Stack, victim: str, signum: int, hf_reference, streams: int = 6) -> float:
    """Signals ``victim`` once every stream is under way; returns how long the streams took from there."""
    prompts = [PROMPTS[i % 3] for i in range(streams)]
    progress: dict[int, int] = {}
    async with grpc.aio.insecure_channel(stack.address) as channel:
        tasks = [asyncio.create_task(stream_tokens(channel, p, progress, i)) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 120
        while not all(progress.get(i, 0) >= 3 or task.done() for i, task in enumerate(tasks)):  # all under way
            assert time.monotonic() < deadline, f"streams did not get going: {progress}"
            await asyncio.sleep(0.05)
        os.kill(pid_of(stack, victim), signum)
        signalled = time.monotonic()
        results = await asyncio.gather(*tasks)
        took = time.monotonic() - signalled
    for prompt, ids in zip(prompts, results):
        assert ids == expected(hf_reference, prompt), "a migrated stream lost, repeated or changed a token"
    return took


async def all_healthy(stack: Stack, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(w.healthy for w in (await cluster_stats(stack.address)).workers):
        assert time.monotonic() < deadline, "a worker never came back into rotation"
        await asyncio.sleep(1)


async def test_decode_worker_paused_or_killed_mid_stream_all_streams_complete(hf_reference):
    stack = Stack.up("--prefill", "1", "--decode", "2", "--policy", "round_robin", *ARGS)
    try:
        # Paused: its connections stay open. Once it fails its health checks its streams move on,
        # long before their deadline (240 s), and it takes requests again once it answers.
        paused = pid_of(stack, "decode-0")
        try:
            took = await signal_mid_stream(stack, "decode-0", signal.SIGSTOP, hf_reference)
        finally:
            os.kill(paused, signal.SIGCONT)
        assert took < 120  # seconds after the pause: about 5 s of health checks, then a re-prefill
        moved = (await cluster_stats(stack.address)).counters["migrations"]
        assert moved >= 1
        await all_healthy(stack)
        # Killed: the launcher restarts it; the health monitor brings it back.
        await signal_mid_stream(stack, "decode-1", signal.SIGKILL, hf_reference)
        assert (await cluster_stats(stack.address)).counters["migrations"] > moved
        await all_healthy(stack)
        ids, _, _ = await collect(stack.address, build_request(PROMPTS[0], max_tokens=8, temperature=0))
        assert ids == expected(hf_reference, PROMPTS[0], 8)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_kill_prefill_worker_under_load_loses_nothing(hf_reference):
    stack = Stack.up("--prefill", "2", "--decode", "1", "--policy", "round_robin", *ARGS)
    try:
        # Long prompts: their prefill spans several steps, so the kill lands while one runs (short
        # ones finished between two stats snapshots on a loaded machine, and the test never fired).
        prompts = [LONG_CONTEXT[i % 4 :] + PROMPTS[i % 4] for i in range(8)]
        async with grpc.aio.insecure_channel(stack.address) as channel:
            tasks = [
                asyncio.create_task(stream_tokens(channel, p, {}, i, max_tokens=12)) for i, p in enumerate(prompts)
            ]
            await wait_until_busy(stack, "prefill-0")  # killed while it prefills
            os.kill(pid_of(stack, "prefill-0"), signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        for prompt, ids in zip(prompts, results):
            assert ids == expected(hf_reference, prompt, 12)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_overload_gets_fast_rejections_and_admitted_requests_finish(hf_reference):
    stack = Stack.up("--prefill", "1", "--decode", "1", "--max-inflight-requests", "4", *ARGS)
    try:

        async def one(i: int):
            started = time.perf_counter()
            try:
                ids, _, _ = await collect(stack.address, build_request(PROMPTS[i % 3], max_tokens=16, temperature=0))
                return "ok", ids, PROMPTS[i % 3], time.perf_counter() - started
            except grpc.aio.AioRpcError as e:
                return e.code(), e, None, time.perf_counter() - started

        outcomes = await asyncio.gather(*(one(i) for i in range(40)))  # 10x what the router admits at once
        rejected = [o for o in outcomes if o[0] is grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [o for o in outcomes if o[0] == "ok"]
        assert len(rejected) + len(served) == 40
        assert len(served) >= 4 and len(rejected) >= 20
        # Rejections come at once: each before the quickest admitted request finished.
        assert max(o[3] for o in rejected) < min(o[3] for o in served), "rejections must come at once"
        assert all(dict(o[1].trailing_metadata()).get("retry-after-ms") for o in rejected)
        for _, ids, prompt, _ in served:
            assert ids == expected(hf_reference, prompt, 16)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_no_leak_after_mixed_run_with_cancels():
    stack = Stack.up("--prefill", "1", "--decode", "1", *ARGS)
    rng = random.Random(7)
    try:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)

            async def one(i: int) -> str:
                call = stub.Generate(build_request(PROMPTS[i % 4], max_tokens=48, temperature=0.8, seed=i), timeout=240)
                cancel_after = rng.randint(0, 6) if rng.random() < 0.3 else None
                n = 0
                async for _ in call:
                    n += 1
                    if cancel_after is not None and n > cancel_after:
                        call.cancel()
                        return "cancelled"
                return "done"

            outcomes = await asyncio.gather(*(one(i) for i in range(20)))
        assert outcomes.count("cancelled") >= 3
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()
