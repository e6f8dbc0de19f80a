"""What the router adds to TTFT: the first token through Router.Generate vs the same two
worker calls (Decode reservation, then Prefill) made directly, interleaved in one run.

    python bench/router_overhead.py --requests 60

Both paths run the same prompt with the same sampling on the same 1P1D cluster (prefix
caching off, so every request really prefills), and both stop the clock at the same event:
the first token, which the prefill worker returns only once the decode worker acknowledged
the KV transfer. The difference of the medians is the router's cost: validation,
tokenization, routing, its two extra gRPC hops and detokenization.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import grpc

from pdserve.client import build_request
from pdserve.config import choices_of
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.model_store import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.security import SecuritySettings
from pdserve.settings import KV_TRANSPORTS, ClusterSettings, RouterSettings, WorkerSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc
from pdserve.wire import sampling_to_proto

TOKEN = "bench-cluster-token"
# Two, not one, on both paths: with one token the prefill's answer is the whole request, no KV
# is shipped and nothing waits for the decode worker's acknowledgement.
MAX_TOKENS = 2
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


async def through_router(stub, prompt: str) -> float:
    started = time.perf_counter()
    call = stub.Generate(
        build_request(prompt, max_tokens=SAMPLING.max_tokens, temperature=SAMPLING.temperature), timeout=60
    )
    try:
        first = await call.read()
        elapsed = time.perf_counter() - started
        _check_kv_was_shipped(first.finish_reason)
        return elapsed
    finally:
        call.cancel()


async def direct(prefill, decode, token_ids: list[int]) -> float:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    sampling = sampling_to_proto(SAMPLING)
    started = time.perf_counter()
    call = decode.Decode(
        pb.DecodeRequest(request_id=f"d{started}", token_ids=token_ids, sampling=sampling),
        timeout=60,
        metadata=metadata,
    )
    try:
        reservation = (await call.read()).reservation
        response = await prefill.Prefill(
            pb.PrefillRequest(
                request_id=f"d{started}", token_ids=token_ids, sampling=sampling, target=reservation.target
            ),
            timeout=60,
            metadata=metadata,
        )
        elapsed = time.perf_counter() - started
        _check_kv_was_shipped(response.finish_reason)
        return elapsed
    finally:
        call.cancel()


def _check_kv_was_shipped(finish_reason: str) -> None:
    """A first token that ends the request skips the KV handoff: the paths would not compare."""
    if finish_reason:
        raise RuntimeError(
            f"the first token ended the request ({finish_reason}); use a --prompt that does not end at once"
        )


async def _interleaved(args, router, prefill, decode, token_ids: list[int]) -> tuple[list[float], list[float]]:
    """(through the router, direct) first-token times, alternating which path goes first."""
    for _ in range(3):  # warm up both paths
        await through_router(router, args.prompt)
        await direct(prefill, decode, token_ids)
    routed, straight = [], []
    for i in range(args.requests):
        if i % 2:
            straight.append(await direct(prefill, decode, token_ids))
            routed.append(await through_router(router, args.prompt))
        else:
            routed.append(await through_router(router, args.prompt))
            straight.append(await direct(prefill, decode, token_ids))
    return routed, straight


async def run(args: argparse.Namespace) -> dict:
    engine = EngineConfig(dtype=args.dtype, kv_cache_memory="256MiB", enable_prefix_caching=False)
    cluster = Cluster(
        engine,
        WorkerSettings(kv_transport=args.kv_transport),
        RouterSettings(port=0),
        ClusterSettings(prefill=1, decode=1),
        SecuritySettings(cluster_token=TOKEN),
    )
    address = cluster.start()
    try:
        token_ids = RouterTokenizer(resolve_model(None)).encode(args.prompt)
        async with grpc.aio.insecure_channel(address) as r:
            router = pdserve_pb2_grpc.RouterStub(r)
            workers = {
                w.role: w.address for w in (await router.GetClusterStats(pb.ClusterStatsRequest(), timeout=10)).workers
            }
            async with (
                grpc.aio.insecure_channel(workers["prefill"]) as p,
                grpc.aio.insecure_channel(workers["decode"]) as d,
            ):
                prefill, decode = pdserve_pb2_grpc.PrefillWorkerStub(p), pdserve_pb2_grpc.DecodeWorkerStub(d)
                routed, straight = await _interleaved(args, router, prefill, decode, token_ids)
    finally:
        cluster.stop()
    ms = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] * 1e3  # noqa: E731
    return {
        "requests": args.requests,
        "prompt_tokens": len(token_ids),
        "max_tokens": MAX_TOKENS,
        "kv_transport": args.kv_transport,
        "ttft_router_p50_ms": round(statistics.median(routed) * 1e3, 2),
        "ttft_direct_p50_ms": round(statistics.median(straight) * 1e3, 2),
        "router_added_p50_ms": round((statistics.median(routed) - statistics.median(straight)) * 1e3, 2),
        "ttft_router_p90_ms": round(ms(routed, 90), 2),
        "ttft_direct_p90_ms": round(ms(straight, 90), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--prompt", default="Summarize the history of the printing press in one paragraph.")
    parser.add_argument("--dtype", default="auto", choices=choices_of(EngineConfig, "dtype"))
    parser.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORTS)
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error("--requests must be >= 2")
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
