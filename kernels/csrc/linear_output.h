// Where a CPU linear kernel's results go (shared by the quantized and the packed dense kernels).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vec_math.h"

namespace {

// Where results go: [rows, ld] of fp32 or bf16, plus an optional per-column bias.
struct Output {
  void* data;
  int64_t ld;
  bool bf16;
  const float* bias;

  inline void store(int64_t r, int64_t col, float v) const {
    if (bias != nullptr) v += bias[col];
    if (bf16) static_cast<c10::BFloat16*>(data)[r * ld + col] = c10::BFloat16(v);
    else static_cast<float*>(data)[r * ld + col] = v;
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// Stores 8 consecutive columns of row r (bias added).
inline void store8(const Output& y, int64_t r, int64_t col, __m256 v) {
  if (y.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(y.bias + col));
  if (y.bf16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<c10::BFloat16*>(y.data) + r * y.ld + col), to_bf16x8(v));
  } else {
    _mm256_storeu_ps(static_cast<float*>(y.data) + r * y.ld + col, v);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Stores 16 consecutive columns of row r (bias added).
inline void store16(const Output& y, int64_t r, int64_t col, __m512 v) {
  if (y.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(y.bias + col));
  if (y.bf16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<c10::BFloat16*>(y.data) + r * y.ld + col), to_bf16(v));
  } else {
    _mm512_storeu_ps(static_cast<float*>(y.data) + r * y.ld + col, v);
  }
}
#endif

}  // namespace
