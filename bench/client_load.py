"""The load generator: sends requests to a live router over grpc.aio and records timelines.

Bounded everywhere: each request carries a gRPC deadline (its timeout, cut to what is left of
the run), no request starts after the run's time limit, and a final wait cancels anything
still open shortly after the limit. Requests that fail, time out or are never sent are kept
as failed timelines with their reason, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import Timeline, cluster_snapshot
from pdserve.bench.workloads import RequestSpec
from pdserve.client import build_request
from pdserve.grpc_server import channel_options
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

FAILED_FINISH = ("error", "cancelled")
STRAGGLER_GRACE_S = 5.0


class Unreachable(ConnectionError):
    """The router did not accept a connection in time."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    address: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None  # with rate inf: a fixed-concurrency (closed-loop) run
    seed: int = 0
    request_timeout_s: float = 120.0
    time_limit_s: float = 600.0
    progress: bool = True
    label: str = ""
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    timelines: list[Timeline]
    duration: float  # from the start of sending to the last response, as vLLM measures it


async def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise Unreachable(f"cannot reach a router at {address} (no connection within {timeout_s:.0f} s)") from None


async def fetch_cluster_stats(address: str, timeout_s: float = 10.0) -> dict | None:
    """The router's ``GetClusterStats`` as a plain dict (``metrics.cluster_snapshot``), or None
    when the router does not answer it (the caller says so; the run itself goes on)."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        try:
            stats = await pdserve_pb2_grpc.RouterStub(channel).GetClusterStats(
                pb.ClusterStatsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return None
    return cluster_snapshot(stats)


async def _send(
    stub: pdserve_pb2_grpc.RouterStub,
    spec: RequestSpec,
    request_id: str,
    timeout_s: float,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> Timeline:
    t = Timeline(prompt_len=spec.prompt_len, max_tokens=spec.max_tokens)
    # ignore_eos: every request produces exactly the output length asked for.
    request = build_request(
        prompt_token_ids=list(spec.prompt_token_ids),
        request_id=request_id,
        max_tokens=spec.max_tokens,
        temperature=temperature,
        top_p=top_p,
        ignore_eos=True,
    )
    t.send_time = time.perf_counter()
    call = stub.Generate(request, timeout=max(timeout_s, 0.001))
    try:
        async for msg in call:
            now = time.perf_counter()
            if msg.token_ids:
                t.chunk_times.append(now)
                t.chunk_tokens.append(len(msg.token_ids))
            if msg.finish_reason:
                t.end_time, t.finish_reason = now, msg.finish_reason
        if not t.finish_reason:
            t.error = "the stream ended without a finish reason"
        elif t.finish_reason in FAILED_FINISH:
            t.error = f"finish_reason={t.finish_reason}"
        elif not t.chunk_times:
            t.error = "finished without any output token"
    except grpc.aio.AioRpcError as e:
        t.error = f"{e.code().name}: {e.details()}"
    except asyncio.CancelledError:
        call.cancel()
        t.error = "cancelled at the run's time limit"
    return t


async def warm_up(address: str, specs: list[RequestSpec], timeout_s: float) -> list[Timeline]:
    """Sends ``specs`` all at once and waits for them (not counted in any result)."""
    if not specs:
        return []
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        tag = uuid.uuid4().hex[:8]
        return list(
            await asyncio.gather(*(_send(stub, s, f"warmup-{tag}-{i}", timeout_s) for i, s in enumerate(specs)))
        )


async def run_load(specs: list[RequestSpec], cfg: LoadConfig) -> LoadResult:
    offsets = arrival_offsets(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list[Timeline | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), desc=cfg.label or "requests", unit="req", disable=not cfg.progress, leave=False)
    tag = uuid.uuid4().hex[:8]

    async with grpc.aio.insecure_channel(cfg.address, options=channel_options()) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()
        deadline = start + cfg.time_limit_s

        async def one(i: int, spec: RequestSpec) -> None:
            if slots is not None:
                try:
                    await asyncio.wait_for(slots.acquire(), max(0.0, deadline - time.perf_counter()))
                except asyncio.TimeoutError:
                    results[i] = _not_sent(spec, "not sent: no free concurrency slot before the time limit")
                    bar.update()
                    return
            try:
                timeout = min(cfg.request_timeout_s, deadline - time.perf_counter())
                results[i] = timeline = await _send(stub, spec, f"bench-{tag}-{i}", timeout, cfg.temperature, cfg.top_p)
                if timeout < cfg.request_timeout_s and timeline.error.startswith("DEADLINE_EXCEEDED"):
                    timeline.error = f"cut at the run's time limit (--time-limit-s {cfg.time_limit_s:g})"
            finally:
                if slots is not None:
                    slots.release()
                bar.update()

        tasks: list[asyncio.Task] = []
        for i, spec in enumerate(specs):
            send_at = start + offsets[i]
            if send_at >= deadline:
                break  # the rest are recorded as not sent below
            delay = send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, spec)))
        if tasks:
            # Deadlines end every call by the time limit; the grace only covers a stuck stream.
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()) + STRAGGLER_GRACE_S)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    bar.close()
    timelines = [
        r if r is not None else _not_sent(s, "not sent before the run's time limit") for r, s in zip(results, specs)
    ]
    return LoadResult(timelines, duration)


def _not_sent(spec: RequestSpec, reason: str) -> Timeline:
    return Timeline(prompt_len=spec.prompt_len, max_tokens=spec.max_tokens, error=reason)
