"""Continuous batching: which tokens of which sequences run in the next forward pass.

Prefill and decode share one forward (as in vLLM v1): every step first gives each running
decode its one token, then spends the rest of the token budget on prompt chunks, oldest
first. Mixing keeps decodes flowing while a long prompt is prefilled in chunks, and on a CPU
one larger matmul costs less than two small ones. A sequence gets blocks for its whole
prompt when admitted, so an admitted prefill always completes; decodes grow one block at a
time and, when blocks run out, the least important running sequence (lowest priority, then
latest admitted) is preempted: its blocks are swapped out to host memory when a swap space is
configured (GPUs), else freed and recomputed later. Swapped-out sequences come back before
any new request is admitted. A waiting request whose TTFT budget has passed is rejected
rather than served late.

A request whose prompt K/V come from a prefill worker (``seq.kv_receive``) waits in the same
queue; admitting it reserves blocks for its prompt and first token (sharing cached prefix
blocks) and parks it as waiting for remote KV, without spending the step's token budget. The
engine's KV connector moves it into the running batch once its blocks have been filled.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.swap import SwapSpace


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences
    max_num_batched_tokens: int = 1024  # tokens per forward pass
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of ``seq`` run this step."""

    seq: Sequence
    start: int
    num_tokens: int
    # Speculative decoding (engine/speculative): a decode may carry up to ``lookahead`` proposed
    # tokens after its last one (cache slots reserved here; ``draft`` filled in after scheduling).
    lookahead: int = 0
    draft: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so a new token is sampled)."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    expired: list[Sequence] = field(default_factory=list)  # could not start within their TTFT budget
    reserved: list[Sequence] = field(default_factory=list)  # now waiting for their K/V from a prefill worker

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


def _importance(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.admitted_at)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, swap: SwapSpace | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.swap = swap
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # preempted with their K/V in host memory
        self.waiting_for_kv: list[Sequence] = []  # blocks reserved, K/V arriving from a prefill worker
        self.num_preemptions = 0
        self.num_rejected = 0
        self._step = 0
        # Optional: given a step's decodes, the most prompt tokens the step may add (so that a
        # mixed step stays within a TPOT SLO; planner.chunking sizes it from a profile).
        self.prefill_token_limit: Callable[[list[ScheduledChunk]], int] | None = None
        # Optional (speculative decoding): how many proposed tokens a decoding sequence may
        # carry this step. Their slots come from free blocks only, never by preempting.
        self.lookahead: Callable[[Sequence], int] | None = None

    # -- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: (s.priority, s.arrival_time))

    def admit_landed(self, seq: Sequence) -> None:
        """A sequence waiting for remote KV has its blocks filled: it joins the running batch.
        Its K/V are local from now on: preempted by recompute, it prefills here."""
        self.waiting_for_kv.remove(seq)
        seq.kv_receive = None
        seq.status = SequenceStatus.RUNNING
        seq.admitted_at = self._step
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting, self.swapped, self.waiting_for_kv):
            if seq in queue:
                queue.remove(seq)
        if seq.swapped_blocks:
            self.swap.release(seq.swapped_blocks)
            seq.swapped_blocks = []

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence: out of every queue, its blocks freed (full ones stay cached)."""
        if seq.kv_send is not None:
            seq.kv_send.transfer.cancel()  # the first token ends it: the decode side is not needed
        self.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.waiting_for_kv)

    def next_deadline(self) -> float | None:
        """The earliest start deadline of a waiting request (the engine must wake by then)."""
        return min((s.start_deadline for s in self.waiting if s.start_deadline is not None), default=None)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Most important first, so preemption victims (taken from the end) are never ones
        # already scheduled in this step.
        self.running.sort(key=_importance)
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            if budget == 0:
                break
            if self._reserve_next_token(seq, out):
                out.decodes.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
                budget -= 1
        if self.lookahead is not None:  # after every next token has its slot: speculation never preempts
            for chunk in out.decodes:
                chunk.lookahead = self._reserve_lookahead(chunk.seq, budget)
                budget -= chunk.lookahead
        if self.prefill_token_limit is not None and out.decodes:
            budget = min(budget, max(0, self.prefill_token_limit(out.decodes)))

        for seq in self.running:
            if budget == 0:
                break
            if seq.is_prefilling:
                chunk = self._chunk_size(seq.num_tokens - seq.num_computed_tokens, budget, nothing_scheduled=out.empty)
                if chunk:
                    out.prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, chunk))
                    budget -= chunk

        self._swap_in()
        out.expired = self._expire_waiting()
        while self.waiting and self.has_room() and not self.swapped:
            seq = self.waiting[0]
            if seq.kv_receive is not None:
                if not self._reserve_for_remote_kv(seq):
                    break  # strict priority order: nothing overtakes the head of the queue
                out.reserved.append(seq)
                continue
            if budget == 0:
                break
            hits = self.blocks.usable_hits(seq)
            if not self.blocks.can_allocate(seq, seq.num_tokens, hits):
                break
            # Size the first chunk before allocating, so a prompt that waits for an emptier
            # step neither takes blocks nor counts as a prefix-cache lookup yet.
            uncached = seq.num_tokens - len(hits) * self.blocks.block_size
            if not self._chunk_size(uncached, budget, nothing_scheduled=out.empty):
                break
            self.blocks.allocate(seq, seq.num_tokens, hits)
            chunk = self._chunk_size(seq.num_tokens - seq.num_computed_tokens, budget, nothing_scheduled=out.empty)
            self._admit(seq)
            self.running.append(seq)
            out.prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, chunk))
            budget -= chunk
        return out

    def _reserve_for_remote_kv(self, seq: Sequence) -> bool:
        """Blocks for the prompt and its first token (so joining the batch once the K/V have
        landed cannot fail), sharing whatever prefix is cached here; False if they do not fit."""
        hits = self.blocks.usable_hits(seq, computes_logits=False)
        if not self.blocks.can_allocate(seq, seq.num_tokens + 1, hits):
            return False
        self.blocks.allocate(seq, seq.num_tokens + 1, hits)
        self._admit(seq)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv.append(seq)
        return True

    def _admit(self, seq: Sequence) -> None:
        self.waiting.pop(0)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_at = self._step
        seq.start_deadline = None  # it has started

    def _chunk_size(self, remaining: int, budget: int, nothing_scheduled: bool) -> int:
        """Prompt tokens to run this step out of ``remaining`` (0: wait for a later step)."""
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        # Unchunked: a prompt over the budget runs alone rather than never.
        return remaining if nothing_scheduled else 0

    def _reserve_next_token(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Makes room for ``seq``'s next token, preempting others if needed; False if ``seq`` itself was preempted."""
        while not self.blocks.ensure_capacity(seq, seq.num_tokens):
            # Not a prompt handing its K/V off layer by layer: started again, it would send over
            # what the receiver already holds, while units queued from its old blocks are in flight.
            victim = next((s for s in reversed(self.running) if s.kv_send is None), seq)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _reserve_lookahead(self, seq: Sequence, budget: int) -> int:
        """Slots for up to ``lookahead(seq)`` proposed tokens, within the token budget and the
        free blocks; the speculator returns the unused ones after the step."""
        wanted = min(self.lookahead(seq), budget)
        if wanted <= 0:
            return 0
        room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size - seq.num_tokens
        wanted = min(wanted, room)
        return wanted if wanted > 0 and self.blocks.ensure_capacity(seq, seq.num_tokens + wanted) else 0

    def preempt(self, seq: Sequence) -> None:
        """Swap the K/V out to host memory if there is room, else drop it (the sequence
        re-prefills prompt + output later)."""
        self.running.remove(seq)
        self.num_preemptions += 1
        # Only the blocks holding computed K/V go to host memory: the table may already have
        # grown a block for the next token (and a handed-off request holds one for its first).
        computed = self.blocks.blocks_needed(seq.num_computed_tokens)
        if self.swap is not None and not seq.is_prefilling and self.swap.can_hold(computed):
            seq.swapped_blocks = self.swap.swap_out(seq.block_table[:computed])
            num_computed = seq.num_computed_tokens
            self.blocks.free(seq)
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.WAITING
            self.swapped.append(seq)
            return
        self.blocks.free(seq)
        self.add(seq)

    def has_room(self) -> bool:
        """Whether one more sequence may run (``max_num_seqs``, those waiting for remote KV included)."""
        return len(self.running) + len(self.waiting_for_kv) < self.config.max_num_seqs

    def _swap_in(self) -> None:
        """Brings swapped-out sequences back, most important first, while blocks allow."""
        self.swapped.sort(key=_importance)
        while self.swapped and self.has_room():
            seq = self.swapped[0]
            needed = len(seq.swapped_blocks)
            if needed > self.blocks.num_free:
                return
            self.swapped.pop(0)
            device_blocks = self.blocks.allocate_blocks_raw(needed)
            try:
                self.swap.swap_in(seq.swapped_blocks, device_blocks)
            except BaseException:  # nothing leaks; the engine fails the step and aborts its requests
                self.blocks.free_blocks(device_blocks)
                self.swap.release(seq.swapped_blocks)
                seq.swapped_blocks = []
                raise
            seq.swapped_blocks, seq.block_table = [], device_blocks
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _expire_waiting(self) -> list[Sequence]:
        """Requests that have not started by their TTFT deadline leave the queue, rejected."""
        now = time.monotonic()
        expired = [s for s in self.waiting if s.start_deadline is not None and now > s.start_deadline]
        for seq in expired:
            self.waiting.remove(seq)
        self.num_rejected += len(expired)
        return expired
