"""The router's online planner: load forecast, measured-vs-predicted correction, the capacity
model it asks, and the Prometheus gauges it exports (fake clock, no servers)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.metrics import ROUTER as REGISTRY  # the router's series
from pdserve.planner import capacity
from pdserve.planner.online import OnlinePlanner
from pdserve.planner.profile import Overheads, Profile, StepCost, TransferCost
from pdserve.router.validation import ValidatedRequest

COST = StepCost(base_ms=10.0, decode_ms=1.0, prefill_ms=1.0, decode_ctx_ms=0.0, prefill_attn_ms=0.0)
PROFILE = Profile(
    model="toy",
    device="toy",
    parallel="tensor_parallel",
    steps={1: COST},
    kv_bytes_per_token=1000,
    transfers={"tcp": TransferCost(0.0, 0.0)},
    transport="tcp",
    overheads=Overheads(first_token_ms=10.0),
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(prompt_len: int, max_tokens: int) -> ValidatedRequest:
    return ValidatedRequest("r", list(range(1000, 1000 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def feed(planner: OnlinePlanner, clock: Clock, rate: float, seconds: float, prompt_len=200, max_tokens=50) -> None:
    for _ in range(int(rate * seconds)):
        planner.watch(request(prompt_len, max_tokens))
        clock.now += 1 / rate


def test_forecast_and_replicas_follow_the_arrival_rate():
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=50, window_s=60, clock=clock)
    assert planner.decide().prefill == 0.0  # nothing arrived: nothing needed
    feed(planner, clock, rate=4.0, seconds=60)
    d = planner.decide()
    assert d.rate == pytest.approx(4.0, rel=0.02)
    w = capacity.WorkloadStats(200, 50, 200)
    p, dd = capacity.replicas_needed(PROFILE, w, d.rate, 1000, 50, 1, 1)
    assert (d.prefill, d.decode) == pytest.approx((p, dd))
    feed(planner, clock, rate=8.0, seconds=60)  # the window forgets the slower minute
    assert planner.decide().rate == pytest.approx(8.0, rel=0.02)
    assert planner.decide().prefill == pytest.approx(2 * d.prefill, rel=0.05)


def test_measured_latency_above_the_profile_asks_for_more_replicas():
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=50, window_s=60, clock=clock)
    feed(planner, clock, rate=4.0, seconds=30, max_tokens=3)  # as long as the answers measured below
    base = planner.decide()
    assert (base.ttft_correction, base.tpot_correction) == (1.0, 1.0)
    predicted_ttft_s = (10.0 + COST.prefill_alone_ms(200)) / 1e3
    predicted_tpot_s = COST.decode_step_ms(1, 200) / 1e3
    for _ in range(5):  # the fleet runs twice as slow as its profile says
        watch = planner.watch(request(200, 3))
        clock.now += 2 * predicted_ttft_s
        watch.token(1, None)
        clock.now += 2 * 2 * predicted_tpot_s
        watch.token(2, "length")
    slow = planner.decide()
    assert slow.ttft_correction == pytest.approx(2.0, rel=0.01)
    assert slow.tpot_correction == pytest.approx(2.0, rel=0.01)
    assert slow.prefill > base.prefill and slow.decode > base.decode


def test_no_forecast_is_exported_before_the_planner_decides():
    """A router without a planner (or before its first decision) exports no request rate: a 0
    would read as a forecast of no traffic to an autoscaler."""
    script = "from prometheus_client import generate_latest; from pdserve import metrics; print(generate_latest(metrics.ROUTER).decode())"
    exported = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert "pdserve_router_inflight_requests" in exported.stdout
    assert "pdserve_planner_request_rate" not in exported.stdout


def test_gauges_are_exported():
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=50, window_s=60, clock=clock)
    feed(planner, clock, rate=2.0, seconds=30)
    d = planner.decide()
    planner.export(d)
    value = lambda name, **labels: REGISTRY.get_sample_value(name, labels)  # noqa: E731
    assert value("pdserve_planner_desired_replicas", role="prefill") == pytest.approx(d.prefill)
    assert value("pdserve_planner_desired_replicas", role="decode") == pytest.approx(d.decode)
    assert value("pdserve_planner_request_rate") == pytest.approx(d.rate)
    assert value("pdserve_planner_latency_correction", metric="ttft") == 1.0


def test_an_slo_no_instance_meets_asks_for_the_lowest_latency_not_the_most(caplog):
    """More replicas than serve one prompt and one sequence at a time lower no latency: an
    unreachable SLO (a noisy correction can make one) must not scale a pool to its maximum."""
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=50, tpot_ms=5, window_s=60, clock=clock)  # below one prefill, one step
    feed(planner, clock, rate=1.0, seconds=10)
    with caplog.at_level("WARNING", logger="pdserve.planner.online"):
        d = planner.decide()
        planner.decide()
    assert caplog.text.count("no instance meets the ttft and tpot SLO") == 1  # once, not at every decision
    w = capacity.WorkloadStats(200, 50, 200)  # what feed() sends
    saturated = d.rate / capacity.prefill_rate(PROFILE, 1, w, None)  # every replica busy all the time
    assert saturated * 1.5 < d.prefill < 1024  # sized for about the lowest TTFT, not for saturation
    assert d.decode == pytest.approx(d.rate / capacity.decode_rate(PROFILE, 1, w, None, max_num_seqs=1))
    assert 0 < d.decode < 1024 and d.decode > d.rate / capacity.decode_rate(PROFILE, 1, w, None)  # batch 1
    planner.export(d)
    assert REGISTRY.get_sample_value("pdserve_planner_desired_replicas", {"role": "decode"}) == pytest.approx(d.decode)


def test_a_ttft_slo_missed_through_queueing_never_asks_for_fewer_prefill_replicas():
    """Queueing raises measured TTFT over the profile's; once that makes the SLO unreachable, the
    planner must not answer with fewer replicas than it asked for while it was met."""
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=400, tpot_ms=None, window_s=60, clock=clock)
    feed(planner, clock, rate=20.0, seconds=30)
    asked = [planner.decide().prefill]
    for measured_s in (0.3, 0.4, 0.6, 1.0, 2.0):  # the fleet queues more and more
        for _ in range(10):
            planner.on_finish(200, measured_s, None, 50)
        asked.append(planner.decide().prefill)
    assert all(math.isfinite(a) and a < 1024 for a in asked)
    assert asked == sorted(asked), asked  # worse latency never asks for fewer


def test_the_planner_needs_an_slo():
    with pytest.raises(ValueError, match="SLO"):
        OnlinePlanner(PROFILE, None, None)


def test_capacity_model_by_hand():
    w = capacity.WorkloadStats(mean_prompt=100, mean_output=50, mean_uncached=100)
    # Decode: steps of 10 + b ms (context is free here) within 40 ms -> 30 sequences; each
    # stays 50 steps of 40 ms = 2 s; 90% of 30 / 2 s = 13.5 req/s.
    assert capacity.decode_batch(PROFILE, 1, w, 40.0) == 30
    assert capacity.decode_rate(PROFILE, 1, w, 40.0) == pytest.approx(13.5)
    # Prefill without an SLO: a full 1024-token step takes 1034 ms; 100 tokens a request.
    assert capacity.prefill_rate(PROFILE, 1, w, None) == pytest.approx(1e3 / (100 * 1034 / 1024))
    # An SLO below one prompt's own prefill (10 + 100 ms + 10 ms overhead) leaves no capacity.
    assert capacity.prefill_rate(PROFILE, 1, w, 115.0) == 0.0
    assert 0 < capacity.prefill_rate(PROFILE, 1, w, 500.0) < capacity.prefill_rate(PROFILE, 1, w, 5000.0)


def finish(planner: OnlinePlanner, clock: Clock, req: ValidatedRequest, tokens: int, step_s: float) -> None:
    """Every choice of ``req`` generates ``tokens`` tokens, one per step of ``step_s``."""
    watch = planner.watch(req)
    for i in range(tokens):
        clock.now += step_s
        for index in range(req.engine_sampling.n):
            watch.token(1, "length" if i == tokens - 1 else None, index)


def test_output_lengths_come_from_finished_requests_not_max_tokens():
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=50, window_s=60, clock=clock)
    feed(planner, clock, rate=2.0, seconds=20, max_tokens=4096)  # a client that asks for the most
    by_max_tokens = planner.decide()
    for _ in range(3):
        finish(planner, clock, request(200, 4096), tokens=50, step_s=0.011)
    d = planner.decide()
    _, decode = capacity.replicas_needed(
        PROFILE, capacity.WorkloadStats(200, 50, 200), d.rate, 1000 / d.ttft_correction, 50 / d.tpot_correction, 1, 1
    )
    assert d.decode == pytest.approx(decode) and d.decode < by_max_tokens.decode / 20


def test_choices_of_one_request_are_one_measurement_at_their_own_pace():
    step_s = COST.decode_step_ms(1, 200) / 1e3 * 2  # twice as slow as the profile
    corrections = []
    for n in (1, 2):
        clock = Clock()
        planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=50, window_s=60, clock=clock)
        req = ValidatedRequest("r", list(range(1000, 1200)), SamplingParams(max_tokens=8, n=n))
        for _ in range(3):
            finish(planner, clock, req, tokens=8, step_s=step_s)
        assert len(planner.ratios) == 3  # one per request, not per choice
        corrections.append(planner.decide().tpot_correction)
    assert corrections[0] == pytest.approx(corrections[1]) and corrections[0] > 1.5


def test_after_an_unmet_ttft_slo_the_prefill_pool_still_follows_the_rate_down():
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=400, tpot_ms=None, window_s=60, clock=clock)
    feed(planner, clock, rate=20.0, seconds=30)
    planner.decide()  # met at 20 req/s
    for _ in range(10):
        planner.on_finish(200, 2.0, None, 50)  # then queueing makes it unreachable
    busy = planner.decide()
    clock.now += 120  # the window forgets the busy minute
    feed(planner, clock, rate=2.0, seconds=30)
    for _ in range(10):
        planner.on_finish(200, 2.0, None, 50)  # still unreachable
    quiet = planner.decide()
    assert quiet.rate < busy.rate / 10  # far less traffic...
    assert quiet.prefill == pytest.approx(busy.prefill * quiet.rate / busy.rate, rel=0.05)  # ...as fewer replicas


def test_the_floor_from_a_met_ttft_target_is_sized_for_todays_prompts():
    """Met with long prompts, then unmet with short ones: the floor is what the last met target
    needs for the short prompts, not the long prompts' replica count."""
    clock = Clock()
    planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=None, window_s=60, clock=clock)
    feed(planner, clock, rate=20.0, seconds=30, prompt_len=900)
    long = planner.decide()  # met
    clock.now += 120
    feed(planner, clock, rate=20.0, seconds=30, prompt_len=300)
    for _ in range(10):
        planner.on_finish(300, 5.0, None, 50)  # queueing: the SLO is out of reach
    short = planner.decide()
    w = capacity.WorkloadStats(300, 50, 300)
    at_met_target = short.rate / capacity.prefill_rate(PROFILE, 1, w, 1000)
    assert short.prefill >= at_met_target * 0.99  # never below what the met target needs now
    assert short.prefill < long.prefill * short.rate / long.rate / 1.5  # not the long prompts' count


def test_requests_larger_than_one_kv_cache_ask_for_the_cap_and_keep_the_planner_running(caplog):
    """A window whose mean request overflows a decode instance's KV cache: no instance serves it
    at any batch, which is said once; the decision stays a number (no division by zero)."""
    clock = Clock()
    small = Profile(**{**PROFILE.__dict__, "kv_cache_tokens": {1: 100}})
    planner = OnlinePlanner(small, ttft_ms=1000, tpot_ms=None, window_s=60, clock=clock)  # a TTFT SLO only
    feed(planner, clock, rate=1.0, seconds=10, prompt_len=200, max_tokens=50)
    with caplog.at_level("WARNING", logger="pdserve.planner.online"):
        d = planner.decide()
        planner.decide()
    assert math.isinf(d.decode) and math.isfinite(d.prefill)
    assert caplog.text.count("does not fit one decode instance's KV cache (100 tokens") == 1
    planner.export(d)
    assert REGISTRY.get_sample_value("pdserve_planner_desired_replicas", {"role": "decode"}) == 1024


async def test_the_loop_outlives_a_decision_that_fails(caplog, monkeypatch):
    planner = OnlinePlanner(PROFILE, ttft_ms=1000, tpot_ms=50, interval_s=0.01)
    decide, calls = planner.decide, []

    def flaky():
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("float division by zero")
        return decide()

    monkeypatch.setattr(planner, "decide", flaky)
    planner.start()
    try:
        for _ in range(200):  # bounded: 2 s
            if len(calls) >= 4:
                break
            await asyncio.sleep(0.01)
    finally:
        await planner.stop()
    assert len(calls) >= 4, "the loop stopped at the failed decision"
    assert "this decision failed" in caplog.text
