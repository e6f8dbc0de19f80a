"""Routing policies on fake workers (no servers)."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.policy import KvAware, LeastLoaded, NoWorkerAvailable, RoundRobin, make_policy, prefix_overlap
from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import Role, Worker
from pdserve.v1 import pdserve_pb2 as pb

SYSTEM = list(range(1000, 1000 + 160))  # a 10-block shared system prompt


def request(tail: list[int]) -> ValidatedRequest:
    return ValidatedRequest("r", SYSTEM + tail, SamplingParams(max_tokens=4))


def worker(name: str, role=Role.PREFILL, **stats) -> Worker:
    w = Worker(name, role, channel=None)
    w.update_stats(pb.WorkerStats(**{"address": name, "block_size": 16, "blocks_total": 100, "blocks_free": 100,
                                     "max_num_seqs": 8, **stats}))
    return w


def test_kv_aware_prefers_the_worker_holding_the_prefix():
    a, b = worker("a"), worker("b", cached_block_hashes=block_hashes(SYSTEM, 16))
    assert KvAware().pick_prefill(request([1, 2, 3]), [a, b]) is b


def test_kv_aware_weighs_queued_work_against_cache_hits():
    hot = worker("hot", cached_block_hashes=block_hashes(SYSTEM, 16), queued_prefill_tokens=5000)
    idle = worker("idle")
    assert KvAware().pick_prefill(request([1]), [hot, idle]) is idle


def test_kv_aware_keeps_a_burst_together_before_digests_arrive():
    policy, workers = KvAware(), [worker("a"), worker("b"), worker("c")]
    first = policy.pick_prefill(request([7]), workers)
    assert all(policy.pick_prefill(request([i]), workers) is first for i in range(8, 14))


def test_kv_aware_decode_avoids_full_workers():
    busy = worker("busy", Role.DECODE, running=8, blocks_free=5)
    free = worker("free", Role.DECODE, running=1, blocks_free=90)
    assert KvAware().pick_decode(request([]), [busy, free]) is free


def test_prefix_overlap_stops_at_the_first_miss():
    hashes = block_hashes(SYSTEM, 16)
    assert prefix_overlap(hashes, set(hashes[:4]) | {hashes[6]}) == 4


def test_round_robin_and_least_loaded():
    a, b = worker("a"), worker("b")
    rr = RoundRobin()
    assert [rr.pick_prefill(request([]), [a, b]).address for _ in range(4)] == ["a", "b", "a", "b"]
    a.inflight = 3
    assert LeastLoaded().pick_decode(request([]), [a, b]) is b


def test_exclusion_and_health():
    a, b = worker("a"), worker("b")
    assert RoundRobin().pick_prefill(request([]), [a, b], exclude={"a"}) is b
    assert RoundRobin().pick_prefill(request([]), [a], exclude={"a"}) is a  # nothing else: try it again
    a.record_failure(threshold=2)
    assert a.healthy
    a.record_failure(threshold=2)
    assert not a.healthy and KvAware().pick_prefill(request([]), [a, b]) is b
    b.healthy = False
    with pytest.raises(NoWorkerAvailable, match="failing health checks"):
        KvAware().pick_prefill(request([]), [a, b])
    a.record_success()
    assert a.healthy


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")
