// AVX2 + FMA + F16C variant of avx512.h: the same ops and packed weight layout. The
// weight-only op quantizes activations as that variant does and computes the same integer sums, so
// both give the same results up to the order of fp32 additions; the dynamic op quantizes them to 7
// bits (below). See avx512.h for the math and the layout; here a 64-byte chunk of a
// 16-row tile is two 32-byte halves, rows 0-7 and rows 8-15.
//
// AVX2 has no vpdpbusd. A u8 x s8 dot product is vpmaddubsw (adjacent products summed into int16,
// saturating) followed by vpmaddwd with ones (pairs of int16 into int32). What must not saturate:
// - 4-bit codes (<= 15) times int8 activations (|x| <= 127): a pair is at most 3810, so the eight
//   vpmaddubsw results of one 32-column block (30480) still fit int16 and are widened once.
// - 8-bit codes u in [0, 255] would overflow (2 * 255 * 127). The codes are made signed,
//   w = u - 128 (a xor with 0x80), and the sign moves to the activation: |w| * (x * sign(w))
//   (vpabsb, vpsignb), at most 2 * 128 * 127 = 32512 per pair, exact. Then
//   sum u*x = sum w*x + 128 * sum x, which folds into the minimum: min' = min + 128 * scale.
//
// Compiled with -mavx2 -mfma -mf16c; the registry (genfast/kernels/native.py) loads it only on
// CPUs with those flags.

#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../common/avx2_vectors.h"
#include "qlinear.h"

namespace {

using namespace genfast_avx2;
using namespace genfast_qlinear;

// The loops over a register tile's accumulators are unrolled explicitly: GCC 12 otherwise keeps
// the accumulator arrays in memory and stores every one of them on each pass of the inner loop.

inline __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }

// 32 activations times `inv`, rounded to nearest even (the default MXCSR mode, as std::nearbyint),
// stored as int8 in order; returns their sum.
template <typename T>
inline int32_t quantize32(const T* src, __m256 inv, int8_t* dst) {
  const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src), inv));
  const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + 8), inv));
  const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + 16), inv));
  const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + 24), inv));
  // The packs work within 128-bit lanes; the permute puts the 4-byte groups back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
  return hsum(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, float* xsum) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + m * k + b * kBlock;
        const __m256 a = _mm256_max_ps(abs8(load8(src)), abs8(load8(src + 8)));
        const __m256 c = _mm256_max_ps(abs8(load8(src + 16)), abs8(load8(src + 24)));
        const float scale = hmax(_mm256_max_ps(a, c)) / 127.f;
        const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
        const int32_t sum = quantize32(src, inv, xq + m * k + b * kBlock);
        xs[m * blocks + b] = scale;
        xsum[m * blocks + b] = scale * static_cast<float>(sum);
      }
    }
  });
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// sum over 4 columns of |w| * (x * sign(w)) for signed 8-bit weights w, as 8 int32 (one per row).
inline __m256i dot_signed(__m256i w, __m256i x4) {
  const __m256i products = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x4, w));
  return _mm256_madd_epi16(products, _mm256_set1_epi16(1));
}

// Dot products of one 32-column activation block with the two 8-row halves of one 16-row tile.
// 8-bit: with the codes made signed (see the header); 4-bit: with the unsigned codes.
template <int Bits>
inline void tile_block_dots(const uint8_t* w, const int8_t* xq, __m256i& dot0, __m256i& dot1) {
  if constexpr (Bits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i x4 = broadcast4(xq + 4 * c);
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64)), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64 + 32)), flip);
      a0 = _mm256_add_epi32(a0, dot_signed(w0, x4));
      a1 = _mm256_add_epi32(a1, dot_signed(w1, x4));
    }
    dot0 = a0;
    dot1 = a1;
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // int16 sums, at most 30480
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i x_low = broadcast4(xq + 8 * c), x_high = broadcast4(xq + 8 * c + 4);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64 + 32));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(v0, low), x_low));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), x_high));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(v1, low), x_low));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), x_high));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    dot0 = _mm256_madd_epi16(s0, ones);
    dot1 = _mm256_madd_epi16(s1, ones);
  }
}

inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The minimum's coefficient for the kernel's integer sums: 8-bit sums are over signed codes.
template <int Bits>
inline __m256 effective_min(__m256 minimum, __m256 scale) {
  if constexpr (Bits == 8) return _mm256_fmadd_ps(scale, _mm256_set1_ps(128.f), minimum);
  return minimum;
}

// Output rows [16 * t0, 16 * (t0 + NT)) for every activation row.
template <int Bits, int NT, typename T>
void tile_run(const Activations& a, const Weights& w, int64_t t0, T* y) {
  static_assert(NT == kTilesPerTask, "a task is one row group of the packed layout");
  constexpr int kHalves = 2 * NT;
  const int64_t s = t0 / kTilesPerTask;
  const int64_t blocks = a.k / kBlock;
  const int64_t blocks_per_group = w.group_size / kBlock;
  const int64_t block_bytes = kBlock * kTileRows * Bits / 8;
  for (int64_t m = 0; m < a.rows; ++m) {
    const int8_t* xrow = a.xq + m * a.k;
    const float* xs_row = a.xs + m * blocks;
    const float* xsum_row = a.xsum + m * blocks;
    __m256 out[kHalves];
#pragma GCC unroll 8
    for (int i = 0; i < kHalves; ++i) out[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.k / w.group_size; ++g) {
      __m256 acc[kHalves];
#pragma GCC unroll 8
      for (int i = 0; i < kHalves; ++i) acc[i] = _mm256_setzero_ps();
      float group_sum = 0.f;
      const uint8_t* group = w.codes(s, g);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const __m256 xscale = _mm256_set1_ps(xs_row[b]);
        const uint8_t* block = group + (b - g * blocks_per_group) * NT * block_bytes;
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          __m256i dot0, dot1;
          tile_block_dots<Bits>(block + i * block_bytes, xrow + b * kBlock, dot0, dot1);
          acc[2 * i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), xscale, acc[2 * i]);
          acc[2 * i + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), xscale, acc[2 * i + 1]);
        }
        group_sum += xsum_row[b];
      }
      const __m256 sum = _mm256_set1_ps(group_sum);
      const at::Half* scales = w.scales(s, g);
      const at::Half* mins = w.mins(s, g);
#pragma GCC unroll 8
      for (int i = 0; i < kHalves; ++i) {
        const __m256 scale = load_half8(scales + i * 8);
        const __m256 minimum = effective_min<Bits>(load_half8(mins + i * 8), scale);
        out[i] = _mm256_fmadd_ps(minimum, sum, _mm256_fmadd_ps(scale, acc[i], out[i]));
      }
    }
    alignas(32) float result[kHalves * 8];
#pragma GCC unroll 8
    for (int i = 0; i < kHalves; ++i) _mm256_store_ps(result + 8 * i, out[i]);
    const int64_t first = t0 * kTileRows;
    store_rows(y + m * w.n + first, result, std::min<int64_t>(kHalves * 8, w.n - first));
  }
}

// ---- dynamic int8: per-token activations, per-channel int8 weights ---------------------------
//
// As in avx512.h: one scale per activation row, int32 sums over all of K, but the
// activations are quantized to 7 bits (|x| <= 63, ops.dynamic_activation_max):
// then a pair of the stored unsigned codes times them fits vpmaddubsw's int16, so the codes are
// multiplied as they are, sum u*x, with the minimum applied to sum x. Per 32 products that is
// vpmaddubsw, vpmaddwd and an add, where the sign trick of the weight-only path (8-bit
// activations) also needs a vpsignb per activation row, so 7 bits are the faster of the two
// (benchmarks/dynamic_int8.py times the op). A register tile is
// kRowsPerTile activation rows x one 16-row weight tile (two halves): each weight vector serves 4 rows.

constexpr int kRowsPerTile = 4;
constexpr float kDynamicMax = 63.f;  // 2 * 255 * 63 = 32130 fits int16

template <typename T>
void quantize_rows_per_token(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, int32_t* xsum) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* src = x + m * k;
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t j = 0; j < k; j += 8) vmax = _mm256_max_ps(vmax, abs8(load8(src + j)));
      const float scale = hmax(vmax) / kDynamicMax;
      const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      int32_t sum = 0;
      for (int64_t j = 0; j < k; j += kBlock) sum += quantize32(src + j, inv, xq + m * k + j);
      xs[m] = scale;
      xsum[m] = sum;
    }
  });
}

// y rows [m0, m0 + R) x outputs [16 * t, 16 * (t + 1)).
template <int R, typename T>
void dynamic_tile(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, const Weights& w,
                  const Epilogue& epilogue, int64_t m0, int64_t t, T* y) {
  constexpr int64_t block_bytes = kBlock * kTileRows;
  const int64_t first = t * kTileRows;
  if (first >= w.n) return;
  // Tiles are stored [row group][block][tile in group][chunk] (one group: all of K): step
  // between blocks of one tile.
  const int64_t s = t / kTilesPerTask, tile_in_group = t % kTilesPerTask;
  const uint8_t* tile = w.codes(s, 0) + tile_in_group * block_bytes;
  const int64_t block_stride = kTilesPerTask * block_bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* block = tile + b * block_stride;
#pragma GCC unroll 2
    for (int c = 0; c < 8; ++c) {
      const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * 64));
      const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + c * 64 + 32));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i x4 = broadcast4(xq + (m0 + r) * k + b * kBlock + 4 * c);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, x4), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, x4), ones));
      }
    }
  }
  const int64_t count = std::min<int64_t>(kTileRows, w.n - first);
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = load_half8(w.scales(s, 0) + tile_in_group * kTileRows + 8 * h);
    const __m256 minimum = load_half8(w.mins(s, 0) + tile_in_group * kTileRows + 8 * h);  // sums over the unsigned codes
    const __m256 bias = epilogue.bias ? _mm256_loadu_ps(epilogue.bias + first + 8 * h) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256 dot = _mm256_fmadd_ps(minimum, _mm256_set1_ps(static_cast<float>(xsum[m])),
                                         _mm256_mul_ps(scale, _mm256_cvtepi32_ps(acc[r][h])));
      __m256 out = _mm256_fmadd_ps(dot, _mm256_set1_ps(xs[m]), bias);
      if (epilogue.gelu) out = gelu(out);
      alignas(32) float result[8];
      _mm256_store_ps(result, out);
      store_rows(y + m * w.n + first + 8 * h, result, std::clamp<int64_t>(count - 8 * h, 0, 8));
    }
  }
}

struct Avx2 {
  template <typename T>
  static void quantize_blocks(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, float* xsum) {
    quantize_rows(x, rows, k, xq, xs, xsum);
  }
  template <int Bits, typename T>
  static void tiles(const Activations& a, const Weights& w, int64_t t0, T* y) {
    tile_run<Bits, kTilesPerTask>(a, w, t0, y);
  }
  template <typename T>
  static void quantize_tokens(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, int32_t* xsum) {
    quantize_rows_per_token(x, rows, k, xq, xs, xsum);
  }
  template <typename T>
  static void dynamic_rows(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, const Weights& w,
                           const Epilogue& epilogue, int64_t m_begin, int64_t m_end, int64_t t0, T* y) {
    for (int64_t t = t0; t < t0 + kTilesPerTask; ++t) {
      int64_t m = m_begin;
      for (; m + kRowsPerTile <= m_end; m += kRowsPerTile)
        dynamic_tile<kRowsPerTile>(xq, xs, xsum, k, w, epilogue, m, t, y);
      for (; m < m_end; ++m) dynamic_tile<1>(xq, xs, xsum, k, w, epilogue, m, t, y);
    }
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("qlinear", &genfast_qlinear::qlinear<Avx2>);
  m.impl("qlinear_dynamic", &genfast_qlinear::qlinear_dynamic<Avx2>);
}
