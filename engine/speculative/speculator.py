"""Speculative decoding in the continuous batch: the engine's three hooks.

1. ``lookahead(seq)`` (the scheduler, for each decode): how many proposed tokens the sequence
   may carry this step. The scheduler reserves their cache slots from free blocks (never by
   preempting) and within the step's token budget. The cap keeps a sequence from running past
   max_tokens or the model's context, and ``backoff`` decides the rest.
2. ``propose(schedule)`` (before the forward pass): fills ``chunk.draft``. The model runner then
   runs each such decode as a chunk of its last token + proposals, logits at every position,
   in the same forward pass as the plain decodes and prompt chunks of the step.
3. ``verify`` (the runner, per chunk) keeps the proposals the model agrees with
   (``verify.py``: exact in distribution); ``step_done`` records acceptance, and gives back the
   slots of rejected proposals: their K/V were written but the sequence's length stops before
   them, blocks past it are freed, and only blocks of accepted tokens are ever hashed into the
   prefix cache (``BlockManager.commit_full_blocks`` counts computed, kept tokens only).

Per-sequence state (acceptance, the n-gram index, the draft's cache) lives here, keyed by the
sequence. A sequence that finishes is dropped in the same step; one that left the running
batch otherwise (aborted, preempted) at the next step, so no other path has to tell the
speculator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampler import sampling_probs
from pdserve.engine.sampling_step import SampledToken
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.backoff import Acceptance, Backoff
from pdserve.engine.speculative.draft import DraftProposer
from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.verify import accept_matching, rejection_sample


@dataclass(frozen=True, slots=True)
class SpecStats:
    drafts: int = 0  # verifications (decodes that carried proposals)
    draft_tokens: int = 0  # proposed tokens
    accepted_tokens: int = 0  # proposed tokens kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: kept proposals + the model's own next token."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may carry proposals. Not requests that want logprobs, a grammar or
    several choices: their sampling step draws one token per sequence and step; nor a prompt
    whose K/V go to a decode worker, which hands off exactly one first token."""
    sp = seq.sampling
    return (
        sp.logprobs is None
        and sp.constraint is None
        and sp.n == 1
        and seq.group is None  # choices: n > 1
        and seq.kv_send is None
    )


class Speculator:
    def __init__(
        self,
        proposer: NgramProposer | DraftProposer,
        num_tokens: int,
        scheduler: Scheduler,
        blocks: BlockManager,
        max_model_len: int,
    ) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.backoff = Backoff(num_tokens)
        self.records: dict[Sequence, Acceptance] = {}
        self._ngram_proposals: dict[Sequence, list[int]] = {}  # found while scheduling, used right after
        self.stats = SpecStats()

    def lookahead(self, seq: Sequence) -> int:
        if not speculates(seq):
            return 0
        record = self.records.get(seq)
        if record is None:
            record = self.records[seq] = self.backoff.new()
        # Emitting k + 1 tokens must not pass max_tokens or the context.
        room = min(seq.sampling.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        k = min(self.backoff.lookahead(record), room)
        if k <= 0:
            return 0
        if isinstance(self.proposer, NgramProposer):  # cheap: look it up now, reserve exactly what was found
            proposal = self.proposer.propose(seq, k)
            if proposal:
                self._ngram_proposals[seq] = proposal
            return len(proposal)
        return k

    def propose(self, schedule: SchedulerOutput) -> None:
        self.drop_finished()
        chunks = [c for c in schedule.decodes if c.lookahead]
        if isinstance(self.proposer, NgramProposer):
            for chunk in chunks:
                chunk.draft = self._ngram_proposals.get(chunk.seq, [])[: chunk.lookahead]
        elif chunks:
            self.proposer.propose(chunks)
        self._ngram_proposals.clear()

    def verify(self, chunk: ScheduledChunk, sampled: list[int], logits: torch.Tensor) -> list[int]:
        sp = chunk.seq.sampling
        if isinstance(self.proposer, DraftProposer) and not sp.greedy and sp.seed is None:
            target = sampling_probs(logits, [sp] * logits.shape[0])
            return rejection_sample(chunk.draft, self.proposer.probs(chunk.seq), target, bonus=sampled[-1])
        return accept_matching(chunk.draft, sampled)

    def step_done(self, schedule: SchedulerOutput, results: list[SampledToken]) -> None:
        drafts = draft_tokens = accepted_tokens = 0
        for result in results:
            chunk = result.chunk
            if not chunk.draft:
                continue
            kept = len(result.token_ids) - (0 if result.cut_at_finish else 1)  # emitted proposals
            drafts, draft_tokens, accepted_tokens = drafts + 1, draft_tokens + len(chunk.draft), accepted_tokens + kept
            self.backoff.update(self.records[chunk.seq], kept)
            if isinstance(self.proposer, DraftProposer):
                self.proposer.accepted(chunk, kept)
        for chunk in schedule.decodes:  # slots reserved for proposals that were not kept (or not made)
            if chunk.seq.is_finished:
                self._forget(chunk.seq)
            elif chunk.lookahead:
                self.blocks.trim(chunk.seq, chunk.seq.num_tokens)
        if drafts:
            s = self.stats
            self.stats = SpecStats(
                s.drafts + drafts, s.draft_tokens + draft_tokens, s.accepted_tokens + accepted_tokens
            )

    def drop_finished(self) -> None:
        """Lets go of sequences that left the running batch (aborted, preempted) since the last step."""
        running = set(self.scheduler.running)
        for seq in [s for s in self.records if s not in running]:
            self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        if self.records.pop(seq, None) is not None:
            self.proposer.release(seq)
