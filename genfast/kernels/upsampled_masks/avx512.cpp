// The automatic mask generator's per-mask statistics and column runs, from low-res logits
// upsampled on the fly: the AVX-512 steps (16 columns per vector). upsampled_masks.h has the
// host side and the method.
//
// Why: upsampling every candidate mask to the image's size and then thresholding, counting,
// boxing and run-length encoding it reads and writes several full-size arrays per mask; for a
// 32x32 grid that is thousands of megapixel masks an image, most of them dropped right after.
// Here only the low-res logits (L1/L2-resident) are read.
//
// Compiled with -mavx512f/bw; the registry (genfast/kernels/native.py) loads it only on CPUs
// with them.

#include <torch/library.h>

#include <immintrin.h>

#include "upsampled_masks.h"

namespace {

struct Avx512 {
  static constexpr int kLanes = 16;
  using Vec = __m512;
  using Index = __m512i;
  static Index load_index(const int32_t* p) { return _mm512_loadu_si512(p); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(float x) { return _mm512_set1_ps(x); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec gather(const float* base, Index i) { return _mm512_i32gather_ps(i, base, 4); }
  static Vec lerp(Vec a, Vec w0, Vec b, Vec w1) { return _mm512_fmadd_ps(a, w0, _mm512_mul_ps(b, w1)); }
  static uint32_t above(Vec v, Vec t) { return _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ); }
};

}  // namespace

// The schemas are defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("upsampled_mask_stats", &genfast_upsampled_masks::upsampled_mask_stats<Avx512>);
  m.impl("upsampled_mask_runs", &genfast_upsampled_masks::upsampled_mask_runs<Avx512>);
}
