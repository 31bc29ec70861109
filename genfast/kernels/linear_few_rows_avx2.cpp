// AVX2 + FMA variant of linear_few_rows_avx512.cpp: y = x W^T for a bf16 weight W [N, K] and 1 to
// 8 input rows x [M, K] (fp32 or bf16), in fp32.
//
// Why: without AVX512-BF16 there is no bf16 dot-product instruction, and both aten's bf16 GEMM
// and inductor's one-row reduction convert and multiply element by element: on a 2-core Zen 3,
// compiled bf16 decode of SmolLM2 streamed its weights at ~9 GB/s of the ~24 GB/s the machine
// reads. A bf16 weight widens to fp32 exactly (a 16-bit shift), so here each 8-weight vector is
// loaded once, widened, and multiplied into all M rows (fp32 FMA) while the next ones stream in:
// the weights are read once at close to the memory's speed, whatever M.
//
// Tiling: R = 8 / M output rows (at least 1) times the M rows: at most 8 accumulators of 8 fp32
// lanes, summed horizontally once per output. The input rows are widened to fp32 once per call.
// K must be a multiple of 32 (the Python side checks and otherwise uses F.linear).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx2_vectors.h"
#include "linear_few_rows.h"

namespace {

using namespace genfast_avx2;

// Output rows [n0, n1) (a multiple of R apart), R at a time, for the M input rows (fp32, [M, K]).
template <int M, int R>
void tiles(const float* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  static_assert(M * R <= 8, "8 accumulators at most");
  for (int64_t n = n0; n < n1; n += R) {
    __m256 acc[M * R];
    for (int i = 0; i < M * R; ++i) acc[i] = _mm256_setzero_ps();
    const at::BFloat16* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = w + (n + r) * K;
    for (int64_t k = 0; k < K; k += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load8(rows[r] + k);
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r * M + m] = _mm256_fmadd_ps(wv[r], xv, acc[r * M + m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int m = 0; m < M; ++m) y[m * N + n + r] = hsum(acc[r * M + m]);
    }
  }
}

struct Avx2 {
  using Input = float;  // bf16 rows widen exactly
  template <int M>
  static constexpr int rows_per_tile = std::max(1, 8 / M);
  template <int M, int R>
  static void tiles(const float* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
    ::tiles<M, R>(x, w, y, n0, n1, N, K);
  }
};

}  // namespace

// The schema is defined on the Python side (genfast/nn.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("linear_few_rows", &genfast_few_rows::linear_few_rows<Avx2>); }
