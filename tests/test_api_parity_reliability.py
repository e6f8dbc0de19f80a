"""A constrained stream survives its decode worker's death: the request migrates (prompt +
tokens so far) and the new worker rebuilds the grammar state from those tokens, so the output
is still valid and, greedy, identical to an undisturbed run. So do n > 1 seeded choices: each
continues on its own with its own seed, and gives the tokens it would have given."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import jsonschema
import pytest
from processes import Stack
from schemas import SCHEMAS
from test_stack_e2e import assert_blocks_all_free, cluster_stats

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SCHEMA = SCHEMAS[11]  # an array of nested objects: long enough to kill the worker mid-way


def constrained(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(
            max_tokens=150,
            temperature=0,
            logprobs=1,
            structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
        ),
    )


async def stream_killing_the_decode_worker(stack: Stack, request: pb.GenerateRequest, after_tokens: int) -> list:
    """Streams ``request``, killing the decode worker that serves it once ``after_tokens`` arrived."""
    messages, victim = [], None
    async with grpc.aio.insecure_channel(stack.address) as channel:
        async for m in pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=300):
            messages.append(m)
            if victim is None and sum(len(x.token_ids) for x in messages) >= after_tokens:
                stats = await cluster_stats(stack.address)
                busy = next((w.address for w in stats.workers if w.role == "decode" and w.running), None)
                assert busy is not None, "the request ended before its decode worker could be killed"
                victim = next(p["pid"] for p in stack.processes if p.get("grpc") == busy)
                os.kill(victim, signal.SIGKILL)
    assert victim is not None
    return messages


async def wait_all_healthy(stack: Stack) -> None:
    deadline = time.monotonic() + 180  # the launcher restarts the dead worker
    while not all(w.healthy for w in (await cluster_stats(stack.address)).workers):
        assert time.monotonic() < deadline
        await asyncio.sleep(1)


def by_choice(messages) -> dict[int, list[int]]:
    choices: dict[int, list[int]] = {}
    for m in messages:
        choices.setdefault(m.index, []).extend(m.token_ids)
    return choices


async def test_a_constraint_survives_a_decode_worker_kill_mid_stream(hf_reference):
    stack = Stack.up(
        "--prefill",
        "1",
        "--decode",
        "2",
        "--policy",
        "round_robin",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "128MiB",
        "--kv-transport",
        "tcp",
    )
    try:
        prompt = "An order with two items, as JSON:"
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)
            undisturbed = [m async for m in stub.Generate(constrained(prompt), timeout=300)]
            want = [t for m in undisturbed for t in m.token_ids]
            assert len(want) >= 12, "the output must be long enough to interrupt"

        migrated = await stream_killing_the_decode_worker(stack, constrained(prompt), 6)
        got = [t for m in migrated for t in m.token_ids]
        assert got == want, "the migrated stream changed a token"
        assert migrated[-1].usage.migrations >= 1  # the request's own usage says it moved
        jsonschema.validate(json.loads(hf_reference.tokenizer.decode(got, skip_special_tokens=True)), SCHEMA)
        assert (await cluster_stats(stack.address)).counters["migrations"] >= 1
        await wait_all_healthy(stack)

        choices = pb.GenerateRequest(
            prompt="Once upon a time",
            sampling=pb.SamplingParams(max_tokens=64, temperature=1.0, seed=11, n=3, ignore_eos=True),
        )
        async with grpc.aio.insecure_channel(stack.address) as channel:
            want = by_choice([m async for m in pdserve_pb2_grpc.RouterStub(channel).Generate(choices, timeout=300)])
        got = by_choice(await stream_killing_the_decode_worker(stack, choices, 12))
        assert got == want, "a migrated choice changed a token"
        await wait_all_healthy(stack)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()
