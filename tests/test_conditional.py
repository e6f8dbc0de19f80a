"""Conditional disaggregation: the router's decision on fake worker records (no servers), the
backlog it keeps, the threshold a profile implies, and the decision inside the simulator."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.workloads import RequestSpec
from pdserve.engine.block_manager import block_hashes
from pdserve.planner.profile import Overheads, Profile, StepCost, TransferCost
from pdserve.planner.sim_topology import SimConfig, Topology
from pdserve.planner.simulator import simulate
from pdserve.planner.thresholds import break_even_tokens, conditional_config
from pdserve.router.conditional import ConditionalConfig, ConditionalRouter
from pdserve.router.workers import Role, Worker
from pdserve.v1 import pdserve_pb2 as pb

CONFIG = ConditionalConfig(threshold_tokens=128, local_tokens_per_s=500, remote_tokens_per_s=1000, handoff_ms=50)


def worker(name: str, role: Role, **stats) -> Worker:
    w = Worker(name, role, channel=None)
    w.update_stats(
        pb.WorkerStats(
            **{
                "address": name,
                "block_size": 16,
                "blocks_total": 1000,
                "blocks_free": 1000,
                "max_num_seqs": 64,
                **stats,
            }
        )
    )
    return w


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_short_prompts_stay_on_the_decode_worker():
    router, decode, pool = ConditionalRouter(CONFIG), worker("d", Role.DECODE), [worker("p", Role.PREFILL)]
    assert router.prefill_locally(prompt(100), decode, pool)
    assert router.decisions == {"local": 1, "remote": 0}


def test_long_prompts_go_to_an_idle_prefill_pool():
    router, decode, pool = ConditionalRouter(CONFIG), worker("d", Role.DECODE), [worker("p", Role.PREFILL)]
    assert not router.prefill_locally(prompt(1500), decode, pool)


def test_a_backed_up_pool_sends_long_prompts_to_the_decode_worker():
    # Remote: (4000 queued + 1500) / 1000 tok/s + 50 ms = 5.55 s; local: 1500 / 500 = 3 s.
    router, decode = ConditionalRouter(CONFIG), worker("d", Role.DECODE)
    busy = worker("p", Role.PREFILL, queued_prefill_tokens=4000)
    assert router.prefill_locally(prompt(1500), decode, [busy])
    # ... unless another prefill worker is free.
    assert not router.prefill_locally(prompt(1500), decode, [busy, worker("q", Role.PREFILL)])


def test_a_decode_worker_without_headroom_takes_no_prompt():
    router, pool = ConditionalRouter(CONFIG), [worker("p", Role.PREFILL, queued_prefill_tokens=100_000)]
    full_batch = worker("d", Role.DECODE, running=48)  # 75% of 64 slots
    assert not router.prefill_locally(prompt(16), full_batch, pool)
    no_blocks = worker("d2", Role.DECODE, blocks_free=100)  # 10% must stay free
    assert not router.prefill_locally(prompt(16), no_blocks, pool)
    assert router.prefill_locally(prompt(16), worker("d3", Role.DECODE, running=40), pool)


def test_the_threshold_counts_only_what_the_decode_worker_does_not_cache():
    router, pool = ConditionalRouter(CONFIG), [worker("p", Role.PREFILL)]
    system = prompt(1024)
    holder = worker("d", Role.DECODE, cached_block_hashes=block_hashes(system, 16))
    assert router.prefill_locally(system + prompt(40, 9000), holder, pool)  # 40 uncached tokens
    assert not router.prefill_locally(system + prompt(40, 9000), worker("e", Role.DECODE), pool)


def test_local_prefills_count_as_backlog_until_their_first_token():
    router, decode = ConditionalRouter(CONFIG), worker("d", Role.DECODE)
    pool = [worker("p", Role.PREFILL, queued_prefill_tokens=2000)]
    # Remote: (2000 + 1500) / 1000 + 0.05 = 3.55 s; local, with 1000 tokens already sent: 2500 / 500 = 5 s.
    work = router.begin_local(decode, prompt(1000, 50_000))
    assert work == 1000 and router.local_tokens == {"d": 1000}
    assert not router.prefill_locally(prompt(1500), decode, pool)
    router.end_local(decode, work)
    assert router.local_tokens == {}
    assert router.prefill_locally(prompt(1500), decode, pool)  # 3 s locally now


def test_track_ends_the_backlog_at_the_first_event_or_on_close():
    router, decode = ConditionalRouter(CONFIG), worker("d", Role.DECODE)

    async def events(n: int):
        for i in range(n):
            yield i

    async def main():
        seen = []
        async for e in router.track(decode, prompt(300), events(3)):
            seen.append((e, dict(router.local_tokens)))
        assert seen == [(0, {}), (1, {}), (2, {})]
        stream = router.track(decode, prompt(300), events(3))
        await stream.__anext__()
        await stream.aclose()
        closed_early = router.track(decode, prompt(300), events(0))
        assert [e async for e in closed_early] == []
        return dict(router.local_tokens)

    assert asyncio.run(main()) == {}


def test_bad_conditional_settings_are_refused():
    with pytest.raises(ValueError, match="conditional_threshold_tokens"):
        ConditionalConfig(threshold_tokens=-1)
    with pytest.raises(ValueError):
        ConditionalConfig(max_occupancy=0)


# -- from a profile -------------------------------------------------------------------------------


def _profile(handoff_ms: float) -> Profile:
    cost = StepCost(base_ms=20.0, decode_ms=1.0, prefill_ms=1.0, decode_ctx_ms=0.0, prefill_attn_ms=0.0)
    return Profile(
        model="toy",
        device="toy",
        parallel="threads",
        steps={1: cost},
        kv_bytes_per_token=1000,
        transfers={"tcp": TransferCost(0.0, 0.0)},
        transport="tcp",
        overheads=Overheads(handoff_ms=handoff_ms),
    )


def test_the_threshold_is_where_the_local_path_stops_being_faster():
    # Local, beside 8 decodes (28 ms): chunks of 52 tokens per 80 ms step; remote: 20 + n + the handoff.
    p = _profile(handoff_ms=100.0)
    threshold = break_even_tokens(p, 1, 1, tpot_ms=80.0)
    assert threshold % 16 == 0 and threshold > 0
    from pdserve.planner.thresholds import local_prefill_ms, remote_prefill_ms

    assert local_prefill_ms(p, threshold, 1, 80.0) <= remote_prefill_ms(p, threshold, 1)
    assert local_prefill_ms(p, threshold + 16, 1, 80.0) > remote_prefill_ms(p, threshold + 16, 1)
    # A costlier handoff makes the local path win for longer prompts; a tighter TPOT, for shorter.
    assert break_even_tokens(_profile(handoff_ms=400.0), 1, 1, 80.0) > threshold
    assert break_even_tokens(p, 1, 1, tpot_ms=40.0) < threshold
    assert conditional_config(p, 80.0).threshold_tokens == threshold
    assert conditional_config(p, 80.0, threshold_tokens=7).threshold_tokens == 7  # the override wins


def test_the_simulator_routes_conditionally():
    p = _profile(handoff_ms=100.0)
    specs = [RequestSpec(tuple(prompt(n, 1000 + 3000 * i)), 8) for i, n in enumerate([32, 2000, 48, 1500])]
    # Short prompts stay local; the first long one goes to the idle pool; the second long one,
    # arriving while the pool still works on the first (~2 s), is prefilled locally sooner.
    run = simulate(p, Topology(1, 1, conditional=True), specs, [0.0, 0.1, 0.2, 0.3], SimConfig(slo_tpot_ms=80.0))
    assert (run.counters["prefill_local"], run.counters["prefill_remote"]) == (3, 1)
    assert all(t.success for t in run.timelines)
    later = simulate(p, Topology(1, 1, conditional=True), specs, [0.0, 0.1, 0.2, 6.0], SimConfig(slo_tpot_ms=80.0))
    assert (later.counters["prefill_local"], later.counters["prefill_remote"]) == (2, 2)  # the pool is idle again
    plain = simulate(p, Topology(1, 1), specs, [0.0, 0.1, 0.2, 0.3])
    assert plain.counters["prefill_remote"] == 4
