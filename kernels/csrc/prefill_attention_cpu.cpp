// Causal attention for prefill on CPUs (flash-attention style): queries [Tq, Hq, D] over keys and
// values [Tk, Hkv, D], query i at position q_offset + i seeing keys 0..q_offset + i.
//
// torch's CPU SDPA spends most of a short prompt's attention on memory traffic for the score
// matrix (head_dim 64 makes its GEMMs thin). Here a work item is (KV head, block of queries): its
// queries of every head sharing that KV head (GQA) form the rows; keys are visited in blocks of
// 16, transposed once per item so a score tile is 8 rows x 16 keys of fp32 FMAs in registers,
// with an online softmax, and the output accumulates in a small per-item buffer. Masked key
// blocks are never computed.
#include "ops.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kKeys = 16;     // keys per block (one vector of scores)
constexpr int64_t kRows = 8;      // rows per score tile
constexpr int64_t kQueries = 16;  // query positions per work item

#if defined(__AVX512F__)
template <typename T>
inline float ld(const T* p) { return static_cast<float>(*p); }

// K of one head transposed per block of 16 keys ([block][d][16]) and V as fp32 rows, the tail
// padded with zeros: done once per head, shared by every query block.
template <typename T>
void pack_head(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t h, int64_t d_size,
               int64_t num_keys, float* kt, float* vf) {
  const int64_t blocks = (num_keys + kKeys - 1) / kKeys;
  std::fill(kt, kt + blocks * d_size * kKeys, 0.f);
  std::fill(vf, vf + blocks * kKeys * d_size, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    float* kb = kt + b * d_size * kKeys;
    for (int64_t j = b * kKeys; j < std::min(num_keys, (b + 1) * kKeys); ++j) {
      const T* kr = k + j * k_stride + h * d_size;
      for (int64_t d = 0; d < d_size; ++d) kb[d * kKeys + (j % kKeys)] = ld(kr + d);
      const T* vr = v + j * v_stride + h * d_size;
      for (int64_t d = 0; d < d_size; ++d) vf[j * d_size + d] = ld(vr + d);
    }
  }
}

template <int NV, typename T>
void attend_block(const T* q, int64_t q_stride, const float* kt, const float* vf, T* out, int64_t out_stride,
                  int64_t group, int64_t h, int64_t q0, int64_t q1, int64_t q_offset, float scale,
                  std::vector<float>& qf, std::vector<float>& of) {
  constexpr int64_t D = NV * 16;
  const int64_t rows = (q1 - q0) * group;
  // Rows are (query, head) pairs: row r is query q0 + r / group of head h * group + r % group.
  // Padded with zero rows to whole tiles, so every tile loop has a fixed trip count (and its
  // accumulators stay in registers); the padding rows are computed and dropped.
  const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
  qf.assign(padded_rows * D, 0.f);
  of.assign(padded_rows * D, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + (q0 + r / group) * q_stride + (h * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = ld(qr + d) * scale;
  }
  std::vector<float> row_max(padded_rows, -std::numeric_limits<float>::infinity()), row_sum(padded_rows, 0.f);
  alignas(64) float p[kRows][kKeys];

  for (int64_t r0 = 0; r0 < padded_rows; r0 += kRows) {
    const int64_t last_query = q0 + (std::min(rows, r0 + kRows) - 1) / group;
    const int64_t tile_blocks = (q_offset + last_query + 1 + kKeys - 1) / kKeys;
    const float* qt = qf.data() + r0 * D;
    float* ot = of.data() + r0 * D;
    for (int64_t b = 0; b < tile_blocks; ++b) {
      // Scores: 8 rows x 16 keys.
      __m512 s[kRows];
#pragma GCC unroll 8
      for (int64_t i = 0; i < kRows; ++i) s[i] = _mm512_setzero_ps();
      const float* kb = kt + b * D * kKeys;
#pragma GCC unroll 4
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kv = _mm512_loadu_ps(kb + d * kKeys);
#pragma GCC unroll 8
        for (int64_t i = 0; i < kRows; ++i) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qt[i * D + d]), kv, s[i]);
      }
      // Mask keys past each row's query position, then the online softmax update.
#pragma GCC unroll 8
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t r = r0 + i;
        const int64_t limit = q_offset + q0 + std::min(r, rows - 1) / group;  // last visible key
        const int64_t visible = std::clamp<int64_t>(limit - b * kKeys + 1, 0, kKeys);
        const __mmask16 keep = visible >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << visible) - 1);
        const __m512 si = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s[i]);
        const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(si));
        const __m512 pi = _mm512_maskz_mov_ps(keep, exp_neg(_mm512_sub_ps(si, _mm512_set1_ps(new_max))));
        const float alpha = std::exp(row_max[r] - new_max);
        row_sum[r] = row_sum[r] * alpha + _mm512_reduce_add_ps(pi);
        row_max[r] = new_max;
        _mm512_store_ps(p[i], pi);
        if (alpha != 1.f) {
          const __m512 a = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + i * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(ot + i * D + 16 * v), a));
        }
      }
      // Output += P V, four rows at a time (their accumulators stay in registers).
      const float* vb = vf + b * kKeys * D;
#pragma GCC unroll 2
      for (int64_t i0 = 0; i0 < kRows; i0 += 4) {
        __m512 acc[4][NV];
#pragma GCC unroll 4
        for (int64_t i = 0; i < 4; ++i)
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_loadu_ps(ot + (i0 + i) * D + 16 * v);
        for (int64_t j = 0; j < kKeys; ++j) {
          __m512 vr[NV];
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) vr[v] = _mm512_loadu_ps(vb + j * D + 16 * v);
#pragma GCC unroll 4
          for (int64_t i = 0; i < 4; ++i) {
            const __m512 pj = _mm512_set1_ps(p[i0 + i][j]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(pj, vr[v], acc[i][v]);
          }
        }
#pragma GCC unroll 4
        for (int64_t i = 0; i < 4; ++i)
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + (i0 + i) * D + 16 * v, acc[i][v]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + (q0 + r / group) * out_stride + (h * group + r % group) * D;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(of[r * D + d] * inv);
  }
}
#endif

}  // namespace

bool has_prefill_attention(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

// q: [Tq, Hq, D], k/v: [Tk, Hkv, D] (rows may be strided: e.g. views into a fused qkv tensor;
// each head's D values contiguous). Returns [Tq, Hq, D] contiguous.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t q_offset) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, H, D]");
  const int64_t tq = q.size(0), hq = q.size(1), d = q.size(2), tk = k.size(0), hkv = k.size(1);
  TORCH_CHECK(has_prefill_attention(d), "prefill_attention supports head_dim 64 and 128 on AVX-512 CPUs");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && hq % hkv == 0, "q, k, v shapes do not fit");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v must share a dtype");
  TORCH_CHECK(q_offset >= 0 && q_offset + tq <= tk, "queries must be the last positions of the keys");
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "each token's heads must be contiguous");
  }
  auto out = torch::empty({tq, hq, d}, q.options());
  const int64_t group = hq / hkv;
  const int64_t qblocks = (tq + kQueries - 1) / kQueries;
#if defined(__AVX512F__)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "prefill_attention", [&] {
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kp = k.data_ptr<scalar_t>();
    const auto* vp = v.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    const int64_t padded = (tk + kKeys - 1) / kKeys * kKeys;
    std::vector<float> kt(hkv * padded * d), vf(hkv * padded * d);
    at::parallel_for(0, hkv, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {
        pack_head(kp, k.stride(0), vp, v.stride(0), h, d, tk, kt.data() + h * padded * d, vf.data() + h * padded * d);
      }
    });
    // Later query blocks see more keys: hand them out first so the threads finish together.
    at::parallel_for(0, hkv * qblocks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> qf, of;
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t h = item % hkv, qb = qblocks - 1 - item / hkv;
        const int64_t q0 = qb * kQueries, q1 = std::min(tq, q0 + kQueries);
        const float* kh = kt.data() + h * padded * d;
        const float* vh = vf.data() + h * padded * d;
        if (d == 64) {
          attend_block<4>(qp, q.stride(0), kh, vh, op, hq * d, group, h, q0, q1, q_offset, static_cast<float>(scale), qf, of);
        } else {
          attend_block<8>(qp, q.stride(0), kh, vh, op, hq * d, group, h, q0, q1, q_offset, static_cast<float>(scale), qf, of);
        }
      }
    });
  });
#endif
  return out;
}
