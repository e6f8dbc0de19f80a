// The AVX2 path of one paged decode-attention work item (paged_attention_item.h states the
// contract and holds the portable and AVX-512 paths), for CPUs without AVX-512: most laptops.
// head_dim 64 or 128 (NV = head_dim / 8 vectors), every cache format, fp32 dot products (AVX2
// has no bf16 ones). Tokens go 8 at a time, one vector of scores per query head; each K or V
// row is read and widened once for the query heads that share it.
#pragma once

#include "paged_attention_item.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {
namespace avx2 {

constexpr int64_t kChunk = 8;       // tokens per vector of scores
constexpr int kHeads = 4;           // query heads of one KV head computed together (accumulators in registers)

// Vector i (8 values) of a K or V row as fp32, unscaled.
template <typename T, int KIND>
inline __m256 load8(const uint8_t* row, int i) {
  if constexpr (KIND == KVFormat::kPlain) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row) + i);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * i);
    }
  } else {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * i));
    if constexpr (KIND == KVFormat::kInt8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    // fp8 e4m3 -> fp16 bits (see kv_format.h) -> fp32.
    const __m128i b = _mm_cvtepu8_epi16(codes);
    const __m128i half = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(static_cast<short>(0x8000))),
                                      _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(half);
  }
}

// The tokens of one chunk, those of the next (prefetched meanwhile, null past the item), and
// the prefetcher's shares of their lines.
struct Chunk {
  const uint8_t* tokens[kChunk];
  const uint8_t* later[kChunk];
  int64_t n;
  const PrefetchShares& prefetch;
};

// Scores of query heads qh0 .. qh0 + G - 1 (all of KV head h) for the chunk's tokens, into p;
// the first of a KV head's calls (first) prefetches its share of the next chunk's K rows.
template <typename T, int KIND, int NV, int G>
inline void chunk_scores(const float* qs, const Chunk& c, const KVFormat& fmt, int64_t h, int64_t qh0, bool first,
                         float (*p)[kChunk]) {
  constexpr int64_t D = NV * 8;
  const int64_t k_offset = fmt.code_offset(0, h);
  alignas(32) float k_scales[kChunk];
  __m256 dots[G][kChunk];
  for (int64_t j = 0; j < kChunk; ++j) {
    __m256 a[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
    if (j < c.n) {
      if (first) c.prefetch(c.later[j], 0, h);
      const uint8_t* row = c.tokens[j] + k_offset;
      k_scales[j] = row_scale<KIND>(c.tokens[j], fmt, 0, h);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const __m256 k = load8<T, KIND>(row, v);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_load_ps(qs + (qh0 + g) * D + 8 * v), k, a[g]);
      }
    } else {
      k_scales[j] = 0.f;
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) dots[g][j] = a[g];
  }
  const __m256 scales = _mm256_load_ps(k_scales);
  for (int g = 0; g < G; ++g) _mm256_store_ps(p[qh0 + g], _mm256_mul_ps(sum8(dots[g]), scales));
}

// acc[qh0 + g] += sum_j p[qh0 + g][j] * v_j over the chunk's tokens, for the G query heads of
// KV head h: two vectors of dims at a time, so G x 2 accumulators stay in registers. As above,
// `first` prefetches the next chunk's V rows.
template <typename T, int KIND, int NV, int G>
inline void chunk_values(const Chunk& c, const KVFormat& fmt, int64_t h, int64_t qh0, bool first,
                         const float (*p)[kChunk], float* acc) {
  constexpr int64_t D = NV * 8;
  const int64_t v_offset = fmt.code_offset(1, h);
  alignas(32) float pv[G][kChunk];  // p times each V row's scale
  for (int64_t j = 0; j < c.n; ++j) {
    if (first) c.prefetch(c.later[j], 1, h);
    const float s = row_scale<KIND>(c.tokens[j], fmt, 1, h);
    for (int g = 0; g < G; ++g) pv[g][j] = p[qh0 + g][j] * s;
  }
  for (int v = 0; v < NV; v += 2) {
    __m256 a[G][2];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      a[g][0] = _mm256_loadu_ps(acc + (qh0 + g) * D + 8 * v);
      a[g][1] = _mm256_loadu_ps(acc + (qh0 + g) * D + 8 * v + 8);
    }
    for (int64_t j = 0; j < c.n; ++j) {
      const uint8_t* row = c.tokens[j] + v_offset;
      const __m256 x0 = load8<T, KIND>(row, v), x1 = load8<T, KIND>(row, v + 1);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m256 pj = _mm256_broadcast_ss(&pv[g][j]);
        a[g][0] = _mm256_fmadd_ps(pj, x0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(pj, x1, a[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(acc + (qh0 + g) * D + 8 * v, a[g][0]);
      _mm256_storeu_ps(acc + (qh0 + g) * D + 8 * v + 8, a[g][1]);
    }
  }
}

// f(std::integral_constant<int, gn>) for gn in 1 .. kHeads: the head count as a compile-time
// constant, so that the accumulators of a KV head's query heads stay in registers.
template <typename F>
inline void with_heads(int64_t gn, F&& f) {
  switch (gn) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, kHeads>{});
  }
}

template <typename T, int KIND, int NV>
void attend(const float* q, int64_t num_q_heads, const uint8_t* cache, const int64_t* table, int64_t block_size,
            int64_t t0, int64_t t1, const KVFormat& fmt, float scale, Partial out) {
  constexpr int64_t D = NV * 8;
  const int64_t heads = fmt.heads, group = num_q_heads / heads, tb = fmt.token_bytes;
  alignas(32) float qs[kMaxQHeads * D];
  for (int64_t i = 0; i < num_q_heads * D; ++i) qs[i] = q[i] * scale;
  alignas(32) float p[kMaxQHeads][kChunk];
  for (int64_t qh = 0; qh < num_q_heads; ++qh) {
    out.max[qh] = kNegInf;
    out.sum[qh] = 0.f;
  }
  std::fill(out.acc, out.acc + num_q_heads * D, 0.f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const PrefetchShares prefetch((tb + 63) / 64, heads);
  Chunk c{{}, {}, 0, prefetch};
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t n = c.n = std::min(kChunk, t1 - c0);
    chunk_tokens<kChunk>(cache, table, block_size, tb, c0, n, t1, c.tokens, c.later);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t g0 = 0; g0 < group; g0 += kHeads)
        with_heads(std::min<int64_t>(kHeads, group - g0), [&](auto G) {
          chunk_scores<T, KIND, NV, G>(qs, c, fmt, h, h * group + g0, g0 == 0, p);
        });
    // Online softmax over the chunk, one vector per query head; lanes past n weigh 0.
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    for (int64_t qh = 0; qh < num_q_heads; ++qh) {
      const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_load_ps(p[qh]), valid);
      const float new_max = std::max(out.max[qh], reduce_max(s));
      const __m256 e = _mm256_and_ps(valid, exp_neg(_mm256_sub_ps(s, _mm256_set1_ps(new_max))));
      const float alpha = std::exp(out.max[qh] - new_max);
      out.sum[qh] = out.sum[qh] * alpha + reduce_add(e);
      out.max[qh] = new_max;
      _mm256_store_ps(p[qh], e);
      if (alpha != 1.f) {
        float* acc = out.acc + qh * D;
        const __m256 a = _mm256_set1_ps(alpha);
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * v), a));
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t g0 = 0; g0 < group; g0 += kHeads)
        with_heads(std::min<int64_t>(kHeads, group - g0), [&](auto G) {
          chunk_values<T, KIND, NV, G>(c, fmt, h, h * group + g0, g0 == 0, p, out.acc);
        });
  }
}

template <typename T, int NV>
AttendFn<T> pick_kind(const KVFormat& fmt) {
  switch (fmt.kind) {
    case KVFormat::kPlain: return &attend<T, KVFormat::kPlain, NV>;
    case KVFormat::kInt8: return &attend<T, KVFormat::kInt8, NV>;
    default: return &attend<T, KVFormat::kFp8, NV>;
  }
}

// This path's function for the shape, or null where it does not serve it.
template <typename T>
AttendFn<T> pick(const KVFormat& fmt, int64_t num_q_heads) {
  if (num_q_heads > kMaxQHeads) return nullptr;
  if (fmt.dim == 64) return pick_kind<T, 8>(fmt);
  if (fmt.dim == 128) return pick_kind<T, 16>(fmt);
  return nullptr;
}

}  // namespace avx2
}  // namespace
#endif
