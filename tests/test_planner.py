"""Profile, simulator and planner (no servers): the profile's JSON round trip and its errors, the
step-cost fit, the simulator's event model against hand-computed tiny cases, its determinism,
chunk sizing in the real scheduler, and the planner on synthetic profiles whose best placement
is known by construction."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import arrivals, workloads
from pdserve.bench.metrics import Goodput, compute
from pdserve.bench.workloads import RequestSpec
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence
from pdserve.planner.chunking import ChunkSizer
from pdserve.planner.fit import StepSample, fit_step_cost
from pdserve.planner.planner import attainment, plan, run_at
from pdserve.planner.profile import Overheads, Profile, StepCost, StepShape, TransferCost
from pdserve.planner.sim_topology import SimConfig, Topology
from pdserve.planner.simulator import simulate

MIB = 2**20
SPAN_S = 12.0  # simulated seconds of arrivals per planner run: long enough for queues to show, short enough for a test


def profile(
    cost: StepCost,
    *,
    overheads: Overheads = Overheads(),
    cores: int | None = None,
    kv_bytes: int = MIB,
    transfer: TransferCost = TransferCost(0.0, 0.0),
    degrees=(1,),
    parallel: str = "threads",
) -> Profile:
    return Profile(
        model="toy",
        device="toy",
        parallel=parallel,
        steps={d: cost for d in degrees},
        kv_bytes_per_token=kv_bytes,
        transfers={"tcp": transfer},
        transport="tcp",
        overheads=overheads,
        cores=cores,
    )


# A step costs 10 ms, +2 ms per decode, +1 ms per prompt token (no attention terms): easy to add up.
SIMPLE = StepCost(base_ms=10.0, decode_ms=2.0, prefill_ms=1.0, decode_ctx_ms=0.0, prefill_attn_ms=0.0)


def req(prompt_len: int, max_tokens: int, first_id: int = 1000) -> RequestSpec:
    return RequestSpec(tuple(range(first_id, first_id + prompt_len)), max_tokens)


def times_ms(timeline) -> list[float]:
    return [round((t - timeline.send_time) * 1e3, 6) for t in timeline.chunk_times]


# -- the profile ---------------------------------------------------------------------------------


def test_profile_round_trip(tmp_path):
    p = Profile(
        model="m",
        device="cpu (2 cores)",
        parallel="threads",
        steps={1: StepCost(17.0, 0.8, 1.3, 5e-4, 2e-4), 2: StepCost(12.0, 0.5, 0.7, 3e-4, 1e-4)},
        kv_bytes_per_token=23040,
        transfers={"shm": TransferCost(2.0, 0.3), "tcp": TransferCost(3.0, 0.5)},
        transport="shm",
        overheads=Overheads(5.0, 20.0, 1.0, 0.1, 1.0),
        cores=2,
        kv_cache_tokens={1: 90000, 2: 90000},
        source="test",
        fit_error={1: 0.05, 2: 0.07},
        samples=({"label": "x", "ms": 1.0},),
    )
    path = p.save(tmp_path / "p.json")
    assert Profile.load(path) == p
    assert Profile.from_dict(json.loads(path.read_text())) == p


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.pop("steps"), "steps"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.update(transport="ucx"), "transport"),
        (lambda d: d["steps"].update({"zero": d["steps"]["1"]}), "steps"),
        (lambda d: d["steps"]["1"].update(base_ms=float("nan")), "base_ms"),
        (lambda d: d["overheads"].update(handoff_ms=-1), "handoff_ms"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d.update(parallel="pipeline"), "parallel"),
        (lambda d: d["steps"]["1"].update(base_ms=0, decode_ms=0, prefill_ms=0), "must each take > 0 ms"),
        (lambda d: d.update(cores="2"), "cores"),
        (lambda d: d.update(kv_cache_tokens={"1": -5}), "kv_cache_tokens"),
        (lambda d: d.update(kv_cache_tokens={"1": "many"}), "kv_cache_tokens"),
        (lambda d: d.update(fit_error={"1": "x"}), "fit_error"),
        (lambda d: d.update(transport=[]), "transport"),
        (lambda d: d.update(kv_bytes_per_token=10**400), "kv_bytes_per_token"),
        (lambda d: d["steps"]["1"].update(decode_ctx_ms=-0.5), "would cost nothing"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(tmp_path, change, field):
    data = profile(SIMPLE).to_dict()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        Profile.load(path)


def test_missing_or_garbled_profile_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="pdserve profile --output"):
        Profile.load(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.load(tmp_path / "x.json")


def test_step_cost_terms_and_chunk_fit():
    cost = StepCost(10.0, 2.0, 1.0, 0.01, 0.001)
    shape = StepShape.of([100, 300], [(0, 50), (200, 10)])
    assert shape == StepShape(2, 400, 60, 50 * 25 + 10 * 205)
    assert cost.ms(shape) == pytest.approx(10 + 2 * 2 + 60 + 0.01 * 400 + 0.001 * (1250 + 2050))
    assert cost.ms(StepShape()) == 0.0  # no step, no cost
    # 4 decodes of 100 tokens: 10 + 8 + 4 = 22 ms; 50 ms leaves 28 ms for n tokens: n + n^2 / 2000 <= 28
    n = cost.max_prefill_tokens(4, 400, 50.0)
    assert cost.ms(StepShape.of([100] * 4, [(0, n)])) <= 50.0 < cost.ms(StepShape.of([100] * 4, [(0, n + 1)]))
    assert cost.max_prefill_tokens(4, 400, 20.0) == 0


def test_fit_recovers_a_known_cost():
    truth = StepCost(15.0, 0.7, 0.9, 0.004, 0.0005)
    shapes = [StepShape.of([], [(0, n)]) for n in (16, 128, 512, 2048)] + [StepShape.of([], [(1024, 512)])]
    shapes += [StepShape.of([c] * b, []) for b, c in ((1, 64), (8, 512), (32, 256), (64, 1024))]
    shapes += [StepShape.of([256] * 8, [(0, 128)])]
    cost, error = fit_step_cost([StepSample(1, s, truth.ms(s)) for s in shapes])
    assert error < 1e-6
    assert cost.coefficients() == pytest.approx(truth.coefficients(), rel=1e-4)


def test_fit_keeps_coefficients_non_negative():
    # Decodes that seem to get cheaper with batch size must not give a negative per-decode cost.
    samples = [StepSample(1, StepShape.of([64] * b, []), ms) for b, ms in ((1, 20.0), (8, 19.0), (32, 18.5))]
    samples += [StepSample(1, StepShape.of([], [(0, n)]), 10 + n) for n in (64, 512)]
    cost, _ = fit_step_cost(samples)
    assert all(c >= 0 for c in cost.coefficients())


# -- the event model against hand-computed cases ----------------------------------------------------


def test_colocated_one_request_by_hand():
    p = profile(SIMPLE, overheads=Overheads(first_token_ms=5.0))
    run = simulate(p, Topology(prefill=0, colocated=True), [req(32, 3)], [0.0])
    # TTFT: 5 (router) + 10 + 32 (the prompt's step); then decode steps of 10 + 2.
    assert times_ms(run.timelines[0]) == [47.0, 59.0, 71.0]
    assert run.timelines[0].success and run.duration == pytest.approx(0.071)


def test_disaggregated_one_request_by_hand():
    p = profile(SIMPLE, overheads=Overheads(first_token_ms=5.0, handoff_ms=7.0), transfer=TransferCost(3.0, 0.5))
    run = simulate(p, Topology(prefill=1, decode=1), [req(32, 3)], [0.0])
    # 5 + 42 (prefill) + 3 + 0.5 x 32 MiB (KV of 32 tokens) + 7 (handoff) = 73; decode steps of 12.
    assert times_ms(run.timelines[0]) == [73.0, 85.0, 97.0]


def test_two_prompts_share_a_step_then_decode_together():
    p = profile(SIMPLE)
    run = simulate(p, Topology(prefill=0, colocated=True), [req(32, 2, 1000), req(32, 2, 5000)], [0.0, 0.0])
    # One step runs both prompts (10 + 64), the next decodes both (10 + 4).
    assert [times_ms(t) for t in run.timelines] == [[74.0, 88.0], [74.0, 88.0]]


def test_chunked_prefill_splits_a_long_prompt_at_the_token_budget():
    p = profile(SIMPLE)
    run = simulate(p, Topology(prefill=0, colocated=True), [req(100, 1)], [0.0], SimConfig(max_num_batched_tokens=64))
    assert times_ms(run.timelines[0]) == [(10 + 64) + (10 + 36)]
    unchunked = simulate(
        p,
        Topology(prefill=0, colocated=True, chunked_prefill=False),
        [req(100, 1)],
        [0.0],
        SimConfig(max_num_batched_tokens=64),
    )
    assert times_ms(unchunked.timelines[0]) == [10 + 100]  # too long for the budget: runs alone, whole


def test_a_second_prompt_waits_for_the_first_step():
    p = profile(SIMPLE)
    run = simulate(p, Topology(prefill=0, colocated=True), [req(40, 1, 1000), req(40, 1, 5000)], [0.0, 0.010])
    assert times_ms(run.timelines[0]) == [50.0]  # 10 + 40
    assert times_ms(run.timelines[1]) == [90.0]  # sent at 10 ms, starts at 50 ms, done at 100 ms


def test_workers_share_cores_when_their_threads_outnumber_them():
    # Two colocated workers with one thread each on one core: while both run, each at half speed.
    p = profile(SIMPLE, cores=1)
    topology = Topology(prefill=0, decode=2, colocated=True, policy="round_robin", decode_degree=1)
    run = simulate(p, topology, [req(40, 1, 1000), req(40, 1, 5000)], [0.0, 0.0])
    assert [times_ms(t) for t in run.timelines] == [[100.0], [100.0]]  # 50 ms of work each, shared
    alone = simulate(p, topology, [req(40, 1, 1000), req(40, 1, 5000)], [0.0, 0.5])
    assert [times_ms(t) for t in alone.timelines] == [[50.0], [50.0]]


def test_prefix_cache_hits_skip_work():
    p = profile(SIMPLE)
    shared = req(64, 1, 1000)
    run = simulate(p, Topology(prefill=0, colocated=True), [shared, shared], [0.0, 1.0])
    # The second prompt finds 3 of its 4 blocks cached (the last token always runs): 10 + 16.
    assert times_ms(run.timelines[1]) == [26.0]


def test_the_first_token_does_not_wait_for_the_prefill_workers_next_step():
    # The decode side acknowledges A's K/V at 68 ms (42 + 3 + 0.5 x 32 + 7) while the prefill
    # worker computes B's prompt (42 to 252 ms): the prefill answers the router at once, so A's
    # first token reaches the client at 68 ms and the decode worker's next two at 80 and 92 ms.
    p = profile(SIMPLE, overheads=Overheads(handoff_ms=7.0), transfer=TransferCost(3.0, 0.5))
    run = simulate(p, Topology(prefill=1, decode=1), [req(32, 3, 1000), req(200, 2, 5000)], [0.0, 0.010])
    assert times_ms(run.timelines[0]) == [68.0, 80.0, 92.0]
    # B: shipped at 252 ms, acknowledged at 362 (3 + 100 + 7), decoded by 374; sent at 10 ms.
    assert times_ms(run.timelines[1]) == [352.0, 364.0]


TWO_THREADS = StepCost(base_ms=5.0, decode_ms=1.0, prefill_ms=0.5, decode_ctx_ms=0.0, prefill_attn_ms=0.0)


def two_core_profile() -> Profile:
    """Two cores; every step costs twice as much on one thread as on two."""
    return Profile(
        model="toy",
        device="toy",
        parallel="threads",
        steps={1: SIMPLE, 2: TWO_THREADS},
        kv_bytes_per_token=MIB,
        transfers={"tcp": TransferCost(0.0, 0.0)},
        transport="tcp",
        overheads=Overheads(),
        cores=2,
    )


def test_one_decode_worker_borrows_the_idle_prefill_workers_core():
    # One thread per decode worker; its decode-only steps cost 12 ms on one thread, 6 on two.
    # The prefill (sharing both cores while the decode worker idles) takes 5 + 0.5 x 32 ms.
    p = two_core_profile()
    alone = simulate(p, Topology(prefill=1, decode=1), [req(32, 4)], [0.0])
    assert times_ms(alone.timelines[0]) == [21.0, 27.0, 33.0, 39.0]
    pinned = simulate(p, Topology(prefill=1, decode=1, decode_degree=1), [req(32, 4)], [0.0])
    assert times_ms(pinned.timelines[0]) == [21.0, 33.0, 45.0, 57.0]  # a degree set by hand: 10 + 2
    two_pools = simulate(p, Topology(prefill=1, decode=2), [req(32, 2)], [0.0])
    assert times_ms(two_pools.timelines[0])[1] - times_ms(two_pools.timelines[0])[0] > 6.0  # no borrowing


def test_a_prefill_worker_sharing_the_cores_runs_on_those_the_decode_worker_leaves():
    # A (32 tokens) prefills on both cores: 21 ms. B (200 tokens, sent at 10 ms) prefills from
    # 21 ms while A's three decode steps run on one thread (12 ms each, B waits for its KV):
    # until 57 ms B runs on the one core left, at half its two-thread speed (18 of its 105 ms),
    # then on both: done at 57 + 87 = 144 ms, 134 ms after it was sent; its next token takes a
    # decode step on both cores (6 ms). With the prefill's degree set by hand, it never shares.
    p = two_core_profile()
    specs, sent = [req(32, 4), req(200, 2, 5000)], [0.0, 0.010]
    shared = simulate(p, Topology(prefill=1, decode=1), specs, sent)
    assert [times_ms(t) for t in shared.timelines] == [[21.0, 33.0, 45.0, 57.0], [134.0, 140.0]]
    by_hand = simulate(p, Topology(prefill=1, decode=1, prefill_degree=1), specs, sent)
    assert [times_ms(t) for t in by_hand.timelines] == [[42.0, 54.0, 66.0, 78.0], [242.0, 248.0]]


def test_a_reservation_waits_for_blocks_and_a_request_ends_at_its_deadline():
    # 8 blocks of 16 tokens per worker: A (40 + 60 tokens) grows to all of them on the decode
    # worker, so B (100 tokens) cannot get its 7 blocks until A has finished.
    p = profile(SIMPLE)
    specs, sent = [req(40, 60, 1000), req(100, 2, 5000)], [0.0, 0.1]
    run = simulate(p, Topology(prefill=1, decode=1), specs, sent, SimConfig(kv_cache_tokens=128))
    a, b = run.timelines
    assert a.success and b.success and b.chunk_times[0] > a.end_time
    # At its deadline a request is cancelled, as the router cancels its calls: A stops there
    # (it ran to its end before, holding the blocks B waited for), and B, whose reservation
    # came only then, cannot prefill and answer by its own.
    short = simulate(
        p, Topology(prefill=1, decode=1), specs, sent, SimConfig(kv_cache_tokens=128, request_timeout_s=0.5)
    )
    a, b = short.timelines
    assert "DEADLINE_EXCEEDED" in a.error and 0 < len(a.chunk_times) < 60 and a.chunk_times[-1] <= 0.5
    assert not b.chunk_times and "DEADLINE_EXCEEDED" in b.error and short.counters["failed"] == 2
    # Sent together, B's wait for its blocks runs out with A's deadline: refused, and it says why.
    together = simulate(
        p, Topology(prefill=1, decode=1), specs, [0.0, 0.0], SimConfig(kv_cache_tokens=128, request_timeout_s=0.5)
    )
    a, b = together.timelines
    assert "DEADLINE_EXCEEDED" in a.error and not b.chunk_times and "RESOURCE_EXHAUSTED" in b.error


def test_requests_that_do_not_fit_fail_cleanly():
    p = profile(SIMPLE)
    run = simulate(p, Topology(prefill=1, decode=1), [req(32, 2), req(9000, 2)], [0.0, 0.0])
    assert run.timelines[0].success
    assert "INVALID_ARGUMENT" in run.timelines[1].error


# -- determinism ------------------------------------------------------------------------------------


def _mixed_run(seed: int, topology: Topology):
    specs = workloads.build(workloads.WorkloadConfig(name="mixed", num_prompts=40, seed=seed), lambda: None)
    p = profile(
        StepCost(17.0, 0.8, 1.3, 5e-4, 2e-4),
        overheads=Overheads(5.0, 20.0, 1.0, 0.1),
        cores=2,
        kv_bytes=23040,
        transfer=TransferCost(2.0, 0.3),
        degrees=(1, 2),
    )
    return simulate(p, topology, specs, arrivals.arrival_offsets(len(specs), 1.0, 1.0, seed), SimConfig(slo_tpot_ms=80))


@pytest.mark.parametrize(
    "topology",
    [Topology(prefill=0, colocated=True), Topology(2, 1), Topology(1, 1, conditional=True)],
    ids=lambda t: t.label,
)
def test_the_simulator_is_deterministic(topology):
    a, b, c = _mixed_run(0, topology), _mixed_run(0, topology), _mixed_run(1, topology)
    key = lambda run: [(t.send_time, t.chunk_times, t.error) for t in run.timelines]  # noqa: E731
    assert key(a) == key(b) and a.counters == b.counters
    assert key(a) != key(c)
    assert all(t.success for t in a.timelines)


# -- chunk sizing in the real scheduler ---------------------------------------------------------------


def test_chunk_sizer_keeps_a_mixed_step_within_the_budget():
    sizer = ChunkSizer(SIMPLE, step_budget_ms=50.0)
    assert sizer.tokens(4, 400) == 50 - 10 - 8  # 32 tokens of 1 ms beside 4 decodes of 2 ms
    assert sizer.tokens(30, 3000) == 16  # no room at all: the minimum, so prompts still progress


def test_scheduler_limits_prompt_chunks_only_while_it_decodes():
    blocks = BlockManager(256, 16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024), blocks)
    scheduler.prefill_token_limit = ChunkSizer(SIMPLE, step_budget_ms=50.0)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    long = Sequence("long", list(range(1000, 1600)), 600, sampling)
    scheduler.add(long)
    first = scheduler.schedule()
    assert [c.num_tokens for c in first.prefills] == [600]  # nothing decodes: the whole budget
    long.num_computed_tokens = 600
    long.token_ids.append(7)
    other = Sequence("other", list(range(5000, 5600)), 600, sampling)
    scheduler.add(other)
    second = scheduler.schedule()
    assert len(second.decodes) == 1
    assert [c.num_tokens for c in second.prefills] == [50 - 10 - 2]


# -- the planner --------------------------------------------------------------------------------------


def _fixed_workload(n: int, prompt: int, output: int) -> list[RequestSpec]:
    return [req(prompt, output, 1000 + 7 * i) for i in range(n)]


def test_planner_picks_more_prefill_when_prompts_dominate():
    # Prompts of 512 tokens at 2 ms each (~1 s to prefill), 32 cheap output tokens, and a TPOT
    # SLO that leaves no room beside a decode step for even a minimal prompt chunk: a colocated
    # or conditional worker breaks TPOT, and one decode worker keeps up with several prefill
    # workers. The best unit within 4 devices is 3P1D.
    cost = StepCost(base_ms=10.0, decode_ms=0.1, prefill_ms=2.0, decode_ctx_ms=0.0, prefill_attn_ms=0.0)
    fleet = plan(
        profile(cost, parallel="tensor_parallel"),
        _fixed_workload(80, 512, 32),
        Goodput(ttft_ms=3000, tpot_ms=25),
        budget=4,
        max_unit_devices=4,
        top_k=8,
        conditional=False,
        span_s=SPAN_S,
    )
    best = fleet.unit.topology
    assert (best.colocated, best.prefill, best.decode) == (False, 3, 1), [
        (u.label, u.goodput) for u in fleet.candidates
    ]
    assert fleet.replicas == 1 and fleet.goodput > 0


def test_planner_keeps_prefill_on_the_decode_worker_when_prompts_are_cheap():
    # Tiny prompts (16 tokens, nearly free) and long outputs: a separate prefill worker would sit
    # idle, so one colocated instance per device serves the most.
    cost = StepCost(base_ms=10.0, decode_ms=1.0, prefill_ms=0.01, decode_ctx_ms=0.0, prefill_attn_ms=0.0)
    fleet = plan(
        profile(cost, parallel="tensor_parallel"),
        _fixed_workload(80, 16, 128),
        Goodput(ttft_ms=1000, tpot_ms=40),
        budget=4,
        max_unit_devices=4,
        top_k=8,
        conditional=False,
        span_s=SPAN_S,
    )
    assert fleet.unit.topology.colocated, [(u.label, u.goodput) for u in fleet.candidates]
    assert fleet.replicas == 4  # one device each: the budget holds four


def test_plan_goodput_meets_the_attainment_it_claims():
    cost = StepCost(base_ms=10.0, decode_ms=0.5, prefill_ms=1.0, decode_ctx_ms=0.0, prefill_attn_ms=0.0)
    p, specs, slo = (
        profile(cost, parallel="tensor_parallel"),
        _fixed_workload(60, 128, 32),
        Goodput(ttft_ms=500, tpot_ms=30),
    )
    fleet = plan(p, specs, slo, budget=2, max_unit_devices=2, top_k=4, span_s=SPAN_S)
    u = fleet.unit
    run = run_at(p, u.topology, specs, u.goodput, SimConfig(), span_s=SPAN_S)
    met = sum(t.success and slo.met_by(t) for t in run.timelines) / len(run.timelines)
    assert met >= 0.9
    assert compute(run.timelines, run.duration, slo).completed == len(run.timelines) >= u.goodput * SPAN_S
    overloaded = run_at(p, u.topology, specs, 2 * u.goodput, SimConfig(), span_s=SPAN_S)
    assert sum(t.success and slo.met_by(t) for t in overloaded.timelines) / len(overloaded.timelines) < 0.9


def test_plan_refuses_bad_budgets_and_missing_slos():
    p = profile(SIMPLE, parallel="tensor_parallel")
    with pytest.raises(ValueError, match="budget"):
        plan(p, _fixed_workload(4, 16, 4), Goodput(ttft_ms=100), budget=0)
    with pytest.raises(ValueError, match="SLO"):
        plan(p, _fixed_workload(4, 16, 4), Goodput(), budget=2)


def test_a_low_rate_sends_every_request_and_meets_what_a_high_one_meets():
    """Below num_prompts / time limit req/s the planner's run must still send the whole workload:
    a slower arrival rate can only make the SLOs easier to meet."""
    p = profile(SIMPLE, kv_bytes=1000)
    specs = [req(100, 20, first_id=1000 + 300 * i) for i in range(40)]
    topology = Topology(prefill=0, decode=1, colocated=True)
    config = SimConfig(time_limit_s=30.0)  # 40 requests at 0.5 req/s arrive over 80 s
    slo = Goodput.parse(["ttft:2000", "tpot:100"], "--slo")
    runs = {rate: run_at(p, topology, specs, rate, config, span_s=1.0) for rate in (0.5, 4.0)}
    for run in runs.values():
        assert len(run.timelines) == 40 and not [t.error for t in run.timelines if t.error]
    assert attainment(runs[0.5], slo) >= attainment(runs[4.0], slo) == 1.0


def test_a_profile_of_another_model_is_named_at_start(caplog):
    p = profile(SIMPLE)  # of the model "toy"
    p.warn_if_other_model("/models/toy", "p.json")
    assert not caplog.records
    p.warn_if_other_model("/models/SmolLM2-135M", "p.json")
    assert "profile p.json measured toy on toy; this worker serves SmolLM2-135M" in caplog.text
