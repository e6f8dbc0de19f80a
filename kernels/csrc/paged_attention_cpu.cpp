// Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
// paged cache through the block table (no gather copy, no padding to the longest context).
//
// Work items are (sequence, KV head, context split): each reads its K/V rows once for all the
// query heads that share the KV head (GQA), and long contexts are split across threads and
// merged with their softmax statistics (flash-decoding), so one long sequence uses every core.
// Rows of 8-bit caches are dequantized as they are read (kv_format.h).
#include "kv_format.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pdserve::KVFormat;

// One K or V row of one head, as fp32 (the scale of 8-bit rows folded in).
template <typename T>
inline void load_row(const uint8_t* token, const KVFormat& fmt, int kv, int64_t h, float* out) {
  const int64_t dim = fmt.dim;
  const uint8_t* src = token + fmt.code_offset(kv, h);
  if (fmt.kind == KVFormat::kPlain) {
    const T* x = reinterpret_cast<const T*>(src);
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(x);
      uint32_t* o = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<uint32_t>(bits[d]) << 16;
    } else {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(x[d]);
    }
    return;
  }
  float scale = fmt.scale(token, kv, h);
  if (fmt.kind == KVFormat::kInt8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(c[d]) * scale;
    return;
  }
  scale *= pdserve::kFp8ViaHalfFactor;
  for (int64_t d = 0; d < dim; ++d) {
    out[d] = c10::detail::fp16_ieee_to_fp32_value(pdserve::fp8_as_half_bits(src[d])) * scale;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    if (i < n) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// The softmax statistics and unnormalized output of a group of query heads over tokens [t0, t1).
struct Partial {
  float* max;  // [group]
  float* sum;  // [group]
  float* acc;  // [group][dim]
};

template <typename T>
void attend(const float* q, int64_t group, const uint8_t* cache, const int64_t* table, int64_t block_size,
            int64_t t0, int64_t t1, int64_t h, const KVFormat& fmt, std::vector<float>& scores,
            std::vector<float>& row, Partial out) {
  const int64_t dim = fmt.dim, n = t1 - t0, block_bytes = block_size * fmt.token_bytes;
  scores.resize(group * n);
  row.resize(dim);
  // Pass 1: scores, block by block, the next block prefetched (blocks sit anywhere in the pool).
  for (int64_t t = t0; t < t1;) {
    const int64_t blk = t / block_size, end = std::min(t1, (blk + 1) * block_size);
    if (end < t1) prefetch(cache + table[blk + 1] * block_bytes, std::min(block_size, t1 - end) * fmt.token_bytes);
    const uint8_t* base = cache + table[blk] * block_bytes;
    for (; t < end; ++t) {
      load_row<T>(base + (t % block_size) * fmt.token_bytes, fmt, 0, h, row.data());
      for (int64_t g = 0; g < group; ++g) scores[g * n + (t - t0)] = dot(q + g * dim, row.data(), dim);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - mx);
      sum += s[i];
    }
    out.max[g] = mx;
    out.sum[g] = sum;
  }
  // Pass 2: the probability-weighted sum of the values.
  std::fill(out.acc, out.acc + group * dim, 0.f);
  for (int64_t t = t0; t < t1;) {
    const int64_t blk = t / block_size, end = std::min(t1, (blk + 1) * block_size);
    if (end < t1) prefetch(cache + table[blk + 1] * block_bytes, std::min(block_size, t1 - end) * fmt.token_bytes);
    const uint8_t* base = cache + table[blk] * block_bytes;
    for (; t < end; ++t) {
      load_row<T>(base + (t % block_size) * fmt.token_bytes, fmt, 1, h, row.data());
      for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + (t - t0)], row.data(), out.acc + g * dim, dim);
    }
  }
}

#if defined(__AVX512F__)
// The AVX-512 version of `attend` for head_dim 64 or 128 (NV = head_dim / 16 vectors), one
// instantiation per cache format: q rows, K/V rows and the output accumulators stay in vector
// registers; rows are widened to fp32 as they are loaded.
// Loads one K or V row of head h as fp32 vectors, unscaled; returns the row's scale (1 for plain rows).
template <typename T, int KIND, int NV>
inline float load_vecs(const uint8_t* token, const KVFormat& fmt, int kv, int64_t h, __m512* out) {
  const uint8_t* src = token + fmt.code_offset(kv, h);
  if constexpr (KIND == KVFormat::kPlain) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src) + i);
        out[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      }
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) out[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src) + 16 * i);
    }
    return 1.f;
  } else if constexpr (KIND == KVFormat::kInt8) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + i);
      out[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
    }
    return fmt.scale(token, kv, h);
  } else {
    // fp8 e4m3 -> fp16 bits (see kv_format.h) -> fp32.
    const __m256i sign = _mm256_set1_epi16(static_cast<short>(0x8000)), rest = _mm256_set1_epi16(0x7F);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + i));
      const __m256i half = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), sign),
                                           _mm256_slli_epi16(_mm256_and_si256(b, rest), 7));
      out[i] = _mm512_cvtph_ps(half);
    }
    return fmt.scale(token, kv, h) * pdserve::kFp8ViaHalfFactor;
  }
}

// Calls fn(token pointer, index in [0, t1 - t0)) for tokens [t0, t1), block by block. Blocks
// sit anywhere in the pool, which defeats the hardware prefetcher at every block boundary, so
// while token j of a block is read, the row it needs (`row_bytes` at `row_offset`) of token j of
// the next block is prefetched.
template <typename Fn>
inline void for_each_token(const uint8_t* cache, const int64_t* table, int64_t block_size, int64_t token_bytes,
                           int64_t row_offset, int64_t row_bytes, int64_t t0, int64_t t1, Fn fn) {
  const int64_t block_bytes = block_size * token_bytes;
  for (int64_t t = t0; t < t1;) {
    const int64_t blk = t / block_size, end = std::min(t1, (blk + 1) * block_size);
    const uint8_t* token = cache + table[blk] * block_bytes + (t - blk * block_size) * token_bytes;
    const int64_t next_len = std::min(block_size, t1 - end);
    const uint8_t* next = next_len > 0 ? cache + table[blk + 1] * block_bytes + row_offset : nullptr;
    for (int64_t j = t - blk * block_size; t < end; ++t, ++j, token += token_bytes) {
      if (j < next_len) prefetch(next + j * token_bytes, row_bytes);
      fn(token, t - t0);
    }
  }
}

template <typename T, int KIND, int NV>
void attend_avx512(const float* q, int64_t group, const uint8_t* cache, const int64_t* table, int64_t block_size,
                   int64_t t0, int64_t t1, int64_t h, const KVFormat& fmt, std::vector<float>& scores, Partial out) {
  constexpr int64_t dim = NV * 16;
  const int64_t n = t1 - t0;
  scores.resize(group * n);
  float* sc = scores.data();
  const int64_t row_bytes = dim * (KIND == KVFormat::kPlain ? sizeof(T) : 1);
  for_each_token(cache, table, block_size, fmt.token_bytes, fmt.code_offset(0, h), row_bytes, t0, t1,
                 [&](const uint8_t* token, int64_t i) {
    __m512 row[NV];
    const float scale = load_vecs<T, KIND, NV>(token, fmt, 0, h, row);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      __m512 acc0 = _mm512_mul_ps(_mm512_loadu_ps(qg), row[0]);
      __m512 acc1 = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), row[1]);
#pragma GCC unroll 8
      for (int v = 2; v < NV; v += 2) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), row[v], acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * (v + 1)), row[v + 1], acc1);
      }
      sc[g * n + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) * scale;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* s = sc + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - mx);
      sum += s[i];
    }
    out.max[g] = mx;
    out.sum[g] = sum;
  }
  // Up to 8 / NV query heads' accumulators live in registers per pass over the values.
  constexpr int64_t kHeads = NV <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int64_t gn = std::min<int64_t>(kHeads, group - g0);
    __m512 acc[kHeads][NV];
#pragma GCC unroll 8
    for (int64_t g = 0; g < kHeads; ++g)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
    for_each_token(cache, table, block_size, fmt.token_bytes, fmt.code_offset(1, h), row_bytes, t0, t1,
                   [&](const uint8_t* token, int64_t i) {
      __m512 row[NV];
      const float scale = load_vecs<T, KIND, NV>(token, fmt, 1, h, row);
#pragma GCC unroll 4
      for (int64_t g = 0; g < kHeads; ++g) {
        if (g >= gn) break;
        const __m512 p = _mm512_set1_ps(sc[(g0 + g) * n + i] * scale);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_fmadd_ps(p, row[v], acc[g][v]);
      }
    });
    for (int64_t g = 0; g < gn; ++g)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out.acc + (g0 + g) * dim + 16 * v, acc[g][v]);
  }
}

// The fast path for this head_dim and format, or nullptr.
template <typename T>
using AttendFn = void (*)(const float*, int64_t, const uint8_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          const KVFormat&, std::vector<float>&, Partial);

template <typename T, int NV>
AttendFn<T> pick_kind(const KVFormat& fmt) {
  switch (fmt.kind) {
    case KVFormat::kPlain: return &attend_avx512<T, KVFormat::kPlain, NV>;
    case KVFormat::kInt8: return &attend_avx512<T, KVFormat::kInt8, NV>;
    default: return &attend_avx512<T, KVFormat::kFp8, NV>;
  }
}

template <typename T>
AttendFn<T> fast_attend(const KVFormat& fmt) {
  if (fmt.dim == 64) return pick_kind<T, 4>(fmt);
  if (fmt.dim == 128) return pick_kind<T, 8>(fmt);
  return nullptr;
}
#else
template <typename T>
using AttendFn = void (*)(const float*, int64_t, const uint8_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          const KVFormat&, std::vector<float>&, Partial);
template <typename T>
AttendFn<T> fast_attend(const KVFormat&) { return nullptr; }
#endif

template <typename T>
void decode_attention(const T* q, const uint8_t* cache, const int64_t* tables, const int64_t* lens, T* out,
                      int64_t batch, int64_t num_q_heads, int64_t max_blocks, int64_t block_size, float scale,
                      const KVFormat& fmt) {
  const int64_t heads = fmt.heads, dim = fmt.dim, group = num_q_heads / heads;
  // Split contexts so that every thread has work; never below ~128 tokens per split.
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = std::max<int64_t>(1, (4 * threads + batch * heads - 1) / (batch * heads));
  std::vector<int64_t> splits(batch), first(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    splits[b] = std::clamp<int64_t>((lens[b] + 127) / 128, 1, wanted);
    first[b + 1] = first[b] + splits[b] * heads;
  }
  const int64_t items = first[batch];
  std::vector<float> maxes(items * group), sums(items * group), accs(items * group * dim);
  const AttendFn<T> fast = fast_attend<T>(fmt);

  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, row, qf(group * dim);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const int64_t local = item - first[b], h = local / splits[b], split = local % splits[b];
      const int64_t len = lens[b], chunk = (len + splits[b] - 1) / splits[b];
      const int64_t t0 = std::min(len, split * chunk), t1 = std::min(len, t0 + chunk);
      const T* qb = q + (b * num_q_heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
      Partial part{maxes.data() + item * group, sums.data() + item * group, accs.data() + item * group * dim};
      if (t0 >= t1) {
        std::fill(part.max, part.max + group, -std::numeric_limits<float>::infinity());
        std::fill(part.sum, part.sum + group, 0.f);
        std::fill(part.acc, part.acc + group * dim, 0.f);
        continue;
      }
      if (fast != nullptr) {
        fast(qf.data(), group, cache, tables + b * max_blocks, block_size, t0, t1, h, fmt, scores, part);
        continue;
      }
      attend<T>(qf.data(), group, cache, tables + b * max_blocks, block_size, t0, t1, h, fmt, scores, row, part);
    }
  });

  // Merge each (sequence, head)'s splits.
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t base = first[b] + h * splits[b];
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits[b]; ++s) mx = std::max(mx, maxes[(base + s) * group + g]);
        float total = 0.f;
        std::vector<float> o(dim, 0.f);
        for (int64_t s = 0; s < splits[b]; ++s) {
          const int64_t idx = (base + s) * group + g;
          if (sums[idx] == 0.f) continue;
          const float w = std::exp(maxes[idx] - mx);
          total += sums[idx] * w;
          axpy(w, accs.data() + idx * dim, o.data(), dim);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        T* ob = out + (b * num_q_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) ob[d] = static_cast<T>(o[d] * inv);
      }
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t kv_format, int64_t num_kv_heads) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
  TORCH_CHECK(kv.is_contiguous(), "kv must be contiguous");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t batch = qc.size(0), num_q_heads = qc.size(1), head_dim = qc.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  const KVFormat fmt(static_cast<KVFormat::Kind>(kv_format), num_kv_heads, head_dim, qc.element_size());
  if (kv_format == KVFormat::kPlain) {
    TORCH_CHECK(kv.scalar_type() == qc.scalar_type(), "q and a plain kv cache must share a dtype");
  }
  const int64_t block_size = kv.size(1);
  TORCH_CHECK(kv.numel() * kv.element_size() == kv.size(0) * block_size * fmt.token_bytes,
              "kv cache layer does not match the heads, head_dim and format");
  TORCH_CHECK(tables.size(0) == batch && lens.size(0) == batch, "one block table and length per sequence");
  const int64_t max_blocks = tables.size(1), num_blocks = kv.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "context length out of range for its block table");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int64_t id = tables.data_ptr<int64_t>()[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " outside the cache");
    }
  }
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qc.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(qc.data_ptr<scalar_t>(), static_cast<const uint8_t*>(kv.data_ptr()),
                               tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch,
                               num_q_heads, max_blocks, block_size, static_cast<float>(scale), fmt);
  });
  return out;
}
