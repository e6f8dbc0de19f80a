// One work item of paged decode attention (paged_attention_cpu.cpp): a sequence's query heads over
// a range of its tokens, read in place from the paged cache through the block table, giving each
// query head's softmax statistics and unnormalized output (`Partial`), which the caller merges
// across a long context's splits. A portable path for any head_dim, and an AVX-512 path for
// head_dim 64 and 128, one instantiation per cache format (the AVX2 path has its own file,
// paged_attention_avx2.h).
#pragma once

#include "kv_format.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pdserve::KVFormat;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The softmax statistics and unnormalized output of every query head over one item's tokens.
struct Partial {
  float* max;  // [num_q_heads]
  float* sum;  // [num_q_heads]
  float* acc;  // [num_q_heads][dim]
};

// ---------------------------------------------------------------------------------------------
// The portable path (any head_dim): per KV head, scores, softmax, values, in plain loops.

template <typename T>
inline void load_row(const uint8_t* token, const KVFormat& fmt, int kv, int64_t h, float* out) {
  const uint8_t* src = token + fmt.code_offset(kv, h);
  if (fmt.kind == KVFormat::kPlain) {
    const T* x = reinterpret_cast<const T*>(src);
    for (int64_t d = 0; d < fmt.dim; ++d) out[d] = static_cast<float>(x[d]);
    return;
  }
  const float scale = fmt.scale(token, kv, h);
  if (fmt.kind == KVFormat::kInt8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(src);
    for (int64_t d = 0; d < fmt.dim; ++d) out[d] = static_cast<float>(c[d]) * scale;
    return;
  }
  for (int64_t d = 0; d < fmt.dim; ++d) {
    out[d] = c10::detail::fp16_ieee_to_fp32_value(pdserve::fp8_as_half_bits(src[d])) * scale * pdserve::kFp8ViaHalfFactor;
  }
}

template <typename T>
void attend_portable(const float* q, int64_t num_q_heads, const uint8_t* cache, const int64_t* table,
                     int64_t block_size, int64_t t0, int64_t t1, const KVFormat& fmt, float scale, Partial out) {
  const int64_t dim = fmt.dim, group = num_q_heads / fmt.heads, n = t1 - t0;
  std::vector<float> scores(n), row(dim), qs(num_q_heads * dim);
  for (int64_t i = 0; i < num_q_heads * dim; ++i) qs[i] = q[i] * scale;
  auto token = [&](int64_t t) { return cache + (table[t / block_size] * block_size + t % block_size) * fmt.token_bytes; };
  for (int64_t qh = 0; qh < num_q_heads; ++qh) {
    const int64_t h = qh / group;
    const float* qv = qs.data() + qh * dim;
    float mx = kNegInf;
    for (int64_t t = t0; t < t1; ++t) {
      load_row<T>(token(t), fmt, 0, h, row.data());
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qv[d] * row[d];
      scores[t - t0] = s;
      mx = std::max(mx, s);
    }
    float sum = 0.f;
    float* acc = out.acc + qh * dim;
    std::fill(acc, acc + dim, 0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float p = std::exp(scores[t - t0] - mx);
      sum += p;
      load_row<T>(token(t), fmt, 1, h, row.data());
      for (int64_t d = 0; d < dim; ++d) acc[d] += p * row[d];
    }
    out.max[qh] = n ? mx : kNegInf;
    out.sum[qh] = sum;
  }
}

// ---------------------------------------------------------------------------------------------
// Walking the paged cache a chunk of tokens at a time, shared by the vector paths.

constexpr int64_t kMaxQHeads = 64;  // query heads of one sequence (the vector paths' scratch is sized by it)

// The token read one chunk later (usually in another block) is prefetched while this chunk is
// computed, a few lines per step so that the requests spread over the whole chunk: its K half
// while the scores are taken, one KV head's share at a time, and its V half while the values
// are summed. A burst of a whole block's lines would stall on the core's outstanding-miss slots
// with nothing to compute meanwhile. Into L2, not L1: an L1 prefetch holds one of L1's few miss
// slots until its line arrives, while L2 keeps many more in flight (and the L1 prefetcher
// brings each line the last step).
struct PrefetchShares {
  int16_t begin[2][kMaxQHeads + 1];  // lines [begin[kv][h], begin[kv][h + 1]) of the K (0) or V (1) half: head h's

  // Worked out once per item: two divisions per prefetch step cost more than the step's compute.
  PrefetchShares(int64_t lines, int64_t heads) {
    const int64_t half = lines / 2;
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t first = kv ? half : 0, count = kv ? lines - half : half;
      for (int64_t h = 0; h <= heads; ++h) begin[kv][h] = static_cast<int16_t>(first + h * count / heads);
    }
  }

  void operator()(const uint8_t* token, int kv, int64_t h) const {
    if (token == nullptr) return;
    for (int64_t l = begin[kv][h]; l < begin[kv][h + 1]; ++l) __builtin_prefetch(token + 64 * l, 0, 2);
  }
};

// The factor a row's codes are multiplied by: its scale for 8-bit caches (fp8's with the factor
// its widening through fp16 leaves out), 1 for plain ones.
template <int KIND>
inline float row_scale(const uint8_t* token, const KVFormat& fmt, int kv, int64_t h) {
  if constexpr (KIND == KVFormat::kPlain) return 1.f;
  const float s = fmt.scale(token, kv, h);
  return KIND == KVFormat::kFp8 ? s * pdserve::kFp8ViaHalfFactor : s;
}

// Where tokens c0 .. c0 + n - 1 sit in the paged cache, and the tokens one chunk (CHUNK tokens)
// later (null past t1), walked block by block: two divisions per chunk, not four per token.
template <int64_t CHUNK>
inline void chunk_tokens(const uint8_t* cache, const int64_t* table, int64_t block_size, int64_t tb, int64_t c0,
                         int64_t n, int64_t t1, const uint8_t** tokens, const uint8_t** later) {
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t first = c0 + pass * CHUNK, count = pass ? std::max<int64_t>(0, std::min(n, t1 - first)) : n;
    const uint8_t** out = pass ? later : tokens;
    int64_t block = first / block_size, offset = first % block_size;
    for (int64_t j = 0; j < count; ++j) {
      out[j] = cache + (table[block] * block_size + offset) * tb;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
    for (int64_t j = count; j < n; ++j) out[j] = nullptr;
  }
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// The AVX-512 path for head_dim 64 or 128 (NV = head_dim / 16 vectors), one instantiation per
// cache format. Tokens go 16 at a time (one vector of scores per query head).
constexpr int64_t kChunk = 16;  // sum16 reduces exactly one vector of scores
static_assert(kChunk == 16);
// One K or V row of head h as fp32 vectors, unscaled; returns the row's scale (1 for plain rows).
template <typename T, int KIND, int NV>
inline float load_vecs(const uint8_t* token, const KVFormat& fmt, int kv, int64_t h, __m512* out) {
  const uint8_t* src = token + fmt.code_offset(kv, h);
  if constexpr (KIND == KVFormat::kPlain) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        out[i] = load_bf16(src + 32 * i);
      }
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) out[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src) + 16 * i);
    }
  } else if constexpr (KIND == KVFormat::kInt8) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      out[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + i)));
    }
  } else {
    // fp8 e4m3 -> fp16 bits (see kv_format.h) -> fp32.
    const __m256i sign = _mm256_set1_epi16(static_cast<short>(0x8000)), rest = _mm256_set1_epi16(0x7F);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + i));
      out[i] = _mm512_cvtph_ps(_mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), sign),
                                               _mm256_slli_epi16(_mm256_and_si256(b, rest), 7)));
    }
  }
  return row_scale<KIND>(token, fmt, kv, h);
}

#if defined(__AVX512BF16__)
// The values of a bf16 cache, two tokens per bf16 dot product: the rows of tokens j and j+1 are
// interleaved (unpack within 128-bit lanes), so one instruction adds p_j v_j + p_j+1 v_j+1 for
// 16 dims, with the pair (p_j, p_j+1) rounded to bf16 as attention kernels on GPUs round their
// probabilities. That is a third of the instructions of widening each row to fp32 and one FMA
// per token. The accumulators hold each 32-dim slice as [lanes' dims 0-3 | lanes' dims 4-7]
// (what the unpacks give); unpair_dims restores the order once per item.
template <int NV>
inline void values_bf16_pairs(const uint8_t* const* tokens, const uint8_t* const* later, int64_t n,
                              const KVFormat& fmt, int64_t num_q_heads, const PrefetchShares& prefetch,
                              const float (*p)[kChunk], float* acc_out) {
  constexpr int64_t D = NV * 16;
  constexpr int64_t kHeads = NV <= 4 ? 4 : 2;  // query heads at once: their accumulators stay in the 32 registers
  const int64_t heads = fmt.heads, group = num_q_heads / heads;
  alignas(64) uint16_t pb[kMaxQHeads][kChunk];  // p in bf16; lanes past n hold 0
  for (int64_t qh = 0; qh < num_q_heads; ++qh) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb[qh]), to_bf16(_mm512_load_ps(p[qh])));
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const int64_t gn = std::min<int64_t>(kHeads, group - g0);
      float* acc_base = acc_out + (h * group + g0) * D;
      __m512 acc[kHeads][NV];
#pragma GCC unroll 4
      for (int64_t g = 0; g < kHeads; ++g)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[g][v] = g < gn ? _mm512_loadu_ps(acc_base + g * D + 16 * v) : _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 2) {
        if (g0 == 0) {
          prefetch(later[j], 1, h);
          if (j + 1 < n) prefetch(later[j + 1], 1, h);
        }
        const uint8_t* a = tokens[j] + fmt.code_offset(1, h);
        const uint8_t* b = j + 1 < n ? tokens[j + 1] + fmt.code_offset(1, h) : nullptr;
        __m512i lo[NV / 2], hi[NV / 2];
#pragma GCC unroll 4
        for (int v = 0; v < NV / 2; ++v) {
          const __m512i x = _mm512_loadu_si512(a + 64 * v);
          const __m512i y = b ? _mm512_loadu_si512(b + 64 * v) : _mm512_setzero_si512();
          lo[v] = _mm512_unpacklo_epi16(x, y);
          hi[v] = _mm512_unpackhi_epi16(x, y);
        }
#pragma GCC unroll 4
        for (int64_t g = 0; g < kHeads; ++g) {
          if (g >= gn) break;
          uint32_t pair;
          std::memcpy(&pair, &pb[h * group + g0 + g][j], sizeof pair);
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
          for (int v = 0; v < NV / 2; ++v) {
            acc[g][2 * v] = _mm512_dpbf16_ps(acc[g][2 * v], (__m512bh)lo[v], pp);
            acc[g][2 * v + 1] = _mm512_dpbf16_ps(acc[g][2 * v + 1], (__m512bh)hi[v], pp);
          }
        }
      }
      for (int64_t g = 0; g < gn; ++g)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc_base + g * D + 16 * v, acc[g][v]);
    }
  }
}

// Back to dim order: in each 32-dim slice, 128-bit lane l of the first vector holds dims 8l..8l+3
// and of the second 8l+4..8l+7.
template <int NV>
inline void unpair_dims(float* acc) {
  for (int v = 0; v < NV / 2; ++v) {
    float* slice = acc + 32 * v;
    alignas(64) float paired[32];
    std::memcpy(paired, slice, sizeof paired);
    for (int l = 0; l < 4; ++l) {
      std::memcpy(slice + 8 * l, paired + 4 * l, 4 * sizeof(float));
      std::memcpy(slice + 8 * l + 4, paired + 16 + 4 * l, 4 * sizeof(float));
    }
  }
}
#endif

template <typename T, int KIND, int NV>
void attend_avx512(const float* q, int64_t num_q_heads, const uint8_t* cache, const int64_t* table,
                   int64_t block_size, int64_t t0, int64_t t1, const KVFormat& fmt, float scale, Partial out) {
  constexpr int64_t D = NV * 16;
  // A bf16 cache's K rows go straight into bf16 dot products (AVX512-BF16: 32 products per
  // instruction, exact, summed in fp32) against q in bf16, which is exact: q comes from a
  // bf16 model and is scaled after the dot product, not before.
#if defined(__AVX512BF16__)
  constexpr bool kBf16Dots = std::is_same_v<T, c10::BFloat16> && KIND == KVFormat::kPlain;
  __m512bh qbf[kBf16Dots ? kMaxQHeads : 1][NV / 2];
  if constexpr (kBf16Dots) {
    for (int64_t qh = 0; qh < num_q_heads; ++qh)
      for (int v = 0; v < NV / 2; ++v)
        qbf[qh][v] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + qh * D + 32 * v + 16), _mm512_loadu_ps(q + qh * D + 32 * v));
  }
#else
  constexpr bool kBf16Dots = false;
#endif
  const int64_t heads = fmt.heads, group = num_q_heads / heads, tb = fmt.token_bytes;
  alignas(64) float qs[kBf16Dots ? 1 : kMaxQHeads * D];  // q * scale for the fp32 dot products
  if constexpr (!kBf16Dots) {
    for (int64_t i = 0; i < num_q_heads * D; ++i) qs[i] = q[i] * scale;
  }
  alignas(64) float p[kMaxQHeads][kChunk];
  for (int64_t qh = 0; qh < num_q_heads; ++qh) {
    out.max[qh] = kNegInf;
    out.sum[qh] = 0.f;
  }
  std::fill(out.acc, out.acc + num_q_heads * D, 0.f);
  const uint8_t* tokens[kChunk];
  const uint8_t* later[kChunk];
  const PrefetchShares prefetch((tb + 63) / 64, heads);
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t n = std::min(kChunk, t1 - c0);
    const __mmask16 valid = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    chunk_tokens<kChunk>(cache, table, block_size, tb, c0, n, t1, tokens, later);
    // Scores of every query head for these tokens.
    for (int64_t h = 0; h < heads; ++h) {
      if constexpr (kBf16Dots) {
#if defined(__AVX512BF16__)
        // Each K row is loaded once for up to four of its query heads.
        const __m512 scales = _mm512_set1_ps(scale);
        const int64_t k_offset = fmt.code_offset(0, h);
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
          const int64_t gn = std::min<int64_t>(4, group - g0), qh0 = h * group + g0;
          __m512 dots[4][kChunk];
          for (int64_t j = 0; j < kChunk; ++j) {
            if (g0 == 0 && j < n) prefetch(later[j], 0, h);
            __m512bh k[NV / 2];
#pragma GCC unroll 4
            for (int v = 0; v < NV / 2; ++v) {
              k[v] = (__m512bh)(j < n ? _mm512_loadu_si512(tokens[j] + k_offset + 64 * v) : _mm512_setzero_si512());
            }
#pragma GCC unroll 4
            for (int64_t g = 0; g < 4; ++g) {
              if (g >= gn) break;
              __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qbf[qh0 + g][0], k[0]);
#pragma GCC unroll 4
              for (int v = 1; v < NV / 2; ++v) a = _mm512_dpbf16_ps(a, qbf[qh0 + g][v], k[v]);
              dots[g][j] = a;
            }
          }
          for (int64_t g = 0; g < gn; ++g) _mm512_store_ps(p[qh0 + g], _mm512_mul_ps(sum16(dots[g]), scales));
        }
#endif
      } else {
        // Each K row widened once for up to four of its query heads, and a chunk's 16 dot
        // products per head summed by one shuffle tree, then scaled by each token's K scale.
        alignas(64) float k_scales[kChunk];
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
          const int64_t gn = std::min<int64_t>(4, group - g0), qh0 = h * group + g0;
          __m512 dots[4][kChunk];
          for (int64_t j = 0; j < kChunk; ++j) {
            __m512 k[NV];
            if (j < n) {
              if (g0 == 0) prefetch(later[j], 0, h);
              k_scales[j] = load_vecs<T, KIND, NV>(tokens[j], fmt, 0, h, k);
            } else {
              k_scales[j] = 0.f;
#pragma GCC unroll 8
              for (int v = 0; v < NV; ++v) k[v] = _mm512_setzero_ps();
            }
#pragma GCC unroll 4
            for (int64_t g = 0; g < 4; ++g) {
              if (g >= gn) break;
              const float* qg = qs + (qh0 + g) * D;
              __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
              __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), k[1]);
#pragma GCC unroll 8
              for (int v = 2; v < NV; v += 2) {
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), k[v], a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * (v + 1)), k[v + 1], a1);
              }
              dots[g][j] = _mm512_add_ps(a0, a1);
            }
          }
          const __m512 scales = _mm512_load_ps(k_scales);
          for (int64_t g = 0; g < gn; ++g) _mm512_store_ps(p[qh0 + g], _mm512_mul_ps(sum16(dots[g]), scales));
        }
      }
    }
    // Online softmax over the chunk, one vector per query head.
    for (int64_t qh = 0; qh < num_q_heads; ++qh) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), valid, p[qh]);
      const float new_max = std::max(out.max[qh], _mm512_reduce_max_ps(s));
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_neg(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      const float alpha = std::exp(out.max[qh] - new_max);
      out.sum[qh] = out.sum[qh] * alpha + _mm512_reduce_add_ps(e);
      out.max[qh] = new_max;
      _mm512_store_ps(p[qh], e);
      if (alpha != 1.f) {
        float* acc = out.acc + qh * D;
        const __m512 a = _mm512_set1_ps(alpha);
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * v), a));
      }
    }
    if constexpr (kBf16Dots) {
#if defined(__AVX512BF16__)
      values_bf16_pairs<NV>(tokens, later, n, fmt, num_q_heads, prefetch, p, out.acc);
#endif
      continue;
    }
    // Values: per KV head, its query heads' accumulators in registers (up to 4 at a time).
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, group - g0);
        float* acc_base = out.acc + (h * group + g0) * D;
        __m512 acc[4][NV];
#pragma GCC unroll 4
        for (int64_t g = 0; g < 4; ++g)
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) acc[g][v] = g < gn ? _mm512_loadu_ps(acc_base + g * D + 16 * v) : _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
          if (g0 == 0) prefetch(later[j], 1, h);
          __m512 vr[NV];
          const float vs = load_vecs<T, KIND, NV>(tokens[j], fmt, 1, h, vr);
#pragma GCC unroll 4
          for (int64_t g = 0; g < 4; ++g) {
            if (g >= gn) break;
            const __m512 pj = _mm512_set1_ps(p[h * group + g0 + g][j] * vs);
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(pj, vr[v], acc[g][v]);
          }
        }
        for (int64_t g = 0; g < gn; ++g)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc_base + g * D + 16 * v, acc[g][v]);
      }
    }
  }
  if constexpr (kBf16Dots) {
#if defined(__AVX512BF16__)
    for (int64_t qh = 0; qh < num_q_heads; ++qh) unpair_dims<NV>(out.acc + qh * D);
#endif
  }
}
#endif

template <typename T>
using AttendFn = void (*)(const float*, int64_t, const uint8_t*, const int64_t*, int64_t, int64_t, int64_t,
                          const KVFormat&, float, Partial);

#if defined(__AVX512F__)
template <typename T, int NV>
AttendFn<T> pick_kind(const KVFormat& fmt) {
  switch (fmt.kind) {
    case KVFormat::kPlain: return &attend_avx512<T, KVFormat::kPlain, NV>;
    case KVFormat::kInt8: return &attend_avx512<T, KVFormat::kInt8, NV>;
    default: return &attend_avx512<T, KVFormat::kFp8, NV>;
  }
}

// The AVX-512 path's function for the shape, or null where it does not serve it.
template <typename T>
AttendFn<T> pick_avx512(const KVFormat& fmt, int64_t num_q_heads) {
  if (num_q_heads > kMaxQHeads) return nullptr;
  if (fmt.dim == 64) return pick_kind<T, 4>(fmt);
  if (fmt.dim == 128) return pick_kind<T, 8>(fmt);
  return nullptr;
}
#endif

}  // namespace
