// Weight-quantized linear layers for CPUs: int8 and int4 weights, integer dot products.
//
// Activations are quantized on the fly, 32 values at a time, to int8 with one fp32 scale per
// group (llama.cpp's Q8 activation scheme); each group's dot products run as int8 x uint8 ->
// int32 (AVX512-VNNI `vpdpbusd`, 64 multiply-adds per instruction) and are scaled into fp32
// accumulators once per group. Weights are stored as unsigned bytes or nibbles, so a weight
// is w = d * q + m per group of 32 (int4 and group-wise int8) or w = s * (q - 128) per output
// channel (per-channel int8):
//
//   y[r, n] = sum_g  d[n,g] * sx[r,g] * sum_k q[n,k] xq[r,k]  +  m[n,g] * sx[r,g] * sum_k xq[r,k]
//
// Packed layout (`pack_weights`): columns in blocks of 16, K in groups of 32. For each column
// block, its groups follow each other ("cells"), so one block's weights are one stream:
//   int8 cell: 8 steps x [16 columns x 4 consecutive k] bytes = 512 bytes
//   int4 cell: 4 steps x [16 columns x 4 k] bytes, low nibble = step 2j, high nibble = step 2j+1 = 256 bytes
//   then, for group-wise formats, 16 x fp16 d and 16 x fp16 m (64 bytes).
// Per-channel int8 has no per-group data; its per-column fp32 scales are a separate tensor.
#include "linear_output.h"
#include "ops.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PDSERVE_VNNI 1
#else
#define PDSERVE_VNNI 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#else
#define PDSERVE_AVX2 0
#endif

namespace {

constexpr int kGroup = 32;   // K values per quantization group
constexpr int kCols = 16;    // columns per block (one 512-bit register of int32)

enum Format : int64_t { kInt8PerChannel = 0, kInt8Group = 1, kInt4Group = 2 };
enum Path : int64_t { kBest = -1, kPortable = 0, kAvx2 = 1, kVnni = 2 };

inline void check_format(int64_t format) {
  TORCH_CHECK(format >= kInt8PerChannel && format <= kInt4Group,
              "format must be 0 (int8 per channel), 1 (int8 group-wise) or 2 (int4 group-wise), not ", format);
}
inline int64_t weight_bytes(int64_t format) { return format == kInt4Group ? 256 : 512; }
inline int64_t cell_bytes(int64_t format) { return weight_bytes(format) + (format == kInt8PerChannel ? 0 : 64); }

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline uint16_t float_to_half(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }

template <typename T>
inline float load_float(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// ---------------------------------------------------------------------------------------------
// Activation quantization: per row, per group of 32: xq = round(x / sx), sx = max|x| / 127.
// xsum[r, g] = sx * sum(xq) (what the m term multiplies). A group whose max|x| is so small that
// 127 / max|x| overflows (< ~4e-37) quantizes to zeros, as an all-zero group does.
constexpr float kTinyAmax = 127.f / std::numeric_limits<float>::max();
#if PDSERVE_AVX2
// One whole group of fp32 values, 8 lanes at a time, with the scalar loop's arithmetic exactly
// (the same scale and reciprocal, one multiply, rounding to nearest even): 5-10% of a prefill GEMM.
inline void quantize_group_avx2(const float* x, int8_t* out, float* scale, float* scaled_sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax > kTinyAmax ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // The two packs interleave 128-bit lanes: bytes come out as dwords 0 4 1 5 2 6 3 7.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *scale = amax / 127.f;
  *scaled_sum = *scale * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t kp, int8_t* xq, float* xs, float* xsum) {
  const int64_t groups = kp / kGroup;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float buf[kGroup];
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      for (int64_t g = 0; g < groups; ++g) {
#if PDSERVE_AVX2
        if constexpr (std::is_same_v<T, float>) {
          if ((g + 1) * kGroup <= k) {
            quantize_group_avx2(xr + g * kGroup, xq + r * kp + g * kGroup, xs + r * groups + g, xsum + r * groups + g);
            continue;
          }
        }
#endif
        float amax = 0.f;
        for (int i = 0; i < kGroup; ++i) {
          const int64_t c = g * kGroup + i;
          buf[i] = c < k ? load_float(xr, c) : 0.f;
          amax = std::max(amax, std::fabs(buf[i]));
        }
        const float scale = amax / 127.f;
        const float inv = amax > kTinyAmax ? 127.f / amax : 0.f;
        int sum = 0;
        int8_t* out = xq + r * kp + g * kGroup;
        for (int i = 0; i < kGroup; ++i) {
          const int q = static_cast<int>(std::nearbyint(buf[i] * inv));
          out[i] = static_cast<int8_t>(q);
          sum += q;
        }
        xs[r * groups + g] = scale;
        xsum[r * groups + g] = scale * static_cast<float>(sum);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The portable path: the same arithmetic, one column at a time (correctness everywhere; the
// engine uses it only where the fast path is not compiled in).
inline int32_t weight_at(const uint8_t* cell, int64_t format, int col, int kk) {
  const int step = kk / 4, i = kk % 4;
  if (format == kInt4Group) {
    const uint8_t byte = cell[(step / 2) * 64 + col * 4 + i];
    return (step % 2) ? (byte >> 4) : (byte & 0x0F);
  }
  return cell[step * 64 + col * 4 + i];
}

void gemm_portable(const uint8_t* w, const float* col_scale, int64_t format, int64_t groups, int64_t nblocks,
                   const int8_t* xq, const float* xs, const float* xsum, int64_t rows, int64_t kp, const Output& y) {
  const int64_t cb = cell_bytes(format), wb = weight_bytes(format);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < rows; ++r) {
        float acc[kCols] = {0};
        float corr = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* cell = w + (b * groups + g) * cb;
          const int8_t* xg = xq + r * kp + g * kGroup;
          const float sx = xs[r * groups + g], sxs = xsum[r * groups + g];
          const uint16_t* dm = reinterpret_cast<const uint16_t*>(cell + wb);
          for (int c = 0; c < kCols; ++c) {
            int32_t dot = 0;
            for (int kk = 0; kk < kGroup; ++kk) dot += weight_at(cell, format, c, kk) * xg[kk];
            if (format == kInt8PerChannel) {
              acc[c] += sx * static_cast<float>(dot);
            } else {
              acc[c] += half_to_float(dm[c]) * sx * static_cast<float>(dot) + half_to_float(dm[kCols + c]) * sxs;
            }
          }
          corr += sxs;
        }
        for (int c = 0; c < kCols; ++c) {
          const int64_t n = b * kCols + c;
          y.store(r, n, format == kInt8PerChannel ? col_scale[n] * (acc[c] - 128.f * corr) : acc[c]);
        }
      }
    }
  });
}

#if PDSERVE_AVX2
// ---------------------------------------------------------------------------------------------
// The AVX2 path (CPUs without AVX512-VNNI, most laptops): `vpmaddubsw` multiplies unsigned by
// signed bytes into saturating 16-bit pair sums, then `vpmaddwd` by ones adds the pairs into
// one int32 per column. Nibbles (0..15) times int8 cannot saturate. Int8 weights could
// (255 x 127 x 2), so they are taken as signed (code - 128) with llama.cpp's sign trick:
// |w| x (x * sign w), at most 128 x 127 x 2. The same packed cells as the VNNI path: a 64-byte
// step is 16 columns x 4 k, here two 32-byte halves of 8 columns.
template <int MR, int64_t F>
inline void avx2_tile(const uint8_t* block, const float* col_scale, int64_t groups, const int8_t* xq, int64_t kp,
                      const float* xs, const float* xsum, const Output& y, int64_t first_row, int64_t first_col) {
  constexpr int64_t WB = F == kInt4Group ? 256 : 512;
  constexpr int64_t CB = WB + (F == kInt8PerChannel ? 0 : 64);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 facc[MR][2];
  for (int r = 0; r < MR; ++r) facc[r][0] = facc[r][1] = _mm256_setzero_ps();

  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* cell = block + g * CB;
    _mm_prefetch(reinterpret_cast<const char*>(cell + 4 * CB), _MM_HINT_T0);
    const int8_t* xg = xq + g * kGroup;
    __m256i iacc[MR][2];
    for (int r = 0; r < MR; ++r) iacc[r][0] = iacc[r][1] = _mm256_setzero_si256();
    if constexpr (F == kInt4Group) {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      for (int s = 0; s < 4; ++s) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cell + s * 64 + h * 32));
          lo[h] = _mm256_and_si256(raw, low4);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
        for (int r = 0; r < MR; ++r) {
          int32_t a, b;
          std::memcpy(&a, xg + r * kp + (2 * s) * 4, 4);
          std::memcpy(&b, xg + r * kp + (2 * s + 1) * 4, 4);
          const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
          for (int h = 0; h < 2; ++h) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa), _mm256_maddubs_epi16(hi[h], xb));
            iacc[r][h] = _mm256_add_epi32(iacc[r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    } else {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int s = 0; s < 8; ++s) {
        __m256i w[2], mag[2];
        for (int h = 0; h < 2; ++h) {
          w[h] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cell + s * 64 + h * 32)), flip);  // code - 128
          mag[h] = _mm256_sign_epi8(w[h], w[h]);  // |w| as unsigned bytes (-128 reads as 128)
        }
        for (int r = 0; r < MR; ++r) {
          int32_t a;
          std::memcpy(&a, xg + r * kp + s * 4, 4);
          const __m256i xa = _mm256_set1_epi32(a);
          for (int h = 0; h < 2; ++h) {
            const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(xa, w[h]));
            iacc[r][h] = _mm256_add_epi32(iacc[r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    if constexpr (F == kInt8PerChannel) {  // w = s * (code - 128): the signed dot is all of it
      for (int r = 0; r < MR; ++r) {
        const __m256 sx = _mm256_set1_ps(xs[r * groups + g]);
        for (int h = 0; h < 2; ++h) facc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][h]), sx, facc[r][h]);
      }
    } else {
      __m256 d[2], m[2];
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cell + WB + h * 16)));
        m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cell + WB + 32 + h * 16)));
        // w = d * code + m; the dot was taken with code - 128 for int8: d * 128 * sum(xq) goes to m's term.
        if constexpr (F == kInt8Group) m[h] = _mm256_fmadd_ps(d[h], _mm256_set1_ps(128.f), m[h]);
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 sx = _mm256_set1_ps(xs[r * groups + g]);
        const __m256 sxs = _mm256_set1_ps(xsum[r * groups + g]);
        for (int h = 0; h < 2; ++h) {
          facc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][h]), _mm256_mul_ps(d[h], sx), facc[r][h]);
          facc[r][h] = _mm256_fmadd_ps(m[h], sxs, facc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256 out = facc[r][h];
      if constexpr (F == kInt8PerChannel) out = _mm256_mul_ps(_mm256_loadu_ps(col_scale + first_col + h * 8), out);
      alignas(32) float v[8];
      _mm256_store_ps(v, out);
      for (int c = 0; c < 8; ++c) y.store(first_row + r, first_col + h * 8 + c, v[c]);
    }
  }
}

template <int64_t F>
void gemm_avx2(const uint8_t* w, const float* cs, int64_t groups, int64_t nblocks, const int8_t* xq, const float* xs,
               const float* xsum, int64_t rows, int64_t kp, const Output& y) {
  constexpr int64_t CB = (F == kInt4Group ? 256 : 512) + (F == kInt8PerChannel ? 0 : 64);
  const int64_t stride = groups * CB;  // bytes per column block
  // A column block's cells stay in L1/L2 while pairs of rows pass over them (16 ymm registers:
  // two rows' int32 and fp32 accumulators, the weights and the constants).
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* block = w + b * stride;
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2)
        avx2_tile<2, F>(block, cs, groups, xq + r * kp, kp, xs + r * groups, xsum + r * groups, y, r, b * kCols);
      if (r < rows)
        avx2_tile<1, F>(block, cs, groups, xq + r * kp, kp, xs + r * groups, xsum + r * groups, y, r, b * kCols);
    }
  });
}
#endif

#if PDSERVE_VNNI
// ---------------------------------------------------------------------------------------------
// The AVX512-VNNI path: a tile of MR rows x NB column blocks kept in registers; each weight
// register is loaded once and used by all MR rows.
template <int MR, int NB, int64_t F>
inline void gemm_tile(const uint8_t* w, int64_t block_stride, const float* col_scale, int64_t groups,
                      const int8_t* xq, int64_t kp, const float* xs, const float* xsum, const Output& y,
                      int64_t first_row, int64_t first_col) {
  constexpr int64_t WB = F == kInt4Group ? 256 : 512;
  constexpr int64_t CB = WB + (F == kInt8PerChannel ? 0 : 64);
  __m512 facc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) facc[r][j] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);

  for (int64_t g = 0; g < groups; ++g) {
    __m512i iacc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) iacc[r][j] = _mm512_setzero_si512();
    const uint8_t* cell[NB];
    for (int j = 0; j < NB; ++j) {
      cell[j] = w + j * block_stride + g * CB;
      // Into L2: an L1 prefetch would hold one of L1's few miss slots until its line lands.
#pragma GCC unroll 8
      for (int64_t line = 0; line < CB; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(cell[j] + 8 * CB + line), _MM_HINT_T1);
    }
    const int8_t* xg = xq + g * kGroup;
    if constexpr (F == kInt4Group) {
      for (int s = 0; s < 4; ++s) {
        __m512i lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          const __m512i raw = _mm512_loadu_si512(cell[j] + s * 64);
          lo[j] = _mm512_and_si512(raw, low4);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        for (int r = 0; r < MR; ++r) {
          int32_t a, b;
          std::memcpy(&a, xg + r * kp + (2 * s) * 4, 4);
          std::memcpy(&b, xg + r * kp + (2 * s + 1) * 4, 4);
          const __m512i xa = _mm512_set1_epi32(a), xb = _mm512_set1_epi32(b);
          for (int j = 0; j < NB; ++j) {
            iacc[r][j] = _mm512_dpbusd_epi32(iacc[r][j], lo[j], xa);
            iacc[r][j] = _mm512_dpbusd_epi32(iacc[r][j], hi[j], xb);
          }
        }
      }
    } else {
      for (int s = 0; s < 8; ++s) {
        __m512i wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(cell[j] + s * 64);
        for (int r = 0; r < MR; ++r) {
          int32_t a;
          std::memcpy(&a, xg + r * kp + s * 4, 4);
          const __m512i xa = _mm512_set1_epi32(a);
          for (int j = 0; j < NB; ++j) iacc[r][j] = _mm512_dpbusd_epi32(iacc[r][j], wv[j], xa);
        }
      }
    }
    if constexpr (F == kInt8PerChannel) {
      for (int r = 0; r < MR; ++r) {
        const __m512 sx = _mm512_set1_ps(xs[r * groups + g]);
        for (int j = 0; j < NB; ++j) facc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][j]), sx, facc[r][j]);
      }
    } else {
      __m512 d[NB], m[NB];
      for (int j = 0; j < NB; ++j) {
        d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cell[j] + WB)));
        m[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cell[j] + WB + 32)));
      }
      for (int r = 0; r < MR; ++r) {
        const __m512 sx = _mm512_set1_ps(xs[r * groups + g]);
        const __m512 sxs = _mm512_set1_ps(xsum[r * groups + g]);
        for (int j = 0; j < NB; ++j) {
          facc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][j]), _mm512_mul_ps(d[j], sx), facc[r][j]);
          facc[r][j] = _mm512_fmadd_ps(m[j], sxs, facc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    float corr = 0.f;
    if constexpr (F == kInt8PerChannel) {
      for (int64_t g = 0; g < groups; ++g) corr += xsum[r * groups + g];
    }
    for (int j = 0; j < NB; ++j) {
      __m512 out = facc[r][j];
      if constexpr (F == kInt8PerChannel) {
        const __m512 cs = _mm512_loadu_ps(col_scale + first_col + j * kCols);
        out = _mm512_mul_ps(cs, _mm512_sub_ps(out, _mm512_set1_ps(128.f * corr)));
      }
      store16(y, first_row + r, first_col + j * kCols, out);
    }
  }
}

template <int NB, int64_t F>
void tile_rows(const uint8_t* w, int64_t stride, const float* cs, int64_t groups, const int8_t* xq, const float* xs,
               const float* xsum, int64_t rows, int64_t kp, const Output& y, int64_t col) {
  constexpr int MR = NB >= 4 ? 2 : 4;  // 32 vector registers: MR x NB int32 + MR x NB fp32 accumulators
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) {
    gemm_tile<MR, NB, F>(w, stride, cs, groups, xq + r * kp, kp, xs + r * groups, xsum + r * groups, y, r, col);
  }
  const int64_t left = rows - r;
  const int8_t* q = xq + r * kp;
  const float *s = xs + r * groups, *ss = xsum + r * groups;
  if constexpr (MR > 3) {
    if (left == 3) gemm_tile<3, NB, F>(w, stride, cs, groups, q, kp, s, ss, y, r, col);
  }
  if constexpr (MR > 2) {
    if (left == 2) gemm_tile<2, NB, F>(w, stride, cs, groups, q, kp, s, ss, y, r, col);
  }
  if (left == 1) gemm_tile<1, NB, F>(w, stride, cs, groups, q, kp, s, ss, y, r, col);
}

template <int NB, int64_t F>
void gemm_vnni_nb(const uint8_t* w, const float* cs, int64_t groups, int64_t nblocks, const int8_t* xq,
                  const float* xs, const float* xsum, int64_t rows, int64_t kp, const Output& y) {
  constexpr int64_t CB = (F == kInt4Group ? 256 : 512) + (F == kInt8PerChannel ? 0 : 64);
  const int64_t stride = groups * CB;  // bytes per column block
  const int64_t tasks = (nblocks + NB - 1) / NB;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t * NB;
      if (b + NB <= nblocks) {
        tile_rows<NB, F>(w + b * stride, stride, cs, groups, xq, xs, xsum, rows, kp, y, b * kCols);
      } else {
        for (int64_t bb = b; bb < nblocks; ++bb)
          tile_rows<1, F>(w + bb * stride, stride, cs, groups, xq, xs, xsum, rows, kp, y, bb * kCols);
      }
    }
  });
}

template <int64_t F>
void gemm_vnni(const uint8_t* w, const float* cs, int64_t groups, int64_t nblocks, const int8_t* xq,
               const float* xs, const float* xsum, int64_t rows, int64_t kp, const Output& y) {
  // Few rows (decode): four column blocks per tile, for four independent dependency chains.
  // More rows: tiles of 4 rows x 2 blocks, each weight register reused by 4 rows.
  if (rows <= 2) gemm_vnni_nb<4, F>(w, cs, groups, nblocks, xq, xs, xsum, rows, kp, y);
  else gemm_vnni_nb<2, F>(w, cs, groups, nblocks, xq, xs, xsum, rows, kp, y);
}
#endif

}  // namespace

// Packs quantized weights into the kernel's layout.
//   q:       [N, K] uint8 codes (int8 formats: q + 128; int4: 0..15), N % 16 == 0, K % 32 == 0
//   d, m:    [N, K/32] float scales and offsets (group-wise formats; ignored per-channel)
torch::Tensor pack_weights(torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t format) {
  check_format(format);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8, "q must be a 2-D uint8 tensor");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kGroup == 0, "pack_weights needs N % 16 == 0 and K % 32 == 0");
  const int64_t groups = k / kGroup, nblocks = n / kCols, cb = cell_bytes(format), wb = weight_bytes(format);
  auto qc = q.contiguous();
  auto dc = d.to(torch::kFloat32).contiguous(), mc = m.to(torch::kFloat32).contiguous();
  if (format != kInt8PerChannel) {
    TORCH_CHECK(dc.size(0) == n && dc.size(1) == groups && mc.sizes() == dc.sizes(), "d and m must be [N, K/32]");
  }
  auto out = torch::zeros({nblocks * groups * cb}, torch::kUInt8);
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint8_t* src = qc.data_ptr<uint8_t>();
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* cell = o + (b * groups + g) * cb;
      for (int c = 0; c < kCols; ++c) {
        const int64_t row = b * kCols + c;
        for (int kk = 0; kk < kGroup; ++kk) {
          const uint8_t v = src[row * k + g * kGroup + kk];
          const int step = kk / 4, i = kk % 4;
          if (format == kInt4Group) {
            uint8_t& byte = cell[(step / 2) * 64 + c * 4 + i];
            byte |= (step % 2) ? static_cast<uint8_t>((v & 0x0F) << 4) : static_cast<uint8_t>(v & 0x0F);
          } else {
            cell[step * 64 + c * 4 + i] = v;
          }
        }
        if (format != kInt8PerChannel) {
          uint16_t* dm = reinterpret_cast<uint16_t*>(cell + wb);
          dm[c] = float_to_half(dc.data_ptr<float>()[row * groups + g]);
          dm[kCols + c] = float_to_half(mc.data_ptr<float>()[row * groups + g]);
        }
      }
    }
  }
  return out;
}

// y = x @ W^T + bias for packed W ([N, K] logically); x: [M, K] float32 or bfloat16. Returns
// [M, N] in x's dtype, or float32 with `float_out` (logits).
std::vector<int64_t> quant_paths() {
  std::vector<int64_t> paths{kPortable};
  if (PDSERVE_AVX2) paths.push_back(kAvx2);
  if (PDSERVE_VNNI) paths.push_back(kVnni);
  return paths;
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor col_scale, torch::Tensor bias,
                           int64_t n, int64_t k, int64_t format, int64_t path, bool float_out) {
  static const std::vector<int64_t> paths = quant_paths();  // once: this runs for every linear of every step
  if (path == kBest) path = paths.back();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "quant_linear path ", path,
              " is not compiled in here");
  check_format(format);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed weights must be contiguous uint8");
  TORCH_CHECK(n % kCols == 0 && k % kGroup == 0, "N % 16 and K % 32 must be 0");
  const int64_t rows = x.size(0), groups = k / kGroup, nblocks = n / kCols;
  TORCH_CHECK(packed.numel() == nblocks * groups * cell_bytes(format), "packed weights do not match N, K and format");
  if (format == kInt8PerChannel) {
    TORCH_CHECK(col_scale.scalar_type() == torch::kFloat32 && col_scale.numel() == n && col_scale.is_contiguous(),
                "col_scale must be a contiguous float32 [N]");
  }
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 && bias.numel() == n && bias.is_contiguous()),
              "bias must be empty or a contiguous float32 [N]");
  auto xc = x.contiguous();
  auto xq = torch::empty({rows, k}, torch::kInt8);
  auto xs = torch::empty({rows, groups}, torch::kFloat32);
  auto xsum = torch::empty({rows, groups}, torch::kFloat32);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "quantize_rows", [&] {
    quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), rows, k, k, xq.data_ptr<int8_t>(), xs.data_ptr<float>(),
                            xsum.data_ptr<float>());
  });
  const bool bf16 = !float_out && xc.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || float_out || xc.scalar_type() == torch::kFloat32, "x must be float32 or bfloat16");
  auto y = torch::empty({rows, n}, bf16 ? torch::kBFloat16 : torch::kFloat32);
  const Output out{y.data_ptr(), n, bf16, bias.numel() ? bias.data_ptr<float>() : nullptr};
  const float* cs = format == kInt8PerChannel ? col_scale.data_ptr<float>() : nullptr;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* q = xq.data_ptr<int8_t>();
  const float *s = xs.data_ptr<float>(), *ss = xsum.data_ptr<float>();
#if PDSERVE_VNNI
  if (path == kVnni) {
    if (format == kInt4Group) gemm_vnni<kInt4Group>(w, cs, groups, nblocks, q, s, ss, rows, k, out);
    else if (format == kInt8Group) gemm_vnni<kInt8Group>(w, cs, groups, nblocks, q, s, ss, rows, k, out);
    else gemm_vnni<kInt8PerChannel>(w, cs, groups, nblocks, q, s, ss, rows, k, out);
    return y;
  }
#endif
#if PDSERVE_AVX2
  if (path == kAvx2) {
    if (format == kInt4Group) gemm_avx2<kInt4Group>(w, cs, groups, nblocks, q, s, ss, rows, k, out);
    else if (format == kInt8Group) gemm_avx2<kInt8Group>(w, cs, groups, nblocks, q, s, ss, rows, k, out);
    else gemm_avx2<kInt8PerChannel>(w, cs, groups, nblocks, q, s, ss, rows, k, out);
    return y;
  }
#endif
  gemm_portable(w, cs, format, groups, nblocks, q, s, ss, rows, k, out);
  return y;
}
