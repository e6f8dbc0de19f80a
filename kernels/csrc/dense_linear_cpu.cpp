// Dense linear layers for few rows (decode): y = x W^T with W packed column-interleaved.
//
// oneDNN's and MKL's GEMMs are excellent for many rows (prefill) but stream a weight matrix at
// a fraction of the memory bandwidth when x has one or a few rows, which is what a decode step
// is (MKL's fp32 GEMV reads 11-14 GB/s on a 30 GB/s AMD CPU). This kernel stores W in blocks of
// columns, like the quantized kernel, so that one vector load holds one k step of a block's
// columns and an FMA multiplies it by a broadcast x value, accumulating the block's columns in
// fp32. A tile of several rows x 2 (or 1-2 rows x 4) column blocks reuses every weight register
// for all its rows, its accumulators filling the registers (every loop over them unrolled, so
// that GCC keeps them there: otherwise it stores them at every step, and halves the speed).
// Three kernels:
//   bf16 (AVX512-BF16): blocks of 16 columns, K in steps of 2; `vdpbf16ps` takes a pair of k.
//   fp32 (AVX2 + FMA):  blocks of 8 columns, K in steps of 1. On an AMD EPYC it beats MKL's
//                       GEMM at every row count measured (1-512), by 1.1-5x.
//   bf16 on AVX2 + FMA (no bf16 instructions): the fp32 kernel's tiles over bf16 weights, each
//                       widened to fp32 as it is loaded (exact), x widened once per call. Half
//                       the bytes of fp32 weights; torch's own bf16 GEMM runs below 1 GFLOP/s here.
#include "linear_output.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PDSERVE_DENSE_BF16 1
#else
#define PDSERVE_DENSE_BF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_DENSE_F32 1
#else
#define PDSERVE_DENSE_F32 0
#endif
// bf16 weights widened to fp32 where the CPU has no bf16 products.
#define PDSERVE_DENSE_BF16_WIDENED (PDSERVE_DENSE_F32 && !PDSERVE_DENSE_BF16)

namespace {

#if PDSERVE_DENSE_BF16
struct Bf16Tiles {
  using Elem = uint16_t;
  using XElem = uint16_t;
  static constexpr int64_t kCols = 16;
  static constexpr int64_t kStep = 2;  // k values per 32-bit lane (one bf16 pair)
  template <int NB>
  static constexpr int rows_per_tile() { return NB >= 4 ? 2 : 4; }  // of 32 zmm registers

  template <int MR, int NB>
  static void tile(const uint16_t* w, int64_t block_stride, int64_t k, const uint16_t* x, const Output& y,
                   int64_t first_row, int64_t first_col) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < k / kStep; ++s) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) {
        const uint16_t* p = w + j * block_stride + s * kCols * kStep;
        // Into L2: an L1 prefetch would hold one of L1's few miss slots until its line lands.
        _mm_prefetch(reinterpret_cast<const char*>(p + 16 * kCols * kStep), _MM_HINT_T1);
        wv[j] = _mm512_loadu_si512(p);
      }
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k + s * kStep, 4);
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], reinterpret_cast<__m512bh>(wv[j]), xb);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) store16(y, first_row + r, first_col + j * kCols, acc[r][j]);
  }
};
#endif

#if PDSERVE_DENSE_F32
// W fp32 (float) or bf16 bits (uint16_t, widened as loaded); x and the accumulators fp32.
template <typename W>
struct AvxTiles {
  using Elem = W;
  using XElem = float;
  static constexpr int64_t kCols = 8;
  static constexpr int64_t kStep = 1;
  template <int NB>
  static constexpr int rows_per_tile() { return NB >= 4 ? 2 : 6; }  // 6 x 2 accumulators of 16 ymm registers

  static inline __m256 load(const W* p) {
    if constexpr (std::is_same_v<W, float>) return _mm256_loadu_ps(p);
    else return widen_bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  template <int MR, int NB>
  static void tile(const W* w, int64_t block_stride, int64_t k, const float* x, const Output& y, int64_t first_row,
                   int64_t first_col) {
    __m256 acc[MR][NB];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < k; ++s) {
      __m256 wv[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const W* p = w + j * block_stride + s * kCols;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T1);  // 1 KB (32 fp32 k steps) ahead
        wv[j] = load(p);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * k + s);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xb, acc[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) store8(y, first_row + r, first_col + j * kCols, acc[r][j]);
  }
};
using F32Tiles = AvxTiles<float>;
using Bf16WidenedTiles = AvxTiles<uint16_t>;
#endif

#if PDSERVE_DENSE_BF16 || PDSERVE_DENSE_F32
// The rows left after the full tiles (fewer than M), as one tile of their count.
template <typename Tiles, int NB, int M>
inline void last_rows(const typename Tiles::Elem* w, int64_t stride, int64_t k, const typename Tiles::XElem* x,
                      int64_t left, const Output& y, int64_t row, int64_t col) {
  if constexpr (M > 0) {
    if (left == M) return Tiles::template tile<M, NB>(w, stride, k, x, y, row, col);
    last_rows<Tiles, NB, M - 1>(w, stride, k, x, left, y, row, col);
  }
}

template <typename Tiles, int NB>
void rows_of(const typename Tiles::Elem* w, int64_t stride, int64_t k, const typename Tiles::XElem* x, int64_t rows,
             const Output& y, int64_t col) {
  constexpr int MR = Tiles::template rows_per_tile<NB>();
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) Tiles::template tile<MR, NB>(w, stride, k, x + r * k, y, r, col);
  last_rows<Tiles, NB, MR - 1>(w, stride, k, x + r * k, rows - r, y, r, col);
}

template <typename Tiles>
void gemm(const typename Tiles::Elem* w, int64_t nblocks, int64_t k, const typename Tiles::XElem* x, int64_t rows,
          const Output& y) {
  const auto run = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    const int64_t stride = k * Tiles::kCols;  // elements per column block
    const int64_t tasks = (nblocks + NB - 1) / NB;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t * NB;
        if (b + NB <= nblocks) {
          rows_of<Tiles, NB>(w + b * stride, stride, k, x, rows, y, b * Tiles::kCols);
        } else {
          for (int64_t bb = b; bb < nblocks; ++bb) rows_of<Tiles, 1>(w + bb * stride, stride, k, x, rows, y, bb * Tiles::kCols);
        }
      }
    });
  };
  if (rows <= 2) run(std::integral_constant<int, 4>{});
  else run(std::integral_constant<int, 2>{});
}
#endif

// The element type's block width and k step (bf16 or fp32) for the kernel built here: bf16
// packs in pairs of k only for AVX512-BF16 products.
std::pair<int64_t, int64_t> layout_of(torch::ScalarType dtype) {
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat32, "dense_linear: bfloat16 or float32 weights");
  const bool pairs = dtype == torch::kBFloat16 && !PDSERVE_DENSE_BF16_WIDENED;
  return pairs ? std::pair<int64_t, int64_t>{16, 2} : std::pair<int64_t, int64_t>{8, 1};
}

}  // namespace

bool dense_bf16_widened() { return PDSERVE_DENSE_BF16_WIDENED; }

std::vector<std::string> dense_dtypes() {
  std::vector<std::string> dtypes;
  if (PDSERVE_DENSE_BF16 || PDSERVE_DENSE_BF16_WIDENED) dtypes.emplace_back("bfloat16");
  if (PDSERVE_DENSE_F32) dtypes.emplace_back("float32");
  return dtypes;
}

// W [N, K] (N a multiple of the block width, K of the k step) -> the kernel's layout: per block
// of columns, for each k step, the block's columns' values.
torch::Tensor pack_dense(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_dense: a 2-D weight");
  const auto [cols, step] = layout_of(w.scalar_type());
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % cols == 0 && k % step == 0, "pack_dense needs N % ", cols, " == 0 and K % ", step, " == 0");
  // [N/cols, cols, K/step, step] -> [N/cols, K/step, cols, step]
  return w.contiguous().view({n / cols, cols, k / step, step}).permute({0, 2, 1, 3}).contiguous().view({n, k});
}

// The inverse of pack_dense: the [N, K] weight as loaded.
torch::Tensor unpack_dense(torch::Tensor packed) {
  TORCH_CHECK(packed.dim() == 2, "unpack_dense: a 2-D packed weight");
  const auto [cols, step] = layout_of(packed.scalar_type());
  const int64_t n = packed.size(0), k = packed.size(1);
  TORCH_CHECK(n % cols == 0 && k % step == 0, "unpack_dense needs N % ", cols, " == 0 and K % ", step, " == 0");
  return packed.contiguous().view({n / cols, k / step, cols, step}).permute({0, 2, 1, 3}).contiguous().view({n, k});
}

torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t n, bool float_out) {
  const auto dtype = packed.scalar_type();
  const auto [cols, step] = layout_of(dtype);
  TORCH_CHECK(dtype == torch::kBFloat16 ? PDSERVE_DENSE_BF16 || PDSERVE_DENSE_BF16_WIDENED : PDSERVE_DENSE_F32,
              "dense_linear: no ",
              c10::toString(dtype), " kernel on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "dense_linear: x must be a 2-D ", c10::toString(dtype));
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == n * k, "dense_linear: packed weights do not match N and K");
  TORCH_CHECK(n % cols == 0 && k % step == 0, "dense_linear: N % ", cols, " and K % ", step, " must be 0");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 && bias.numel() == n && bias.is_contiguous()),
              "bias must be empty or a contiguous float32 [N]");
  auto xc = x.contiguous();
  const bool bf16_out = dtype == torch::kBFloat16 && !float_out;
  auto y = torch::empty({rows, n}, bf16_out ? torch::kBFloat16 : torch::kFloat32);
  const Output out{y.data_ptr(), n, bf16_out, bias.numel() ? bias.data_ptr<float>() : nullptr};
#if PDSERVE_DENSE_BF16
  if (dtype == torch::kBFloat16) {
    gemm<Bf16Tiles>(reinterpret_cast<const uint16_t*>(packed.data_ptr()), n / cols, k,
                    reinterpret_cast<const uint16_t*>(xc.data_ptr()), rows, out);
  }
#endif
#if PDSERVE_DENSE_F32
  if (dtype == torch::kFloat32) gemm<F32Tiles>(packed.data_ptr<float>(), n / cols, k, xc.data_ptr<float>(), rows, out);
#endif
#if PDSERVE_DENSE_BF16_WIDENED
  if (dtype == torch::kBFloat16) {
    const auto xf = xc.to(torch::kFloat32);  // widened once: rows x K, against the N x K weight
    gemm<Bf16WidenedTiles>(reinterpret_cast<const uint16_t*>(packed.data_ptr()), n / cols, k, xf.data_ptr<float>(),
                           rows, out);
  }
#endif
  (void)out;
  return y;
}
