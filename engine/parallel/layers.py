"""The parallel layers a sharded model runs: each wraps the plain layer holding this rank's slice
(``nn.Linear``, ``PackedLinear`` or ``QuantizedLinear`` alike) and adds the communication.

- ``RowParallel`` (o_proj, down_proj): partial outputs from this rank's input columns, summed
  over the stage's TP ranks by one all-reduce.
- ``VocabParallelEmbedding``: looks up the ids in this rank's vocabulary rows, zeros for the
  others, and all-reduces, so every rank ends with the whole embedding.
- ``VocabParallelHead``: this rank's logits columns, gathered on the stage's tp rank 0 (the
  only one that samples); other ranks get an empty tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.parallel.groups import RankGroups


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, groups: RankGroups) -> None:
        super().__init__()
        self.inner = inner
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    def __init__(self, inner: nn.Embedding, first_row: int, groups: RankGroups) -> None:
        super().__init__()
        self.inner = inner
        self.first_row = first_row
        self.groups = groups

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.inner.num_embeddings)
        out = self.inner(local.masked_fill(outside, 0))
        out[outside] = 0
        return self.groups.all_reduce(out)


class VocabParallelHead(nn.Module):
    def __init__(self, inner: nn.Module, vocab_size: int, groups: RankGroups) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.groups.gather_to_root(self.inner(x).float().contiguous())
        if parts is None:
            return torch.empty((x.shape[0], 0), dtype=torch.float32, device=x.device)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
