"""A LLaMA-family decoder (Llama, SmolLM, Qwen2, Mistral) over a paged KV cache.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM``, except that q/k/v and
gate/up are stacked into one linear layer each (the loader stacks the checkpoint's tensors).
Every step runs all of its tokens (decodes and prefill chunks of many sequences) through the
linear layers as one flat [T, hidden] batch; only attention looks at sequence boundaries.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rope import RotaryEmbedding
from pdserve.kernels import AttentionBackend

# Called after layer i has written its K/V for the step: lets a prefill worker ship that
# layer while the next one computes.
LayerHook = Callable[[int], None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
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
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(batch.positions, q, k)
        backend.write_kv(kv, k, v, batch.slot_mapping)

        out = torch.empty_like(q)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, batch, kv, rope, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv, rope, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
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
        x = self.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, batch, kv_layers[i], self.rope, self.backend)
            if layer_hook is not None:
                layer_hook(i)
        x = self.model.norm(x[batch.logits_indices])
        return self.lm_head(x).float()
