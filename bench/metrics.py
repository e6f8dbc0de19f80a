"""Serving metrics from per-request timelines, defined as in vLLM's serving benchmark.

Per successful request (times from the client's clock):
- TTFT: first message carrying tokens - send time.
- ITL: gaps between successive messages carrying tokens (a message may carry several tokens;
  like vLLM, the gap is per message, not split across its tokens).
- ITL per token: the same gaps split over the tokens of the message that ends them (a gap
  of g before a message of n tokens counts n times g / n), as SGLang's benchmark reports
  ITL under speculative decoding; equal to ITL when every message carries one token.
- E2EL: final message - send time.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for outputs of more than one token.
Goodput (DistServe): successful requests per second whose TTFT, TPOT (0 for one-token
outputs) and E2EL are within every SLO given. Failed requests count in ``failed`` and are
excluded from the latency statistics and throughputs, as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (90, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class Timeline:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    prompt_len: int
    max_tokens: int
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of messages with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those messages
    end_time: float | None = None  # arrival of the final message
    finish_reason: str = ""
    error: str = ""  # "" = success

    @property
    def success(self) -> bool:
        return not self.error and self.end_time is not None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        assert self.end_time is not None
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def itls_per_token(self) -> list[float]:
        return [gap / n for gap, n in zip(self.itls, self.chunk_tokens[1:]) for _ in range(n)]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None


@dataclass(frozen=True, slots=True)
class Stats:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p99: float

    @staticmethod
    def of(seconds: list[float]) -> "Stats":
        # vLLM reports 0 for an empty sample (e.g. every request failed) rather than NaN.
        a = np.asarray(seconds or [0.0], dtype=float) * 1e3
        p90, p99 = np.percentile(a, PERCENTILES)
        return Stats(float(a.mean()), float(np.median(a)), float(a.std()), float(p90), float(p99))


@dataclass(frozen=True, slots=True)
class Goodput:
    """SLOs in milliseconds; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def as_dict(self) -> dict[str, float]:
        return {
            k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms)) if v is not None
        }

    @staticmethod
    def parse(pairs: list[str] | None, flag: str = "--goodput") -> "Goodput":
        """['ttft:500', 'tpot:50'] -> Goodput; raises ValueError naming ``flag``."""
        values: dict[str, float] = {}
        for pair in pairs or []:
            name, sep, value = pair.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"{flag} takes KEY:MS pairs with KEY in {', '.join(GOODPUT_METRICS)}, got {pair!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"{flag} {name}: {value!r} is not a number of milliseconds") from None
            if not (ms > 0 and math.isfinite(ms)):
                raise ValueError(f"{flag} {name}: the SLO must be a positive number of milliseconds, got {value}")
            values[f"{name}_ms"] = ms
        return Goodput(**values)

    def met_by(self, t: Timeline) -> bool:
        tpot = t.tpot or 0.0
        checks = ((self.ttft_ms, t.ttft), (self.tpot_ms, tpot), (self.e2el_ms, t.e2el))
        return all(slo is None or value * 1e3 <= slo for slo, value in checks)


@dataclass(frozen=True, slots=True)
class RunMetrics:
    duration: float
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    itl_per_token: Stats
    max_output_tokens_per_s: float
    max_concurrent_requests: int


def compute(timelines: list[Timeline], duration_s: float, goodput: Goodput | None = None) -> RunMetrics:
    ok = [t for t in timelines if t.success]
    total_in = sum(t.prompt_len for t in ok)
    total_out = sum(t.output_tokens for t in ok)
    dur = max(duration_s, 1e-9)
    good = None
    if goodput is not None and goodput.is_set():
        good = sum(goodput.met_by(t) for t in ok) / dur
    peak_tokens, peak_requests = _peaks(ok)
    return RunMetrics(
        duration=duration_s,
        completed=len(ok),
        failed=len(timelines) - len(ok),
        total_input=total_in,
        total_output=total_out,
        request_throughput=len(ok) / dur,
        request_goodput=good,
        output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        ttft=Stats.of([t.ttft for t in ok]),
        tpot=Stats.of([t.tpot for t in ok if t.tpot is not None]),
        itl=Stats.of([g for t in ok for g in t.itls]),
        e2el=Stats.of([t.e2el for t in ok]),
        itl_per_token=Stats.of([g for t in ok for g in t.itls_per_token]),
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
    )


def _peaks(ok: list[Timeline]) -> tuple[float, int]:
    """Most output tokens in any one-second bucket, and most requests active in a bucket
    (vLLM's max_output_tokens_per_s / max_concurrent_requests)."""
    if not ok:
        return 0.0, 0
    t0 = min(t.send_time for t in ok)
    buckets = int(math.ceil(max(t.end_time or t0 for t in ok) - t0)) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for t in ok:
        for at, n in zip(t.chunk_times, t.chunk_tokens):
            tokens[min(int(at - t0), buckets - 1)] += n
        active[int(t.send_time - t0) : int((t.end_time or t0) - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


# -- TTFT by prompt length -----------------------------------------------------------------

DEFAULT_SHORT_THRESHOLD = 256


def ttft_by_length(timelines: list[Timeline], short_threshold: int = DEFAULT_SHORT_THRESHOLD) -> dict:
    """TTFT percentiles (ms) of the successful requests whose prompt is shorter than
    ``short_threshold`` tokens ("short") and of the rest ("long"); None for an empty class."""
    ok = [t for t in timelines if t.success]
    out: dict = {"short_threshold": short_threshold}
    for name, group in (
        ("short", [t for t in ok if t.prompt_len < short_threshold]),
        ("long", [t for t in ok if t.prompt_len >= short_threshold]),
    ):
        out[f"num_{name}"] = len(group)
        a = np.asarray([t.ttft for t in group], dtype=float) * 1e3
        for p in (50, 99):
            out[f"{name}_ttft_p{p}_ms"] = float(np.percentile(a, p)) if len(a) else None
    return out


# -- cluster counters ----------------------------------------------------------------------

PREFIX_COUNTERS = ("prefix_hits", "prefix_queries")
ROUTER_COUNTERS = ("migrations", "retries")
SPEC_COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")  # worker counters (pdserve.wire)


def cluster_snapshot(stats) -> dict:
    """A plain copy of a ``ClusterStats`` message: the router counters and, per worker, its
    address, role, health and counters."""
    return {
        "counters": dict(stats.counters),
        "workers": [
            {"address": w.address, "role": w.role, "healthy": w.healthy, "counters": dict(w.counters)}
            for w in stats.workers
        ],
    }


def _delta(after: float, before: float) -> float:
    # A counter that went down belongs to a restarted process: it counted from 0 since.
    return after - before if after >= before else after


def cluster_delta(before: dict, after: dict) -> dict:
    """What changed between two ``cluster_snapshot``s (taken around one measured run).

    ``prefix_hit_rate``: prompt blocks found in the prefix cache / blocks looked up, summed
    over the workers that prefill: the prefill workers, or (no prefill worker: colocated
    mode) the colocated/decode workers; None when none were looked up. ``prefix_cache`` has
    hits, queries and hit_rate per role (decode workers of a 1PnD stack look up the prompt
    too, to skip transferring blocks they hold). ``migrations``/``retries``: router counters;
    ``router_counters``: every router counter that changed. ``speculative``: speculative
    decoding's proposals and acceptances (None when no worker speculates). ``incomplete``: a
    worker did not answer in the second snapshot, so its part is missing.
    """
    old = {w["address"]: w for w in before.get("workers", [])}
    by_role: dict[str, dict[str, float]] = {}
    spec: dict[str, float] = {}
    incomplete = False
    for w in after.get("workers", []):
        if not w["healthy"] or not w["counters"]:
            incomplete = True
            continue
        prev = old.get(w["address"], {}).get("counters", {})
        role = by_role.setdefault(w["role"], {"hits": 0.0, "queries": 0.0})
        role["hits"] += _delta(w["counters"].get("prefix_hits", 0.0), prev.get("prefix_hits", 0.0))
        role["queries"] += _delta(w["counters"].get("prefix_queries", 0.0), prev.get("prefix_queries", 0.0))
        for key in SPEC_COUNTERS:
            if key in w["counters"]:
                spec[key] = spec.get(key, 0.0) + _delta(w["counters"][key], prev.get(key, 0.0))
    for role in by_role.values():
        role["hit_rate"] = role["hits"] / role["queries"] if role["queries"] else None
    prefilling = ["prefill"] if "prefill" in by_role else [r for r in by_role if r != "prefill"]
    hits = sum(by_role[r]["hits"] for r in prefilling)
    queries = sum(by_role[r]["queries"] for r in prefilling)
    rc_before, rc_after = before.get("counters", {}), after.get("counters", {})
    changed = {k: _delta(v, rc_before.get(k, 0.0)) for k, v in rc_after.items()}
    return {
        "prefix_hit_rate": hits / queries if queries else None,
        "prefix_cache": dict(sorted(by_role.items())),
        **{k: changed.get(k, 0.0) for k in ROUTER_COUNTERS},
        "router_counters": {k: v for k, v in sorted(changed.items()) if v},
        "speculative": _speculative(spec) if spec else None,
        "incomplete": incomplete,
    }


def _speculative(c: dict[str, float]) -> dict[str, float | None]:
    """Speculative decoding over the run, summed over the decoding workers."""
    drafts, proposed, accepted = (c.get(k, 0.0) for k in SPEC_COUNTERS)
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,  # tokens per verification
    }
