"""What an engine reports about itself (the workers' ``GetStats``, the router's load signals,
Prometheus): one snapshot type, filled the same way by the real engine and the planner's
simulated one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.kv_connector import KVConnector
    from pdserve.engine.scheduler import Scheduler
    from pdserve.engine.speculative import SpecStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    running: int
    waiting: int
    prefilled_held: int  # prefills whose blocks wait for the decode side's acknowledgement
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    evictions: int
    queued_prefill_tokens: int = 0
    cached_block_hashes: tuple[int, ...] = ()
    prefill_tokens_per_s: float = 0.0
    rejected: int = 0
    waiting_for_kv: int = 0  # reservations whose K/V a prefill worker is sending
    forks: int = 0  # choices (n > 1) forked from another choice's prompt
    ended_choices: int = 0  # choices the router ended while others went on (stop strings)
    spec: SpecStats | None = None  # speculative decoding's counters, when it is on


def collect_stats(
    scheduler: Scheduler,
    connector: KVConnector,
    *,
    cached_block_hashes: tuple[int, ...] = (),
    prefill_tokens_per_s: float = 0.0,
    forks: int = 0,
    ended_choices: int = 0,
    spec: SpecStats | None = None,
) -> EngineStats:
    """The queues' and the block pool's counters now; the rest is what only the caller knows."""
    b = scheduler.blocks.stats()
    pending = [*scheduler.waiting, *(s for s in scheduler.running if s.is_prefilling)]
    return EngineStats(
        blocks_total=b.num_blocks,
        blocks_free=b.num_free,
        blocks_cached=b.num_cached,
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        prefilled_held=len(connector.sending),
        preemptions=scheduler.num_preemptions,
        prefix_queries=b.prefix_queries,
        prefix_hits=b.prefix_hits,
        evictions=b.evictions,
        # A reservation's prompt is prefilled elsewhere: it is not this worker's queue.
        queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in pending if s.kv_receive is None),
        cached_block_hashes=cached_block_hashes,
        prefill_tokens_per_s=prefill_tokens_per_s,
        rejected=scheduler.num_rejected,
        waiting_for_kv=len(scheduler.waiting_for_kv),
        forks=forks,
        ended_choices=ended_choices,
        spec=spec,
    )
