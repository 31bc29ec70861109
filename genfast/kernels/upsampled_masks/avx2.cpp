// The automatic mask generator's per-mask statistics and column runs, from low-res logits
// upsampled on the fly: the AVX2 steps (8 columns per vector) of avx512.cpp, which says why the
// kernel exists; upsampled_masks.h has the host side and the method.
//
// Compiled with -mavx2 -mfma; the registry (genfast/kernels/native.py) loads it only on CPUs
// with them.

#include <torch/library.h>

#include <immintrin.h>

#include "upsampled_masks.h"

namespace {

struct Avx2 {
  static constexpr int kLanes = 8;
  using Vec = __m256;
  using Index = __m256i;
  static Index load_index(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec broadcast(float x) { return _mm256_set1_ps(x); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec gather(const float* base, Index i) { return _mm256_i32gather_ps(base, i, 4); }
  static Vec lerp(Vec a, Vec w0, Vec b, Vec w1) { return _mm256_fmadd_ps(a, w0, _mm256_mul_ps(b, w1)); }
  static uint32_t above(Vec v, Vec t) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ)));
  }
};

}  // namespace

// The schemas are defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("upsampled_mask_stats", &genfast_upsampled_masks::upsampled_mask_stats<Avx2>);
  m.impl("upsampled_mask_runs", &genfast_upsampled_masks::upsampled_mask_runs<Avx2>);
}
