// Attention over a KV cache (decode_attention.h) with 16-lane AVX-512 vectors.

#include <torch/library.h>

#include "../common/avx512_vectors.h"
#include "decode_attention.h"

namespace {

struct Avx512 {
  using Vec = __m512;
  static constexpr int W = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return genfast_avx512::load16(p); }
  static Vec load(const c10::BFloat16* p) { return genfast_avx512::load16(p); }
  static void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static float hsum(Vec x) { return _mm512_reduce_add_ps(x); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static float hmax(Vec x) { return _mm512_reduce_max_ps(x); }
  static Vec exp_nonpositive(Vec x) { return genfast_avx512::exp_nonpositive(x); }
  static Vec zero_where_neginf(Vec e, Vec s) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ), e);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("decode_attention", &genfast_decode_attention::decode_attention<Avx512>); }
