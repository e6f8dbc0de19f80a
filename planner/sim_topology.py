"""What a simulation is asked (the stack's topology and settings) and what it answers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from pdserve.bench.metrics import Timeline
from pdserve.placement import borrowed_threads, shared_prefill_threads
from pdserve.planner.profile import Profile


@dataclass(frozen=True, slots=True)
class Topology:
    prefill: int = 1
    decode: int = 1
    colocated: bool = False
    conditional: bool = False
    policy: str = "kv_aware"
    chunked_prefill: bool = True
    prefill_degree: int | None = None  # threads / TP per prefill worker; None: as ``pdserve up`` gives them
    decode_degree: int | None = None

    def __post_init__(self) -> None:
        if self.decode < 1 or self.prefill < 0 or (not self.colocated and self.prefill < 1):
            raise ValueError(
                f"a topology needs >= 1 decode worker and, unless colocated, >= 1 prefill worker "
                f"(got {self.prefill}P{self.decode}D)"
            )
        if self.colocated and self.conditional:
            raise ValueError("conditional disaggregation needs a prefill pool; colocated has none")

    @property
    def label(self) -> str:
        base = "colocated" if self.colocated else f"{self.prefill}p{self.decode}d"
        return base + ("-conditional" if self.conditional else "")

    @property
    def num_workers(self) -> int:
        return self.decode + (0 if self.colocated else self.prefill)

    def degrees(self, profile: Profile, num_threads: int | None = None) -> tuple[int, int]:
        """(prefill, decode) degrees. On a shared CPU the launcher's rule: ``num_threads``, else
        the machine's cores split evenly over the workers."""
        default = profile.degrees[0]
        if profile.cores is not None:
            default = num_threads or max(1, profile.cores // self.num_workers)
        return self.prefill_degree or default, self.decode_degree or default

    def borrowed_degree(self, profile: Profile, num_threads: int | None = None) -> int | None:
        """The threads a decode step borrows while no prefill computes for it, as ``pdserve up``
        sets them on a shared CPU."""
        return self._on_shared_cpu(borrowed_threads, profile, by_hand=bool(num_threads or self.decode_degree))

    def shared_prefill_degree(self, profile: Profile, num_threads: int | None = None) -> int | None:
        """A prefill worker's degree when it shares the machine's cores, as ``pdserve up`` sets
        it on a shared CPU: it computes on the cores the decode workers leave idle."""
        return self._on_shared_cpu(shared_prefill_threads, profile, by_hand=bool(num_threads or self.prefill_degree))

    def _on_shared_cpu(self, rule: Callable[..., int | None], profile: Profile, by_hand: bool) -> int | None:
        if profile.cores is None:  # a worker per device: no cores to share
            return None
        return rule(profile.cores, prefill=self.prefill, decode=self.decode, colocated=self.colocated, by_hand=by_hand)

    def devices(self, profile: Profile) -> int:
        p, d = self.degrees(profile)
        return d * self.decode + (0 if self.colocated else p * self.prefill)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The engine and router settings of the simulated stack (``EngineConfig``/``RouterSettings``)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_tokens: int | None = None  # per worker; None: the profile's capacity at the worker's degree
    num_threads: int | None = None  # per worker (CPU); None: the launcher's rule
    slo_tpot_ms: float | None = None  # size prefill chunks from the profile for this TPOT (planner.chunking)
    conditional_threshold_tokens: int | None = None  # None: from the profile
    request_timeout_s: float = 120.0
    time_limit_s: float = 600.0
    max_concurrency: int | None = None


@dataclass
class SimRun:
    timelines: list[Timeline]
    duration: float
    counters: Counter = field(default_factory=Counter)
