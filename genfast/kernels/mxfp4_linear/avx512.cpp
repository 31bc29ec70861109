// The AVX512-VNNI variant (the math and the layout: mxfp4_linear.h, ops.py). Per block of 32
// columns and tile of 16 rows: four 64-byte loads of codes, the low and high nibbles looked up in a
// 16-byte table (vpshufb) as 2 w + 12, and vpdpbusd against 4 broadcast activation bytes sums 16
// rows at once, no horizontal sums. The block's scales (16 bytes a tile) become 2^(e-128) with
// vscalefps, exact down to the denormals.
//
// Compiled with -mavx512f/bw/vl/vnni; the Python side calls it only when the CPU has them.

#include <torch/library.h>

#include <immintrin.h>

#include <cstring>

#include "mxfp4_linear.h"

namespace {

using namespace genfast_mxfp4;

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

struct Avx512 {
  template <typename T>
  static void row_group(const Activations& a, const uint8_t* w, const int64_t* rows, int64_t count, int64_t first,
                        T* y) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512 one = _mm512_set1_ps(1.f);
    const int64_t blocks = a.k / kBlock;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t m = rows[i];
      const int8_t* xrow = a.xq + m * a.k;
      __m512 out[kTiles];
      for (int t = 0; t < kTiles; ++t) out[t] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* codes = w + b * kGroupBlockBytes;
        __m512i xlo[4], xhi[4];
        for (int c = 0; c < 4; ++c) {
          xlo[c] = broadcast4(xrow + b * kBlock + 8 * c);
          xhi[c] = broadcast4(xrow + b * kBlock + 8 * c + 4);
        }
        const __m512i offset = _mm512_set1_epi32(kCodeOffset * a.xsum[m * blocks + b]);
        const __m512 xscale = _mm512_set1_ps(a.xs[m * blocks + b]);
#pragma GCC unroll 4
        for (int t = 0; t < kTiles; ++t) {
          __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(codes + t * 256 + c * 64);
            const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
            const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            acc0 = _mm512_dpbusd_epi32(acc0, lo, xlo[c]);
            acc1 = _mm512_dpbusd_epi32(acc1, hi, xhi[c]);
          }
          const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(acc0, acc1), offset);
          const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kCodeBytes + t * kTileRows));
          const __m512 exponent = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e)), _mm512_set1_ps(128.f));
          const __m512 scale = _mm512_mul_ps(_mm512_scalef_ps(one, exponent), xscale);
          out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, out[t]);
        }
      }
      for (int t = 0; t < kTiles; ++t) {
        const int64_t col = first + t * kTileRows;
        if (col >= a.n) break;
        alignas(64) float result[kTileRows];
        _mm512_store_ps(result, out[t]);
        store_outputs(y + m * a.n + col, result, std::min<int64_t>(kTileRows, a.n - col));
      }
    }
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("mxfp4_expert_linear", &genfast_mxfp4::mxfp4_expert_linear<Avx512>);
}
