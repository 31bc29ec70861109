// y = x W^T for a bf16 weight W [N, K] and a few input rows x [M, K] (M <= 8), in fp32. fp32 rows
// are rounded to bf16 first: the products are bf16 x bf16 (the AVX2 variant multiplies them in fp32).
//
// Why: decoding a batch of a few sequences, or verifying k drafts, multiplies a handful of rows by
// every weight. That is bound by reading the weights, but aten's GEMM for 2-8 rows streams them at
// ~20 GB/s on a 2-core Zen 4, under half the ~50 GB/s that the one-row reduction reaches
// (`python benchmarks/linear_kernels.py --rows 2,4,5,8`). Here each weight vector is loaded once and
// multiplied into all M rows in registers (AVX512-BF16 `vdpbf16ps`: 32 bf16 products summed in
// pairs into 16 fp32 lanes), so the weights are read once whatever M.
//
// Tiling: a tile is R = 16 / M output rows times the M input rows: at most 16 fp32 accumulator
// vectors, summed lane-wise at the end by one transpose-and-add tree into a vector of the tile's
// dot products. K must be a multiple of 32 (the Python side checks and otherwise uses F.linear).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "linear_few_rows.h"

namespace {

inline __m512bh load_bf16x32(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
}

// v[i] = sum of the 16 lanes of a[i], for i in 0..15.
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  // Per 128-bit lane, b[i] holds partial sums of (a[2i], a[2i+1], a[2i], a[2i+1]).
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Per 128-bit lane j, c[i] holds lane j's sums of a[4i..4i+3]; add the four lanes.
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// Output rows [n0, n1) (a multiple of R apart), R at a time, for the M input rows; y is [M, N] fp32.
template <int M, int R>
void tiles(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  static_assert(M * R <= 16, "16 accumulators at most");
  alignas(64) float sums[16];
  for (int64_t n = n0; n < n1; n += R) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xs[M];
      for (int m = 0; m < M; ++m) xs[m] = load_bf16x32(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = load_bf16x32(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], wv, xs[m]);
      }
    }
    _mm512_store_ps(sums, reduce16(acc));
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < M; ++m) y[m * N + n + r] = sums[r * M + m];
    }
  }
}

struct Avx512 {
  using Input = at::BFloat16;  // fp32 rows are rounded to bf16: the products are bf16 x bf16
  static at::Tensor input(const at::Tensor& x) { return x.to(at::kBFloat16).contiguous(); }
  template <int M>
  static constexpr int rows_per_tile = 16 / M;  // output rows per tile: M * R of the 16 accumulators
  template <int M, int R>
  static void tiles(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N,
                    int64_t K) {
    ::tiles<M, R>(x, w, y, n0, n1, N, K);
  }
};

}  // namespace

// The schema is defined on the Python side (genfast/nn.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("linear_few_rows", &genfast_few_rows::linear_few_rows<Avx512>); }
