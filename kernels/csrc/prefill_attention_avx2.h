// The fp32 work item of causal prefill attention on AVX2 + FMA CPUs (no AVX-512): the method of
// prefill_attention_cpu.cpp's AVX-512 path in 8-lane vectors. Keys come in blocks of 8, packed
// once per head as [block][d][8] (K) and fp32 rows (V); a score tile is 8 rows x 8 keys in
// registers, and P V runs over 4 rows x 16 output dimensions at a time, so its accumulators fit
// AVX2's 16 registers. bf16 inputs are widened when packed and computed in fp32.
#pragma once

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// A work item's end, in both paths: its rows (row r: query q0 + r / group of head h * group +
// r % group) divided by their softmax sums, into the [T, H, D] output.
template <typename T>
void store_rows(const std::vector<float>& of, const std::vector<float>& row_sum, T* out, int64_t out_stride,
                int64_t group, int64_t h, int64_t q0, int64_t rows, int64_t d_size) {
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + (q0 + r / group) * out_stride + (h * group + r % group) * d_size;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    for (int64_t d = 0; d < d_size; ++d) o[d] = static_cast<T>(of[r * d_size + d] * inv);
  }
}

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kAvx2Keys = 8;  // keys per block (one vector of scores)
constexpr int64_t kAvx2Rows = 8;  // rows per score tile

// One work item: the queries [q0, q1) of every head sharing KV head h (rows as in the AVX-512
// path: row r is query q0 + r / group of head h * group + r % group), q scaled before.
template <int NV, typename T>
void attend_block_avx2(const T* q, int64_t q_stride, const float* kt, const float* vt, T* out, int64_t out_stride,
                       int64_t group, int64_t h, int64_t q0, int64_t q1, int64_t q_offset, float scale,
                       std::vector<float>& qf, std::vector<float>& of) {
  constexpr int64_t D = NV * 8;
  const int64_t rows = (q1 - q0) * group;
  const int64_t padded_rows = (rows + kAvx2Rows - 1) / kAvx2Rows * kAvx2Rows;  // padding rows: computed, dropped
  qf.assign(padded_rows * D, 0.f);
  of.assign(padded_rows * D, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + (q0 + r / group) * q_stride + (h * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qr[d]) * scale;
  }
  std::vector<float> row_max(padded_rows, -std::numeric_limits<float>::infinity()), row_sum(padded_rows, 0.f);
  alignas(32) float p[kAvx2Rows][kAvx2Keys];
  const __m256i key_lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());

  for (int64_t r0 = 0; r0 < padded_rows; r0 += kAvx2Rows) {
    const int64_t last_query = q0 + (std::min(rows, r0 + kAvx2Rows) - 1) / group;
    const int64_t tile_blocks = (q_offset + last_query + 1 + kAvx2Keys - 1) / kAvx2Keys;
    const float* qt = qf.data() + r0 * D;
    float* ot = of.data() + r0 * D;
    for (int64_t b = 0; b < tile_blocks; ++b) {
      // Scores: 8 rows x 8 keys.
      __m256 s[kAvx2Rows];
#pragma GCC unroll 8
      for (int64_t i = 0; i < kAvx2Rows; ++i) s[i] = _mm256_setzero_ps();
      const float* kb = kt + b * D * kAvx2Keys;
#pragma GCC unroll 4
      for (int64_t d = 0; d < D; ++d) {
        const __m256 kv = _mm256_loadu_ps(kb + d * kAvx2Keys);
#pragma GCC unroll 8
        for (int64_t i = 0; i < kAvx2Rows; ++i) s[i] = _mm256_fmadd_ps(_mm256_set1_ps(qt[i * D + d]), kv, s[i]);
      }
      // Mask keys past each row's query position, then the online softmax update.
      for (int64_t i = 0; i < kAvx2Rows; ++i) {
        const int64_t r = r0 + i;
        const int64_t limit = q_offset + q0 + std::min(r, rows - 1) / group;  // last visible key
        const int64_t visible = std::clamp<int64_t>(limit - b * kAvx2Keys + 1, 0, kAvx2Keys);
        const __m256 keep =
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(visible)), key_lane));
        const __m256 si = _mm256_blendv_ps(minus_inf, s[i], keep);
        const float new_max = std::max(row_max[r], reduce_max(si));
        const __m256 pi = _mm256_and_ps(keep, exp_neg(_mm256_sub_ps(si, _mm256_set1_ps(new_max))));
        const float alpha = std::exp(row_max[r] - new_max);
        row_sum[r] = row_sum[r] * alpha + reduce_add(pi);
        row_max[r] = new_max;
        _mm256_store_ps(p[i], pi);
        if (alpha != 1.f) {
          const __m256 a = _mm256_set1_ps(alpha);
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) _mm256_storeu_ps(ot + i * D + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(ot + i * D + 8 * v), a));
        }
      }
      // Output += P V: 4 rows x 16 dimensions at a time.
      const float* vb = vt + b * kAvx2Keys * D;
      for (int64_t i0 = 0; i0 < kAvx2Rows; i0 += 4) {
        for (int v0 = 0; v0 < NV; v0 += 2) {
          __m256 acc[4][2];
#pragma GCC unroll 4
          for (int64_t i = 0; i < 4; ++i) {
            acc[i][0] = _mm256_loadu_ps(ot + (i0 + i) * D + 8 * v0);
            acc[i][1] = _mm256_loadu_ps(ot + (i0 + i) * D + 8 * v0 + 8);
          }
#pragma GCC unroll 8
          for (int64_t j = 0; j < kAvx2Keys; ++j) {
            const __m256 v_lo = _mm256_loadu_ps(vb + j * D + 8 * v0), v_hi = _mm256_loadu_ps(vb + j * D + 8 * v0 + 8);
#pragma GCC unroll 4
            for (int64_t i = 0; i < 4; ++i) {
              const __m256 pj = _mm256_set1_ps(p[i0 + i][j]);
              acc[i][0] = _mm256_fmadd_ps(pj, v_lo, acc[i][0]);
              acc[i][1] = _mm256_fmadd_ps(pj, v_hi, acc[i][1]);
            }
          }
#pragma GCC unroll 4
          for (int64_t i = 0; i < 4; ++i) {
            _mm256_storeu_ps(ot + (i0 + i) * D + 8 * v0, acc[i][0]);
            _mm256_storeu_ps(ot + (i0 + i) * D + 8 * v0 + 8, acc[i][1]);
          }
        }
      }
    }
  }
  store_rows(of, row_sum, out, out_stride, group, h, q0, rows, D);
}

}  // namespace
#endif
