"""A constrained stream survives its decode worker's death: the request migrates (prompt +
tokens so far) and the new worker rebuilds the grammar state from those tokens, so the output
is still valid and, greedy, identical to an undisturbed run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import jsonschema
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc
from processes import Stack
from schemas import SCHEMAS
from test_stack_e2e import assert_blocks_all_free, cluster_stats

pytestmark = pytest.mark.e2e
SCHEMA = SCHEMAS[11]  # an array of nested objects: long enough to kill the worker mid-way


def constrained(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
        max_tokens=150, temperature=0, logprobs=1,
        structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA))))


async def test_a_constraint_survives_a_decode_worker_kill_mid_stream(hf_reference):
    stack = Stack.up("--prefill", "1", "--decode", "2", "--policy", "round_robin", "--dtype", "float32",
                     "--kv-cache-memory", "128MiB", "--kv-transport", "tcp")
    try:
        prompt = "An order with two items, as JSON:"
        async with grpc.aio.insecure_channel(stack.address) as channel:
            stub = pdserve_pb2_grpc.RouterStub(channel)
            undisturbed = [m async for m in stub.Generate(constrained(prompt), timeout=300)]
            want = [t for m in undisturbed for t in m.token_ids]
            assert len(want) >= 12, "the output must be long enough to interrupt"

            got, victim = [], None
            async for m in stub.Generate(constrained(prompt), timeout=300):
                got += m.token_ids
                if victim is None and len(got) >= 6:  # under way: kill the decode worker serving it
                    stats = await cluster_stats(stack.address)
                    busy = next(w.address for w in stats.workers if w.role == "decode" and w.running)
                    victim = next(p["pid"] for p in stack.processes if p.get("grpc") == busy)
                    os.kill(victim, signal.SIGKILL)
            assert victim is not None
        assert got == want, "the migrated stream changed a token"
        jsonschema.validate(json.loads(hf_reference.tokenizer.decode(got, skip_special_tokens=True)), SCHEMA)
        assert (await cluster_stats(stack.address)).counters["migrations"] >= 1
        deadline = time.monotonic() + 180  # the launcher restarts the dead worker
        while not all(w.healthy for w in (await cluster_stats(stack.address)).workers):
            assert time.monotonic() < deadline
            await asyncio.sleep(1)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()
