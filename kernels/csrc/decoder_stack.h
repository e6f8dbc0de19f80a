// The decoder layers of a decode-only step in one call (see decoder_stack.cpp).
#pragma once
#include "ops.h"

#include <limits>
#include <vector>

class DecoderStack {
 public:
  // A linear layer: packed quantized weights (quant_linear), packed bf16 or fp32 weights
  // (dense_linear up to max_packed_rows, else at::linear on the plain weight, which a layer
  // whose kernel serves every row count does not hold), or a plain weight (at::linear).
  struct Linear {
    enum Kind { kQuantized, kPacked, kDense };
    Kind kind = kDense;
    torch::Tensor packed, col_scale, bias, weight, dense_bias;
    int64_t padded_out = 0, in_features = 0, out_features = 0, format = 0, max_packed_rows = 0;

    static Linear quantized(torch::Tensor packed, torch::Tensor col_scale, torch::Tensor bias, int64_t padded_out,
                            int64_t in_features, int64_t out_features, int64_t format) {
      Linear l;
      l.kind = kQuantized;
      l.packed = std::move(packed), l.col_scale = std::move(col_scale), l.bias = std::move(bias);
      l.padded_out = padded_out, l.in_features = in_features, l.out_features = out_features, l.format = format;
      return l;
    }
    static Linear packed_dense(torch::Tensor packed, torch::Tensor kernel_bias, torch::Tensor weight,
                               torch::Tensor bias, int64_t out_features, int64_t max_packed_rows) {
      TORCH_CHECK(weight.numel() > 0 || max_packed_rows == std::numeric_limits<int64_t>::max(),
                  "a packed layer without its plain weight must take every row count");
      Linear l;
      l.kind = kPacked;
      l.packed = std::move(packed), l.bias = std::move(kernel_bias);
      l.weight = std::move(weight), l.dense_bias = std::move(bias);
      l.padded_out = l.packed.size(0), l.in_features = l.packed.size(1), l.out_features = out_features;
      l.max_packed_rows = max_packed_rows;
      return l;
    }
    static Linear dense(torch::Tensor weight, torch::Tensor bias) {
      Linear l;
      l.out_features = weight.size(0), l.in_features = weight.size(1);
      l.weight = std::move(weight), l.dense_bias = std::move(bias);
      return l;
    }
  };

  struct Layer {
    torch::Tensor input_norm;
    Linear qkv, o;
    torch::Tensor post_norm;
    Linear gate_up, down;
  };

  DecoderStack(std::vector<Layer> layers, torch::Tensor final_norm, double eps, torch::Tensor cos, torch::Tensor sin,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t kv_format);

  // residual: [B, hidden] embeddings of the step's tokens (updated in place); returns the final
  // norm of the last residual, ready for the lm_head.
  torch::Tensor forward(torch::Tensor residual, const std::vector<torch::Tensor>& kv_layers, torch::Tensor positions,
                        torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens);

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  double eps_;
  torch::Tensor cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_, kv_format_;
  double scale_;
};
