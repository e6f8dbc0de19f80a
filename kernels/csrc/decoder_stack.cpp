// The decoder layers of a decode-only step in one C++ call.
//
// A decode step at small batch sizes runs ~10 short kernels per layer; driven from Python each
// costs a few microseconds of interpreter and dispatch overhead, which at batch 1 is as much as
// the kernels themselves. This runs the same kernels (the ones the Python model calls: quantized
// or dense linears, fused RMSNorm, RoPE + cache write, paged decode attention, SiLU-mul) in a
// C++ loop. The Python model stays the reference and handles everything else (prefill chunks,
// per-layer hooks, other devices).
#include "decoder_stack.h"

#include <ATen/ATen.h>

namespace {

using Linear = DecoderStack::Linear;

torch::Tensor apply(const Linear& l, const torch::Tensor& x) {
  torch::Tensor y;
  if (l.kind == Linear::kQuantized) {
    y = quant_linear(x, l.packed, l.col_scale, l.bias, l.padded_out, l.in_features, l.format, -1, false);
  } else if (l.kind == Linear::kPacked && x.size(0) <= l.max_packed_rows) {
    y = dense_linear(x, l.packed, l.bias, l.padded_out, false);
  } else {
    return l.dense_bias.defined() && l.dense_bias.numel() > 0 ? at::linear(x, l.weight, l.dense_bias)
                                                               : at::linear(x, l.weight);
  }
  return l.padded_out == l.out_features ? y : y.narrow(1, 0, l.out_features).contiguous();
}

}  // namespace

DecoderStack::DecoderStack(std::vector<Layer> layers, torch::Tensor final_norm, double eps, torch::Tensor cos,
                           torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t kv_format)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), eps_(eps), cos_(std::move(cos)),
      sin_(std::move(sin)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      kv_format_(kv_format), scale_(1.0 / std::sqrt(static_cast<double>(head_dim))) {}

torch::Tensor DecoderStack::forward(torch::Tensor residual, const std::vector<torch::Tensor>& kv_layers,
                                    torch::Tensor positions, torch::Tensor slot_mapping, torch::Tensor block_tables,
                                    torch::Tensor context_lens) {
  TORCH_CHECK(kv_layers.size() == layers_.size(), "one cache layer per decoder layer");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "hidden states must be a contiguous [B, hidden]");
  const int64_t batch = residual.size(0);
  const int64_t q_width = num_heads_ * head_dim_;
  auto h = rms_norm(residual, layers_[0].input_norm, eps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    auto qkv = apply(layer.qkv, h).contiguous();
    rope_write_kv(qkv, positions, cos_, sin_, num_heads_, num_kv_heads_, head_dim_, kv_layers[i], slot_mapping,
                  kv_format_);
    auto q = qkv.narrow(1, 0, q_width).view({batch, num_heads_, head_dim_});
    auto attn = paged_decode_attention(q, kv_layers[i], block_tables, context_lens, scale_, kv_format_, num_kv_heads_);
    h = add_rms_norm(apply(layer.o, attn.view({batch, q_width})), residual, layer.post_norm, eps_);
    const auto& next_norm = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
    h = add_rms_norm(apply(layer.down, silu_mul(apply(layer.gate_up, h))), residual, next_norm, eps_);
  }
  return h;
}
