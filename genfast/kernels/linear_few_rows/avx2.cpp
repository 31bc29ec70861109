// AVX2 + FMA variant of avx512.cpp: y = x W^T for a bf16 weight W [N, K] and input rows x [M, K]
// (fp32 or bf16), in fp32.
//
// Why: without AVX512-BF16 there is no bf16 dot-product instruction, and both aten's bf16 GEMM
// and inductor's one-row reduction convert and multiply element by element, streaming the weights
// well below the rate the memory allows. A bf16 weight widens to fp32 exactly (a 16-bit shift), so here each 16-weight vector is
// loaded once, widened, and multiplied into all M rows (fp32 FMA) while the next ones stream in:
// the weights are read once at close to the memory's speed, whatever M.
//
// Each thread walks its output rows one by one, so it reads one contiguous run of the weight, with
// software prefetch 8 KB ahead: faster than 8 rows side by side without prefetch, for one input
// row and for four (`benchmarks/linear_kernels.py --rows 1,4` compares them).
// K must be a multiple of 32 (the Python side checks and otherwise uses F.linear).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../common/avx2_vectors.h"
#include "linear_few_rows.h"

namespace {

using namespace genfast_avx2;

// The input rows as the kernel reads them: in each 16-column chunk, the 8 even columns, then the 8
// odd ones. A 32-byte load of 16 bf16 weights holds the even ones in the low halves of its 32-bit
// lanes and the odd ones in the high halves, so a shift and a mask widen both to fp32 in place
// (no cross-lane shuffle, which has one port on most x86 cores); each meets its half of x.
// Read in the rows' own dtype (fp32 or bf16): no conversion op dispatched before the kernel.
template <typename T>
void arrange_rows(const T* src, float* dst, int64_t numel) {
  for (int64_t chunk = 0; chunk < numel; chunk += 16) {
    for (int j = 0; j < 8; ++j) {
      dst[chunk + j] = static_cast<float>(src[chunk + 2 * j]);
      dst[chunk + 8 + j] = static_cast<float>(src[chunk + 2 * j + 1]);
    }
  }
}

at::Tensor arrange(const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kFloat));
  if (xc.scalar_type() == at::kFloat) {
    arrange_rows(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel());
  } else {
    arrange_rows(xc.data_ptr<at::BFloat16>(), out.data_ptr<float>(), xc.numel());
  }
  return out;
}

// Output rows [n0, n1), one at a time, for the M arranged input rows. One output row reads one
// contiguous weight row, so each thread streams a single run of memory (reading R rows side by
// side, R streams of K * 2 bytes, was measured slower). Each row's sum runs in U chains of 16-column
// chunks (chunk i in chain i mod U; a tail past the last whole U chunks in chain 0), even and odd
// columns apart, added in one order: the same for every M, so a row's result does not depend on M
// (see linear_few_rows.h); 4 FMA chains per row, 12 for a group of 3 rows.
using genfast_few_rows::kPrefetchBytes;
constexpr int U = 2;

template <int M>
void rows_one_by_one(const float* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* row = w + n * K;
    __m256 acc[M][U][2];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        acc[m][u][0] = _mm256_setzero_ps();
        acc[m][u][1] = _mm256_setzero_ps();
      }
    }
    auto step = [&](int64_t k, int u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        acc[m][u][0] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xm), acc[m][u][0]);
        acc[m][u][1] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xm + 8), acc[m][u][1]);
      }
    };
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U) {
      for (int u = 0; u < U; u += 2) {  // one 64-byte line per two chunks
        _mm_prefetch(reinterpret_cast<const char*>(row + k + 16 * u) + kPrefetchBytes, _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) step(k + 16 * u, u);
    }
    for (; k < K; k += 16) step(k, 0);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m256 total = _mm256_add_ps(acc[m][0][0], acc[m][0][1]);
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, _mm256_add_ps(acc[m][u][0], acc[m][u][1]));
      y[m * N + n] = hsum(total);
    }
  }
}

struct Avx2 {
  using Input = float;  // bf16 rows widen exactly
  static constexpr int kGroupRows = 3;  // 3 x U x 2 accumulators and the weight's two halves in 16 registers
  static at::Tensor input(const at::Tensor& x) { return arrange(x); }
  template <int M>
  static void rows(const float* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
    rows_one_by_one<M>(x, w, y, n0, n1, N, K);
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("linear_few_rows", &genfast_few_rows::linear_few_rows<Avx2>); }
