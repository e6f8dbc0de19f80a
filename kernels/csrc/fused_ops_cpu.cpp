// Fused elementwise kernels for the decoder layer on CPUs: each replaces several torch ops
// (and their temporaries) with one pass over the data, computing in fp32.
//
//   rms_norm(x, w)               -> w * x / rms(x)
//   add_rms_norm(x, residual, w) -> residual += x; returns w * residual / rms(residual)
//   silu_mul(gate_up)            -> silu(gate) * up       (gate, up: the two halves of the last dim)
//   rope_write_kv(qkv, ...)      -> rotates q and k in place (Hugging Face's rotate-half RoPE) and
//                                   stores each token's k and v in its cache slot, quantizing them
//                                   for an 8-bit cache (see kv_format.h).
#include "kv_format.h"
#include "ops.h"

#include "vec_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

namespace {

#if defined(__AVX512BF16__)
// bf16 rows, 16 values at a time (vec_math.h's conversions: round to nearest even, as
// c10::BFloat16 does; the instruction reads fp32 denormals as zero, which activations never are).
constexpr bool kBf16Vectors = true;
inline void store_bf16(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
inline __m512 round_bf16(__m512 v) { return widen_bf16(to_bf16(v)); }  // float(bf16(v))
#else
constexpr bool kBf16Vectors = false;
#endif

template <typename T>
inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
inline void st(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }

#if defined(__AVX512BF16__)
// One row of (add_)rms_norm in bf16, with the scalar loop's roundings: the residual sum and the
// normalized value are rounded to bf16 before their next use.
void bf16_rms_norm_row(const c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, c10::BFloat16* out,
                       int64_t dim, float eps, float* buf) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 v = load_bf16(x + i);
    if (residual != nullptr) {
      const __m256i sum = to_bf16(_mm512_add_ps(load_bf16(residual + i), v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual + i), sum);
      v = widen_bf16(sum);
    }
    _mm512_storeu_ps(buf + i, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    store_bf16(out + i, _mm512_mul_ps(load_bf16(w + i), round_bf16(_mm512_mul_ps(_mm512_loadu_ps(buf + i), inv))));
  }
}

// silu(gate) * up for one bf16 row: silu rounded to bf16 first, as torch computes it.
void bf16_silu_mul_row(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* out, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __m512 a = load_bf16(g + i);
    const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), a))));
    store_bf16(out + i, _mm512_mul_ps(round_bf16(silu), load_bf16(u + i)));
  }
}
#endif

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(dim);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      if constexpr (kBf16Vectors && std::is_same_v<T, c10::BFloat16>) {
        if (dim % 16 == 0) {
          bf16_rms_norm_row(xr, residual ? residual + r * dim : nullptr, w, out + r * dim, dim, eps, buf.data());
          continue;
        }
      }
      float ss = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          // The residual stream is kept in the model dtype, as the unfused model does.
          const T sum = static_cast<T>(ld(rr, i) + ld(xr, i));
          rr[i] = sum;
          buf[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) buf[i] = ld(xr, i);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      // Hugging Face rounds the normalized value to the model dtype before the weight multiply.
      for (int64_t i = 0; i < dim; ++i) st(o, i, ld(w, i) * static_cast<float>(static_cast<T>(buf[i] * inv)));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      if constexpr (kBf16Vectors && std::is_same_v<T, c10::BFloat16>) {
        if (inter % 16 == 0) {
          bf16_silu_mul_row(g, u, o, inter);
          continue;
        }
      }
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float a = ld(g, i);
        // silu is computed (and rounded) in the model dtype first, as torch does.
        const float s = static_cast<float>(static_cast<T>(a / (1.f + std::exp(-a))));
        st(o, i, s * ld(u, i));
      }
    }
  });
}

// Rotates one head in place (no fused multiply-adds: each product is rounded, as torch does): out[d] = x[d] cos[d] - x[d+h] sin[d]; out[d+h] = x[d+h] cos[d+h] + x[d] sin[d+h].
template <typename T>
__attribute__((optimize("fp-contract=off"))) inline void rotate(T* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = ld(x, d), b = ld(x, d + half);
    // Each product is rounded to the model dtype, as the unfused (Hugging Face) code does.
    const float c0 = static_cast<float>(static_cast<T>(cos[d])), s0 = static_cast<float>(static_cast<T>(sin[d]));
    const float c1 = static_cast<float>(static_cast<T>(cos[d + half])), s1 = static_cast<float>(static_cast<T>(sin[d + half]));
    const float ra = static_cast<float>(static_cast<T>(a * c0)) + static_cast<float>(static_cast<T>(-b * s0));
    const float rb = static_cast<float>(static_cast<T>(b * c1)) + static_cast<float>(static_cast<T>(a * s1));
    st(x, d, ra);
    st(x, d + half, rb);
  }
}

template <typename T>
void rope_write(T* qkv, int64_t tokens, int64_t width, const int64_t* positions, const float* cos_table,
                const float* sin_table, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                uint8_t* cache, const int64_t* slots, int64_t kv_format) {
  const int64_t kv_width = num_kv_heads * head_dim;
  const pdserve::KVFormat fmt(static_cast<pdserve::KVFormat::Kind>(kv_format), num_kv_heads, head_dim, sizeof(T));
  at::parallel_for(0, tokens, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* row = qkv + t * width;
      const float* cos = cos_table + positions[t] * head_dim;
      const float* sin = sin_table + positions[t] * head_dim;
      for (int64_t h = 0; h < num_q_heads + num_kv_heads; ++h) rotate(row + h * head_dim, cos, sin, head_dim);
      if (slots[t] < 0) continue;
      const T* k = row + num_q_heads * head_dim;
      fmt.store_token<T>(cache + slots[t] * fmt.token_bytes, k, k + kv_width);
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && weight.numel() == x.size(1), "rms_norm: x must be a contiguous [T, D]");
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.dim() == 2,
              "add_rms_norm: x and residual must be contiguous [T, D] tensors");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "add_rms_norm: dtype mismatch");
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: [T, 2I] contiguous");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

void rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                   int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, torch::Tensor kv_layer,
                   torch::Tensor slot_mapping, int64_t kv_format) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2, "rope_write_kv: qkv must be a contiguous [T, width]");
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * head_dim, "rope_write_kv: qkv width mismatch");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "rope_write_kv: cos and sin must be contiguous fp32 [P, D] of one shape");
  TORCH_CHECK(num_q_heads > 0 && head_dim % 2 == 0, "rope_write_kv: query heads > 0 and an even head dim");
  TORCH_CHECK(kv_layer.is_contiguous(), "rope_write_kv: the cache layer must be contiguous");
  auto pos = positions.to(torch::kInt64).contiguous();
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(pos.numel() == qkv.size(0) && slots.numel() == qkv.size(0), "rope_write_kv: one position and slot per token");
  const int64_t token_bytes = pdserve::KVFormat::checked(kv_format, num_kv_heads, head_dim, qkv.element_size()).token_bytes;
  const int64_t slots_in_cache = kv_layer.numel() * kv_layer.element_size() / token_bytes;
  for (int64_t t = 0; t < pos.numel(); ++t) {
    const int64_t p = pos.data_ptr<int64_t>()[t], s = slots.data_ptr<int64_t>()[t];
    TORCH_CHECK(p >= 0 && p < cos.size(0), "rope_write_kv: position ", p, " outside the RoPE table");
    TORCH_CHECK(s < slots_in_cache, "rope_write_kv: slot ", s, " outside the cache");
  }
  if (kv_format == pdserve::KVFormat::kPlain) {
    TORCH_CHECK(kv_layer.scalar_type() == qkv.scalar_type(), "rope_write_kv: cache dtype must match the model's");
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(0), qkv.size(1), pos.data_ptr<int64_t>(),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), num_q_heads, num_kv_heads, head_dim,
                         static_cast<uint8_t*>(kv_layer.data_ptr()), slots.data_ptr<int64_t>(), kv_format);
  });
}
