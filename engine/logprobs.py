"""Log probabilities of generated and prompt tokens.

They are computed from the model's raw next-token distribution: ``log_softmax`` of the fp32
logits of the very forward pass the sampler draws from, *before* temperature, top-k/top-p and
any structured-output mask. That is what OpenAI reports (its logprobs do not change with
temperature) and vLLM's default (``logprobs_mode=raw_logprobs``), except under a grammar:
vLLM applies the structured-output mask first, here the alternatives stay the model's own. A
constrained or truncated sampler may therefore pick a token whose reported logprob is low,
never -inf.

Prompt logprobs: position ``p`` of a prompt predicts token ``p + 1``; a prompt of ``L``
tokens has ``L - 1`` of them (OpenAI's ``echo`` reports ``null`` for the first token). The
rows they need are appended after the sampling rows of a step's logits, so the sampler's
rows keep their order. A request that wants prompt logprobs computes its whole prompt: it
does not reuse the prefix cache (as vLLM), since a cached block holds K/V, not logits. The
cost is that prompt's prefill, plus one ``lm_head`` row and one ``log_softmax`` per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import Sequence

ROWS_PER_PASS = 256  # prompt rows turned into logprobs at once (bounds the [rows, vocab] temporaries)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token's logprob, its rank (1 = most likely) and the ``k`` most likely
    alternatives, most likely first."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """``logits``: [R, V] fp32 (raw); ``token_ids``: [R] the tokens whose logprobs are wanted."""
    out: list[TokenLogprob] = []
    for start in range(0, logits.shape[0], ROWS_PER_PASS):
        rows = logits[start : start + ROWS_PER_PASS].float().log_softmax(dim=-1)
        ids = token_ids[start : start + ROWS_PER_PASS].to(rows.device)
        chosen = rows.gather(1, ids[:, None])
        ranks = (rows > chosen).sum(dim=-1) + 1
        chosen_list, rank_list = chosen[:, 0].tolist(), ranks.tolist()
        if num_top > 0:
            top = rows.topk(num_top, dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        else:
            top_ids = top_lps = [[] for _ in chosen_list]
        out += [TokenLogprob(lp, rank, ti, tl) for lp, rank, ti, tl in zip(chosen_list, rank_list, top_ids, top_lps)]
    return out


# -- prompt logprobs ------------------------------------------------------------------------------
def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether ``seq``'s prompt logprobs are still being collected (they go out with its first token)."""
    return seq.prompt_logprobs is not None


def start_prompt_logprobs(seq: Sequence) -> None:
    """Called when the request is added: one slot per prompt token after the first."""
    if seq.sampling.prompt_logprobs is not None and seq.num_prior_output_tokens == 0:
        seq.prompt_logprobs = [None] * (seq.num_prompt_tokens - 1)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Rows ``[row, row + count)`` of the step's logits predict ``seq``'s prompt tokens
    ``first + 1 .. first + count``."""

    seq: Sequence
    row: int
    first: int
    count: int


def add_prompt_rows(batch: ForwardBatch, prefills: list[ScheduledChunk]) -> list[PromptRows]:
    """Appends to ``batch.logits_indices`` the rows of every prefill chunk whose sequence
    wants prompt logprobs (after the sampling rows, whose order is kept)."""
    spans: list[PromptRows] = []
    extra: list[torch.Tensor] = []
    row = batch.logits_indices.shape[0]
    segments = batch.prefills[len(batch.prefills) - len(prefills) :]  # after the verified decodes' segments
    for chunk, segment in zip(prefills, segments):
        seq = chunk.seq
        if not wants_prompt_logprobs(seq):
            continue
        # Positions start .. end-1 of the chunk; the prompt's last position predicts the first
        # generated token (the sampler's row), not a prompt token.
        count = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1) - chunk.start
        if count <= 0:
            continue
        extra.append(torch.arange(segment.query_start, segment.query_start + count, device=batch.logits_indices.device))
        spans.append(PromptRows(seq, row, chunk.start, count))
        row += count
    if extra:
        batch.logits_indices = torch.cat([batch.logits_indices, *extra])
    return spans


def collect_prompt_logprobs(logits: torch.Tensor, spans: list[PromptRows]) -> None:
    """Stores each span's logprobs on its sequence (a recomputed chunk overwrites its slots)."""
    for span in spans:
        seq = span.seq
        targets = torch.tensor(seq.token_ids[span.first + 1 : span.first + 1 + span.count], dtype=torch.int64)
        rows = logits[span.row : span.row + span.count]
        for i, lp in enumerate(token_logprobs(rows, targets, seq.sampling.prompt_logprobs)):
            seq.prompt_logprobs[span.first + i] = lp


def take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
    """The prompt's logprobs once complete (with its first token), and only once."""
    collected, seq.prompt_logprobs = seq.prompt_logprobs, None
    return collected
