// KV rows moved between caches and staging buffers, hashed on the way (the KV handoff's
// integrity check in one pass over the bytes).
//
// A unit is tokens in order; token i is row src_slots[i] of `src` ([rows, token_bytes]) and
// goes to row dst_slots[i] of `dst`. Its checksum is the XXH64 (seed 0) of every 1024-byte
// chunk of the token-ordered bytes, the last chunk zero-padded: the digests the GPU path's
// Triton kernel computes, folded by the caller the same way. Eight chunks are hashed side by
// side. Where each of the eight lies in one run of consecutive rows on both sides (always, for
// runs of whole blocks of a 1 KiB multiple), their bytes go from the source into registers,
// are hashed there and stored from there: one read and one write of each byte, with the rows
// a few windows ahead prefetched, since every run starts where the hardware prefetcher cannot
// guess. Other windows are gathered into a buffer that stays in L1 and hashed there.
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "ops.h"

namespace {

constexpr int64_t kChunk = 1024;
constexpr int64_t kWindowChunks = 8;
constexpr int64_t kWindow = kChunk * kWindowChunks;
constexpr int64_t kPrefetchChunks = 4 * kWindowChunks;  // how far ahead the rows are asked for (32 KiB)
constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL, P3 = 0x165667B19E3779F9ULL,
                   P4 = 0x85EBCA77C2B2AE63ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t xxh_round(uint64_t acc, uint64_t input) { return rotl(acc + input * P2, 31) * P1; }

// XXH64's end for a 1024-byte input, from its four lane accumulators.
inline uint64_t finish_chunk(const uint64_t lanes[4]) {
  uint64_t h = rotl(lanes[0], 1) + rotl(lanes[1], 7) + rotl(lanes[2], 12) + rotl(lanes[3], 18);
  for (int i = 0; i < 4; ++i) h = (h ^ xxh_round(0, lanes[i])) * P1 + P4;
  h += kChunk;
  h = (h ^ (h >> 33)) * P2;
  h = (h ^ (h >> 29)) * P3;
  return h ^ (h >> 32);
}

inline void seed_lanes(uint64_t lanes[4]) {
  lanes[0] = P1 + P2;
  lanes[1] = P2;
  lanes[2] = 0;
  lanes[3] = 0 - P1;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define KV_COPY_FUSED 1
// One XXH64 round on eight chunks' lanes at once: register = two chunks' four lanes.
inline __m512i xxh_round8(__m512i acc, __m512i x, __m512i p1, __m512i p2) {
  return _mm512_mullo_epi64(_mm512_rol_epi64(_mm512_add_epi64(acc, _mm512_mullo_epi64(x, p2)), 31), p1);
}

// Eight whole chunks, chunk k at src[k], hashed from registers, and copied to dst[k] on the
// way when dst is given (`stream`: with stores that bypass the cache; dst 64-byte aligned).
inline void copy_hash8(const uint8_t* const src[8], uint8_t* const dst[8], bool copying, bool stream,
                       uint64_t* out) {
  const __m512i p1 = _mm512_set1_epi64(P1), p2 = _mm512_set1_epi64(P2);
  const __m512i seed = _mm512_setr_epi64(P1 + P2, P2, 0, 0 - P1, P1 + P2, P2, 0, 0 - P1);
  __m512i acc[4] = {seed, seed, seed, seed};
  for (int64_t at = 0; at < kChunk; at += 64) {
    for (int r = 0; r < 4; ++r) {  // four independent multiply chains in flight
      const __m512i a = _mm512_loadu_si512(src[2 * r] + at), b = _mm512_loadu_si512(src[2 * r + 1] + at);
      if (copying && stream) {
        _mm512_stream_si512((__m512i*)(dst[2 * r] + at), a);
        _mm512_stream_si512((__m512i*)(dst[2 * r + 1] + at), b);
      } else if (copying) {
        _mm512_storeu_si512(dst[2 * r] + at, a);
        _mm512_storeu_si512(dst[2 * r + 1] + at, b);
      }
      // 64 bytes are two 32-byte stripes of each chunk: first stripes, then second stripes.
      acc[r] = xxh_round8(acc[r], _mm512_shuffle_i64x2(a, b, 0x44), p1, p2);
      acc[r] = xxh_round8(acc[r], _mm512_shuffle_i64x2(a, b, 0xEE), p1, p2);
    }
  }
  alignas(64) uint64_t lanes[32];
  for (int r = 0; r < 4; ++r) _mm512_store_si512((__m512i*)(lanes + 8 * r), acc[r]);
  for (int k = 0; k < 8; ++k) out[k] = finish_chunk(lanes + 4 * k);
}
#endif

// XXH64 of `count` consecutive chunks at `data`.
void hash_chunks(const uint8_t* data, int64_t count, uint64_t* out) {
  int64_t c = 0;
#ifdef KV_COPY_FUSED
  for (; c + 8 <= count; c += 8) {
    const uint8_t* chunks[8];
    for (int k = 0; k < 8; ++k) chunks[k] = data + (c + k) * kChunk;
    copy_hash8(chunks, nullptr, false, false, out + c);
  }
#endif
  for (; c < count; ++c) {
    uint64_t lanes[4];
    seed_lanes(lanes);
    const uint8_t* p = data + c * kChunk;
    for (int64_t stripe = 0; stripe < kChunk; stripe += 32) {
      for (int i = 0; i < 4; ++i) {
        uint64_t word;
        std::memcpy(&word, p + stripe + 8 * i, 8);
        lanes[i] = xxh_round(lanes[i], word);
      }
    }
    out[c] = finish_chunk(lanes);
  }
}

// Writes a piece of the window to its destination; `stream`: bypassing the cache where it can
// (the destination is another process's cache, which nothing here reads again, and a cached
// store would first read every line it overwrites).
inline void write_out(uint8_t* dst, const uint8_t* window_piece, int64_t n, bool stream) {
#if defined(__AVX512F__)
  if (stream && (((uintptr_t)dst | (uintptr_t)window_piece | (uintptr_t)n) & 63) == 0) {
    for (int64_t i = 0; i < n; i += 64)
      _mm512_stream_si512((__m512i*)(dst + i), _mm512_load_si512((const __m512i*)(window_piece + i)));
    return;
  }
#endif
  std::memcpy(dst, window_piece, n);
}

// Runs of tokens consecutive on both sides: one memcpy each, however the unit is split.
struct Run {
  int64_t src_row, dst_row, tokens;
};

// Also checks every slot against its side's rows (IndexError in Python: the unit's problem).
std::vector<Run> runs_of(const int64_t* src, int64_t src_rows, const int64_t* dst, int64_t dst_rows, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(src[i] >= 0 && src[i] < src_rows, "src slot ", src[i], " is outside ", src_rows, " rows");
    TORCH_CHECK_INDEX(!dst || (dst[i] >= 0 && dst[i] < dst_rows), "dst slot ", dst ? dst[i] : 0, " is outside ",
                      dst_rows, " rows");
  }
  std::vector<Run> runs;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && src[j] == src[j - 1] + 1 && (!dst || dst[j] == dst[j - 1] + 1)) ++j;
    runs.push_back({src[i], dst ? dst[i] : 0, j - i});
    i = j;
  }
  return runs;
}

#ifdef KV_COPY_FUSED
// Where every whole chunk of the unit starts on each side, or null where it spans two runs
// (or is the zero-padded last one).
void chunk_starts(const std::vector<Run>& runs, int64_t token_bytes, const uint8_t* src, uint8_t* dst, int64_t total,
                  std::vector<const uint8_t*>& src_at, std::vector<uint8_t*>& dst_at) {
  src_at.assign(total / kChunk, nullptr);
  dst_at.assign(total / kChunk, nullptr);
  int64_t run_start = 0;  // where the run begins in the unit's bytes
  for (const Run& r : runs) {
    const int64_t run_end = run_start + r.tokens * token_bytes;
    for (int64_t c = (run_start + kChunk - 1) / kChunk; (c + 1) * kChunk <= run_end; ++c) {
      src_at[c] = src + r.src_row * token_bytes + (c * kChunk - run_start);
      if (dst) dst_at[c] = dst + r.dst_row * token_bytes + (c * kChunk - run_start);
    }
    run_start = run_end;
  }
}

// Eight chunks from `first` that each lie in one run on both sides; `aligned`: every
// destination is 64-byte aligned (what streaming stores need).
bool whole_window(const std::vector<const uint8_t*>& src_at, const std::vector<uint8_t*>& dst_at, int64_t first,
                  bool copying, bool* aligned) {
  if (first + kWindowChunks > (int64_t)src_at.size()) return false;
  *aligned = true;
  for (int64_t c = first; c < first + kWindowChunks; ++c) {
    if (!src_at[c] || (copying && !dst_at[c])) return false;
    if (copying && ((uintptr_t)dst_at[c] & 63)) *aligned = false;
  }
  return true;
}
#endif

void check_rows(const torch::Tensor& rows, const torch::Tensor& slots, const char* what) {
  TORCH_CHECK(rows.device().is_cpu() && rows.dtype() == torch::kUInt8 && rows.dim() == 2 && rows.is_contiguous(),
              what, ": expected contiguous uint8 CPU rows [slots, token_bytes]");
  TORCH_CHECK(slots.device().is_cpu() && slots.dtype() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous(),
              what, ": expected contiguous int64 CPU slots");
}

}  // namespace

torch::Tensor copy_rows_hashed(torch::Tensor src, torch::Tensor src_slots, c10::optional<torch::Tensor> dst,
                               c10::optional<torch::Tensor> dst_slots, bool stream) {
  check_rows(src, src_slots, "src");
  const bool copying = dst.has_value();
  TORCH_CHECK(copying == dst_slots.has_value(), "dst and dst_slots come together");
  const int64_t token_bytes = src.size(1), n = src_slots.numel();
  if (copying) {
    check_rows(*dst, *dst_slots, "dst");
    TORCH_CHECK(dst->size(1) == token_bytes && dst_slots->numel() == n, "dst: another token size or token count");
  }
  const int64_t total = n * token_bytes;
  const int64_t num_chunks = std::max<int64_t>(1, (total + kChunk - 1) / kChunk);
  auto digests = torch::empty({num_chunks}, torch::kInt64);
  auto* out = reinterpret_cast<uint64_t*>(digests.data_ptr<int64_t>());
  const uint8_t* src_base = src.data_ptr<uint8_t>();
  uint8_t* dst_base = copying ? dst->data_ptr<uint8_t>() : nullptr;
  const auto runs = runs_of(src_slots.data_ptr<int64_t>(), src.size(0),
                            copying ? dst_slots->data_ptr<int64_t>() : nullptr, copying ? dst->size(0) : 0, n);

#ifdef KV_COPY_FUSED
  std::vector<const uint8_t*> src_at;
  std::vector<uint8_t*> dst_at;
  chunk_starts(runs, token_bytes, src_base, dst_base, total, src_at, dst_at);
#endif

  alignas(64) uint8_t window[kWindow];
  size_t run = 0;
  int64_t run_offset = 0;  // bytes of the current run already taken
  for (int64_t at = 0, chunk = 0; chunk < num_chunks; at += kWindow, chunk += kWindowChunks) {
    const int64_t take = std::min(kWindow, total - at);
#ifdef KV_COPY_FUSED
    bool aligned;
    if (whole_window(src_at, dst_at, chunk, copying, &aligned)) {
      for (int64_t c = chunk + kPrefetchChunks; c < std::min<int64_t>(chunk + kPrefetchChunks + kWindowChunks, src_at.size()); ++c)
        if (src_at[c])
          for (int64_t line = 0; line < kChunk; line += 64) _mm_prefetch((const char*)src_at[c] + line, _MM_HINT_T0);
      copy_hash8(&src_at[chunk], &dst_at[chunk], copying, stream && aligned, out + chunk);
      for (int64_t left = kWindow; left > 0;) {  // keep the gathering path's place in the runs
        const int64_t step = std::min(left, runs[run].tokens * token_bytes - run_offset);
        left -= step;
        run_offset += step;
        if (run_offset == runs[run].tokens * token_bytes) ++run, run_offset = 0;
      }
      continue;
    }
#endif
    for (int64_t filled = 0; filled < take;) {
      const Run& r = runs[run];
      const int64_t piece = std::min(take - filled, r.tokens * token_bytes - run_offset);
      std::memcpy(window + filled, src_base + r.src_row * token_bytes + run_offset, piece);
      if (copying) write_out(dst_base + r.dst_row * token_bytes + run_offset, window + filled, piece, stream);
      filled += piece;
      run_offset += piece;
      if (run_offset == r.tokens * token_bytes) ++run, run_offset = 0;
    }
    const int64_t chunks = std::min(kWindowChunks, num_chunks - chunk);
    std::memset(window + take, 0, chunks * kChunk - take);  // the last chunk's zero padding
    hash_chunks(window, chunks, out + chunk);
  }
  if (stream) _mm_sfence();  // the streamed stores are visible before the caller announces them
  return digests;
}
