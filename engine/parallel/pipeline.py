"""Pipeline parallel: a stage's share of a step, in micro-batches so that stages overlap.

The step's flat token batch is cut into micro-batches of about equal token counts, cutting
through prompt chunks where needed (a piece of a chunk attends to the pieces before it through
the paged cache: each stage runs its micro-batches in order, so their K/V are there). Stage 0
(rank 0) embeds and runs micro-batch k, hands (hidden, residual) to stage 1 and goes on with
k + 1 while stage 1 works on k; the last stage computes the logits of each micro-batch and
sends them to rank 0, which samples.

On a step that ships K/V (a prefill worker), each stage reports to rank 0 when a layer is done
for the whole step; rank 0 then calls the layer hook, which reads that layer from the stage's
own cache: the K/V leave from whichever stage computed them, layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.model import LayerHook
from pdserve.engine.parallel.groups import RankGroups
from pdserve.engine.parallel.sharding import NEXT_STAGE_NORM, ModelShard

_HIDDEN, _RESIDUAL, _LOGITS, _LAYER_DONE = range(4)


def _tag(kind: int, index: int) -> int:
    return index * 4 + kind


@dataclass(slots=True)
class MicroBatch:
    batch: ForwardBatch
    logits_rows: list[int]  # where this micro-batch's logits go in the step's logits


def split_batch(batch: ForwardBatch, parts: int) -> list[MicroBatch]:
    """Cuts the step's tokens into ``parts`` (at most one per token) contiguous micro-batches."""
    total = batch.num_tokens
    parts = max(1, min(parts, total))
    cuts = [round(k * total / parts) for k in range(parts + 1)]
    logits = batch.logits_indices.tolist()
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        nd = max(0, min(hi, batch.num_decode) - lo)
        segments = []
        for seg in batch.prefills:
            end = seg.query_start + seg.num_query
            a, b = max(seg.query_start, lo), min(end, hi)
            if a < b:  # this piece of the chunk ends (end - b) tokens before the chunk does
                segments.append(PrefillSegment(a - lo, b - a, seg.context_len - (end - b), seg.block_table))
        rows = [j for j, row in enumerate(logits) if lo <= row < hi]
        out.append(
            MicroBatch(
                ForwardBatch(
                    input_ids=batch.input_ids[lo:hi],
                    positions=batch.positions[lo:hi],
                    slot_mapping=batch.slot_mapping[lo:hi],
                    num_decode=nd,
                    decode_block_tables=batch.decode_block_tables[lo : lo + nd] if nd else None,
                    decode_context_lens=batch.decode_context_lens[lo : lo + nd] if nd else None,
                    prefills=segments,
                    logits_indices=torch.tensor(
                        [logits[j] - lo for j in rows], dtype=torch.int64, device=batch.input_ids.device
                    ),
                ),
                rows,
            )
        )
    return out


class PipelineStage:
    """Runs this rank's layers of a step; rank 0 also collects the logits."""

    def __init__(
        self, model, shard: ModelShard, groups: RankGroups, kv_layers: list[torch.Tensor], dtype: torch.dtype
    ) -> None:
        self.model = model
        self.shard = shard
        self.groups = groups
        self.kv_layers = kv_layers
        self.dtype = dtype
        layout = shard.layout
        stage, tp_rank = layout.coords(groups.rank)
        self.prev = layout.rank_of(stage - 1, tp_rank) if stage > 0 else None
        self.next = layout.rank_of(stage + 1, tp_rank) if stage + 1 < layout.pp else None
        self.last_root = layout.rank_of(layout.pp - 1, 0)  # where the logits are gathered
        assert layout.pp > 1, "a single stage runs the model's own forward"

    def run(
        self,
        batch: ForwardBatch,
        num_micro_batches: int,
        layer_hook: LayerHook | None = None,
        report_layers: bool = False,
    ) -> torch.Tensor | None:
        """``layer_hook`` (rank 0): called with each layer's global index once its K/V are written
        for the whole step, wherever it ran; ``report_layers`` (other ranks): tell rank 0."""
        micro = split_batch(batch, num_micro_batches)
        pending = []
        for k, mb in enumerate(micro):
            last_micro = k == len(micro) - 1
            h, residual = self._input(mb.batch, k)
            h = self._layers(
                h, residual, mb.batch, layer_hook if last_micro else None, report_layers and last_micro, pending
            )
            if self.next is not None:
                pending += [
                    self.groups.send(h.contiguous(), self.next, _tag(_HIDDEN, k)),
                    self.groups.send(residual, self.next, _tag(_RESIDUAL, k)),
                ]
            elif mb.logits_rows:
                logits = self.model.lm_head(h[mb.batch.logits_indices]).float()
                if self.groups.rank == self.last_root:
                    pending.append(self.groups.send(logits.contiguous(), 0, _tag(_LOGITS, k)))
        result = self._collect(micro, layer_hook) if self.groups.rank == 0 else None
        self.groups.wait(pending)
        return result

    def _input(self, batch: ForwardBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prev is None:
            residual = self.model.model.embed_tokens(batch.input_ids)
            first = self.model.model.layers[0].input_layernorm
            return self.model.ops.rms_norm(residual, first.weight, first.eps), residual
        shape = (batch.num_tokens, self.shard.config.hidden_size)
        device = self.groups.device
        h = self.groups.recv(torch.empty(shape, dtype=self.dtype, device=device), self.prev, _tag(_HIDDEN, k))
        residual = self.groups.recv(torch.empty(shape, dtype=self.dtype, device=device), self.prev, _tag(_RESIDUAL, k))
        return h, residual

    def _layers(self, h, residual, batch, hook, report, pending) -> torch.Tensor:
        model, layers, first = self.model, self.model.model.layers, self.shard.layers.start
        last_norm = model.model.norm if self.next is None else getattr(model, NEXT_STAGE_NORM)
        for j, layer in enumerate(layers):
            next_norm = layers[j + 1].input_layernorm if j + 1 < len(layers) else last_norm
            h = layer(h, residual, next_norm, batch, self.kv_layers[j], model.rope, model.backend, model.ops)
            if hook is not None:
                hook(first + j)
            elif report and self.groups.tp_rank == 0:
                done = torch.tensor([first + j], dtype=torch.int64, device=self.groups.device)
                pending.append(self.groups.send(done, 0, _tag(_LAYER_DONE, first + j)))
        return h

    def _collect(self, micro: list[MicroBatch], hook: LayerHook | None) -> torch.Tensor:
        """Rank 0: the layer reports of later stages (in layer order), then the logits."""
        num_layers, layout = self.shard.config.num_layers, self.shard.layout
        if hook is not None:
            for layer in range(self.shard.layers.stop, num_layers):
                src = layout.rank_of(layout.stage_of_layer(layer, num_layers), 0)
                self.groups.recv(
                    torch.empty(1, dtype=torch.int64, device=self.groups.device), src, _tag(_LAYER_DONE, layer)
                )
                hook(layer)
        vocab, device = self.shard.config.vocab_size, self.groups.device
        parts = [
            self.groups.recv(
                torch.empty((len(mb.logits_rows), vocab), dtype=torch.float32, device=device),
                self.last_root,
                _tag(_LOGITS, k),
            )
            for k, mb in enumerate(micro)
            if mb.logits_rows
        ]
        order = [row for mb in micro for row in mb.logits_rows]
        logits = torch.empty((len(order), vocab), dtype=torch.float32, device=device)
        if order:
            logits[torch.tensor(order, device=self.groups.device)] = torch.cat(parts)
        return logits
