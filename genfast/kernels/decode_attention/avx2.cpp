// Attention over a KV cache (decode_attention.h) with 8-lane AVX2 + FMA vectors.

#include <torch/library.h>

#include "../common/avx2_vectors.h"
#include "decode_attention.h"

namespace {

struct Avx2 {
  using Vec = __m256;
  static constexpr int W = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return genfast_avx2::load8(p); }
  static Vec load(const c10::BFloat16* p) { return genfast_avx2::load8(p); }
  static void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static float hsum(Vec x) { return genfast_avx2::hsum(x); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static float hmax(Vec x) { return genfast_avx2::hmax(x); }
  static Vec exp_nonpositive(Vec x) { return genfast_avx2::exp_nonpositive(x); }
  static Vec zero_where_neginf(Vec e, Vec s) {
    return _mm256_and_ps(_mm256_cmp_ps(s, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ), e);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("decode_attention", &genfast_decode_attention::decode_attention<Avx2>); }
