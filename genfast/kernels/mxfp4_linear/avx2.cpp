// The AVX2 variant (the math and the layout: mxfp4_linear.h, ops.py). A 64-byte chunk of a tile
// is two vectors of 8 rows x 4 columns. vpmaddubsw multiplies the looked-up codes (2 w + 12, at
// most 24) by the int8 activations and sums pairs into int16; two chunks' low and high nibble
// products (4 x 2 x 24 x 127 < 32767) are added in int16 before vpmaddwd widens them to int32.
// Scales 2^(e-128) are built from their bits (no vscalefps here): (e - 1) << 23, and the two
// denormals 2^-128 and 2^-127 for e = 0 and 1.
//
// Compiled with -mavx2 -mfma.

#include <torch/library.h>

#include <immintrin.h>

#include <cstring>

#include "mxfp4_linear.h"

namespace {

using namespace genfast_mxfp4;

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 2^(e - 128) for 8 E8M0 bytes.
inline __m256 scales8(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, small));
}

struct Avx2 {
  template <typename T>
  static void row_group(const Activations& a, const uint8_t* w, const int64_t* rows, int64_t count, int64_t first,
                        T* y) {
    const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                           12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t blocks = a.k / kBlock;
    constexpr int kHalves = 2 * kTiles;  // vectors of 8 rows in a row group
    for (int64_t i = 0; i < count; ++i) {
      const int64_t m = rows[i];
      const int8_t* xrow = a.xq + m * a.k;
      __m256 out[kHalves];
      for (int h = 0; h < kHalves; ++h) out[h] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* codes = w + b * kGroupBlockBytes;
        __m256i xlo[4], xhi[4];
        for (int c = 0; c < 4; ++c) {
          xlo[c] = broadcast4(xrow + b * kBlock + 8 * c);
          xhi[c] = broadcast4(xrow + b * kBlock + 8 * c + 4);
        }
        const __m256i offset = _mm256_set1_epi32(kCodeOffset * a.xsum[m * blocks + b]);
        const __m256 xscale = _mm256_set1_ps(a.xs[m * blocks + b]);
#pragma GCC unroll 8
        for (int h = 0; h < kHalves; ++h) {  // h = 2 t + half: rows 8h..8h+7 of the group
          const uint8_t* tile = codes + (h / 2) * 256 + (h % 2) * 32;
          __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int c = 0; c < 4; c += 2) {
            __m256i sum16 = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int cc = c; cc < c + 2; ++cc) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + cc * 64));
              const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
              const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
              sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(lo, xlo[cc]));
              sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(hi, xhi[cc]));
            }
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(sum16, ones));
          }
          const __m256i dot = _mm256_sub_epi32(acc, offset);
          const __m256 scale = _mm256_mul_ps(scales8(codes + kCodeBytes + 8 * h), xscale);
          out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, out[h]);
        }
      }
      for (int h = 0; h < kHalves; ++h) {
        const int64_t col = first + h * 8;
        if (col >= a.n) break;
        alignas(32) float result[8];
        _mm256_store_ps(result, out[h]);
        store_outputs(y + m * a.n + col, result, std::min<int64_t>(8, a.n - col));
      }
    }
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("mxfp4_expert_linear", &genfast_mxfp4::mxfp4_expert_linear<Avx2>);
}
