"""Scheduling across the cluster: KV-aware routing sends a shared prefix where it is cached,
prefix hits are counted and change nothing in the output, a decode worker that holds a
prefix receives only the rest, and a full worker queue rejects at once and recovers."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from processes import Stack
from test_stack_e2e import assert_blocks_all_free, cluster_stats, collect

from pdserve.client import build_request

pytestmark = pytest.mark.e2e
SYSTEM = "You are a meticulous assistant for a shipping company. " * 12  # ~130 tokens, 8 full blocks
ARGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB", "--kv-transport", "tcp")


def by_role(stats, role):
    return [w for w in stats.workers if w.role == role]


async def test_kv_aware_routes_a_shared_prefix_to_the_worker_that_caches_it(hf_reference):
    stack = Stack.up("--prefill", "2", "--decode", "1", "--policy", "kv_aware", *ARGS)
    try:
        first, _, msgs = await collect(
            stack.address, build_request(SYSTEM + "Question 1: where is my parcel?", max_tokens=8, temperature=0)
        )
        assert msgs[-1].usage.cached_prompt_tokens == 0
        # No waiting for fresh cache digests: the router remembers where it sent the prefix.
        for i in range(2, 6):
            prompt = SYSTEM + f"Question {i}: when does the store open?"
            ids, _, msgs = await collect(stack.address, build_request(prompt, max_tokens=8, temperature=0))
            assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, 8)  # hits change nothing
            assert msgs[-1].usage.cached_prompt_tokens >= 96
        prefill = by_role(await cluster_stats(stack.address), "prefill")
        hits = sorted(w.counters["prefix_hits"] for w in prefill)
        assert hits[0] == 0 and hits[1] >= 4 * 6, f"every follow-up should hit one worker's cache: {hits}"
        decode = by_role(await cluster_stats(stack.address), "decode")[0]
        assert decode.counters["prefix_hits"] >= 4 * 6  # the decode worker kept the prefix: fewer blocks moved
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_full_worker_queue_rejects_fast_and_recovers(hf_reference):
    stack = Stack.up("--colocated", "--max-queued-requests", "2", "--max-num-seqs", "2", *ARGS)
    try:

        async def one(i):
            started = time.perf_counter()
            try:
                ids, _, _ = await collect(
                    stack.address, build_request(f"Count to {i}:", max_tokens=24, temperature=0, ignore_eos=True)
                )
                return "ok", time.perf_counter() - started, ids
            except grpc.aio.AioRpcError as e:
                return e.code(), time.perf_counter() - started, None

        outcomes = await asyncio.gather(*(one(i) for i in range(16)))
        rejected = [o for o in outcomes if o[0] is grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [o for o in outcomes if o[0] == "ok"]
        # Rejections come at once: each before the quickest admitted request finished.
        assert rejected and max(o[1] for o in rejected) < min(o[1] for o in served)
        assert len(served) >= 2  # the bounded queue admitted some
        # Recovered: the queue drained, new requests are served.
        ids, _, _ = await collect(stack.address, build_request("The capital of France is", max_tokens=8, temperature=0))
        assert ids == hf_reference.greedy(hf_reference.tokenizer("The capital of France is").input_ids, 8)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()


async def test_a_disaggregated_request_waits_for_a_decode_slot_as_long_as_its_deadline_allows(hf_reference):
    """As a colocated one: the KV lease starts with the reservation, it does not bound the wait
    for one."""
    stack = Stack.up("--max-num-seqs", "1", "--kv-lease-s", "1", *ARGS)
    try:
        long = asyncio.create_task(
            collect(stack.address, build_request("Count:", max_tokens=400, temperature=0, ignore_eos=True), timeout=300)
        )
        deadline = time.monotonic() + 60
        while not any(w.running for w in by_role(await cluster_stats(stack.address), "decode")):
            assert time.monotonic() < deadline, "the long request never started"
            await asyncio.sleep(0.05)
        prompt = "The capital of France is"  # waits behind it (its only batch slot) past the 1 s lease
        ids, _, _ = await collect(stack.address, build_request(prompt, max_tokens=8, temperature=0), timeout=300)
        assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, 8)
        await long
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()
