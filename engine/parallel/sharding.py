"""What one rank holds of the model: its shape, its slice of the checkpoint, its parallel layers.

The loader asks a ``ModelShard`` three things (see ``engine.loader.load_model``): the local
config to build the model with (this rank's heads, intermediate size and layers), which
modules to drop before loading (the embedding off the first stage, the head off the last),
and this rank's slice of every tensor. After loading (and packing or quantizing, which then
work on the slices) it swaps in the parallel layers. The slices, for tp rank r of a stage:

- q/k/v (stacked): the rows of r's query heads, then of r's KV heads for k and for v;
- gate/up (stacked): r's slice of the gate rows, then the same slice of the up rows;
- o and down: r's slice of their input columns; their bias only on tp rank 0 (the all-reduce
  sums the partial outputs, so a bias on every rank would be added tp times);
- embedding and (untied) lm_head: r's rows of the vocabulary, the last shard zero-padded.

A stage that is not the last also keeps the first ``input_layernorm`` of the next stage: the
decoder layer fuses the next layer's norm into its output, so the hidden state a stage hands
on is already normalized for the next stage's first layer.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.layout import ParallelLayout, kv_heads_per_rank

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
NEXT_STAGE_NORM = "next_stage_norm"  # the attribute of CausalLM holding the next stage's first input norm


@dataclasses.dataclass(frozen=True)
class ModelShard:
    layout: ParallelLayout
    rank: int
    config: ModelConfig  # the whole model's

    @property
    def stage(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def layers(self) -> range:
        return self.layout.stage_layers(self.stage, self.config.num_layers)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.layout.pp - 1

    def local_config(self) -> ModelConfig:
        c, tp = self.config, self.layout.tp
        return dataclasses.replace(
            c,
            num_heads=c.num_heads // tp,
            num_kv_heads=kv_heads_per_rank(c.num_kv_heads, tp),
            intermediate_size=c.intermediate_size // tp,
            num_layers=len(self.layers),
            vocab_size=self.layout.vocab_shard_size(c.vocab_size),
        )

    # -- before loading (on the meta device) -------------------------------------------------------
    def prune(self, model) -> None:
        """Drops what this stage never runs; adds the next stage's first norm where needed."""
        from pdserve.engine.model import RMSNorm

        keeps_embedding = self.first_stage or (self.last_stage and self.config.tie_word_embeddings)
        if not keeps_embedding:
            model.model.embed_tokens = None
        if not self.last_stage:
            model.lm_head = None
            model.model.norm = None
            setattr(model, NEXT_STAGE_NORM, RMSNorm(self.config.hidden_size, self.config.rms_norm_eps))

    # -- the checkpoint ----------------------------------------------------------------------------
    def shard_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a (stacked) checkpoint, under the local model's names."""
        out: dict[str, torch.Tensor] = {}
        layers = self.layers
        for name, tensor in state.items():
            match = _LAYER_KEY.match(name)
            if match is None:
                self._shard_global(name, tensor, out)
                continue
            layer, rest = int(match.group(1)), match.group(2)
            if layer in layers:
                out[f"model.layers.{layer - layers.start}.{rest}"] = self._shard_layer_tensor(rest, tensor)
            elif rest == "input_layernorm.weight" and not self.last_stage and layer == layers.stop:
                out[f"{NEXT_STAGE_NORM}.weight"] = tensor
        return out

    def _shard_global(self, name: str, tensor: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        if name == "model.embed_tokens.weight":
            if self.first_stage or (self.last_stage and self.config.tie_word_embeddings):
                out[name] = self._vocab_rows(tensor)
        elif name == "lm_head.weight":
            if self.last_stage:
                out[name] = self._vocab_rows(tensor)
        elif name == "model.norm.weight":
            if self.last_stage:
                out[name] = tensor
        else:
            out[name] = tensor

    def _vocab_rows(self, weight: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return weight
        rows = self.layout.vocab_rows(self.tp_rank, self.config.vocab_size)
        part = weight[rows.start : rows.stop]
        pad = self.layout.vocab_shard_size(self.config.vocab_size) - len(rows)
        return F.pad(part, (0, 0, 0, pad)) if pad else part.clone()

    def _shard_layer_tensor(self, rest: str, tensor: torch.Tensor) -> torch.Tensor:
        tp, r, c = self.layout.tp, self.tp_rank, self.config
        if tp == 1:
            return tensor
        kind = rest.rsplit(".", 1)[1]  # weight or bias
        if rest.startswith("self_attn.qkv_proj."):
            d = c.head_dim
            q, k, v = tensor.split((c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d))
            qh, kvh = self.layout.q_heads(r, c.num_heads), self.layout.kv_heads(r, c.num_kv_heads)
            return torch.cat(
                [q[qh.start * d : qh.stop * d], k[kvh.start * d : kvh.stop * d], v[kvh.start * d : kvh.stop * d]]
            ).contiguous()
        if rest.startswith("mlp.gate_up_proj."):
            gate, up = tensor.chunk(2)
            per = c.intermediate_size // tp
            return torch.cat([gate[r * per : (r + 1) * per], up[r * per : (r + 1) * per]]).contiguous()
        if rest.startswith(("self_attn.o_proj.", "mlp.down_proj.")):
            if kind == "bias":  # added once, after the all-reduce sums the partial outputs
                return tensor if r == 0 else torch.zeros_like(tensor)
            per = tensor.shape[1] // tp
            return tensor[:, r * per : (r + 1) * per].contiguous()
        return tensor  # norms: every rank needs them whole

    # -- after loading -------------------------------------------------------------------------------
    def wrap(self, model, groups) -> None:
        """Swaps in the parallel layers (after packing or quantizing, which work on the slices).
        The C++ decode loop runs all layers in one call, with no all-reduce in between: off."""
        from pdserve.engine.parallel.layers import RowParallel, VocabParallelEmbedding, VocabParallelHead

        model.decode_stack = None
        if self.layout.tp == 1:
            return
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, groups)
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, groups)
        if model.model.embed_tokens is not None:
            first_row = self.layout.vocab_rows(self.tp_rank, self.config.vocab_size).start
            model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, first_row, groups)
        if model.lm_head is not None:
            model.lm_head = VocabParallelHead(model.lm_head, self.config.vocab_size, groups)
