// Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
// paged cache through the block table (no gather copy, no padding to the longest context).
//
// Cache layout per layer: kv[num_blocks][block_size][2][num_kv_heads][head_dim].
// Work is split over sequences; each handles all its heads, so every token's K and V rows
// (contiguous in this layout) are read once for all the query heads. Scores are kept for the
// whole context (two passes, one exp per score), which vectorizes far better than an online
// softmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Widening loads the compiler can vectorize (bf16 is the top half of a float).
inline void load_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at every block
// boundary: ask for the next block while this one is being read.
inline void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

template <typename T>
void decode_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t kv_width = num_kv_heads * head_dim;  // K (or V) of one token, all heads
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_q_heads * head_dim), acc(num_q_heads * head_dim), row(kv_width), scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const T* qb = q + b * num_q_heads * head_dim;
      for (int64_t i = 0; i < num_q_heads * head_dim; ++i) qf[i] = to_float(qb[i]) * scale;
      scores.resize(num_q_heads * len);

      // Pass 1: every query head against every key, block by block (each K row read once
      // for all the heads; query head h*group+g uses kv head h).
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* block = kv + table[t0 / block_size] * block_size * 2 * kv_width;
        const int64_t n = std::min(block_size, len - t0);
        if (t0 + block_size < len) {
          prefetch_block(kv + table[t0 / block_size + 1] * block_size * 2 * kv_width,
                         std::min(block_size, len - t0 - block_size) * 2 * kv_width * sizeof(T));
        }
        for (int64_t j = 0; j < n; ++j) {
          load_row(block + j * 2 * kv_width, row.data(), kv_width);
          for (int64_t hq = 0; hq < num_q_heads; ++hq) {
            const float* qh = qf.data() + hq * head_dim;
            const float* kh = row.data() + (hq / group) * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
            scores[hq * len + t0 + j] = s;
          }
        }
      }
      // Softmax per query head: one exp per score.
      for (int64_t hq = 0; hq < num_q_heads; ++hq) {
        float* sh = scores.data() + hq * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sh[t] = std::exp(sh[t] - mx);
          sum += sh[t];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
      }
      // Pass 2: weighted sum of the values, block by block.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* block = kv + table[t0 / block_size] * block_size * 2 * kv_width + kv_width;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          load_row(block + j * 2 * kv_width, row.data(), kv_width);
          for (int64_t hq = 0; hq < num_q_heads; ++hq) {
            const float p = scores[hq * len + t0 + j];
            const float* vh = row.data() + (hq / group) * head_dim;
            float* ah = acc.data() + hq * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vh[d];
          }
        }
      }
      T* ob = out + b * num_q_heads * head_dim;
      for (int64_t i = 0; i < num_q_heads * head_dim; ++i) ob[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5, "q must be [B, Hq, D] and kv [blocks, block_size, 2, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv must share a dtype");
  TORCH_CHECK(kv.is_contiguous(), "kv must be contiguous");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t batch = qc.size(0), num_q_heads = qc.size(1), head_dim = qc.size(2);
  const int64_t block_size = kv.size(1), num_kv_heads = kv.size(3);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(kv.size(4) == head_dim, "head_dim mismatch");
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(qc.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, num_q_heads, num_kv_heads,
                            head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
