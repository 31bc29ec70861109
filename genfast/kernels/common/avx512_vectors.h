// Vector helpers the AVX-512 variants (*/avx512.cpp) share: bf16 widening, exp and GELU. Include only
// from files compiled with -mavx512f -mavx512bw.

#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

namespace genfast_avx512 {

// 16 values as fp32 (bf16 widened exactly: its bits are the top half of an fp32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// acc + the sums of four u8 x s8 products per lane (vpdpbusd; files compiled with -mavx512vnni).
// In inline assembly: GCC 12's _mm512_dpbusd_epi32 copied every accumulator of a register tile
// to a fresh register, and spilled some, on each use (it does not tie the destination operand).
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// exp(x) for x <= 0: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor
// polynomial (relative error < 2e-7).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// GELU(x) = x/2 (1 + erf(x / sqrt 2)), the exact (erf) form, PyTorch's default. For z = |x| / sqrt 2,
// 1 - erf(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2) with t = 1 / (1 + p z)
// (Abramowitz and Stegun 7.1.26: absolute error <= 1.5e-7); then GELU(x) = x - x/2 (1 - erf(z))
// for x >= 0 and x/2 (1 - erf(z)) for x < 0, so the small term is computed directly, never as
// the difference of two nearly equal values. 1 / (1 + p z): rcp14 and one Newton step.
inline __m512 gelu(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.707106781f));
  const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), z, one);
  __m512 t = _mm512_rcp14_ps(d);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));
  __m512 poly = _mm512_set1_ps(1.061405429f);
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
  const __m512 erfc = _mm512_mul_ps(_mm512_mul_ps(poly, t), exp_nonpositive(_mm512_mul_ps(z, _mm512_sub_ps(_mm512_setzero_ps(), z))));
  const __m512 half_term = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), erfc);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(negative, _mm512_sub_ps(x, half_term), half_term);
}

}  // namespace genfast_avx512
