// bf16 linear layers for few rows (decode): y = x W^T with W packed for AVX512-BF16.
//
// oneDNN's bf16 GEMM is excellent for many rows (prefill) but streams a weight matrix at a
// fraction of the memory bandwidth when x has one or a few rows, which is what a decode step
// is. This kernel stores W column-interleaved like the quantized kernel (blocks of 16 columns,
// K in steps of 2): one 64-byte load holds 2 consecutive k of 16 columns, and `vdpbf16ps`
// multiplies it by a broadcast pair of x values, accumulating 16 columns in fp32. A tile of up
// to 4 rows x 2 column blocks reuses every weight register for all its rows.
#include "linear_output.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PDSERVE_DENSE_BF16 1
#else
#define PDSERVE_DENSE_BF16 0
#endif

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kStep = 2;  // k values per 32-bit lane (one bf16 pair)

#if PDSERVE_DENSE_BF16
template <int MR, int NB>
inline void tile(const uint16_t* w, int64_t block_stride, int64_t k, const uint16_t* x, const Output& y,
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

template <int NB>
void rows_of(const uint16_t* w, int64_t stride, int64_t k, const uint16_t* x, int64_t rows, const Output& y,
             int64_t col) {
  constexpr int MR = NB >= 4 ? 2 : 4;
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) tile<MR, NB>(w, stride, k, x + r * k, y, r, col);
  const int64_t left = rows - r;
  if constexpr (MR > 3) {
    if (left == 3) tile<3, NB>(w, stride, k, x + r * k, y, r, col);
  }
  if constexpr (MR > 2) {
    if (left == 2) tile<2, NB>(w, stride, k, x + r * k, y, r, col);
  }
  if (left == 1) tile<1, NB>(w, stride, k, x + r * k, y, r, col);
}

template <int NB>
void gemm(const uint16_t* w, int64_t nblocks, int64_t k, const uint16_t* x, int64_t rows, const Output& y) {
  const int64_t stride = k * kCols;  // elements per column block
  const int64_t tasks = (nblocks + NB - 1) / NB;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t * NB;
      if (b + NB <= nblocks) {
        rows_of<NB>(w + b * stride, stride, k, x, rows, y, b * kCols);
      } else {
        for (int64_t bb = b; bb < nblocks; ++bb) rows_of<1>(w + bb * stride, stride, k, x, rows, y, bb * kCols);
      }
    }
  });
}
#endif

}  // namespace

bool has_dense_bf16() { return PDSERVE_DENSE_BF16; }

// W [N, K] bf16 (N % 16 == 0, K % 2 == 0) -> the kernel's layout: per block of 16 columns, for
// each pair of k, the 16 columns' two values.
torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_bf16: a 2-D bfloat16 weight");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kStep == 0, "pack_bf16 needs N % 16 == 0 and K even");
  // [N/16, 16, K/2, 2] -> [N/16, K/2, 16, 2]
  return w.contiguous().view({n / kCols, kCols, k / kStep, kStep}).permute({0, 2, 1, 3}).contiguous().view({n, k});
}

torch::Tensor dense_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t n, bool float_out) {
  TORCH_CHECK(PDSERVE_DENSE_BF16, "dense_linear needs AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "dense_linear: x must be a 2-D bfloat16");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.numel() == n * k,
              "dense_linear: packed weights do not match N and K");
  TORCH_CHECK(n % kCols == 0 && k % kStep == 0, "dense_linear: N % 16 and K % 2 must be 0");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 && bias.numel() == n && bias.is_contiguous()),
              "bias must be empty or a contiguous float32 [N]");
  auto xc = x.contiguous();
  auto y = torch::empty({rows, n}, float_out ? torch::kFloat32 : torch::kBFloat16);
#if PDSERVE_DENSE_BF16
  const Output out{y.data_ptr(), n, !float_out, bias.numel() ? bias.data_ptr<float>() : nullptr};
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  if (rows <= 2) gemm<4>(w, n / kCols, k, xp, rows, out);
  else gemm<2>(w, n / kCols, k, xp, rows, out);
#endif
  return y;
}
