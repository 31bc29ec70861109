// Group normalization of a channels-last (NHWC) tensor, fp32 or bf16, in two passes over memory:
// the AVX2 loops (8 channels per vector) of avx512.cpp, which says why the kernel
// exists; group_norm.h has the host side and the math.
//
// Compiled with -mavx2 -mfma -mf16c; the registry (genfast/kernels/native.py) loads it only on
// CPUs with them.

#include <torch/library.h>

#include <immintrin.h>

#include "../common/avx2_vectors.h"
#include "group_norm.h"

namespace {

using namespace genfast_avx2;

constexpr int64_t kChannelBlock = 32;  // 4 vectors: 8 accumulators and 4 shifts in registers

// Per-channel shifted sums over pixels [p0, p1) of V vectors of channels starting at c0.
template <int V, typename T>
void block_sums(const T* x, int64_t c_total, int64_t c0, int64_t p0, int64_t p1, const float* shift, float* sum,
                float* sq) {
  __m256 s[V], q[V], k[V];
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    s[v] = q[v] = _mm256_setzero_ps();
    k[v] = _mm256_loadu_ps(shift + c0 + 8 * v);
  }
  for (int64_t p = p0; p < p1; ++p) {
    const T* row = x + p * c_total + c0;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m256 d = _mm256_sub_ps(load8(row + 8 * v), k[v]);
      s[v] = _mm256_add_ps(s[v], d);
      q[v] = _mm256_fmadd_ps(d, d, q[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    _mm256_storeu_ps(sum + c0 + 8 * v, s[v]);
    _mm256_storeu_ps(sq + c0 + 8 * v, q[v]);
  }
}

struct Avx2 {
  template <typename T>
  static void chunk_sums(const T* x, int64_t c_total, int64_t p0, int64_t p1, const float* shift, float* sum,
                         float* sq) {
    int64_t c0 = 0;
    for (; c0 + kChannelBlock <= c_total; c0 += kChannelBlock) block_sums<4>(x, c_total, c0, p0, p1, shift, sum, sq);
    for (; c0 < c_total; c0 += 8) block_sums<1>(x, c_total, c0, p0, p1, shift, sum, sq);
  }
  template <typename T>
  static void scale_shift(const T* src, T* dst, int64_t c_total, const float* scale, const float* offset) {
    for (int64_t c = 0; c < c_total; c += 8)
      store8(dst + c, _mm256_fmadd_ps(load8(src + c), _mm256_loadu_ps(scale + c), _mm256_loadu_ps(offset + c)));
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("group_norm_nhwc", &genfast_group_norm::group_norm_nhwc<Avx2>); }
