"""Model quality figures printed beside every speed figure: perplexity on a fixed text and
how often a quantized model's next-token choice agrees with the unquantized one.

The fixed text is Python's own ``pydoc_data.topics`` (on every machine, ~700 k characters).
Perplexity is computed in non-overlapping windows: each window is one prompt run through the
engine's model with logits at every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.llm_engine import LLMEngine


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


@torch.inference_mode()
def token_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] for every position of one sequence (position i predicts token i + 1)."""
    n = len(token_ids)
    bs = engine.config.block_size
    blocks = engine.blocks.allocate_blocks_raw(engine.blocks.blocks_needed(n))
    try:
        device = engine.device
        positions = torch.arange(n, device=device)
        table = torch.tensor(blocks, dtype=torch.int64, device=device)
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=positions,
            slot_mapping=table[positions // bs] * bs + positions % bs,
            num_decode=0, decode_block_tables=None, decode_context_lens=None,
            prefills=[PrefillSegment(query_start=0, num_query=n, context_len=n, block_table=table)],
            logits_indices=positions,
        )
        return engine.model(batch, engine.kv_cache.layers)
    finally:
        engine.blocks.free_blocks(blocks)


@dataclass(frozen=True, slots=True)
class Perplexity:
    tokens: int
    nll: float  # mean negative log-likelihood per predicted token

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def perplexity(engine: LLMEngine, token_ids: list[int], window: int = 1024) -> Perplexity:
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = token_logits(engine, chunk)
        target = torch.tensor(chunk[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits[:-1], target, reduction="sum").item()
        count += len(chunk) - 1
    return Perplexity(count, total / count)


def top1_agreement(engine: LLMEngine, reference: LLMEngine, sequences: list[list[int]]) -> float:
    """Share of positions where both models pick the same next token, both reading the same
    text (teacher forcing: one early difference does not compound into every later token)."""
    same = total = 0
    for ids in sequences:
        a = token_logits(engine, ids).argmax(-1)
        b = token_logits(reference, ids).argmax(-1)
        same += int((a == b).sum())
        total += len(ids)
    return same / total
