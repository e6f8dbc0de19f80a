"""From a step's logits to its new tokens: the part of sampling that sees whole requests.

For every chunk that completes its sequence, one logits row: grammar masks for constrained
rows (structured output), the batched sampler, and the chosen tokens' logprobs (from the raw
row, before temperature, top-k/top-p and the mask: see ``engine.logprobs``). A sequence whose
choices are about to fork (n > 1, its first token) gets its row repeated once per choice,
each with that choice's seed, so the n first tokens come from the one prefill. A decode that
carries proposed tokens (speculative decoding) has a row per position, each sampled as that
output token would be, and ``verify`` keeps what the model agrees with; such requests never
ask for logprobs, grammars or choices (``speculator.speculates``). Prompt logprobs come from
the extra rows ``engine.logprobs.add_prompt_rows`` asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.choices import choice_sampling, needs_fork
from pdserve.engine.logprobs import PromptRows, TokenLogprob, collect_prompt_logprobs, token_logprobs
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.structured_output import BatchMasker, GrammarState


@dataclass(slots=True)
class SampledToken:
    chunk: ScheduledChunk
    token_ids: list[int]  # one; with proposals, those kept and the model's next token
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # n > 1, first token: every choice's (token, logprob), choice 0's first (it repeats the above)
    choices: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    # A stop token or the length limit among the kept proposals: the tokens after it were cut
    # off, so every token left is a kept proposal (none is the model's own next token).
    cut_at_finish: bool = False


# (chunk, tokens sampled at its 1 + len(draft) positions, their logits) -> the tokens it emits
Verify = Callable[[ScheduledChunk, list[int], torch.Tensor], list[int]]


class SamplingStep:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.masker = BatchMasker()
        self.verify: Verify | None = None  # set by the speculator

    def __call__(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], prompt_rows: list[PromptRows] = ()
    ) -> list[SampledToken]:
        """``logits``: 1 + len(chunk.draft) rows per chunk (in order), then the prompt rows."""
        num_rows = sum(1 + len(c.draft) for c in chunks)
        if prompt_rows:
            collect_prompt_logprobs(logits, prompt_rows)
            logits = logits[:num_rows]
        if not chunks:
            return []

        # One row per token being drawn: (chunk, its logits row, sampling, output index, grammar).
        source, row_of, params, index, grammars = [], [], [], [], []
        first_row = 0
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            n = seq.sampling.n if needs_fork(seq) else 1
            if seq.grammar is not None:
                seq.grammar.sync(seq.generated_token_ids)
            for choice in range(n):
                for position in range(1 + len(chunk.draft)):  # a fork has no proposals
                    source.append(i)
                    row_of.append(first_row + position)
                    params.append(seq.sampling if choice == 0 else choice_sampling(seq.sampling, choice))
                    index.append(seq.num_output_tokens + position)
                    grammars.append(seq.grammar)
            first_row += 1 + len(chunk.draft)
        rows = logits if row_of == list(range(num_rows)) else logits[torch.tensor(row_of, device=logits.device)]

        wanted = [r for r, p in enumerate(params) if p.logprobs is not None]
        raw = rows[wanted] if wanted else None  # a copy, taken before the masks change the rows in place
        constrained: list[tuple[int, GrammarState]] = [(r, g) for r, g in enumerate(grammars) if g is not None]
        if constrained:
            self.masker.apply(rows, constrained)
        # Nothing reads the rows after sampling but verification (proposals never carry grammars).
        token_ids = self.sampler(rows, params, index, overwrite=not any(c.draft for c in chunks))

        logprobs: list[TokenLogprob | None] = [None] * len(params)
        if wanted:
            num_top = max(params[r].logprobs for r in wanted)
            for r, lp in zip(wanted, token_logprobs(raw, token_ids[wanted], num_top)):
                keep = params[r].logprobs
                logprobs[r] = (
                    lp
                    if keep == num_top
                    else TokenLogprob(lp.logprob, lp.rank, lp.top_token_ids[:keep], lp.top_logprobs[:keep])
                )
        ids = token_ids.tolist()
        out: list[SampledToken] = []
        r = 0
        while r < len(source):
            chunk, count = chunks[source[r]], 1 + len(chunks[source[r]].draft)
            if chunk.draft:
                out.append(SampledToken(chunk, self.verify(chunk, ids[r : r + count], rows[r : r + count])))
            else:
                sampled = SampledToken(chunk, [ids[r]], logprobs[r])
                if needs_fork(chunk.seq):  # every choice's first token, choice 0's first
                    count = chunk.seq.sampling.n
                    sampled.choices = list(zip(ids[r : r + count], logprobs[r : r + count]))
                out.append(sampled)
            r += count
        return out
