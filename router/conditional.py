"""Conditional disaggregation: prefill a prompt on its decode worker, or in the prefill pool.

The disaggregated path pays a second hop, a KV handoff and, on a busy pool, a queue; a short
prompt costs its decode worker one small chunk. So the router prefills on the decode worker
itself (the colocated path) when that worker has headroom (batch slots and free KV blocks)
and either

- the part of the prompt the decode worker does not cache is at most ``threshold_tokens``, or
- the prefill pool is backed up: the decode worker, in its own chunks, would produce the
  first token sooner than the least-loaded prefill worker gets through its queue;

everything else goes to the prefill pool. The threshold comes from a profile (the prompt
length up to which the local path is the faster one on an idle pool) or is set by hand.
Local prefills the router has sent and not yet seen a first token of count as that decode
worker's backlog, as in-flight prompts do for prefill workers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, TypeVar

from pdserve.router.workers import PromptBlocks, Worker

T = TypeVar("T")

DEFAULT_THRESHOLD_TOKENS = 128
FALLBACK_TOKENS_PER_S = 500.0  # until a worker reports its prefill speed


@dataclass(frozen=True, slots=True)
class ConditionalConfig:
    threshold_tokens: int = DEFAULT_THRESHOLD_TOKENS  # uncached prompt tokens a decode worker always takes
    local_tokens_per_s: float = 0.0  # a decode worker's prefill speed next to its decodes (0: its reported speed)
    remote_tokens_per_s: float = 0.0  # a prefill worker's (0: its reported speed)
    handoff_ms: float = 0.0  # what the disaggregated path adds besides the prefill itself
    max_occupancy: float = 0.75  # share of a decode worker's batch slots in use beyond which it takes no prompts
    min_free_blocks: float = 0.1  # share of its KV blocks that must stay free after the prompt

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError(f"conditional_threshold_tokens: must be >= 0, got {self.threshold_tokens}")
        if self.local_tokens_per_s < 0 or self.remote_tokens_per_s < 0 or self.handoff_ms < 0:
            raise ValueError("conditional prefill speeds and handoff cost must be >= 0")
        if not 0 < self.max_occupancy <= 1 or not 0 <= self.min_free_blocks < 1:
            raise ValueError("conditional max_occupancy must be in (0, 1] and min_free_blocks in [0, 1)")


class ConditionalRouter:
    def __init__(self, config: ConditionalConfig) -> None:
        self.config = config
        self.local_tokens: dict[str, int] = {}  # decode worker -> prompt tokens sent there to prefill, not yet done
        self.decisions = {"local": 0, "remote": 0}

    def prefill_locally(self, token_ids: list[int], decode: Worker, prefill_pool: list[Worker]) -> bool:
        """True: prefill on ``decode`` itself; False: in the prefill pool."""
        local = self._decide(PromptBlocks(token_ids), decode, prefill_pool)
        self.decisions["local" if local else "remote"] += 1
        return local

    def _decide(self, prompt: PromptBlocks, decode: Worker, prefill_pool: list[Worker]) -> bool:
        uncached = decode.uncached_tokens(prompt)
        if not self._has_headroom(decode, len(prompt.token_ids)):
            return False
        if uncached <= self.config.threshold_tokens:
            return True
        pool = [w for w in prefill_pool if w.healthy]
        if not pool:
            return True
        return self._local_ms(decode, uncached) < min(self._remote_ms(w, prompt) for w in pool)

    def _has_headroom(self, decode: Worker, prompt_len: int) -> bool:
        stats = decode.last_stats
        if stats is None or not stats.blocks_total:
            return True  # nothing known yet: its own admission control still protects it
        busy = stats.running + stats.waiting + decode.inflight
        if busy >= self.config.max_occupancy * max(1, stats.max_num_seqs or 64):
            return False
        needed = -(-(prompt_len + 1) // max(1, stats.block_size or 16))
        return stats.blocks_free - needed >= self.config.min_free_blocks * stats.blocks_total

    def _local_ms(self, decode: Worker, uncached: int) -> float:
        stats = decode.last_stats
        reported = stats.queued_prefill_tokens if stats else 0
        backlog = max(reported, self.local_tokens.get(decode.address, 0))
        rate = self.config.local_tokens_per_s or _reported_rate(decode)
        return (backlog + uncached) / rate * 1e3

    def _remote_ms(self, worker: Worker, prompt: PromptBlocks) -> float:
        stats = worker.last_stats
        queued = max(stats.queued_prefill_tokens if stats else 0, worker.inflight_tokens)
        rate = self.config.remote_tokens_per_s or _reported_rate(worker)
        return (queued + worker.uncached_tokens(prompt)) / rate * 1e3 + self.config.handoff_ms

    # -- the backlog of local prefills -----------------------------------------------------------
    def begin_local(self, decode: Worker, token_ids: list[int]) -> int:
        work = decode.uncached_tokens(PromptBlocks(token_ids))
        self.local_tokens[decode.address] = self.local_tokens.get(decode.address, 0) + work
        return work

    def end_local(self, decode: Worker, work: int) -> None:
        left = self.local_tokens.get(decode.address, 0) - work
        if left > 0:
            self.local_tokens[decode.address] = left
        else:
            self.local_tokens.pop(decode.address, None)

    async def track(self, decode: Worker, token_ids: list[int], stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """``stream`` (the colocated path's events), counting its prompt as ``decode``'s backlog
        until the first event (the prompt is done) or the end of the stream."""
        work = self.begin_local(decode, token_ids)
        try:
            async with contextlib.aclosing(stream):  # closing this closes the worker call at once
                async for event in stream:
                    if work:
                        self.end_local(decode, work)
                        work = 0
                    yield event
        finally:
            if work:
                self.end_local(decode, work)


def _reported_rate(worker: Worker) -> float:
    stats = worker.last_stats
    return stats.prefill_tokens_per_s if stats and stats.prefill_tokens_per_s > 0 else FALLBACK_TOKENS_PER_S
