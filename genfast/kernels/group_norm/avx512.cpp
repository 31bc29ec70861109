// Group normalization of a channels-last (NHWC) tensor, fp32 or bf16, in two passes over memory:
// the AVX-512 loops (16 channels per vector). group_norm.h has the host side and the math.
//
// Why: a UNet/VAE decoder at 256x256 and 512x512 spends a large share of its time in GroupNorm,
// which inductor and ATen run on channels-last tensors several times slower than reading and
// writing the tensor once takes (`python benchmarks/diffusion_parts.py group-norm` times ATen,
// inductor and this kernel).
//
// Compiled with -mavx512f/bw; the registry (genfast/kernels/native.py) loads it only on CPUs
// with them.

#include <torch/library.h>

#include <immintrin.h>

#include "../common/avx512_vectors.h"
#include "group_norm.h"

namespace {

using namespace genfast_avx512;

constexpr int64_t kChannelBlock = 64;  // 4 vectors: 8 accumulators in registers

inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(at::BFloat16* dst, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// Per-channel shifted sums over pixels [p0, p1) of V vectors of channels starting at c0.
template <int V, typename T>
void block_sums(const T* x, int64_t c_total, int64_t c0, int64_t p0, int64_t p1, const float* shift, float* sum,
                float* sq) {
  __m512 s[V], q[V], k[V];
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    s[v] = q[v] = _mm512_setzero_ps();
    k[v] = _mm512_loadu_ps(shift + c0 + 16 * v);
  }
  for (int64_t p = p0; p < p1; ++p) {
    const T* row = x + p * c_total + c0;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m512 d = _mm512_sub_ps(load16(row + 16 * v), k[v]);
      s[v] = _mm512_add_ps(s[v], d);
      q[v] = _mm512_fmadd_ps(d, d, q[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    _mm512_storeu_ps(sum + c0 + 16 * v, s[v]);
    _mm512_storeu_ps(sq + c0 + 16 * v, q[v]);
  }
}

struct Avx512 {
  template <typename T>
  static void chunk_sums(const T* x, int64_t c_total, int64_t p0, int64_t p1, const float* shift, float* sum,
                         float* sq) {
    int64_t c0 = 0;
    for (; c0 + kChannelBlock <= c_total; c0 += kChannelBlock) block_sums<4>(x, c_total, c0, p0, p1, shift, sum, sq);
    for (; c0 < c_total; c0 += 16) block_sums<1>(x, c_total, c0, p0, p1, shift, sum, sq);
  }
  template <typename T>
  static void scale_shift(const T* src, T* dst, int64_t c_total, const float* scale, const float* offset) {
    for (int64_t c = 0; c < c_total; c += 16)
      store16(dst + c, _mm512_fmadd_ps(load16(src + c), _mm512_loadu_ps(scale + c), _mm512_loadu_ps(offset + c)));
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("group_norm_nhwc", &genfast_group_norm::group_norm_nhwc<Avx512>); }
