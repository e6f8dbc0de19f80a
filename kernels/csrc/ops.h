// The CPU kernels' entry points (bound to Python in bindings.cpp).
#pragma once
#include <torch/extension.h>

// kv_format: 0 plain (the model dtype), 1 int8, 2 fp8 e4m3 (see kv_format.h). path: 0 portable,
// 1 AVX2, 2 AVX-512, -1 the fastest compiled in.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t kv_format, int64_t num_kv_heads,
                                     int64_t path = -1);
// paged_decode_attention's paths compiled in here, fastest last.
std::vector<int64_t> attention_paths();

torch::Tensor pack_weights(torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t format);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor bias,
                           int64_t n, int64_t k, int64_t format, int64_t path, bool float_out);
// quant_linear's paths compiled in here: 0 portable, 1 AVX2, 2 AVX512-VNNI (-1 asks for the last).
std::vector<int64_t> quant_paths();

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                   int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, torch::Tensor kv_layer,
                   torch::Tensor slot_mapping, int64_t kv_format);

// dense_linear's element types compiled in here ("bfloat16": AVX512-BF16, or AVX2 widening
// bf16 weights to fp32; "float32": AVX2).
std::vector<std::string> dense_dtypes();
bool dense_bf16_widened();
torch::Tensor pack_dense(torch::Tensor w);
torch::Tensor unpack_dense(torch::Tensor packed);
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t n, bool float_out);

bool has_prefill_attention(int64_t head_dim);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t q_offset);

// XXH64 digests of each 1024-byte chunk of the token-ordered rows `src_slots` of `src`, copied
// on the way into rows `dst_slots` of `dst` when given, with streaming stores if `stream`
// (kv_copy_cpu.cpp).
torch::Tensor copy_rows_hashed(torch::Tensor src, torch::Tensor src_slots, c10::optional<torch::Tensor> dst,
                               c10::optional<torch::Tensor> dst_slots, bool stream);

// Fills out [rows, vocab] (float32) with seeded sampling's Exponential(1) noise, row r keyed by
// keys[r] (race_noise_cpu.cpp).
void race_noise_(torch::Tensor out, torch::Tensor keys);
