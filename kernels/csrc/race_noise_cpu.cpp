// The exponential race's noise for seeded sampling (engine/sampler.py): E[r, v] = -log(u) with u
// drawn from a counter-based hash of (row key, token v), so a row's noise costs a few vector
// instructions per token instead of a sequential generator's ~4 ns, and any token's noise can be
// computed alone. The hash is SplitMix64's finalizer; u is the top 23 bits as an odd multiple of
// 2^-24, strictly inside (0, 1), so E is finite and positive. The torch fallback in sampler.py
// computes the same u bit for bit; E may differ from it in the last bit of the logarithm (log_ps
// is within one unit in the last place).
#include "ops.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull, kMix1 = 0xBF58476D1CE4E5B9ull, kMix2 = 0x94D049BB133111EBull;

inline uint64_t mix(uint64_t key, uint64_t v) {
  uint64_t x = key ^ (v * kGolden);
  x = (x ^ (x >> 30)) * kMix1;
  x = (x ^ (x >> 27)) * kMix2;
  return x ^ (x >> 31);
}

inline float uniform_of(uint64_t bits) { return static_cast<float>(((bits >> 41) << 1) | 1) * 0x1p-24f; }

#if defined(__AVX512F__) && defined(__AVX512DQ__)
inline __m512i mix8(__m512i key, __m512i v) {
  __m512i x = _mm512_xor_si512(key, _mm512_mullo_epi64(v, _mm512_set1_epi64(static_cast<int64_t>(kGolden))));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)), _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)), _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

// 16 tokens' noise from tokens v0..v0+15.
inline __m512 noise16(__m512i key, int64_t v0) {
  const __m512i lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i lo = mix8(key, _mm512_add_epi64(lanes, _mm512_set1_epi64(v0)));
  const __m512i hi = mix8(key, _mm512_add_epi64(lanes, _mm512_set1_epi64(v0 + 8)));
  const __m512i top = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_srli_epi64(lo, 41))),
                                         _mm512_cvtepi64_epi32(_mm512_srli_epi64(hi, 41)), 1);
  const __m512i odd = _mm512_or_si512(_mm512_slli_epi32(top, 1), _mm512_set1_epi32(1));
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(0x1p-24f));
  return _mm512_sub_ps(_mm512_setzero_ps(), log_ps(u));
}
#endif

}  // namespace

void race_noise_(torch::Tensor out, torch::Tensor keys) {
  TORCH_CHECK(out.device().is_cpu() && keys.device().is_cpu(), "race_noise_ runs on CPU tensors");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat32 && out.is_contiguous(),
              "out must be a contiguous [rows, vocab] float32 tensor");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == torch::kInt64 && keys.size(0) == out.size(0),
              "keys must be int64, one per row");
  const int64_t rows = out.size(0), vocab = out.size(1);
  auto keys_c = keys.contiguous();
  const int64_t* key = keys_c.data_ptr<int64_t>();
  float* base = out.data_ptr<float>();
  constexpr int64_t kSpan = 4096;  // tokens per work item
  const int64_t spans = (vocab + kSpan - 1) / kSpan;
  at::parallel_for(0, rows * spans, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / spans, v0 = (i % spans) * kSpan, v1 = std::min(vocab, v0 + kSpan);
      const uint64_t k = static_cast<uint64_t>(key[r]);
      float* row = base + r * vocab;
      int64_t v = v0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      const __m512i kv = _mm512_set1_epi64(static_cast<int64_t>(k));
      for (; v + 16 <= v1; v += 16) _mm512_storeu_ps(row + v, noise16(kv, v));
#endif
      for (; v < v1; ++v) row[v] = -std::log(uniform_of(mix(k, static_cast<uint64_t>(v))));
    }
  });
}
