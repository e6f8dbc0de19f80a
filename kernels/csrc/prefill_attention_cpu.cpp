// Causal attention for prefill on CPUs (flash-attention style): queries [Tq, Hq, D] over keys and
// values [Tk, Hkv, D], query i at position q_offset + i seeing keys 0..q_offset + i.
//
// torch's CPU SDPA spends most of a short prompt's attention on memory traffic for the score
// matrix (head_dim 64 makes its GEMMs thin). Here a work item is (KV head, block of queries): its
// queries of every head sharing that KV head (GQA) form the rows; keys are visited in blocks of
// 16, packed once per head so a score tile is 8 rows x 16 keys in registers (fp32 FMAs, or
// AVX512-BF16 dot products on a bf16 model), with an online softmax, and the output accumulates
// in a small per-item buffer. Masked key blocks are never computed. CPUs with AVX2 but not
// AVX-512 run the same method in 8-lane vectors (prefill_attention_avx2.h).
#include "ops.h"
#include "prefill_attention_avx2.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_PREFILL_ATTENTION 1
constexpr int64_t kKeyBlock = 16;  // keys per block: one vector of scores
#elif defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_PREFILL_ATTENTION 1
constexpr int64_t kKeyBlock = kAvx2Keys;
#else
#define PDSERVE_PREFILL_ATTENTION 0
#endif

namespace {

constexpr int64_t kRows = 8;      // rows per score tile
constexpr int64_t kQueries = 16;  // query positions per work item

#if PDSERVE_PREFILL_ATTENTION
template <typename T>
inline float ld(const T* p) { return static_cast<float>(*p); }

// fp32 operands: K of one head transposed per block of kKeyBlock keys ([block][d][kKeyBlock]) and
// V as fp32 rows, the tail padded with zeros. Done once per head, shared by every query block.
template <typename T>
void pack_head(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t h, int64_t d_size,
               int64_t num_keys, float* kt, float* vf) {
  const int64_t blocks = (num_keys + kKeyBlock - 1) / kKeyBlock;
  std::fill(kt, kt + blocks * d_size * kKeyBlock, 0.f);
  std::fill(vf, vf + blocks * kKeyBlock * d_size, 0.f);
  for (int64_t j = 0; j < num_keys; ++j) {
    float* kb = kt + (j / kKeyBlock) * d_size * kKeyBlock + j % kKeyBlock;
    const T* kr = k + j * k_stride + h * d_size;
    for (int64_t d = 0; d < d_size; ++d) kb[d * kKeyBlock] = ld(kr + d);
    const T* vr = v + j * v_stride + h * d_size;
    for (int64_t d = 0; d < d_size; ++d) vf[j * d_size + d] = ld(vr + d);
  }
}
#endif

#if defined(__AVX512F__)
constexpr int64_t kKeys = kKeyBlock;

// bf16 operands, for AVX512-BF16 dot products (two products per fp32 lane): per block of 16
// keys, K as pairs of dimensions ([d / 2][16 keys][2]) and V as pairs of keys ([8][d][2]), so a
// 64-byte row is one operand. The bits are copied as stored, nothing is rounded.
void pack_head_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t h,
                    int64_t d_size, int64_t num_keys, uint16_t* kt, uint16_t* vt) {
  const int64_t blocks = (num_keys + kKeys - 1) / kKeys;
  std::fill(kt, kt + blocks * d_size * kKeys, uint16_t{0});
  std::fill(vt, vt + blocks * d_size * kKeys, uint16_t{0});
  for (int64_t j = 0; j < num_keys; ++j) {
    const uint16_t* kr = k + j * k_stride + h * d_size;
    const uint16_t* vr = v + j * v_stride + h * d_size;
    uint16_t* kb = kt + (j / kKeys) * d_size * kKeys + (j % kKeys) * 2;
    uint16_t* vb = vt + (j / 2) * d_size * 2 + j % 2;
    for (int64_t d = 0; d < d_size; d += 2) {
      kb[d * kKeys] = kr[d];
      kb[d * kKeys + 1] = kr[d + 1];
    }
    for (int64_t d = 0; d < d_size; ++d) vb[d * 2] = vr[d];
  }
}

// One work item: the queries [q0, q1) of every head sharing KV head h. BF16 (bf16 models): the
// scores are bf16 dot products of q as it is (exact) against K, scaled after; P is rounded to
// bf16 for its product with V, as flash attention does on GPUs, while the softmax's running
// max and sum stay fp32. Otherwise fp32 throughout, q scaled before.
template <int NV, bool BF16, typename T>
void attend_block(const T* q, int64_t q_stride, const void* kt, const void* vt, T* out, int64_t out_stride,
                  int64_t group, int64_t h, int64_t q0, int64_t q1, int64_t q_offset, float scale,
                  std::vector<float>& qf, std::vector<float>& of) {
  constexpr int64_t D = NV * 16;
  constexpr int64_t kQWidth = BF16 ? D / 2 : D;  // floats per query row (bf16: its bits, in pairs)
  const int64_t rows = (q1 - q0) * group;
  // Rows are (query, head) pairs: row r is query q0 + r / group of head h * group + r % group.
  // Padded with zero rows to whole tiles, so every tile loop has a fixed trip count (and its
  // accumulators stay in registers); the padding rows are computed and dropped.
  const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
  qf.assign(padded_rows * kQWidth, 0.f);
  of.assign(padded_rows * D, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + (q0 + r / group) * q_stride + (h * group + r % group) * D;
    if constexpr (BF16) {
      std::memcpy(qf.data() + r * kQWidth, qr, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] = ld(qr + d) * scale;
    }
  }
  std::vector<float> row_max(padded_rows, -std::numeric_limits<float>::infinity()), row_sum(padded_rows, 0.f);
  alignas(64) float p[kRows][kKeys];
  alignas(64) uint32_t pairs[kRows][kKeys / 2];  // BF16: p rounded to bf16, two keys per word

  for (int64_t r0 = 0; r0 < padded_rows; r0 += kRows) {
    const int64_t last_query = q0 + (std::min(rows, r0 + kRows) - 1) / group;
    const int64_t tile_blocks = (q_offset + last_query + 1 + kKeys - 1) / kKeys;
    const float* qt = qf.data() + r0 * kQWidth;
    float* ot = of.data() + r0 * D;
    for (int64_t b = 0; b < tile_blocks; ++b) {
      // Scores: 8 rows x 16 keys.
      __m512 s[kRows];
#pragma GCC unroll 8
      for (int64_t i = 0; i < kRows; ++i) s[i] = _mm512_setzero_ps();
      if constexpr (BF16) {
#if defined(__AVX512BF16__)
        const auto* kb = static_cast<const uint16_t*>(kt) + b * D * kKeys;
        using word = int __attribute__((__may_alias__));  // two bf16 of q, read as one 32-bit word
        const auto* qw = reinterpret_cast<const word*>(qt);
#pragma GCC unroll 4
        for (int64_t dp = 0; dp < D / 2; ++dp) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + dp * 2 * kKeys);
#pragma GCC unroll 8
          for (int64_t i = 0; i < kRows; ++i)
            s[i] = _mm512_dpbf16_ps(s[i], (__m512bh)_mm512_set1_epi32(qw[i * kQWidth + dp]), kv);
        }
        const __m512 scales = _mm512_set1_ps(scale);
#pragma GCC unroll 8
        for (int64_t i = 0; i < kRows; ++i) s[i] = _mm512_mul_ps(s[i], scales);
#endif
      } else {
        const float* kb = static_cast<const float*>(kt) + b * D * kKeys;
#pragma GCC unroll 4
        for (int64_t d = 0; d < D; ++d) {
          const __m512 kv = _mm512_loadu_ps(kb + d * kKeys);
#pragma GCC unroll 8
          for (int64_t i = 0; i < kRows; ++i) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qt[i * D + d]), kv, s[i]);
        }
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
        if constexpr (BF16) {
#if defined(__AVX512BF16__)
          _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i]), (__m256i)_mm512_cvtneps_pbh(pi));
#endif
        } else {
          _mm512_store_ps(p[i], pi);
        }
        if (alpha != 1.f) {
          const __m512 a = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + i * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(ot + i * D + 16 * v), a));
        }
      }
      // Output += P V, four rows at a time (their accumulators stay in registers).
#pragma GCC unroll 2
      for (int64_t i0 = 0; i0 < kRows; i0 += 4) {
        __m512 acc[4][NV];
#pragma GCC unroll 4
        for (int64_t i = 0; i < 4; ++i)
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_loadu_ps(ot + (i0 + i) * D + 16 * v);
        if constexpr (BF16) {
#if defined(__AVX512BF16__)
          const auto* vb = static_cast<const uint16_t*>(vt) + b * kKeys * D;
          for (int64_t jp = 0; jp < kKeys / 2; ++jp) {  // two keys per dot product
            __m512bh vr[NV];
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) vr[v] = (__m512bh)_mm512_loadu_si512(vb + (jp * D + 16 * v) * 2);
#pragma GCC unroll 4
            for (int64_t i = 0; i < 4; ++i) {
              const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i0 + i][jp]));
#pragma GCC unroll 8
              for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pj, vr[v]);
            }
          }
#endif
        } else {
          const float* vb = static_cast<const float*>(vt) + b * kKeys * D;
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
        }
#pragma GCC unroll 4
        for (int64_t i = 0; i < 4; ++i)
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + (i0 + i) * D + 16 * v, acc[i][v]);
      }
    }
  }
  store_rows(of, row_sum, out, out_stride, group, h, q0, rows, D);
}
#endif

}  // namespace

bool has_prefill_attention(int64_t head_dim) {
#if PDSERVE_PREFILL_ATTENTION
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
  TORCH_CHECK(has_prefill_attention(d), "prefill_attention supports head_dim 64 and 128 on AVX2 and AVX-512 CPUs");
  TORCH_CHECK(hq > 0 && hkv > 0, "q, k and v need at least one head");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && hq % hkv == 0, "q, k, v shapes do not fit");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v must share a dtype");
  TORCH_CHECK(q_offset >= 0 && q_offset + tq <= tk, "queries must be the last positions of the keys");
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "each token's heads must be contiguous");
  }
  auto out = torch::empty({tq, hq, d}, q.options());
  const int64_t group = hq / hkv;
  const int64_t qblocks = (tq + kQueries - 1) / kQueries;
#if PDSERVE_PREFILL_ATTENTION
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "prefill_attention", [&] {
#if defined(__AVX512BF16__)
    constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
#else
    constexpr bool kBf16 = false;
#endif
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kp = k.data_ptr<scalar_t>();
    const auto* vp = v.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    const int64_t per_head = (tk + kKeyBlock - 1) / kKeyBlock * kKeyBlock * d;  // elements of K (or V) per head
    // The packed operands of every head: fp32, or bf16 bits (then half the bytes).
    std::vector<float> kt(hkv * per_head / (kBf16 ? 2 : 1)), vt(hkv * per_head / (kBf16 ? 2 : 1));
    at::parallel_for(0, hkv, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {
#if defined(__AVX512F__)
        if constexpr (kBf16) {
          auto* kh = reinterpret_cast<uint16_t*>(kt.data()) + h * per_head;
          auto* vh = reinterpret_cast<uint16_t*>(vt.data()) + h * per_head;
          pack_head_bf16(reinterpret_cast<const uint16_t*>(kp), k.stride(0), reinterpret_cast<const uint16_t*>(vp),
                         v.stride(0), h, d, tk, kh, vh);
          continue;
        }
#endif
        pack_head(kp, k.stride(0), vp, v.stride(0), h, d, tk, kt.data() + h * per_head, vt.data() + h * per_head);
      }
    });
    // Later query blocks see more keys: they go first, dealt round-robin to the threads (a
    // contiguous split would give one thread the long rows and the other the short ones).
    const int64_t items = hkv * qblocks, workers = std::min<int64_t>(at::get_num_threads(), items);
    at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> qf, of;
      for (int64_t w = w0; w < w1; ++w) {
        for (int64_t item = w; item < items; item += workers) {
          const int64_t h = item % hkv, qb = qblocks - 1 - item / hkv;
          const int64_t q0 = qb * kQueries, q1 = std::min(tq, q0 + kQueries);
          const int64_t offset = h * per_head / (kBf16 ? 2 : 1);  // in floats
          const float* kh = kt.data() + offset;
          const float* vh = vt.data() + offset;
          const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
          if (d == 64) {
            attend_block<4, kBf16>(qp, q.stride(0), kh, vh, op, hq * d, group, h, q0, q1, q_offset, sc, qf, of);
          } else {
            attend_block<8, kBf16>(qp, q.stride(0), kh, vh, op, hq * d, group, h, q0, q1, q_offset, sc, qf, of);
          }
#else
          if (d == 64) {
            attend_block_avx2<8>(qp, q.stride(0), kh, vh, op, hq * d, group, h, q0, q1, q_offset, sc, qf, of);
          } else {
            attend_block_avx2<16>(qp, q.stride(0), kh, vh, op, hq * d, group, h, q0, q1, q_offset, sc, qf, of);
          }
#endif
        }
      }
    });
  });
#endif
  return out;
}
