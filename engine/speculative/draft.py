"""Draft-model proposals: a smaller model with the target's vocabulary, run by the decode worker.

The draft keeps its own paged KV cache (its own block pool, as many blocks as the target's,
no prefix sharing), filled on the decode worker rather than shipped from the prefill pool:
the first time a sequence proposes, the draft runs over its prompt and output so far, at
most ``CATCH_UP_TOKENS`` per step across the batch, so a long prompt catches up over a few
steps (proposing nothing meanwhile) instead of stalling everyone's next token. Each step then
runs the draft k times for the sequences that propose: one pass over the tokens it has not
seen (usually the last verified one or few), which gives the first proposal, then k - 1
one-token passes (decode-only batches, the fused decode loop's case). After verification the
draft's K/V of kept proposals stay; the rest are overwritten later.

Proposals are drawn as the target will draw its tokens: greedy requests take the argmax;
seeded requests take argmax(q / E) with E the very noise the target's sampler uses for that
token (``sampler.seeded_noise``), so the proposal predicts the target's own sample and the
result is reproducible anywhere; unseeded sampled requests draw from q and keep q for
rejection sampling (``verify.rejection_sample``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.kv_cache import KVCache, KVLayout
from pdserve.engine.model import CausalLM
from pdserve.engine.sampler import inverse_transform, sampling_probs, seeded_noise
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import Sequence

CATCH_UP_TOKENS = 256  # draft tokens per step spent on sequences the draft has not seen yet


@dataclass(slots=True)
class DraftState:
    block_table: list[int] = field(default_factory=list)
    cached: int = 0  # leading tokens of the sequence whose K/V the draft cache holds
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each proposal (unseeded sampling only)


@dataclass(slots=True)
class _Row:
    """One sequence's tokens in a draft pass."""

    tokens: list[int]
    start: int  # position of tokens[0]
    block_table: list[int]
    wants_logits: bool = True


class DraftProposer:
    def __init__(self, model: CausalLM, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.model = model
        self.cache = KVCache(layout, num_blocks, device)
        self.block_size = layout.block_size
        self.device = device
        self.free_blocks = list(range(num_blocks))
        self.states: dict[Sequence, DraftState] = {}

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq, None)
        if state is not None:
            self.free_blocks += state.block_table

    def probs(self, seq: Sequence) -> torch.Tensor:
        """[k, V]: the distributions the last proposals of an unseeded sampled request came from."""
        return torch.stack(self.states[seq].probs)

    def accepted(self, chunk: ScheduledChunk, kept: int) -> None:
        """The draft's K/V stay valid up to the last kept proposal it has run (it never runs the last one)."""
        state = self.states[chunk.seq]
        state.cached = chunk.start + 1 + min(kept, len(chunk.draft) - 1)

    def propose(self, chunks: list[ScheduledChunk]) -> None:
        """Sets ``chunk.draft`` (``chunk.lookahead`` tokens, or none while catching up or out of blocks)."""
        rows, proposing = [], []
        budget = CATCH_UP_TOKENS
        for chunk in chunks:
            seq = chunk.seq
            state = self.states.setdefault(seq, DraftState())
            pending = seq.num_tokens - state.cached
            if seq.num_tokens + chunk.lookahead > self.model.config.max_position:
                continue
            if pending > budget:  # catch up part of the way; propose once the draft has seen it all
                if budget and self._grow(state, state.cached + budget):
                    rows.append(
                        _Row(
                            seq.token_ids[state.cached : state.cached + budget], state.cached, state.block_table, False
                        )
                    )
                    state.cached += budget
                budget = 0
                continue
            if not self._grow(state, seq.num_tokens + chunk.lookahead - 1):
                continue
            budget -= pending
            rows.append(_Row(seq.token_ids[state.cached :], state.cached, state.block_table))
            state.cached = seq.num_tokens
            state.probs = []
            proposing.append(chunk)
        if not rows:
            return
        logits = self._forward(rows)
        for step in range(max((c.lookahead for c in proposing), default=0)):
            if step:  # feed each still-proposing sequence its previous proposal
                proposing = [c for c in proposing if c.lookahead > step]
                logits = self._forward(
                    [_Row([c.draft[-1]], c.start + step, self.states[c.seq].block_table) for c in proposing]
                )
            for chunk, token in zip(proposing, self._sample(logits, proposing, step)):
                chunk.draft.append(token)

    # -- internals ---------------------------------------------------------------------------------
    def _grow(self, state: DraftState, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(state.block_table)
        if needed > len(self.free_blocks):
            return False
        for _ in range(max(0, needed)):
            state.block_table.append(self.free_blocks.pop())
        return True

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk], step: int) -> list[int]:
        """One proposal per chunk: the token at output index ``num_output_tokens + step``."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, chunk in enumerate(chunks):
            sp = chunk.seq.sampling
            if sp.greedy:
                continue
            probs = sampling_probs(logits[i : i + 1], [sp])[0]
            if sp.seed is None:
                self.states[chunk.seq].probs.append(probs)
                tokens[i] = int(inverse_transform(probs[None], torch.rand(1)))
            else:
                noise = seeded_noise([(sp.seed, chunk.seq.num_output_tokens + step)], probs.shape[0], probs.device)
                tokens[i] = int((probs / noise[0]).argmax())
        return tokens

    def _forward(self, rows: list[_Row]) -> torch.Tensor:
        """Runs the draft over ``rows`` (one-token rows as decodes, the rest as chunks over their
        cached context); returns the logits of each row's last token, for rows that want them."""
        bs = self.block_size
        singles = [r for r in rows if len(r.tokens) == 1]
        chunks = [r for r in rows if len(r.tokens) > 1]
        input_ids, positions, slots, wanted = [], [], [], {}
        segments = []
        for row in singles + chunks:
            query_start = len(input_ids)
            input_ids += row.tokens
            span = range(row.start, row.start + len(row.tokens))
            positions.extend(span)
            slots.extend(row.block_table[p // bs] * bs + p % bs for p in span)
            if len(row.tokens) > 1:
                segments.append(
                    PrefillSegment(
                        query_start,
                        len(row.tokens),
                        span.stop,
                        torch.tensor(row.block_table, dtype=torch.int64, device=self.device),
                    )
                )
            if row.wants_logits:
                wanted[id(row)] = len(input_ids) - 1
        tables = lens = None
        if singles:
            width = max(len(r.block_table) for r in singles)
            tables = torch.tensor(
                [r.block_table + [0] * (width - len(r.block_table)) for r in singles],
                dtype=torch.int64,
                device=self.device,
            )
            lens = torch.tensor([r.start + 1 for r in singles], dtype=torch.int64, device=self.device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        order = [wanted[id(r)] for r in rows if r.wants_logits]  # logits in the caller's row order
        batch = ForwardBatch(
            as_tensor(input_ids),
            as_tensor(positions),
            as_tensor(slots),
            len(singles),
            tables,
            lens,
            segments,
            as_tensor(order),
        )
        return self.model(batch, self.cache.layers)
