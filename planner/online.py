"""The router's online planner: how many prefill and decode replicas its load needs, as gauges.

Every interval the router forecasts its load from its own recent arrivals (the rate over the
last window, those requests' prompt lengths and the output lengths of the window's finished
requests: ``max_tokens`` only until a few have finished), corrects the profile by what it
measured, and asks the capacity model (``capacity``) how many prefill and decode instances
that load needs within the SLOs. The correction is Dynamo's: measured over predicted TTFT and
TPOT of the window's requests (predicted from the profile at their prompt length and the
current decode batch, without queueing); a fleet slower than its profile, or queueing, gets
tighter effective SLOs and so more replicas.

Gauges (``pdserve.metrics``): ``pdserve_planner_desired_replicas{role}``, unrounded (each
router sees only its share of the traffic, so an autoscaler sums over routers and rounds up
once: deploy/k8s/50-autoscaling.yaml), ``pdserve_planner_request_rate`` and
``pdserve_planner_latency_correction{metric}``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from pdserve import metrics
from pdserve.planner import capacity
from pdserve.planner.profile import Profile

log = logging.getLogger(__name__)

CORRECTION_RANGE = (0.25, 4.0)
MIN_SAMPLES = 3  # finished requests before measured latency corrects the profile
FLOOR_MARGIN = 1.1  # an unmet TTFT SLO: sized for this much above the lowest TTFT one instance reaches


@dataclass(frozen=True, slots=True)
class Decision:
    rate: float  # forecast req/s
    prefill: float  # desired replicas, unrounded
    decode: float
    ttft_correction: float
    tpot_correction: float


class RequestWatch:
    """One request's first token and end, for the planner (``Dispatcher.observer``); with n > 1,
    each choice's tokens apart, and one report once every choice has ended."""

    __slots__ = ("planner", "prompt_len", "started", "first", "tokens", "tpots", "open")

    def __init__(self, planner: "OnlinePlanner", prompt_len: int, choices: int = 1) -> None:
        self.planner, self.prompt_len = planner, prompt_len
        self.started, self.first = planner.clock(), None
        self.tokens = [0] * choices
        self.tpots: list[float] = []
        self.open = choices

    def token(self, count: int, finish_reason: str | None, index: int = 0) -> None:
        now = self.planner.clock()
        if self.first is None:
            self.first = now
        self.tokens[index] += count
        if not finish_reason:
            return
        if self.tokens[index] > 1:
            self.tpots.append((now - self.first) / (self.tokens[index] - 1))
        self.open -= 1
        if self.open == 0:
            tpot = statistics.fmean(self.tpots) if self.tpots else None
            self.planner.on_finish(self.prompt_len, self.first - self.started, tpot, max(self.tokens))


class OnlinePlanner:
    def __init__(
        self,
        profile: Profile,
        ttft_ms: float | None,
        tpot_ms: float | None,
        *,
        window_s: float = 120.0,
        interval_s: float = 30.0,
        decode_batch: Callable[[], float] = lambda: 1.0,
        prefill_degree: int | None = None,
        decode_degree: int | None = None,
        max_num_seqs: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttft_ms is None and tpot_ms is None:
            raise ValueError("the online planner needs an SLO: set slo_ttft_ms and/or slo_tpot_ms")
        self.profile, self.ttft_ms, self.tpot_ms = profile, ttft_ms, tpot_ms
        self.window_s, self.interval_s, self.clock = window_s, interval_s, clock
        self.decode_batch = decode_batch
        self.prefill_degree = prefill_degree or profile.degrees[0]
        self.decode_degree = decode_degree or profile.degrees[0]
        self.max_num_seqs = max_num_seqs
        self.started = clock()
        self.arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, max tokens)
        self.outputs: deque[tuple[float, int]] = deque()  # (time, tokens a finished request generated)
        self.ratios: deque[tuple[float, float, float | None]] = deque()  # (time, TTFT measured/predicted, TPOT ...)
        self._unmet: tuple[str, ...] = ()  # the SLOs no instance met at the last decision (warned once)
        self._met_ttft = math.inf  # the (corrected) TTFT target last met: an unmet one needs at least its replicas
        self._task: asyncio.Task | None = None

    # -- what the dispatcher reports ------------------------------------------------------------
    def watch(self, request) -> RequestWatch:
        """Called as a request arrives (``request``: a ValidatedRequest)."""
        self.arrivals.append((self.clock(), len(request.prompt_token_ids), request.sampling.max_tokens))
        return RequestWatch(self, len(request.prompt_token_ids), request.engine_sampling.n)

    def on_finish(self, prompt_len: int, ttft_s: float, tpot_s: float | None, output_tokens: int = 0) -> None:
        o, cost = self.profile.overheads, self.profile.step_cost(self.prefill_degree)
        now = self.clock()
        if output_tokens:
            self.outputs.append((now, output_tokens))
        predicted_ttft = o.first_token_ms + o.handoff_ms + cost.prefill_alone_ms(prompt_len) + o.step_ms
        if predicted_ttft <= 0:  # a profile that prices nothing predicts nothing to correct
            return
        tpot_ratio = None
        if tpot_s is not None:
            batch = max(1, round(self.decode_batch()))
            step = (
                self.profile.step_cost(self.decode_degree).decode_step_ms(batch, prompt_len)
                + o.step_ms
                + o.seq_ms * batch
            )
            tpot_ratio = tpot_s * 1e3 / step if step > 0 else None
        self.ratios.append((now, ttft_s * 1e3 / predicted_ttft, tpot_ratio))

    # -- the decision ----------------------------------------------------------------------------
    def decide(self) -> Decision:
        now = self.clock()
        for q in (self.arrivals, self.ratios, self.outputs):
            while q and q[0][0] < now - self.window_s:
                q.popleft()
        ttft_c = _correction([r for _, r, _ in self.ratios])
        tpot_c = _correction([r for _, _, r in self.ratios if r is not None])
        if not self.arrivals:
            return Decision(0.0, 0.0, 0.0, ttft_c, tpot_c)
        rate = len(self.arrivals) / max(min(self.window_s, now - self.started), 1e-3)
        prompts = statistics.fmean(p for _, p, _ in self.arrivals)
        # What requests generated, once enough have ended: max_tokens is often far above it.
        finished = [tokens for _, tokens in self.outputs]
        outputs = (
            statistics.fmean(finished)
            if len(finished) >= MIN_SAMPLES
            else statistics.fmean(m for _, _, m in self.arrivals)
        )
        w = capacity.WorkloadStats(prompts, outputs, prompts)
        ttft = self.ttft_ms / ttft_c if self.ttft_ms is not None else None
        tpot = self.tpot_ms / tpot_c if self.tpot_ms is not None else None
        prefill, decode = capacity.replicas_needed(
            self.profile, w, rate, ttft, tpot, self.prefill_degree, self.decode_degree, self.max_num_seqs
        )
        # An SLO no instance meets (as measured now): ask for the replicas of about the lowest
        # latency a pool reaches, not for the most (more do not help), and never for fewer than
        # the target last met needs for today's load (an SLO missed through queueing must not
        # scale the pool down).
        unmet = tuple(name for name, needed in (("ttft", prefill), ("tpot", decode)) if math.isinf(needed))
        if "ttft" in unmet:
            rate_at = lambda ms: capacity.prefill_rate(self.profile, self.prefill_degree, w, ms)  # noqa: E731
            reachable = _tightest_met(rate_at, ttft) * FLOOR_MARGIN
            met_rate = rate_at(self._met_ttft) if math.isfinite(self._met_ttft) else 0.0  # today's prompts
            floor = rate / met_rate if met_rate > 0 else 0.0
            prefill = max(rate / rate_at(reachable), floor) if math.isfinite(reachable) else math.inf
        elif ttft is not None:
            self._met_ttft = ttft
        if "tpot" in unmet:  # one sequence at a time: the lowest TPOT there is
            one = capacity.decode_rate(self.profile, self.decode_degree, w, None, max_num_seqs=1)
            decode = rate / one if one > 0 else math.inf  # inf: today's requests overflow one KV cache
        if unmet and unmet != self._unmet:
            if math.isinf(decode):
                log.warning(
                    "online planner: today's mean request (%.0f prompt + %.0f output tokens) does not fit "
                    "one decode instance's KV cache (%s tokens in the profile)",
                    prompts,
                    outputs,
                    self.profile.kv_tokens(self.decode_degree),
                )
            log.warning(
                "online planner: no instance meets the %s SLO (corrections: ttft %.2f, tpot %.2f); "
                "asking for the replicas of the lowest latency instead",
                " and ".join(unmet),
                ttft_c,
                tpot_c,
            )
        self._unmet = unmet
        return Decision(rate, prefill, decode, ttft_c, tpot_c)

    def export(self, d: Decision) -> None:
        # Past the cap is not a number an autoscaler can act on.
        metrics.PLANNER_DESIRED_REPLICAS.labels("prefill").set(_finite(d.prefill))
        metrics.PLANNER_DESIRED_REPLICAS.labels("decode").set(_finite(d.decode))
        metrics.set_planner_request_rate(d.rate)
        metrics.PLANNER_CORRECTION.labels("ttft").set(d.ttft_correction)
        metrics.PLANNER_CORRECTION.labels("tpot").set(d.tpot_correction)

    # -- the loop ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.export(self.decide())
        self._task = asyncio.create_task(self._run(), name="online-planner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                d = self.decide()
            except ValueError as e:  # e.g. a window of one-token prompts the capacity model refuses
                log.warning("online planner: %s", e)
                continue
            except Exception:  # the loop must outlive one bad decision: its gauges would freeze
                log.exception("online planner: this decision failed; the next interval tries again")
                continue
            self.export(d)
            log.info(
                "planner: %.2f req/s -> prefill %.2f, decode %.2f replicas (correction ttft %.2f, tpot %.2f)",
                d.rate,
                d.prefill,
                d.decode,
                d.ttft_correction,
                d.tpot_correction,
            )


def _tightest_met(rate_at: Callable[[float], float], missed_ms: float) -> float:
    """About the tightest latency SLO (ms) one instance meets at any rate (``rate_at(ms) > 0``),
    searched up from one it misses; inf if none is found."""
    low, high = missed_ms, max(missed_ms, 1.0) * 2
    for _ in range(64):
        if rate_at(high) > 0:
            break
        low, high = high, high * 2
    else:
        return math.inf
    for _ in range(32):
        middle = (low + high) / 2
        low, high = (low, middle) if rate_at(middle) > 0 else (middle, high)
    return high


def _correction(ratios: list[float]) -> float:
    if len(ratios) < MIN_SAMPLES:
        return 1.0
    return min(max(statistics.median(ratios), CORRECTION_RANGE[0]), CORRECTION_RANGE[1])


def _finite(replicas: float, cap: float = 1024.0) -> float:
    return cap if math.isinf(replicas) or replicas > cap else replicas
