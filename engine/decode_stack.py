"""The C++ decode loop: a decode-only step's decoder layers in one call (CPU).

At small batch sizes a decode step is ~10 short kernels per layer, and driving them from
Python costs as much as running them. ``kernels/csrc/decoder_stack.cpp`` runs the very kernels
the Python model calls, in the same order, so both paths give identical results; the Python
model stays the reference and handles prefill chunks, per-layer hooks and other devices.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.packed_linear import PackedLinear
from pdserve.engine.quantization import QuantizedLinear


def _linear(module, layer: nn.Module):
    if isinstance(layer, QuantizedLinear):
        if layer.kernels is None:
            return None  # the dequantize-and-matmul fallback has no C++ counterpart
        return module.StackLinear.quantized(
            layer.packed,
            layer.col_scale,
            layer.bias,
            layer.padded_out,
            layer.in_features,
            layer.out_features,
            int(layer.fmt),
        )
    bias = layer.bias.detach() if layer.bias is not None else torch.empty(0)
    if isinstance(layer, PackedLinear):
        return module.StackLinear.packed(
            layer.packed,
            layer.kernel_bias,
            layer.weight if layer.weight is not None else torch.empty(0),  # the library GEMM's, if it has one
            bias,
            layer.out_features,
            layer.max_kernel_rows,
        )
    return module.StackLinear.dense(layer.weight.detach(), bias)


def build_decode_stack(model: nn.Module, module, kv_kind: int):
    """A ``DecoderStack`` over ``model``'s weights (shared, not copied), or None if some layer has
    no C++ counterpart. ``module``: the compiled CPU kernels; ``kv_kind``: the cache format."""
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_linear(module, m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(lin is None for lin in linears):
            return None
        qkv, o, gate_up, down = linears
        layers.append(
            module.StackLayer(
                layer.input_layernorm.weight.detach(),
                qkv,
                o,
                layer.post_attention_layernorm.weight.detach(),
                gate_up,
                down,
            )
        )
    config = model.config
    return module.DecoderStack(
        layers,
        model.model.norm.weight.detach(),
        config.rms_norm_eps,
        model.rope.cos,
        model.rope.sin,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        kv_kind,
    )
