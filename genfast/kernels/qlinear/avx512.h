// y = x @ W^T for weights stored as unsigned 8-bit or 4-bit codes with a per (row, group) fp16
// scale and minimum: W[n, k] = u[n, k] * scale[g, n] + min[g, n], g = k / group_size.
//
// Activations are quantized on the fly to int8 per block of 32 (x ≈ xs[b] * xq[k], as llama.cpp's
// Q8 activations), so the inner product runs on AVX512-VNNI `vpdpbusd` (64 u8 x s8 products per
// instruction): per block, sum_k u*x = xs[b] * dot(u, xq), and the minimum contributes
// min * sum_k x, with sum_k x taken from the same quantized x so the two terms stay consistent.
//
// Weight layout (made by ops.pack): rows in tiles of 16, tiles in groups
// of 4 (64 rows, the unit of work of one thread). A tile's chunk of 4 (int8) or 8 (int4) columns
// is 64 bytes = 16 rows x 4 bytes, so one vpdpbusd with 4 broadcast activation bytes serves 16
// output rows and no horizontal sums are needed; for int4 the low nibbles hold columns 8c..8c+3
// and the high nibbles 8c+4..8c+7. Storage order: [row group][group][activation block][tile][chunk],
// each group's 64 scales and 64 minima right after its codes (qlinear.h), so each thread reads
// one contiguous stream (short interleaved streams defeat the prefetchers). No software
// prefetch: the hardware prefetchers follow the stream, and an explicit one made the loops of
// both variants slower on one thread and no faster on two.
// A tile's 16 scales (and minima) load as one vector.
//
// The AVX-512 variant's math, as a header: avx512.cpp registers it, and amx.cpp reuses all of it
// but the dynamic-int8 tiles. Compiled with -mavx512f/bw/vl/vnni/f16c; the Python side calls it
// only when the CPU has them.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../common/avx512_vectors.h"
#include "qlinear.h"

namespace {

using namespace genfast_avx512;
using namespace genfast_qlinear;

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, float* xsum) {
  static_assert(kBlock == 32, "one block is two vectors of 16");
  const int64_t blocks = k / kBlock;
  const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + m * k + b * kBlock;
        const __m512 v0 = load16(src), v1 = load16(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign_mask), _mm512_and_ps(v1, sign_mask)));
        const float scale = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
        // Round to nearest even (the default MXCSR mode), as std::nearbyint.
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        int8_t* dst = xq + m * k + b * kBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
        xs[m * blocks + b] = scale;
        xsum[m * blocks + b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      }
    }
  });
}

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Dot products of one activation block (32 values) with NT tiles of 16 rows. Several tiles
// share each activation broadcast, and two accumulators per tile keep independent vpdpbusd
// chains in flight.
template <int Bits, int NT>
inline void block_dots(const uint8_t* const* w, const int8_t* xq, __m512i* dot) {
  __m512i acc0[NT], acc1[NT];
  for (int i = 0; i < NT; ++i) acc0[i] = acc1[i] = _mm512_setzero_si512();
  if constexpr (Bits == 8) {
    // Tile by tile, so the block's 2 KB are read in address order: visiting the 4 tiles chunk by
    // chunk (8 lines 512 bytes apart at a time) was slower (`benchmarks/quant_kernels.py`). For
    // int4 (1 KB a block) the two orders measured alike, so it keeps the chunk-major loop below.
    __m512i xb[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) xb[c] = broadcast4(xq + 4 * c);
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) {
#pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {
        acc0[i] = _mm512_dpbusd_epi32(acc0[i], _mm512_loadu_si512(w[i] + c * 64), xb[c]);
        acc1[i] = _mm512_dpbusd_epi32(acc1[i], _mm512_loadu_si512(w[i] + (c + 1) * 64), xb[c + 1]);
      }
    }
  } else {
    // The high nibbles are used in place (v & 0xF0 = 16 * code): their sums come out 16x too
    // large and are shifted back once per block, which saves a shift per 64 bytes.
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i x0 = broadcast4(xq + 8 * c), x1 = broadcast4(xq + 8 * c + 4);
      for (int i = 0; i < NT; ++i) {
        const __m512i v = _mm512_loadu_si512(w[i] + c * 64);
        acc0[i] = _mm512_dpbusd_epi32(acc0[i], _mm512_and_si512(v, low), x0);
        acc1[i] = _mm512_dpbusd_epi32(acc1[i], _mm512_and_si512(v, high), x1);
      }
    }
    for (int i = 0; i < NT; ++i) acc1[i] = _mm512_srai_epi32(acc1[i], 4);
  }
  for (int i = 0; i < NT; ++i) dot[i] = _mm512_add_epi32(acc0[i], acc1[i]);
}

// Output rows [16 * t0, 16 * (t0 + NT)) for every activation row.
template <int Bits, int NT, typename T>
void tile_run(const Activations& a, const Weights& w, int64_t t0, T* y) {
  static_assert(NT == kTilesPerTask, "a task is one row group of the packed layout");
  const int64_t s = t0 / kTilesPerTask;
  const int64_t blocks = a.k / kBlock;
  const int64_t blocks_per_group = w.group_size / kBlock;
  const int64_t block_bytes = kBlock * kTileRows * Bits / 8;
  for (int64_t m = 0; m < a.rows; ++m) {
    const int8_t* xrow = a.xq + m * a.k;
    const float* xs_row = a.xs + m * blocks;
    const float* xsum_row = a.xsum + m * blocks;
    __m512 out[NT];
    for (int i = 0; i < NT; ++i) out[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a.k / w.group_size; ++g) {
      __m512 acc[NT];
      for (int i = 0; i < NT; ++i) acc[i] = _mm512_setzero_ps();
      float group_sum = 0.f;
      const uint8_t* group = w.codes(s, g);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const uint8_t* ptrs[NT];
        for (int i = 0; i < NT; ++i) ptrs[i] = group + ((b - g * blocks_per_group) * NT + i) * block_bytes;
        __m512i dot[NT];
        block_dots<Bits, NT>(ptrs, xrow + b * kBlock, dot);
        const __m512 xscale = _mm512_set1_ps(xs_row[b]);
        for (int i = 0; i < NT; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), xscale, acc[i]);
        group_sum += xsum_row[b];
      }
      const __m512 sum = _mm512_set1_ps(group_sum);
      const at::Half* scales = w.scales(s, g);
      const at::Half* mins = w.mins(s, g);
      for (int i = 0; i < NT; ++i) {
        const __m512 scale = load_half16(scales + i * kTileRows);
        const __m512 minimum = load_half16(mins + i * kTileRows);
        out[i] = _mm512_fmadd_ps(minimum, sum, _mm512_fmadd_ps(scale, acc[i], out[i]));
      }
    }
    for (int i = 0; i < NT; ++i) {
      alignas(64) float result[kTileRows];
      _mm512_store_ps(result, out[i]);
      const int64_t first = (t0 + i) * kTileRows;
      store_rows(y + m * w.n + first, result, std::min<int64_t>(kTileRows, w.n - first));
    }
  }
}

// ---- dynamic int8: per-token activations, per-channel int8 weights ---------------------------
//
// For the compute-bound layers of SAM and diffusion (thousands of rows). Each activation row is
// quantized with one scale (x ≈ xs[m] * xq[m, k]), so the int32 dot products accumulate over the
// whole of K and are scaled once: y[m, n] = xs[m] * (scale[n] * sum_k u[n,k] xq[m,k] + min[n] * sum_k xq[m,k]).
// A register tile is kRowsPerTile activation rows x 4 weight tiles (64 outputs): every weight
// vector loaded serves 4 rows and every activation broadcast 4 tiles. Same packed weights as
// qlinear (8-bit, one group).

constexpr int kRowsPerTile = 4;

// Where activation m's codes for columns [j, j + 16) go (j a multiple of 16): row after row.
struct RowMajorCodes {
  int64_t k;
  int64_t operator()(int64_t m, int64_t j) const { return m * k + j; }
};

// `codes`: where each row's codes go (RowMajorCodes, or the AMX variant's tile order).
template <typename T, typename Codes>
void quantize_rows_per_token(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, int32_t* xsum,
                             Codes codes) {
  const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* src = x + m * k;
      __m512 vmax = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; j += 16) vmax = _mm512_max_ps(vmax, _mm512_and_ps(load16(src + j), sign_mask));
      const float scale = _mm512_reduce_max_ps(vmax) / 127.f;
      const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t j = 0; j < k; j += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src + j), inv));
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + codes(m, j)), _mm512_cvtsepi32_epi8(q));
      }
      xs[m] = scale;
      xsum[m] = _mm512_reduce_add_epi32(sum);
    }
  });
}

inline void store16(float* dst, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(dst, mask, v); }
inline void store16(at::BFloat16* dst, __m512 v, __mmask16 mask) {
  // fp32 -> bf16, round to nearest even (the instruction for it needs AVX512-BF16).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// The dynamic path's outputs of tile t of the task at tile t0, outputs [first, first + 16) (the
// caller skips a tile that is all padding): the weights' scales and minima, the bias and the mask
// of the outputs below n. `store` finishes one activation row from its int32 sums over K (`dot`)
// and the row's scale and sum of codes, then applies the epilogue (bias, GELU).
struct TileOutputs {
  int64_t first;
  __mmask16 mask;
  __m512 scale, minimum, bias;
  bool apply_gelu;

  TileOutputs(const Weights& w, const Epilogue& epilogue, int64_t t0, int64_t t)
      : first((t0 + t) * kTileRows),
        mask(static_cast<__mmask16>(w.n - first >= 16 ? 0xFFFF : (1u << (w.n - first)) - 1)),
        scale(load_half16(w.scales(t0 / kTilesPerTask, 0) + t * kTileRows)),
        minimum(load_half16(w.mins(t0 / kTilesPerTask, 0) + t * kTileRows)),
        bias(epilogue.bias ? _mm512_loadu_ps(epilogue.bias + first) : _mm512_setzero_ps()),
        apply_gelu(epilogue.gelu) {}

  template <typename T>
  void store(__m512i dot, float xs, int32_t xsum, T* y_row) const {
    const __m512 sum = _mm512_fmadd_ps(minimum, _mm512_set1_ps(static_cast<float>(xsum)),
                                       _mm512_mul_ps(scale, _mm512_cvtepi32_ps(dot)));
    __m512 out = _mm512_fmadd_ps(sum, _mm512_set1_ps(xs), bias);
    if (apply_gelu) out = gelu(out);
    store16(y_row + first, out, mask);
  }
};

// y rows [m0, m0 + R) x outputs [16 * t0, 16 * (t0 + kTilesPerTask)).
template <int R, typename T>
void dynamic_tile(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, const Weights& w,
                  const Epilogue& epilogue, int64_t m0, int64_t t0, T* y) {
  constexpr int NT = kTilesPerTask;
  constexpr int64_t block_bytes = kBlock * kTileRows;
  const int64_t s = t0 / kTilesPerTask;
  const uint8_t* base = w.codes(s, 0);  // one group: all of K
  __m512i acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_si512();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* block = base + b * NT * block_bytes;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i wv[NT];
      for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(block + t * block_bytes + c * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = broadcast4(xq + (m0 + r) * k + b * kBlock + 4 * c);
        for (int t = 0; t < NT; ++t) acc[r][t] = genfast_avx512::dpbusd(acc[r][t], wv[t], xv);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    if ((t0 + t) * kTileRows >= w.n) break;
    const TileOutputs outputs(w, epilogue, t0, t);
    for (int r = 0; r < R; ++r) outputs.store(acc[r][t], xs[m0 + r], xsum[m0 + r], y + (m0 + r) * w.n);
  }
}

struct Avx512 {
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
    quantize_rows_per_token(x, rows, k, xq, xs, xsum, RowMajorCodes{k});
  }
  template <typename T>
  static void dynamic_rows(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, const Weights& w,
                           const Epilogue& epilogue, int64_t m_begin, int64_t m_end, int64_t t0, T* y) {
    int64_t m = m_begin;
    for (; m + kRowsPerTile <= m_end; m += kRowsPerTile)
      dynamic_tile<kRowsPerTile>(xq, xs, xsum, k, w, epilogue, m, t0, y);
    for (; m < m_end; ++m) dynamic_tile<1>(xq, xs, xsum, k, w, epilogue, m, t0, y);
  }
};

}  // namespace
