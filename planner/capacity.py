"""Quick capacity estimates from a profile: the request rate one prefill, decode or colocated
instance sustains within the SLOs. They rank placements before the planner simulates the best
of them, and they are the router's online planner, which must answer at once.

- Prefill: prompts queue for one server whose service time is a prompt's share of a full
  step (chunked prefill batches prompts up to the token budget). The first token must come
  within the TTFT SLO after the serving overheads, so the queue may only be so busy: with
  M/D/1 waiting (mean rho S / (2 (1 - rho))) and its 90th percentile taken as 2.3x the mean
  (an exponential tail), the utilisation rho solves overheads + prefill alone +
  1.15 rho S / (1 - rho) = the TTFT SLO.
- Decode: the largest batch whose step fits the TPOT SLO (and whose KV fits) holds that many
  requests at once; each stays for its output length, so by Little's law the instance
  sustains batch / (output x step) requests/s (90% of it, so the batch seldom overflows).
- Colocated: one instance does both, so its time splits: 1 / (1/prefill + 1/decode).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.workloads import RequestSpec
from pdserve.planner.profile import Profile

TAIL_FACTOR = 2.3  # p90 / mean of an exponential waiting time
DECODE_UTILISATION = 0.9


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    mean_prompt: float
    mean_output: float
    mean_uncached: float  # prompt tokens not found in a prefix cache (= mean_prompt without sharing)

    def __post_init__(self) -> None:
        if self.mean_prompt <= 0 or self.mean_output <= 0:
            raise ValueError("a workload needs prompts and outputs of at least one token")

    @classmethod
    def of(cls, specs: list[RequestSpec], block_size: int = 16) -> "WorkloadStats":
        if not specs:
            raise ValueError("an empty workload has no statistics")
        seen: set[tuple[int, ...]] = set()
        uncached = 0
        for s in specs:  # full blocks shared with an earlier prompt would be cache hits
            ids, hit = s.prompt_token_ids, 0
            while hit + block_size < len(ids) and ids[: hit + block_size] in seen:
                hit += block_size
            uncached += len(ids) - hit
            seen.update(ids[:k] for k in range(block_size, len(ids) + 1, block_size))
        n = len(specs)
        return cls(sum(s.prompt_len for s in specs) / n, sum(s.max_tokens for s in specs) / n, uncached / n)


def prefill_rate(
    profile: Profile,
    degree: int,
    w: WorkloadStats,
    ttft_ms: float | None,
    batch_tokens: int = 1024,
    disaggregated: bool = True,
) -> float:
    """Requests/s one prefill instance sustains with its TTFT p90 within ``ttft_ms``."""
    cost, o = profile.step_cost(degree), profile.overheads
    per_token = (cost.prefill_alone_ms(batch_tokens) + o.step_ms) / batch_tokens  # ms, in full steps
    service = w.mean_uncached * per_token
    if ttft_ms is None:
        return 1e3 / service
    uncached = max(1, round(w.mean_uncached))
    path = o.first_token_ms + (o.handoff_ms + profile.transfer_ms(uncached) if disaggregated else 0.0)
    slack = ttft_ms - path - cost.prefill_alone_ms(uncached) - o.step_ms
    if slack <= 0:
        return 0.0
    x = slack / (TAIL_FACTOR / 2 * service)  # rho / (1 - rho) may be at most this
    return x / (1 + x) * 1e3 / service


def decode_batch(profile: Profile, degree: int, w: WorkloadStats, tpot_ms: float | None, max_num_seqs: int = 64) -> int:
    """The largest decode batch whose step stays within ``tpot_ms`` and whose KV fits."""
    cost, o = profile.step_cost(degree), profile.overheads
    context = round(w.mean_prompt + w.mean_output / 2)
    kv = profile.kv_tokens(degree)
    best = 0
    for batch in range(1, max_num_seqs + 1):
        if kv is not None and batch * (w.mean_prompt + w.mean_output) > kv:
            break
        if tpot_ms is not None and cost.decode_step_ms(batch, context) + o.step_ms + o.seq_ms * batch > tpot_ms:
            break
        best = batch
    return best


def decode_rate(
    profile: Profile, degree: int, w: WorkloadStats, tpot_ms: float | None, max_num_seqs: int = 64
) -> float:
    """Requests/s one decode instance sustains with every step within ``tpot_ms``."""
    batch = decode_batch(profile, degree, w, tpot_ms, max_num_seqs)
    if batch == 0:
        return 0.0
    o = profile.overheads
    context = round(w.mean_prompt + w.mean_output / 2)
    step = profile.step_cost(degree).decode_step_ms(batch, context) + o.step_ms + o.seq_ms * batch
    return DECODE_UTILISATION * batch / (w.mean_output * step / 1e3)


def colocated_rate(
    profile: Profile,
    degree: int,
    w: WorkloadStats,
    ttft_ms: float | None,
    tpot_ms: float | None,
    max_num_seqs: int = 64,
) -> float:
    p = prefill_rate(profile, degree, w, ttft_ms, disaggregated=False)
    d = decode_rate(profile, degree, w, tpot_ms, max_num_seqs)
    return 0.0 if p <= 0 or d <= 0 else 1 / (1 / p + 1 / d)


def replicas_needed(
    profile: Profile,
    w: WorkloadStats,
    rate: float,
    ttft_ms: float | None,
    tpot_ms: float | None,
    prefill_degree: int,
    decode_degree: int,
    max_num_seqs: int = 64,
) -> tuple[float, float]:
    """(prefill, decode) instances a disaggregated fleet needs for ``rate`` req/s, unrounded
    (routers each export their share; whoever scales rounds up once). inf: an SLO no instance meets."""
    p = prefill_rate(profile, prefill_degree, w, ttft_ms)
    d = decode_rate(profile, decode_degree, w, tpot_ms, max_num_seqs)
    return (rate / p if p > 0 else float("inf")), (rate / d if d > 0 else float("inf"))
