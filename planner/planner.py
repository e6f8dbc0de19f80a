"""The placement search behind ``pdserve plan``: prefill/decode counts and degrees with the
most goodput per device.

DistServe's method. A candidate unit is P prefill and D decode instances with their parallel
degrees (or one colocated instance, or P:D with conditional disaggregation). Its goodput is
the highest request rate at which at least ``attainment`` of the requests (90%) meet both the
TTFT and the TPOT SLO, found by simulating the workload at a rate and bisecting on it. The
analytic estimate (``capacity``) ranks every candidate first; only the most promising are
simulated. A fleet is the best unit replicated (units do not share requests): as many as the
device budget holds, or as many as a target rate needs.

A finite workload sent faster than a unit can serve it still "meets" the SLOs if the unit can
hold all of it at once; so each simulated run sends requests for at least ``span_s`` seconds
(the workload repeated as needed, each repeat a ``workloads.variant`` so it finds nothing of
the earlier ones in the prefix cache), long enough that a queue that grows shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import Goodput, RunMetrics, compute
from pdserve.bench.workloads import RequestSpec, variant
from pdserve.planner import capacity
from pdserve.planner.profile import Profile
from pdserve.planner.sim_topology import SimConfig, SimRun, Topology
from pdserve.planner.simulator import simulate

BISECT_STEPS = 7
MAX_DOUBLINGS = 8
DEFAULT_SPAN_S = 60.0


@dataclass(frozen=True, slots=True)
class UnitResult:
    topology: Topology
    devices: int
    estimate: float  # req/s, analytic
    goodput: float | None = None  # req/s at the attainment target, simulated (None: not simulated)
    metrics: RunMetrics | None = None  # the simulated run at that rate

    @property
    def label(self) -> str:
        t = self.topology
        p, d = t.prefill_degree or 1, t.decode_degree or 1
        if t.colocated:
            return f"colocated x{d}"
        return f"{t.prefill}P(x{p}) {t.decode}D(x{d})" + (" conditional" if t.conditional else "")

    @property
    def per_device(self) -> float:
        return (self.goodput if self.goodput is not None else self.estimate) / self.devices


@dataclass(frozen=True, slots=True)
class FleetPlan:
    unit: UnitResult
    replicas: int
    budget: int
    target_rate: float | None  # req/s asked for, if any
    replicas_for_target: int | None  # units of ``target_unit`` the target rate needs
    at_target: RunMetrics | None  # one such unit at its share of the target rate
    candidates: list[UnitResult] = field(default_factory=list)
    target_unit: UnitResult | None = None  # the unit that serves the target on the fewest devices

    @property
    def devices(self) -> int:
        return self.replicas * self.unit.devices

    @property
    def goodput(self) -> float:
        return self.replicas * (self.unit.goodput or 0.0)


def attainment(run: SimRun, slo: Goodput) -> float:
    """Share of all requests (failed ones miss) that meet every SLO."""
    if not run.timelines:
        return 0.0
    return sum(t.success and slo.met_by(t) for t in run.timelines) / len(run.timelines)


def candidates(profile: Profile, max_unit_devices: int, conditional: bool = True) -> list[Topology]:
    degrees = [d for d in profile.degrees if d <= max_unit_devices]
    out = [Topology(prefill=0, decode=1, colocated=True, decode_degree=d) for d in degrees]
    for dp in degrees:
        for dd in degrees:
            for p in range(1, max_unit_devices // dp + 1):
                for d in range(1, (max_unit_devices - p * dp) // dd + 1):
                    for cond in (False, True) if conditional else (False,):
                        out.append(Topology(p, d, conditional=cond, prefill_degree=dp, decode_degree=dd))
    return [t for t in out if unit_devices(profile, t) <= max_unit_devices]


def unit_devices(profile: Profile, topology: Topology) -> int:
    """Devices a unit occupies; on a shared CPU, at most the machine's cores."""
    devices = topology.devices(profile)
    return min(devices, profile.cores) if profile.cores else devices


def estimate(
    profile: Profile, topology: Topology, w: capacity.WorkloadStats, slo: Goodput, max_num_seqs: int = 64
) -> float:
    p, d = topology.degrees(profile)
    if topology.colocated:
        return topology.decode * capacity.colocated_rate(profile, d, w, slo.ttft_ms, slo.tpot_ms, max_num_seqs)
    prefill = topology.prefill * capacity.prefill_rate(profile, p, w, slo.ttft_ms)
    decode = topology.decode * capacity.decode_rate(profile, d, w, slo.tpot_ms, max_num_seqs)
    if profile.cores and topology.devices(profile) > profile.cores:  # oversubscribed cores share their time
        return min(prefill, decode) * profile.cores / topology.devices(profile)
    return min(prefill, decode)


def sustained(specs: list[RequestSpec], rate: float, span_s: float) -> list[RequestSpec]:
    """``specs``, repeated (as variants) until sending them at ``rate`` takes ``span_s``."""
    wanted = max(len(specs), math.ceil(rate * span_s))
    out, k = list(specs), 1
    while len(out) < wanted:
        out += variant(specs, k)[: wanted - len(out)]
        k += 1
    return out


def run_at(
    profile: Profile,
    topology: Topology,
    specs: list[RequestSpec],
    rate: float,
    config: SimConfig,
    burstiness: float = 1.0,
    seed: int = 0,
    span_s: float = DEFAULT_SPAN_S,
) -> SimRun:
    specs = sustained(specs, rate, span_s)
    offsets = arrival_offsets(len(specs), rate, burstiness, seed)
    # Every request is sent and may take its whole timeout: a low rate must not run out of time.
    config = replace(config, time_limit_s=max(config.time_limit_s, offsets[-1] + config.request_timeout_s))
    return simulate(profile, topology, specs, offsets, config)


def unit_goodput(
    profile: Profile,
    topology: Topology,
    specs: list[RequestSpec],
    slo: Goodput,
    target: float,
    config: SimConfig,
    guess: float,
    burstiness: float = 1.0,
    seed: int = 0,
    span_s: float = DEFAULT_SPAN_S,
) -> tuple[float, RunMetrics | None]:
    """The highest rate (req/s) at which ``target`` of the requests meet the SLOs, by
    simulation: double from ``guess`` until it fails, then bisect."""

    def ok(rate: float) -> tuple[bool, SimRun]:
        run = run_at(profile, topology, specs, rate, config, burstiness, seed, span_s)
        return attainment(run, slo) >= target, run

    lo, hi, best = 0.0, max(guess, 1e-3), None
    for _ in range(MAX_DOUBLINGS):
        good, run = ok(hi)
        if not good:
            break
        lo, best, hi = hi, run, hi * 2
    else:
        return lo, compute(best.timelines, best.duration, slo)
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        good, run = ok(mid)
        if good:
            lo, best = mid, run
        else:
            hi = mid
    return lo, (compute(best.timelines, best.duration, slo) if best else None)


def plan(
    profile: Profile,
    specs: list[RequestSpec],
    slo: Goodput,
    budget: int,
    *,
    target_rate: float | None = None,
    attainment_target: float = 0.9,
    max_unit_devices: int = 8,
    top_k: int = 6,
    conditional: bool = True,
    config: SimConfig | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    span_s: float = DEFAULT_SPAN_S,
    progress: Callable[[str], None] | None = None,
) -> FleetPlan:
    """The best unit by simulated goodput per device, replicated over ``budget`` devices."""
    if budget < 1:
        raise ValueError(f"the device budget must be >= 1, got {budget}")
    if not (slo.ttft_ms or slo.tpot_ms):
        raise ValueError("give at least one SLO (ttft and/or tpot) to plan for")
    config = config or SimConfig()
    w = capacity.WorkloadStats.of(specs, config.block_size)
    limit = min(budget, max_unit_devices)
    units = [
        UnitResult(t, unit_devices(profile, t), estimate(profile, t, w, slo, config.max_num_seqs))
        for t in candidates(profile, limit, conditional)
    ]
    if not units:
        raise ValueError(f"no placement fits {limit} devices with the profile's degrees {list(profile.degrees)}")
    units.sort(key=lambda u: (-u.per_device, u.devices))
    simulated = []
    for unit in _shortlist(units, top_k):
        if progress:
            progress(unit.label)
        rate, metrics = unit_goodput(
            profile,
            unit.topology,
            specs,
            slo,
            attainment_target,
            config,
            guess=unit.estimate or 0.05,
            burstiness=burstiness,
            seed=seed,
            span_s=span_s,
        )
        simulated.append(UnitResult(unit.topology, unit.devices, unit.estimate, rate, metrics))
    best = best_fill(simulated, budget)
    replicas = budget // best.devices
    needed, at_target, target_unit = None, None, None
    serving = [u for u in simulated if u.goodput]
    if target_rate is not None and serving:
        # The fewest devices that serve the target: often a smaller unit than the budget's best.
        target_unit = min(serving, key=lambda u: (math.ceil(target_rate / u.goodput) * u.devices, -u.per_device))
        needed = max(1, math.ceil(target_rate / target_unit.goodput))
        run = run_at(profile, target_unit.topology, specs, target_rate / needed, config, burstiness, seed, span_s)
        at_target = compute(run.timelines, run.duration, slo)
    ranked = sorted(simulated, key=lambda u: -u.per_device) + [u for u in units if u not in _shortlist(units, top_k)]
    return FleetPlan(best, replicas, budget, target_rate, needed, at_target, ranked, target_unit)


def best_fill(units: list[UnitResult], budget: int) -> UnitResult:
    """The simulated unit that, replicated as often as ``budget`` holds, serves the most
    (goodput per device breaks ties)."""
    fitting = [u for u in units if u.goodput is not None and u.devices <= budget]
    if not fitting:
        raise ValueError(f"no simulated unit fits {budget} devices")
    return max(fitting, key=lambda u: ((budget // u.devices) * (u.goodput or 0.0), u.per_device))


def _shortlist(units: list[UnitResult], top_k: int) -> list[UnitResult]:
    """The best ``top_k`` estimates, plus the best colocated and the best disaggregated unit
    (so both kinds are always simulated)."""
    picked = units[:top_k]
    for kind in (True, False):
        first = next((u for u in units if u.topology.colocated is kind), None)
        if first is not None and first not in picked:
            picked.append(first)
    return picked
