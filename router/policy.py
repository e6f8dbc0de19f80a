"""Routing policies: which prefill and which decode worker serve a request.

``kv_aware`` (the default) follows Dynamo's cost model: a prefill worker costs the prompt
tokens it would have to compute (the prompt minus the longest prefix it already caches) plus
the prefill tokens already queued on it; a decode worker costs its batch occupancy and its
KV memory pressure. Workers publish digests of their cached block hashes through their stats,
and the router also remembers where it just sent a prompt, so a burst of requests sharing a
system prompt lands on the same worker before the next digest arrives.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from pdserve.engine.block_manager import block_hashes
from pdserve.router.validation import ValidatedRequest
from pdserve.router.workers import Worker

POLICIES = ("round_robin", "least_loaded", "kv_aware")


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


class KvAware:
    name = "kv_aware"

    def pick_prefill(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        hashes_by_block_size: dict[int, list[int]] = {}

        def cost(worker: Worker) -> tuple[float, float]:
            stats = worker.last_stats
            block_size = stats.block_size if stats and stats.block_size else 16
            if block_size not in hashes_by_block_size:
                hashes_by_block_size[block_size] = block_hashes(request.prompt_token_ids, block_size)
            cached = prefix_overlap(hashes_by_block_size[block_size], worker.cached_hashes) * block_size
            queued = stats.queued_prefill_tokens if stats else 0
            return len(request.prompt_token_ids) - cached + queued + worker.inflight_tokens, worker.inflight

        chosen = min(_healthy(workers, exclude), key=cost)
        size = chosen.last_stats.block_size if chosen.last_stats and chosen.last_stats.block_size else 16
        # Expect the prompt's blocks there from now on (the next digest will confirm it).
        chosen.cached_hashes.update(hashes_by_block_size.get(size) or block_hashes(request.prompt_token_ids, size))
        return chosen

    def pick_decode(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        def cost(worker: Worker) -> float:
            stats = worker.last_stats
            if not stats or not stats.blocks_total:
                return float(worker.inflight)
            occupancy = (stats.running + stats.waiting + worker.inflight) / max(1, stats.max_num_seqs or 64)
            memory = 1 - stats.blocks_free / stats.blocks_total
            return occupancy + memory

        return min(_healthy(workers, exclude), key=cost)


def prefix_overlap(request_hashes: list[int], cached: set[int]) -> int:
    """Leading blocks of the request found in a worker's cache (chained hashes: stop at the first miss)."""
    n = 0
    for h in request_hashes:
        if h not in cached:
            break
        n += 1
    return n


def make_policy(name: str) -> RoutingPolicy:
    policies = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "kv_aware": KvAware}
    if name not in policies:
        raise ValueError(f"policy must be one of {', '.join(policies)}, got {name!r}")
    return policies[name]()
