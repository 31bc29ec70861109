// Vector helpers the AVX-512 kernels (*_avx512.cpp) share. Include only from files compiled with
// -mavx512f -mavx512bw.

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

}  // namespace genfast_avx512
