// Where a CPU linear kernel's results go (shared by the quantized and the packed-bf16 kernels).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// fp32 -> bf16, round to nearest even (the instruction where the CPU has it).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}


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
