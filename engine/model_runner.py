"""Turns a scheduled step into tensors, runs the model, and samples.

A decode that carries proposed tokens (speculative decoding, ``engine/speculative``) runs its
last token and the proposals as one chunk over its cached context, the shape of a prefill
chunk, with logits at every position; ``verify`` then keeps the proposals the model agrees
with. Logit rows come in the batch's order: plain decodes, those chunks, then prompt chunks.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.model import CausalLM, LayerHook
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, kv_layers: list[torch.Tensor], block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device)
        # (chunk, tokens sampled at its 1 + len(draft) positions, their logits) -> the tokens
        # it emits; set by the speculator.
        self.verify: Callable[[ScheduledChunk, list[int], torch.Tensor], list[int]] | None = None

    @staticmethod
    def _decodes(out: SchedulerOutput) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """The step's decodes without and with proposed tokens."""
        return [c for c in out.decodes if not c.draft], [c for c in out.decodes if c.draft]

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        decodes, verified = self._decodes(out)

        for chunk in decodes:
            seq, pos = chunk.seq, chunk.start
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            logits_indices.append(len(input_ids) - 1)

        decode_tables = decode_lens = None
        if decodes:
            width = max(len(c.seq.block_table) for c in decodes)
            table = [c.seq.block_table + [0] * (width - len(c.seq.block_table)) for c in decodes]
            decode_tables = torch.tensor(table, dtype=torch.int64, device=self.device)
            decode_lens = torch.tensor([c.start + 1 for c in decodes], dtype=torch.int64, device=self.device)

        segments = []
        for chunk in verified:  # last token + proposals over the cached context, logits at each
            seq, start, count = chunk.seq, chunk.start, 1 + len(chunk.draft)
            query_start = len(input_ids)
            input_ids += [seq.token_ids[start], *chunk.draft]
            positions.extend(range(start, start + count))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + count))
            segments.append(PrefillSegment(query_start, count, start + count,
                                           torch.tensor(seq.block_table, dtype=torch.int64, device=self.device)))
            logits_indices.extend(range(query_start, query_start + count))
        for chunk in out.prefills:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            segments.append(
                PrefillSegment(
                    query_start=query_start,
                    num_query=chunk.num_tokens,
                    context_len=end,
                    block_table=torch.tensor(table, dtype=torch.int64, device=self.device),
                )
            )
            if chunk.completes:
                logits_indices.append(len(input_ids) - 1)

        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            num_decode=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=segments,
            logits_indices=as_tensor(logits_indices),
        )

    def run(self, out: SchedulerOutput, layer_hook: LayerHook | None = None) -> list[tuple[ScheduledChunk, list[int]]]:
        """One forward pass; returns the new tokens of every chunk that completes its sequence
        (one, or with proposed tokens, those accepted and one more)."""
        batch = self.build_batch(out)
        logits = self.model(batch, self.kv_layers, layer_hook)
        decodes, verified = self._decodes(out)
        sampled_chunks = decodes + verified + [c for c in out.prefills if c.completes]  # in logit row order
        if not sampled_chunks:
            return []
        # Each position of a chunk samples as the next token would: row i is output token n + i.
        counts = [1 + len(c.draft) for c in sampled_chunks]
        token_ids = self.sampler(
            logits,
            [c.seq.sampling for c, n in zip(sampled_chunks, counts) for _ in range(n)],
            [c.seq.num_output_tokens + i for c, n in zip(sampled_chunks, counts) for i in range(n)],
        ).tolist()
        results, row = [], 0
        for chunk, n in zip(sampled_chunks, counts):
            tokens = token_ids[row : row + n]
            if chunk.draft:
                tokens = self.verify(chunk, tokens, logits[row : row + n])
            results.append((chunk, tokens))
            row += n
        return results
