"""A LLaMA-family decoder (Llama, SmolLM, Qwen2, Mistral) over a paged KV cache.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM``, except that q/k/v and
gate/up are stacked into one linear layer each (the loader stacks the checkpoint's tensors).
Every step runs all of its tokens (decodes and prefill chunks of many sequences) through the
linear layers as one flat [T, hidden] batch; only attention looks at sequence boundaries.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rope import RotaryEmbedding
from pdserve.kernels import AttentionBackend, LayerOps, rope_then_write

# Called after layer i has written its K/V for the step: lets a prefill worker ship that
# layer while the next one computes.
LayerHook = Callable[[int], None]


class RMSNorm(nn.Module):
    """Holds the weight; the layer ops (``kernels.layer_ops``) compute it, fused with the residual add."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        # q, k and v in one matmul (the loader stacks the checkpoint's three): one larger GEMM
        # runs markedly faster than three small ones at decode batch sizes.
        self.split = (q_dim, kv_dim, kv_dim)
        self.qkv_proj = nn.Linear(hidden, q_dim + 2 * kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = rope_then_write(
            backend,
            self.qkv_proj(x),
            batch.positions,
            rope,
            kv,
            batch.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        out = torch.empty((tokens, self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        nd = batch.num_decode
        if nd:
            out[:nd] = backend.decode_attention(
                q[:nd], kv, batch.decode_block_tables, batch.decode_context_lens, self.scale
            )
        for seg in batch.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.num_query)
            if seg.has_prior_context:
                out[rows] = backend.prefill_attention(q[rows], kv, seg.block_table, seg.context_len, self.scale)
            else:
                # A whole prompt in one chunk: attend over the fresh K/V, no cache read.
                out[rows] = backend.causal_attention(q[rows], k[rows], v[rows], self.scale)
        return self.o_proj(out.view(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.intermediate_size = i
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)  # gate and up stacked, as q/k/v are
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        next_norm: RMSNorm,
        batch: ForwardBatch,
        kv: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        ops: LayerOps,
    ) -> torch.Tensor:
        """``h``: this layer's normalized input; ``residual``: the residual stream, updated in
        place. Returns ``next_norm(residual)``, the next layer's input (the residual adds are
        fused into the norms)."""
        eps = self.post_attention_layernorm.eps
        h = ops.add_rms_norm(
            self.self_attn(h, batch, kv, rope, backend), residual, self.post_attention_layernorm.weight, eps
        )
        return ops.add_rms_norm(self.mlp(h, ops), residual, next_norm.weight, next_norm.eps)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Given its weight, Embedding skips its random init: normal_ (even on the meta device the
        # loader builds on) imports torch._dynamo, a second of every worker's start.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.ops = ops
        self.decode_stack = None  # the C++ decode loop (engine/decode_stack.py), where available
        self.model = DecoderModel(config)
        self.rope = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_layers: list[torch.Tensor], layer_hook: LayerHook | None = None
    ) -> torch.Tensor:
        """Runs every token of the step; returns logits (fp32) for ``batch.logits_indices`` only."""
        layers = self.model.layers
        residual = self.model.embed_tokens(batch.input_ids)
        if self.decode_stack is not None and layer_hook is None and batch.num_decode == batch.num_tokens:
            h = self.decode_stack.forward(
                residual,
                kv_layers,
                batch.positions,
                batch.slot_mapping,
                batch.decode_block_tables,
                batch.decode_context_lens,
            )
            return self.lm_head(h[batch.logits_indices]).float()
        first = layers[0].input_layernorm
        h = self.ops.rms_norm(residual, first.weight, first.eps)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h = layer(h, residual, next_norm, batch, kv_layers[i], self.rope, self.backend, self.ops)
            if layer_hook is not None:
                layer_hook(i)
        return self.lm_head(h[batch.logits_indices]).float()
