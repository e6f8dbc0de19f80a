// Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
// paged cache through the block table (no gather copy, no padding to the longest context).
//
// Work items are (sequence, context split). An item walks its cache blocks in order and uses
// every byte of a block (all heads' K and V of its tokens, one contiguous run) while it sits in
// L1/L2: scores for every query head, an online softmax, then the values. Each block is read
// from memory once, as a stream, which is what keeps a large batch near the memory bandwidth;
// long contexts are split across threads and merged with their softmax statistics
// (flash-decoding), so one long sequence uses every core. Rows of 8-bit caches are dequantized
// as they are read (kv_format.h). Paths: portable (any head_dim), AVX2 (paged_attention_avx2.h)
// and AVX-512 (paged_attention_item.h), each for head_dim 64 and 128.
#include "ops.h"
#include "paged_attention_avx2.h"
#include "paged_attention_item.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

enum Path : int64_t { kBest = -1, kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

std::vector<int64_t> compiled_paths() {
  std::vector<int64_t> paths{kPortable};
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  paths.push_back(kAvx2);
#endif
#if defined(__AVX512F__)
  paths.push_back(kAvx512);
#endif
  return paths;
}

// The function for `path` (kBest: the fastest compiled in); a path that does not serve the
// shape (another head_dim, too many query heads, a plain cache of doubles) falls back to the
// portable one.
template <typename T>
AttendFn<T> pick_attend(const KVFormat& fmt, int64_t num_q_heads, int64_t path) {
  static const std::vector<int64_t> paths = compiled_paths();
  if (path == kBest) path = paths.back();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "attention path ", path,
              " is not compiled in on this CPU");
  constexpr bool kVectorRows = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  if (!kVectorRows && fmt.kind == KVFormat::kPlain) return &attend_portable<T>;  // they read fp32 or bf16 rows
  AttendFn<T> fn = nullptr;
#if defined(__AVX512F__)
  if (path == kAvx512) fn = pick_avx512<T>(fmt, num_q_heads);
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (path == kAvx2) fn = avx2::pick<T>(fmt, num_q_heads);
#endif
  return fn ? fn : &attend_portable<T>;
}

template <typename T>
void decode_attention(const T* q, const uint8_t* cache, const int64_t* tables, const int64_t* lens, T* out,
                      int64_t batch, int64_t num_q_heads, int64_t max_blocks, int64_t block_size, float scale,
                      const KVFormat& fmt, int64_t path) {
  const int64_t dim = fmt.dim;
  // Work is tokens. A context longer than a thread's fair share is split (flash-decoding: the
  // splits' softmaxes are merged below), never below ~128 tokens per split; then each thread
  // takes a run of items holding about 1/threads of the tokens, so one long sequence in a batch
  // of short ones does not leave a core idle.
  const int64_t threads = at::get_num_threads();
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += lens[b];
  const int64_t share = std::max<int64_t>(128, (total + 4 * threads - 1) / (4 * threads));
  std::vector<int64_t> splits(batch), first(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    splits[b] = std::max<int64_t>(1, (lens[b] + share - 1) / share);
    first[b + 1] = first[b] + splits[b];
  }
  const int64_t items = first[batch];
  std::vector<float> maxes(items * num_q_heads), sums(items * num_q_heads), accs(items * num_q_heads * dim);
  const AttendFn<T> attend = pick_attend<T>(fmt, num_q_heads, path);
  // Each item's token range, and where each thread's run of items starts (an item goes to the
  // thread whose share of the tokens holds its middle).
  std::vector<int64_t> begin(items), end(items), owner_start(threads + 1, items);
  for (int64_t b = 0, done = 0; b < batch; ++b) {
    const int64_t chunk = (lens[b] + splits[b] - 1) / splits[b];
    for (int64_t item = first[b]; item < first[b + 1]; ++item) {
      begin[item] = std::min(lens[b], (item - first[b]) * chunk);
      end[item] = std::min(lens[b], begin[item] + chunk);
      const int64_t middle = done + (end[item] - begin[item]) / 2;
      const int64_t owner = total > 0 ? std::min(threads - 1, middle * threads / total) : 0;
      owner_start[owner] = std::min(owner_start[owner], item);
      done += end[item] - begin[item];
    }
  }
  owner_start[0] = 0;
  for (int64_t w = threads - 1; w >= 0; --w) owner_start[w] = std::min(owner_start[w], owner_start[w + 1]);

  at::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> qf(num_q_heads * dim);
    for (int64_t item = owner_start[w0]; item < owner_start[w1]; ++item) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const T* qb = q + b * num_q_heads * dim;
      for (int64_t i = 0; i < num_q_heads * dim; ++i) qf[i] = static_cast<float>(qb[i]);
      Partial part{maxes.data() + item * num_q_heads, sums.data() + item * num_q_heads,
                   accs.data() + item * num_q_heads * dim};
      attend(qf.data(), num_q_heads, cache, tables + b * max_blocks, block_size, begin[item], end[item], fmt, scale,
             part);
    }
  });

  // Merge each sequence's splits, per query head.
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t qh = 0; qh < num_q_heads; ++qh) {
      float mx = kNegInf;
      for (int64_t i = first[b]; i < first[b + 1]; ++i) mx = std::max(mx, maxes[i * num_q_heads + qh]);
      float total = 0.f;
      std::vector<float> o(dim, 0.f);
      for (int64_t i = first[b]; i < first[b + 1]; ++i) {
        const int64_t idx = i * num_q_heads + qh;
        if (sums[idx] == 0.f) continue;
        const float w = std::exp(maxes[idx] - mx);
        total += sums[idx] * w;
        for (int64_t d = 0; d < dim; ++d) o[d] += w * accs[idx * dim + d];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      T* ob = out + (b * num_q_heads + qh) * dim;
      for (int64_t d = 0; d < dim; ++d) ob[d] = static_cast<T>(o[d] * inv);
    }
  }
}

}  // namespace

std::vector<int64_t> attention_paths() { return compiled_paths(); }

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t kv_format, int64_t num_kv_heads,
                                     int64_t path) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
  TORCH_CHECK(kv.is_contiguous(), "kv must be contiguous");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t batch = qc.size(0), num_q_heads = qc.size(1), head_dim = qc.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  const KVFormat fmt = KVFormat::checked(kv_format, num_kv_heads, head_dim, qc.element_size());
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
                               num_q_heads, max_blocks, block_size, static_cast<float>(scale), fmt, path);
  });
  return out;
}
