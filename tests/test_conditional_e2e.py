"""Conditional disaggregation and profile-sized prefill chunks on a real 1P1D stack: a short
prompt is prefilled by the decode worker, a long one by the prefill worker, both give the
reference tokens, the router counts the local prefill, the decode worker logs the chunk size it
took from the profile and the router runs the online planner; every block is free afterwards."""

from __future__ import annotations

import pytest
from processes import Stack
from test_stack_e2e import assert_blocks_all_free, cluster_stats, collect

from pdserve.client import build_request
from pdserve.planner.profile import Overheads, Profile, StepCost, TransferCost

pytestmark = pytest.mark.e2e
ARGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB", "--kv-transport", "tcp")


def write_profile(path) -> str:
    cost = StepCost(base_ms=20.0, decode_ms=1.0, prefill_ms=1.5, decode_ctx_ms=0.005, prefill_attn_ms=0.001)
    p = Profile(
        model="SmolLM2-135M",
        device="cpu",
        parallel="threads",
        steps={1: cost, 2: cost},
        kv_bytes_per_token=46080,
        transfers={"tcp": TransferCost(1.0, 0.5)},
        transport="tcp",
        overheads=Overheads(30.0, 20.0, 1.0, 0.1),
        cores=2,
    )
    return str(p.save(path))


async def test_conditional_stack_prefills_short_prompts_on_the_decode_worker(hf_reference, tmp_path):
    profile = write_profile(tmp_path / "profile.json")
    stack = Stack.up(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--conditional",
        "--conditional-threshold-tokens",
        "64",
        "--profile",
        profile,
        "--slo-tpot-ms",
        "100",
        "--slo-ttft-ms",
        "3000",
        *ARGS,
    )
    try:
        short = "The capital of France is"
        long = "Here is a long story about a lighthouse keeper and the sea. " * 24  # ~300 tokens
        for prompt in (short, long):
            ids, _, msgs = await collect(stack.address, build_request(prompt, max_tokens=8, temperature=0))
            assert ids == hf_reference.greedy(hf_reference.tokenizer(prompt).input_ids, 8), prompt[:30]
            assert msgs[-1].finish_reason == "length"
        stats = await cluster_stats(stack.address)
        assert stats.counters["conditional_local_prefills"] == 1
        prefill = next(w for w in stats.workers if w.role == "prefill")
        assert prefill.counters["prefix_queries"] >= 256 // 16  # the long prompt went to the prefill worker
        assert stack.proc.saw(lambda line: "prefill chunks sized from" in line)
        assert stack.proc.saw(lambda line: "online planner: every" in line)
        await assert_blocks_all_free(stack.address)
    finally:
        stack.down()
