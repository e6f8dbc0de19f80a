"""Routing policies on fake workers (no servers)."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefix_hash import block_hashes
from pdserve.router.policy import KvAware, LeastLoaded, NoWorkerAvailable, RoundRobin, make_policy
from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import PrefillWork, PromptBlocks, Role, Worker, prefix_overlap
from pdserve.v1 import pdserve_pb2 as pb

SYSTEM = list(range(1000, 1000 + 160))  # a 10-block shared system prompt


def request(tail: list[int]) -> ValidatedRequest:
    return ValidatedRequest("r", SYSTEM + tail, SamplingParams(max_tokens=4))


def worker(name: str, role=Role.PREFILL, **stats) -> Worker:
    w = Worker(name, role, channel=None)
    w.update_stats(
        pb.WorkerStats(
            **{"address": name, "block_size": 16, "blocks_total": 100, "blocks_free": 100, "max_num_seqs": 8, **stats}
        )
    )
    return w


def test_kv_aware_prefers_the_worker_holding_the_prefix():
    a, b = worker("a"), worker("b", cached_block_hashes=block_hashes(SYSTEM, 16))
    assert KvAware().pick_prefill(request([1, 2, 3]), [a, b]) is b


def test_kv_aware_weighs_queued_work_against_cache_hits():
    hot = worker("hot", cached_block_hashes=block_hashes(SYSTEM, 16), queued_prefill_tokens=5000)
    idle = worker("idle")
    assert KvAware().pick_prefill(request([1]), [hot, idle]) is idle


def test_kv_aware_keeps_a_burst_together_before_digests_arrive():
    """As the dispatcher does: pick, then count the prompt on the worker (before any reply)."""
    policy, workers = KvAware(), [worker("a"), worker("b"), worker("c")]
    picked, work = [], []
    for i in range(7):
        chosen = policy.pick_prefill(request([i]), workers)
        picked.append(chosen)
        work.append(chosen.begin_prefill(PromptBlocks(request([i]).prompt_token_ids)))
    assert all(w is picked[0] for w in picked)
    assert [w.tokens for w in work] == [len(SYSTEM) + 1] + [1] * 6  # the prefix is computed once
    for chosen, done in zip(picked, work):
        chosen.end_prefill(done)
    assert all(w.inflight == 0 and w.inflight_tokens == 0 for w in workers)


def test_kv_aware_spreads_when_the_queue_outweighs_the_prefix():
    a, b = worker("a"), worker("b")
    for i in range(4):
        a.begin_prefill(PromptBlocks(list(range(5000 + 400 * i, 5400 + 400 * i))))  # 1600 unrelated tokens queued on a
    assert KvAware().pick_prefill(request([1]), [a, b]) is b  # 161 new tokens on b beat 800 + 161 on a


def test_kv_aware_queue_counts_only_uncached_work():
    a, b = worker("a"), worker("b")
    for i in range(4):  # a has the prefix and four requests queued, each 1 token past it
        a.begin_prefill(PromptBlocks(request([i]).prompt_token_ids))
    assert a.inflight_tokens == len(SYSTEM) + 1 + 3
    assert KvAware().pick_prefill(request([9]), [a, b]) is a


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
    a.record_failure(threshold=2, reason="UNAUTHENTICATED: the cluster credential does not match")
    assert not a.healthy and KvAware().pick_prefill(request([]), [a, b]) is b
    b.healthy = False
    with pytest.raises(NoWorkerAvailable, match=r"failing health checks: a \(UNAUTHENTICATED: the cluster"):
        KvAware().pick_prefill(request([]), [a, b])  # why, not only where
    a.record_success()
    assert a.healthy


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")


def test_a_prompt_is_hashed_once_per_block_size():
    prompt = PromptBlocks(SYSTEM)
    assert prompt.hashes(16) is prompt.hashes(16)
    assert prompt.hashes(16) == block_hashes(SYSTEM, 16) and prompt.hashes(32) == block_hashes(SYSTEM, 32)


def test_a_stale_digest_does_not_forget_a_prompt_sent_meanwhile():
    """A digest asked for before a prompt was sent (or while it was still being prefilled) does
    not hold its blocks yet: the router keeps expecting them there until a later digest."""
    a, b = worker("a"), worker("b")
    mark = a.digest_mark()  # the health monitor asks for a's stats...
    work = a.begin_prefill(PromptBlocks(request([1]).prompt_token_ids))  # ...a prompt goes to a...
    a.update_stats(pb.WorkerStats(address="a", block_size=16), mark)  # ...and the answer predates it
    assert KvAware().pick_prefill(request([2]), [b, a]) is a
    mark = a.digest_mark()  # asked while the prefill runs: still not in the digest
    a.update_stats(pb.WorkerStats(address="a", block_size=16), mark)
    assert KvAware().pick_prefill(request([2]), [b, a]) is a
    a.end_prefill(work)
    evicted = a.digest_mark()  # asked after it finished: the digest is the truth (here: evicted since)
    a.update_stats(pb.WorkerStats(address="a", block_size=16), evicted)
    assert a.uncached_tokens(PromptBlocks(request([2]).prompt_token_ids)) == len(SYSTEM) + 1
    assert KvAware().pick_prefill(request([2]), [b, a]) is b  # a tie again: the first listed


def test_a_worker_never_idle_forgets_what_its_digests_have_answered_for():
    """Under constant load some prompt is always in prefill: the blocks of prompts that finished
    before a digest was asked for are the digest's to report, and the router lets them go."""
    a = worker("a")
    a.update_stats(pb.WorkerStats(address="a", block_size=16))
    waiting = a.begin_prefill(PromptBlocks(list(range(-64, 0))))  # waits all along for its decode reservation

    def send(i: int) -> PrefillWork:
        work = a.begin_prefill(PromptBlocks(list(range(1000 * i, 1000 * i + 64))))
        a.prefill_sent(work)
        return work

    running = [send(i) for i in range(2)]
    for i in range(2, 300):  # a new prompt starts as the oldest ends: never idle
        a.end_prefill(running.pop(0))
        running.append(send(i))
        if i % 10 == 0:
            a.update_stats(pb.WorkerStats(address="a", block_size=16), a.digest_mark())
    assert len(a._expected) <= 4 * 13  # those in flight, the waiting one, those since the last digest (4 blocks each)
    assert set(waiting.hashes) <= a.cached_hashes  # not sent yet: no digest can hold it, still expected
    a.update_stats(pb.WorkerStats(address="a", block_size=16), a.digest_mark())  # an empty digest
    in_flight = PromptBlocks(list(range(1000 * 299, 1000 * 299 + 64))).hashes(16)  # the last one sent
    assert set(in_flight) <= a.cached_hashes  # what is still being prefilled stays expected


def test_before_its_first_stats_a_worker_caches_nothing_and_has_no_decode_figures():
    fresh = Worker("fresh", Role.PREFILL, channel=None)
    prompt = PromptBlocks(request([1]).prompt_token_ids)
    assert fresh.block_size is None and fresh.uncached_tokens(prompt) == len(prompt.token_ids)
    assert fresh.begin_prefill(prompt).tokens == len(prompt.token_ids) and not fresh.cached_hashes
    busy = worker("busy", Role.DECODE, running=8, blocks_free=5)
    unknown = Worker("unknown", Role.DECODE, channel=None)
    assert KvAware().pick_decode(request([]), [busy, unknown]) is unknown  # no figures: judged by in-flight count (0)


def test_policy_names_are_the_settings_choices():
    from pdserve.settings import ROUTING_POLICIES, RouterSettings

    assert set(ROUTING_POLICIES) == {"round_robin", "least_loaded", "kv_aware"}
    assert RouterSettings().policy in ROUTING_POLICIES
    assert all(make_policy(name).name == name for name in ROUTING_POLICIES)
