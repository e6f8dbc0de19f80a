"""Turns a scheduled step into tensors, runs the model, and samples.

A decode that carries proposed tokens (speculative decoding, ``engine/speculative``) runs its
last token and the proposals as one chunk over its cached context, the shape of a prefill
chunk, with logits at every position; the sampling step's ``verify`` then keeps the proposals the model agrees
with. Logit rows come in the batch's order: plain decodes, those chunks, then prompt chunks.
"""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.logprobs import add_prompt_rows
from pdserve.engine.model import CausalLM, LayerHook
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_step import SampledToken, SamplingStep
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, kv_layers: list[torch.Tensor], block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device)
        self.sampling = SamplingStep(self.sampler)  # grammar masks, n > 1 first tokens, logprobs, verification

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
            segments.append(
                PrefillSegment(
                    query_start,
                    count,
                    start + count,
                    torch.tensor(seq.block_table, dtype=torch.int64, device=self.device),
                )
            )
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

    def run(self, out: SchedulerOutput, layer_hook: LayerHook | None = None) -> list[SampledToken]:
        """One forward pass; returns the new tokens of every chunk that completes its sequence
        (one, or with proposed tokens, those accepted and one more)."""
        batch = self.build_batch(out)
        prompt_rows = add_prompt_rows(batch, out.prefills)  # prompt logprobs: rows after the sampling rows
        logits = self.model(batch, self.kv_layers, layer_hook)
        decodes, verified = self._decodes(out)
        return self.sampling(logits, decodes + verified + [c for c in out.prefills if c.completes], prompt_rows)
