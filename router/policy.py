"""Routing policies: which prefill and which decode worker serve a request.

``kv_aware`` (the default) follows Dynamo's cost model: a prefill worker costs the prompt
tokens it would have to compute (the prompt minus the longest prefix it already caches) plus
half the prefill tokens already queued on it; a decode worker costs its batch occupancy and its
KV memory pressure. Workers publish digests of their cached block hashes through their stats,
and the router also remembers where it just sent a prompt, so a burst of requests sharing a
system prompt lands on the same worker before the next digest arrives.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol

from pdserve.router.workers import PromptBlocks, Worker

if TYPE_CHECKING:  # settings import this module for the policy names: keep it light
    from pdserve.router.validation import ValidatedRequest


class NoWorkerAvailable(Exception):
    pass


class RoutingPolicy(Protocol):
    name: str

    def pick_prefill(
        self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None
    ) -> Worker: ...

    def pick_decode(
        self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None
    ) -> Worker: ...


def _healthy(workers: list[Worker], exclude: set[str] | None = None) -> list[Worker]:
    """Healthy workers, minus ``exclude`` (ones that just failed this request) unless that leaves none."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        if not workers:
            raise NoWorkerAvailable("no worker registered")
        down = ", ".join(f"{w.address}{f' ({w.last_error})' if w.last_error else ''}" for w in workers)
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
    # Queued prompts weigh half a token each against the prompt's own uncached tokens: a
    # prefill worker batches what is queued (chunked prefill), so a queue delays a newcomer by
    # less than its token count, while computing a prefix a second time costs in full.
    queue_weight = 0.5

    def pick_prefill(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        prompt = PromptBlocks(request.prompt_token_ids)

        def cost(worker: Worker) -> tuple[float, int]:
            # The worker's reported queue is a moment old and includes what this router sent;
            # our own in-flight count is current: take the larger rather than the sum.
            reported = worker.last_stats.queued_prefill_tokens if worker.last_stats else 0
            queued = max(reported, worker.inflight_tokens)
            return worker.uncached_tokens(prompt) + self.queue_weight * queued, worker.inflight

        return min(_healthy(workers, exclude), key=cost)

    def pick_decode(self, request: ValidatedRequest, workers: list[Worker], exclude: set[str] | None = None) -> Worker:
        def cost(worker: Worker) -> float:
            stats = worker.last_stats
            if not stats or not stats.blocks_total or not stats.max_num_seqs:  # no figures yet
                return float(worker.inflight)
            occupancy = (stats.running + stats.waiting + worker.inflight) / stats.max_num_seqs
            memory = 1 - stats.blocks_free / stats.blocks_total
            return occupancy + memory

        return min(_healthy(workers, exclude), key=cost)


POLICIES: dict[str, type[RoutingPolicy]] = {cls.name: cls for cls in (RoundRobin, LeastLoaded, KvAware)}
POLICY_NAMES = tuple(POLICIES)  # the one list of names (settings' choices come from here)


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
    return POLICIES[name]()
