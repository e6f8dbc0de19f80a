"""Routing policies: which prefill and which decode worker serve a request."""

from __future__ import annotations

import itertools
from typing import Protocol

from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import Worker


class NoWorkerAvailable(Exception):
    pass


class RoutingPolicy(Protocol):
    name: str

    def pick_prefill(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker: ...

    def pick_decode(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker: ...


def _healthy(workers: list[Worker], exclude: set[str] | None = None) -> list[Worker]:
    """Healthy workers, minus ``exclude`` (ones that just failed this request) unless that leaves none."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        if not workers:
            raise NoWorkerAvailable("no worker registered")
        down = ", ".join(w.address for w in workers)
        raise NoWorkerAvailable(f"no healthy {workers[0].role.value} worker available (failing health checks: {down})")
    return [w for w in healthy if w.address not in (exclude or ())] or healthy


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._prefill = itertools.count()
        self._decode = itertools.count()

    def pick_prefill(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        candidates = _healthy(workers, exclude)
        return candidates[next(self._prefill) % len(candidates)]

    def pick_decode(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        candidates = _healthy(workers, exclude)
        return candidates[next(self._decode) % len(candidates)]


class LeastLoaded:
    """Fewest requests in flight from this router (plus the worker's reported queue)."""

    name = "least_loaded"

    def pick_prefill(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        return min(_healthy(workers, exclude), key=lambda w: w.load)

    def pick_decode(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        return min(_healthy(workers, exclude), key=lambda w: w.load)


def make_policy(name: str) -> RoutingPolicy:
    policies = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
    if name not in policies:
        raise ValueError(f"policy must be one of {', '.join(policies)}, got {name!r}")
    return policies[name]()
