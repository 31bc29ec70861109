// y = x W^T for a bf16 weight W [N, K] and input rows x [M, K], in fp32, fastest for a few rows. fp32 rows
// are rounded to bf16 first: the products are bf16 x bf16 (the AVX2 variant multiplies them in fp32).
//
// Why: decoding a batch of a few sequences, or verifying k drafts, multiplies a handful of rows by
// every weight. That is bound by reading the weights, but aten's GEMM for 2-8 rows streams them at
// under half the rate that the one-row reduction reaches (`python benchmarks/linear_kernels.py
// --rows 2,4,5,8`). Here each weight vector is loaded once and
// multiplied into all M rows in registers (AVX512-BF16 `vdpbf16ps`: 32 bf16 products summed in
// pairs into 16 fp32 lanes), so the weights are read once whatever M.
//
// Each thread walks its output rows one by one, reading one contiguous run of the weight with
// software prefetch ahead, as the AVX2 variant does: tiles of 16 output rows side by side (16
// streams per thread, one transpose-and-add tree for their sums) were slower, for one input row
// and for four (`benchmarks/linear_kernels.py --rows 1,4`). K must be a multiple of 32 (the
// Python side checks and otherwise uses F.linear).

#include <ATen/core/Tensor.h>
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

// Output rows [n0, n1), one at a time, for the M input rows. Each row's sum runs in U chains of
// 32-column chunks (chunk i in chain i mod U; a tail past the last whole U chunks in chain 0),
// added in order: U is the same for every M, so a row's result does not depend on M (see
// linear_few_rows.h), and 4 chains keep one row's `vdpbf16ps` latency hidden.
using genfast_few_rows::kPrefetchBytes;
constexpr int U = 4;

template <int M>
void rows_one_by_one(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N,
                     int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 acc[M][U];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    }
    auto step = [&](int64_t k, int u) {
      const __m512bh wv = load_bf16x32(row + k);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, load_bf16x32(x + m * K + k));
    };
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {  // one 64-byte line per chunk
        _mm_prefetch(reinterpret_cast<const char*>(row + k + 32 * u) + kPrefetchBytes, _MM_HINT_T0);
        step(k + 32 * u, u);
      }
    }
    for (; k < K; k += 32) step(k, 0);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512 total = acc[m][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) total = _mm512_add_ps(total, acc[m][u]);
      y[m * N + n] = _mm512_reduce_add_ps(total);
    }
  }
}

struct Avx512 {
  using Input = at::BFloat16;  // fp32 rows are rounded to bf16: the products are bf16 x bf16
  static constexpr int kGroupRows = 4;  // 4 x U accumulators of the 32 registers
  static at::Tensor input(const at::Tensor& x) {
    // bf16 rows as they come: no dispatched `to` (~1 µs of a ~2 µs call, 121 calls a step).
    return x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();
  }
  template <int M>
  static void rows(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N,
                   int64_t K) {
    rows_one_by_one<M>(x, w, y, n0, n1, N, K);
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("linear_few_rows", &genfast_few_rows::linear_few_rows<Avx512>); }
