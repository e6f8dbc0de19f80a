"""What one forward pass computes: the flattened tokens of a step and where their K/V live."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSegment:
    """A chunk of one sequence's prompt: ``num_query`` tokens ending at ``context_len``."""

    query_start: int  # offset of the chunk in the flattened token batch
    num_query: int
    context_len: int  # tokens in the cache after this chunk (earlier chunks and cached prefix included)
    block_table: torch.Tensor  # [num_blocks] int64

    @property
    def has_prior_context(self) -> bool:
        return self.context_len > self.num_query


@dataclass(slots=True)
class ForwardBatch:
    """The tokens of one step. Decode tokens come first (one per sequence), then prefill chunks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T], where each token's K/V is written
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decode]
    prefills: list[PrefillSegment]
    logits_indices: torch.Tensor  # rows of the hidden states that need next-token logits

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
