"""From a step's logits to its new tokens: the part of sampling that sees whole requests.

For every chunk that completes its sequence, one logits row: grammar masks for constrained
rows (structured output), the batched sampler, and the chosen tokens' logprobs (from the raw
row, before temperature, top-k/top-p and the mask: see ``engine.logprobs``). A sequence whose
choices are about to fork (n > 1, its first token) gets its row repeated once per choice,
each with that choice's seed, so the n first tokens come from the one prefill. Prompt
logprobs come from the extra rows ``engine.logprobs.add_prompt_rows`` asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.choices import choice_sampling, needs_fork
from pdserve.engine.logprobs import PromptRows, TokenLogprob, collect_prompt_logprobs, token_logprobs
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.structured_output import BatchMasker, GrammarState


@dataclass(slots=True)
class SampledToken:
    chunk: ScheduledChunk
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # n > 1, first token: every choice's (token, logprob), choice 0's first (it repeats the above)
    choices: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)


class SamplingStep:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.masker = BatchMasker()

    def __call__(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                 prompt_rows: list[PromptRows] = ()) -> list[SampledToken]:
        """``logits``: one row per chunk (in order), then the prompt rows."""
        if prompt_rows:
            collect_prompt_logprobs(logits, prompt_rows)
            logits = logits[: len(chunks)]
        if not chunks:
            return []

        # One row per choice being drawn: (chunk, its sampling, output index, grammar).
        source, params, index, grammars = [], [], [], []
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            n = seq.sampling.n if needs_fork(seq) else 1
            for choice in range(n):
                source.append(i)
                params.append(seq.sampling if choice == 0 else choice_sampling(seq.sampling, choice))
                index.append(seq.num_output_tokens)
                if seq.grammar is not None:
                    seq.grammar.sync(seq.generated_token_ids)
                grammars.append(seq.grammar)
        rows = logits if len(source) == len(chunks) else logits[torch.tensor(source, device=logits.device)]

        wanted = [r for r, p in enumerate(params) if p.logprobs is not None]
        raw = rows[wanted] if wanted else None  # a copy, taken before the masks change the rows in place
        constrained: list[tuple[int, GrammarState]] = [(r, g) for r, g in enumerate(grammars) if g is not None]
        if constrained:
            self.masker.apply(rows, constrained)
        token_ids = self.sampler(rows, params, index)

        logprobs: list[TokenLogprob | None] = [None] * len(params)
        if wanted:
            num_top = max(params[r].logprobs for r in wanted)
            for r, lp in zip(wanted, token_logprobs(raw, token_ids[wanted], num_top)):
                keep = params[r].logprobs
                logprobs[r] = lp if keep == num_top else TokenLogprob(lp.logprob, lp.rank, lp.top_token_ids[:keep],
                                                                         lp.top_logprobs[:keep])
        ids = token_ids.tolist()
        out: list[SampledToken] = []
        for r, i in enumerate(source):
            if r and source[r - 1] == i:
                out[-1].choices.append((ids[r], logprobs[r]))
                continue
            sampled = SampledToken(chunks[i], ids[r], logprobs[r])
            if needs_fork(chunks[i].seq):
                sampled.choices.append((ids[r], logprobs[r]))
            out.append(sampled)
        return out
