// Vector math shared by the CPU kernels: exp, log, horizontal sums, bf16 conversions.
#pragma once

namespace {

// 2^f for f in [-0.5, 0.5]: a degree-6 polynomial (relative error ~2e-7), highest term first.
constexpr float kExp2Poly[] = {1.5252734e-5f, 1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f,
                               5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f};

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

// e^x for softmax arguments, 8 lanes (AVX2): exp_neg's method below for x <= 0 (below -87 it
// gives e^-87), with 2^n built in the exponent bits since AVX2 has no scalef.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The horizontal sums of 8 vectors at once: lane j of the result is the sum of v[j]'s lanes.
inline __m256 sum8(const __m256* v) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // q0 holds v0..v3's sums over lanes 0-3 in its low half and over lanes 4-7 in its high half.
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

inline float reduce_add(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float reduce_max(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// 8 bf16 -> fp32 (exact: the bits are the top half of the float).
inline __m256 widen_bf16x8(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }

// 8 fp32 -> bf16, round to nearest even, NaN kept a (quiet) NaN, as c10::BFloat16 rounds.
inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));  // in order
}

}  // namespace
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// e^x for softmax arguments (x <= 0; below -87 it gives e^-87), and as well for positive x up to
// ~88 (beyond, +inf): 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], with kExp2Poly for 2^f.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// log(x) for positive normal x (relative error ~1e-7): x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// then Cephes' polynomial for log(m), with ln 2 split in two so that e ln 2 stays exact.
inline __m512 log_ps(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  __m512 e = _mm512_getexp_ps(x);
  const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.f)), z = _mm512_mul_ps(f, f);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(3.3333331174e-1f));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

// The horizontal sums of 16 vectors at once: lane j of the result is the sum of v[j]'s lanes.
// A tree of 45 shuffles and adds, against ~8 dependent operations for each of 16 separate
// reductions.
inline __m512 sum16(const __m512* v) {
  auto pairs = [](__m512 a, __m512 b) {  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  };
  auto quads = [](__m512 ab, __m512 cd) {  // per 128-bit lane: the lane's sums of a, b, c, d
    const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  };
  auto lanes = [](__m512 x, __m512 y) {  // [x.0+x.1, x.2+x.3, y.0+y.1, y.2+y.3] in 128-bit lanes
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  __m512 q[4];
  for (int i = 0; i < 4; ++i) q[i] = quads(pairs(v[4 * i], v[4 * i + 1]), pairs(v[4 * i + 2], v[4 * i + 3]));
  return lanes(lanes(q[0], q[1]), lanes(q[2], q[3]));
}

#if defined(__AVX512BW__)
// bf16 bits -> fp32 (exact: the bits are the top half of the float).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_bf16(const void* p) { return widen_bf16(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }

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
#endif

}  // namespace
#endif
