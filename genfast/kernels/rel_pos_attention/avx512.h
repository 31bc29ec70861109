// Attention with SAM's decomposed relative-position bias, fused, for bf16 on AVX512-BF16 CPUs:
//
//   out[b, i] = sum_j softmax_j(scale * q[b, i] . k[b, j] + rel_h[b, i, j / W] + rel_w[b, i, j % W]) v[b, j]
//
// for keys j = (row, column) on an H x W grid. The unfused form materializes the bias as a
// [B, N, N] tensor (N = 4096 for SAM's global blocks: 400 MB per head batch in bf16) and hands
// it to SDPA, so global attention is bound by writing and re-reading that tensor. Here each task
// takes 32 query rows of one head (all of a window's, where the keys are few): their scores
// (32 x N fp32, 512 KB at N = 4096) stay in the L2 cache, the bias is added from the two small tables while scores are still hot, and the
// softmax and P @ V follow before the next rows. Nothing of size N x N is ever written.
// `attention` is the same without a bias, and with any number of queries (SAM 2's Hiera: its
// pooling blocks have a quarter as many queries as keys); there the scale is folded into the
// softmax's exponent, so the scores are read once less.
// Beyond kOnePassKeys keys (SAM 2's memory attention: 4096 queries over up to ~29K memory keys,
// one head of 256 channels) a task's scores no longer fit L2, and K and V (29 MB in bf16) hardly
// fit L3: a task then takes kLongQueryBlock rows over the keys in chunks of kKeyChunk, with the
// online softmax of flash attention (a running max and sum per row, the output rescaled when the
// max grows), so each chunk of K and V is read once per 128 query rows and stays in L2 meanwhile.
// So do calls whose K holds more than kOnePassElements (the memory attention's self-attention,
// 4096 keys of 256 channels: 2 MB of K and V, re-read from L3 by every 32 rows in one pass; in
// chunks 22 instead of 28 ms on two Zen 4 cores, where Hiera's 4096 x 96 lost 10% in chunks;
// the bound is the products' policy's, half of it on AMX's tiles: amx.cpp).
//
// Both products run on `vdpbf16ps` (16 lanes, each += a pair of bf16 products into fp32), so the
// scores and output accumulate in fp32 like a flash kernel; P is rounded to bf16 for P @ V.
// Operands are re-laid out once per head so every inner-loop load is one contiguous vector:
//   K as pairs of channels, [C/2][N_pad + 16] (lane = key), for S = Q K^T;
//   V as pairs of keys,     [N_pad/2][C] (lane = channel), for O = P V.
// N is padded to a multiple of 16 (of 32 on AMX's tiles) with zero keys whose probabilities are
// set to 0. S is computed key block by key block, each block of K read from L1 by all the task's
// rows. K's rows (and the scores') are one vector longer than N_pad: at N = 4096 a row is 16 KB,
// and the loads of one key block, one per channel pair, all fell in the same L1 sets (4K
// aliasing), which cost a quarter of the global blocks' time (sam2.1-hiera-tiny, Zen 4).
//
// int8 scores (`attention` only): S = Q K^T on q and k quantized to int8, each query row and each
// key with its own absmax scale, on `vpdpbusd` (16 lanes, each += four u8 x s8 products into
// int32): twice vdpbf16ps's products per instruction, so S costs about half. K is re-laid out as
// quads of channels [C/4][N_pad + 16] of s8 codes with a scale per key; each task quantizes its
// query rows to u8 codes (the int8 code + 128), and the 128 * sum of each key's codes that this
// adds to its dot products is taken back, with the two scales applied, as S leaves the registers.
//
// int8 values (`attention` only): O = P V on `vpdpbusd` too, P as u8 codes and V as s8 codes, for
// keys in blocks of kValueBlock. Each query row's probabilities in a block have their own scale
// (the block's largest / 255), as does each channel of V in a block (absmax / 127); a block's
// int32 sums are scaled into the fp32 output as the block ends. Codes drop every probability
// under half a step, 1/510 of the block's largest: a row with one dominant key (an attention
// sink) and a broad tail of small ones would lose the tail's mass in the sink's block (with one
// scale per row, in every block: all of the tail). So each row and block also keeps the mass its
// codes dropped, and the output takes it back on the block's mean of V. V is re-laid out as quads
// of keys [N_pad/4][C] of s8 codes, with [N_pad/kValueBlock][2][C] terms (scales, means).
//
// fp32 products (`products.fp32`): the products not on int8 codes multiply the same bf16 pairs of
// K and V, each widened to two fp32 vectors in registers (a shift, a mask), by the task's query
// rows widened once and by P kept in fp32 (in place of its scores), on FMAs: 16 products per
// instruction against vdpbf16ps's 32, but where vdpbf16ps issues at a quarter of the FMA's rate
// (Intel Xeons with AVX512-BF16 but no AMX; docs/notes.md) that is about twice the products a
// cycle, the widening included. The layouts, passes and softmax are the same.
//
// The AVX-512 variant as a header: avx512.cpp registers it, and amx.cpp reuses all of it with the
// bf16 products on AMX's tiles. `attend` takes the bf16 products from a policy (VectorProducts
// here): where its keys are padded to, how its buffers' rows are rounded, up to how much of K one
// pass takes, S = Q K^T for a task's rows against a pass's keys, and O += P V. Compiled with
// -mavx512f/bw/bf16/vnni; the Python side calls it only when the CPU has them.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/avx512_vectors.h"
#include "rel_pos_attention.h"

namespace {

using genfast_rel_pos_attention::Bias;
using genfast_rel_pos_attention::kMaxHeadDim;

constexpr int64_t kQueryBlock = 32;       // query rows per task
constexpr int64_t kFewKeys = 256;         // up to this many (padded) keys, a task takes up to
constexpr int64_t kMaxQueryBlock = 256;   // this many query rows
constexpr int64_t kOnePassKeys = 4096;    // up to this many (padded) keys, one pass over them all
constexpr int64_t kOnePassElements = 4096 * 128;  // (and up to this many elements of K);
constexpr int64_t kKeyChunk = 256;        // beyond, passes of this many keys
constexpr int64_t kLongQueryBlock = 128;  // over this many query rows per task
constexpr int kRows = 4;             // query rows per register tile of S and of O
constexpr int kKeyVectors = 4;       // 16-key vectors per register tile of S
// A register tile of O is kRows x CV accumulators: with the tile's CV vectors of V and P's
// broadcast they fit the 32 vector registers (CV <= 6), so each vector of V is loaded once per
// tile. (4 rows x 8 vectors did not fit: V was re-loaded for every row, and P @ V ran bound by the
// loads: 671 against ~785 GFLOP/s for 4096 x 28,736 x 256 on two Zen 4 cores; 6 rows x 4 vectors
// measured about the same as 4 x 4.) Heads of up to kMaxChannelVectors vectors take one slice of
// channels (Hiera's 96), wider ones slices of kWideSliceVectors.
constexpr int kMaxChannelVectors = 6;
constexpr int kWideSliceVectors = 4;
constexpr int64_t kRelayoutKeys = 1024;  // keys per task of the shared re-layout (a multiple of 16)
constexpr int64_t kRowPad = 16;      // K's and the scores' rows are this much longer than N_pad
// int8 values: keys per block with their own scales (a multiple of 16 dividing kKeyChunk and
// kRelayoutKeys). 256 rather than 128: the per-block reductions of P's codes cost ~10% of a
// global block's time at 128.
constexpr int64_t kValueBlock = 256;
static_assert(kKeyChunk <= kOnePassKeys && kOnePassKeys % kValueBlock == 0);  // a pass's blocks: see block_top

// exp(x) for x <= 0 to the precision the probabilities keep (bf16): 2^n * p(r) with
// x = n ln2 + r, |r| <= ln2 / 2, p the degree-4 Taylor polynomial (relative error < 5e-5; bf16
// rounds at 4e-3; with fp32 products P keeps the 5e-5, below the output's own rounding to bf16). Two multiply-adds fewer than exp_nonpositive (common/avx512_vectors.h), on 4096 x 4096
// values per head of a global block.
inline __m512 exp_to_bf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.0f / 24);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// The fp32 values of the low and of the high bf16 in each 32-bit lane of a pair layout (channels
// 2i and 2i + 1 of K, keys 2i and 2i + 1 of V).
inline __m512 low_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 high_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Runs tile.template operator()<R>(r) on rows r = 0, R, 2R, ... of `rows`, then the rows left
// (fewer than R) as one smaller tile.
template <int R, typename Tile>
inline void last_tile(int64_t left, int64_t r, Tile& tile) {
  if constexpr (R > 0) {
    if (left == R)
      tile.template operator()<R>(r);
    else
      last_tile<R - 1>(left, r, tile);
  }
}

template <int R, typename Tile>
inline void for_row_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) tile.template operator()<R>(r);
  last_tile<R - 1>(rows - r, r, tile);
}

// S[r, j0 + 16t + l] = q[r] . k[j0 + 16t + l] for R rows and KV vectors of 16 keys.
// q: rows of C/2 channel pairs; kp: [C/2][k_ld] channel pairs.
template <int R, int KV>
inline void scores_tile(const uint32_t* q, int64_t q_stride, const uint32_t* kp, int64_t k_ld,
                        int64_t pairs, int64_t j0, float* s, int64_t s_stride) {
  __m512 acc[R][KV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c2 = 0; c2 < pairs; ++c2) {
    __m512bh keys[KV];
    for (int t = 0; t < KV; ++t) keys[t] = as_bh(_mm512_loadu_si512(kp + c2 * k_ld + j0 + 16 * t));
    for (int r = 0; r < R; ++r) {
      const __m512bh query = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * q_stride + c2])));
      for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], query, keys[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) _mm512_storeu_ps(s + r * s_stride + j0 + 16 * t, acc[r][t]);
}

// scores_tile with fp32 products: q rows of C fp32 channels (q_stride floats apart), K's bf16
// pairs widened in registers.
template <int R, int KV>
inline void scores_tile(const float* q, int64_t q_stride, const uint32_t* kp, int64_t k_ld, int64_t pairs,
                        int64_t j0, float* s, int64_t s_stride) {
  __m512 acc[R][KV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c2 = 0; c2 < pairs; ++c2) {
    __m512 even[KV], odd[KV];
    for (int t = 0; t < KV; ++t) {
      const __m512i keys = _mm512_loadu_si512(kp + c2 * k_ld + j0 + 16 * t);
      even[t] = low_bf16(keys);
      odd[t] = high_bf16(keys);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 q_even = _mm512_set1_ps(q[r * q_stride + 2 * c2]);
      const __m512 q_odd = _mm512_set1_ps(q[r * q_stride + 2 * c2 + 1]);
      for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_fmadd_ps(q_odd, odd[t], _mm512_fmadd_ps(q_even, even[t], acc[r][t]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) _mm512_storeu_ps(s + r * s_stride + j0 + 16 * t, acc[r][t]);
}

// The int8 form of scores_tile: q rows of C/4 words of four u8 codes with their scales q_scale,
// kq [C/4][k_ld] words of four s8 codes (lane = key) with k_scale and k_offset (128 * the sum of
// the key's codes) per key.
template <int R, int KV>
inline void scores_tile_int8(const uint32_t* q, int64_t q_stride, const float* q_scale, const uint32_t* kq,
                             int64_t k_ld, int64_t quads, int64_t j0, const float* k_scale, const int32_t* k_offset,
                             float* s, int64_t s_stride) {
  __m512i acc[R][KV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_setzero_si512();
  for (int64_t c4 = 0; c4 < quads; ++c4) {
    __m512i keys[KV];
    for (int t = 0; t < KV; ++t) keys[t] = _mm512_loadu_si512(kq + c4 * k_ld + j0 + 16 * t);
    for (int r = 0; r < R; ++r) {
      const __m512i query = _mm512_set1_epi32(static_cast<int>(q[r * q_stride + c4]));
      for (int t = 0; t < KV; ++t) acc[r][t] = genfast_avx512::dpbusd(acc[r][t], query, keys[t]);
    }
  }
  for (int t = 0; t < KV; ++t) {
    const __m512i offset = _mm512_loadu_si512(k_offset + j0 + 16 * t);
    const __m512 key_scale = _mm512_loadu_ps(k_scale + j0 + 16 * t);
    for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][t], offset));
      _mm512_storeu_ps(s + r * s_stride + j0 + 16 * t, _mm512_mul_ps(dot, _mm512_mul_ps(key_scale, _mm512_set1_ps(q_scale[r]))));
    }
  }
}

// One row of c bf16 values (c a multiple of 16) as int8 codes round(x * 127 / max|x|), each plus
// `bias` (128: u8 codes, 0: s8 codes), into `codes`; returns the scale max|x| / 127 (0 for a row of
// zeros, whose codes are all `bias`) and the sum of the int8 codes in *code_sum.
inline float quantize_row(const c10::BFloat16* x, int64_t c, int bias, uint8_t* codes, int32_t* code_sum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < c; ch += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(genfast_avx512::load16(x + ch)));
  const float m = _mm512_reduce_max_ps(amax);
  *code_sum = 0;
  if (!(m > 0.0f)) {
    std::memset(codes, bias, c);
    return 0.0f;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / m);
  const __m512i shift = _mm512_set1_epi32(bias);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t ch = 0; ch < c; ch += 16) {
    const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(genfast_avx512::load16(x + ch), inv));
    sum = _mm512_add_epi32(sum, code);
    // Codes are in [-127, 127], so code + bias fits a byte as s8 (bias 0) or u8 (bias 128).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + ch), _mm512_cvtepi32_epi8(_mm512_add_epi32(code, shift)));
  }
  *code_sum = _mm512_reduce_add_epi32(sum);
  return m / 127.0f;
}

// O[r, :16 CV] += P[r] @ V[:, :16 CV] for R rows and CV vectors of 16 channels.
// p: rows of key_pairs probability pairs; vp: [key_pairs][v_ld] key pairs; o: rows of o_ld floats.
template <int R, int CV>
inline void output_tile(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t v_ld, int64_t key_pairs,
                        float* o, int64_t o_ld) {
  __m512 acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t j2 = 0; j2 < key_pairs; ++j2) {
    __m512bh values[CV];
    for (int t = 0; t < CV; ++t) values[t] = as_bh(_mm512_loadu_si512(vp + j2 * v_ld + 16 * t));
    for (int r = 0; r < R; ++r) {
      const __m512bh prob = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * p_stride + j2])));
      for (int t = 0; t < CV; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], prob, values[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) {
      float* dst = o + r * o_ld + 16 * t;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][t]));
    }
}

// output_tile with fp32 products: p rows of fp32 probabilities (p_stride floats apart), V's bf16
// key pairs widened in registers, one vector of channels at a time (both halves of a tile's
// vectors at once would not fit the registers beside its accumulators).
template <int R, int CV>
inline void output_tile(const float* p, int64_t p_stride, const uint32_t* vp, int64_t v_ld, int64_t key_pairs,
                        float* o, int64_t o_ld) {
  __m512 acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t j2 = 0; j2 < key_pairs; ++j2) {
    for (int t = 0; t < CV; ++t) {
      const __m512i values = _mm512_loadu_si512(vp + j2 * v_ld + 16 * t);
      const __m512 even = low_bf16(values), odd = high_bf16(values);
      for (int r = 0; r < R; ++r) {
        const float* prob = p + r * p_stride + 2 * j2;
        acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(prob[1]), odd, _mm512_fmadd_ps(_mm512_set1_ps(prob[0]), even, acc[r][t]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) {
      float* dst = o + r * o_ld + 16 * t;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][t]));
    }
}

// P: uint32_t (bf16 pairs of probabilities) or float (fp32 probabilities), as output_tile takes.
template <typename P, int CV>
void output_rows(const P* p, int64_t p_stride, const uint32_t* vp, int64_t v_ld, int64_t key_pairs, int64_t rows,
                 float* o, int64_t o_ld) {
  for_row_tiles<kRows>(rows, [&]<int R>(int64_t r) {
    output_tile<R, CV>(p + r * p_stride, p_stride, vp, v_ld, key_pairs, o + r * o_ld, o_ld);
  });
}

template <typename P>
using OutputRowsFn = void (*)(const P*, int64_t, const uint32_t*, int64_t, int64_t, int64_t, float*, int64_t);
template <typename P>
constexpr OutputRowsFn<P> kOutputRowsFns[kMaxChannelVectors] = {output_rows<P, 1>, output_rows<P, 2>,
                                                                output_rows<P, 3>, output_rows<P, 4>,
                                                                output_rows<P, 5>, output_rows<P, 6>};

// c channels as slices of a register tile's width: slice(ch, vectors) for each, its first channel
// and its count of 16-channel vectors.
template <typename Slice>
void for_channel_slices(int64_t c, Slice&& slice) {
  const int64_t width = c / 16 <= kMaxChannelVectors ? kMaxChannelVectors : kWideSliceVectors;
  for (int64_t ch = 0; ch < c; ch += 16 * width) slice(ch, std::min<int64_t>(width, (c - ch) / 16));
}

// O[r, :] += P[r] @ V for `rows` rows of c channels, in slices of channels (a register tile's);
// P as output_rows takes it.
template <typename P>
void accumulate_output(const P* p, int64_t p_stride, const uint32_t* vp, int64_t key_pairs, int64_t rows, int64_t c,
                       float* o) {
  for_channel_slices(c, [&](int64_t ch, int64_t vectors) {
    kOutputRowsFns<P>[vectors - 1](p, p_stride, vp + ch, c, key_pairs, rows, o + ch, c);
  });
}

// The int8 form of output_tile, for one block of keys: O[r, :16 CV] += P[r] @ V[:, :16 CV] over
// key_quads (<= kValueBlock / 4) quads of keys. p: rows of u8 codes (p_stride words of four), with
// the block's terms per row (p_terms, rows of pt_stride: P's scale, then the mass its codes
// dropped); vq: [key_quads][v_ld] words of four s8 codes (lane = channel), with the block's terms
// per channel (v_terms: V's scales, then at v_mean the block's mean of V). A tile of its own per
// block keeps the int32 sums in registers (with a loop over blocks around them, GCC kept them on
// the stack).
template <int R, int CV>
inline void output_tile_int8(const uint32_t* p, int64_t p_stride, const float* p_terms, int64_t pt_stride,
                             const uint32_t* vq, int64_t v_ld, const float* v_terms, int64_t v_mean,
                             int64_t key_quads, float* o, int64_t o_ld) {
  __m512i acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) acc[r][t] = _mm512_setzero_si512();
  for (int64_t j4 = 0; j4 < key_quads; ++j4) {
    __m512i values[CV];
    for (int t = 0; t < CV; ++t) values[t] = _mm512_loadu_si512(vq + j4 * v_ld + 16 * t);
    for (int r = 0; r < R; ++r) {
      const __m512i prob = _mm512_set1_epi32(static_cast<int>(p[r * p_stride + j4]));
      for (int t = 0; t < CV; ++t) acc[r][t] = genfast_avx512::dpbusd(acc[r][t], prob, values[t]);
    }
  }
  for (int t = 0; t < CV; ++t) {
    const __m512 channel_scale = _mm512_loadu_ps(v_terms + 16 * t);
    const __m512 mean = _mm512_loadu_ps(v_terms + v_mean + 16 * t);
    for (int r = 0; r < R; ++r) {
      float* dst = o + r * o_ld + 16 * t;
      const __m512 both = _mm512_mul_ps(channel_scale, _mm512_set1_ps(p_terms[r * pt_stride]));
      const __m512 dropped = _mm512_mul_ps(mean, _mm512_set1_ps(p_terms[r * pt_stride + 1]));
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), both, _mm512_add_ps(_mm512_loadu_ps(dst), dropped)));
    }
  }
}

// The rows' P @ V over key_quads quads of keys, block by block of kValueBlock keys (P's terms:
// a pair per block in rows of pt_stride; V's: rows of vt_ld per block, the means at v_mean).
template <int CV>
void output_rows_int8(const uint32_t* p, int64_t p_stride, const float* p_terms, int64_t pt_stride, const uint32_t* vq,
                      int64_t v_ld, const float* v_terms, int64_t vt_ld, int64_t v_mean, int64_t key_quads,
                      int64_t rows, float* o, int64_t o_ld) {
  constexpr int64_t kBlockQuads = kValueBlock / 4;
  for_row_tiles<kRows>(rows, [&]<int R>(int64_t r) {
    for (int64_t q0 = 0, block = 0; q0 < key_quads; q0 += kBlockQuads, ++block)
      output_tile_int8<R, CV>(p + r * p_stride + q0, p_stride, p_terms + r * pt_stride + 2 * block, pt_stride,
                              vq + q0 * v_ld, v_ld, v_terms + block * vt_ld, v_mean,
                              std::min(kBlockQuads, key_quads - q0), o + r * o_ld, o_ld);
  });
}

using OutputRowsInt8Fn = void (*)(const uint32_t*, int64_t, const float*, int64_t, const uint32_t*, int64_t,
                                  const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);
constexpr OutputRowsInt8Fn kOutputRowsInt8Fns[kMaxChannelVectors] = {
    output_rows_int8<1>, output_rows_int8<2>, output_rows_int8<3>,
    output_rows_int8<4>, output_rows_int8<5>, output_rows_int8<6>};

// accumulate_output on int8 codes: P's u8 codes with p_terms (rows of pt_stride), V's s8 codes with
// v_terms (quantize_values), over key_quads quads of keys from a block's start.
void accumulate_output_int8(const uint32_t* p, int64_t p_stride, const float* p_terms, int64_t pt_stride,
                            const uint32_t* vq, const float* v_terms, int64_t key_quads, int64_t rows, int64_t c,
                            float* o) {
  for_channel_slices(c, [&](int64_t ch, int64_t vectors) {
    kOutputRowsInt8Fns[vectors - 1](p, p_stride, p_terms, pt_stride, vq + ch, c, v_terms + ch, 2 * c, c, key_quads,
                                    rows, o + ch, c);
  });
}

// V's keys [j_begin, j_end) of one head (j_begin a multiple of kValueBlock, j_end of 4; keys from
// n on are padding) as s8 codes: vq [N_pad/4][c] words of four keys' codes per channel; v_terms
// [N_pad/kValueBlock][2][c]: each block's absmax / 127 per channel, then its mean over the block's
// keys (what the probabilities that P's codes drop are applied to). `row(j)` is key j's c values.
template <typename Row>
void quantize_values(Row&& row, int64_t n, int64_t c, int64_t j_begin, int64_t j_end, uint32_t* vq, float* v_terms) {
  for (int64_t b0 = j_begin; b0 < j_end; b0 += kValueBlock) {
    const int64_t b1 = std::min(b0 + kValueBlock, j_end), real_end = std::min(b1, n);
    float* scale = v_terms + (b0 / kValueBlock) * 2 * c;
    const __m512 inv_count = _mm512_set1_ps(1.0f / static_cast<float>(std::max<int64_t>(real_end - b0, 1)));
    for (int64_t ch = 0; ch < c; ch += 16) {
      __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
      for (int64_t j = b0; j < real_end; ++j) {
        const __m512 x = genfast_avx512::load16(row(j) + ch);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
        sum = _mm512_add_ps(sum, x);
      }
      _mm512_storeu_ps(scale + ch, _mm512_mul_ps(amax, _mm512_set1_ps(1.0f / 127)));
      _mm512_storeu_ps(scale + c + ch, _mm512_mul_ps(sum, inv_count));
      // 127 / absmax, 0 for channels of zeros (their codes are then 0).
      const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                             _mm512_set1_ps(127.0f), amax);
      for (int64_t j = b0; j < b1; j += 4) {
        __m512i word = _mm512_setzero_si512();
        for (int64_t jj = 0; jj < 4 && j + jj < real_end; ++jj) {
          const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(genfast_avx512::load16(row(j + jj) + ch), inv));
          word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_and_si512(code, _mm512_set1_epi32(0xff)), 8 * jj));
        }
        _mm512_storeu_si512(vq + (j / 4) * c + ch, word);
      }
    }
  }
}

// S for `rows` query rows against keys [0, n_pad): key block by key block, every row tile reading
// the block from L1. tile<R, KV>(r, j0) computes rows r .. r + R against keys j0 .. j0 + 16 KV.
template <typename Tile>
void score_rows(int64_t rows, int64_t n_pad, Tile&& tile) {
  int64_t j0 = 0;
  for (; j0 + 16 * kKeyVectors <= n_pad; j0 += 16 * kKeyVectors)
    for_row_tiles<kRows>(rows, [&]<int R>(int64_t r) { tile.template operator()<R, kKeyVectors>(r, j0); });
  for (; j0 < n_pad; j0 += 16) for_row_tiles<kRows>(rows, [&]<int R>(int64_t r) { tile.template operator()<R, 1>(r, j0); });
}

// Scale and bias one row's scores for keys j0 .. j0 + len (bias: query row `row`'s terms; none
// where bias.h is null, the scale then applied in the exponent).
void add_bias(float* s, const Bias& bias, int64_t row, int64_t j0, int64_t len, float scale) {
  if (!bias.h) return;
  const float* bias_h = bias.h + row * bias.grid_h;
  const float* bias_w = bias.w + row * bias.grid_w;
  for (int64_t j = j0, end = j0 + len; j < end;) {  // segment by segment of grid rows
    const int64_t kh = j / bias.grid_w, kw = j % bias.grid_w;
    const int64_t seg = std::min(end - j, bias.grid_w - kw);
    float* out = s + (j - j0);
    const float h_term = bias_h[kh];
    for (int64_t i = 0; i < seg; ++i) out[i] = out[i] * scale + h_term + bias_w[kw + i];
    j += seg;
  }
}

// Element offset of row `row` of head `bh` (batch entry bh / heads) in a [B, heads, N, C] view.
inline int64_t row_offset(const at::Tensor& t, int64_t heads, int64_t bh, int64_t row) {
  return (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1) + row * t.stride(2);
}

// rows[i] = row i of a 16 x 16 block of floats; afterwards rows[i] = its column i.
inline void transpose16(__m512 rows[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit block b: t[i] = r_i(4b), r_i+1(4b), r_i(4b+1), r_i+1(4b+1)
    t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // block b of u[i + w]: rows i .. i + 3 of column 4b + w
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int w = 0; w < 4; ++w) {  // column 4b + w: block b of u[w], u[4 + w], u[8 + w], u[12 + w]
    const __m512 lo01 = _mm512_shuffle_f32x4(u[w], u[4 + w], 0x44), hi01 = _mm512_shuffle_f32x4(u[w], u[4 + w], 0xEE);
    const __m512 lo23 = _mm512_shuffle_f32x4(u[8 + w], u[12 + w], 0x44);
    const __m512 hi23 = _mm512_shuffle_f32x4(u[8 + w], u[12 + w], 0xEE);
    rows[w] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
    rows[4 + w] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
    rows[8 + w] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
    rows[12 + w] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
  }
}

// `attention` over at most kLaneKeys keys (the mask decoder's image-to-token attention: 4096 image
// tokens over the 7-8 prompt tokens), in fp32, 16 query rows at a time. The general path's
// softmax takes a horizontal max and sum per query row; with 8 keys those reductions, and the
// loop around each row, were most of its time (docs/notes.md, SAM 2's automatic generator). Here each
// row's scores are a vector over the keys; 16 rows' vectors are transposed so that the max, the
// exponentials and the sum run down the keys, one vector of 16 rows each, and transposed back
// for P @ V, which sums down the keys into one vector per channel (16 rows' outputs), transposed
// back to rows: the decoder's [4, 8, 4096, 16] over 8 keys in less than half the general path's time.
constexpr int64_t kLaneKeys = 16;
constexpr int64_t kFewKeysTaskRows = 256;  // query rows per task (K and V widened once per task)
// Only from this many query rows per head: Hiera's windows of 16 keys (4 or 16 queries each) ran
// slower here than on the general path, which widens nothing per window.
constexpr int64_t kFewKeysMinQueries = 256;

at::Tensor attend_few_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t heads = q.size(1), nq = q.size(2), n = k.size(2), c = q.size(3);
  const int64_t bh_count = q.size(0) * heads, blocks = (nq + kFewKeysTaskRows - 1) / kFewKeysTaskRows;
  at::Tensor out = at::empty({q.size(0), nq, heads, c}, q.options());
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const auto* q_ptr = q.data_ptr<at::BFloat16>();
  const auto* k_ptr = k.data_ptr<at::BFloat16>();
  const auto* v_ptr = v.data_ptr<at::BFloat16>();
  const __m512 exp_scale = _mm512_set1_ps(static_cast<float>(scale));
  at::parallel_for(0, bh_count * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> keys, values, query_rows;
    keys.assign(c * kLaneKeys, 0.0f);  // [c][16]: channel ch of every key (zero past n: set once)
    values.resize(kLaneKeys * c);  // [16][c]
    query_rows.assign(kLaneKeys * c, 0.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i_begin = (task % blocks) * kFewKeysTaskRows;
      const int64_t i_end = std::min(nq, i_begin + kFewKeysTaskRows);
      for (int64_t j = 0; j < n; ++j) {
        const at::BFloat16* kj = k_ptr + row_offset(k, heads, bh, j);
        const at::BFloat16* vj = v_ptr + row_offset(v, heads, bh, j);
        for (int64_t ch = 0; ch < c; ++ch) keys[ch * kLaneKeys + j] = static_cast<float>(kj[ch]);
        for (int64_t ch = 0; ch < c; ch += 16)
          _mm512_storeu_ps(values.data() + j * c + ch, genfast_avx512::load16(vj + ch));
      }
      for (int64_t i0 = i_begin; i0 < i_end; i0 += 16) {
        const int64_t rows = std::min<int64_t>(16, i_end - i0);
        for (int64_t r = 0; r < rows; ++r) {  // the rows in fp32 (past `rows`: an earlier group's, or zeros)
          const at::BFloat16* src = q_ptr + row_offset(q, heads, bh, i0 + r);
          for (int64_t ch = 0; ch < c; ch += 16)
            _mm512_storeu_ps(query_rows.data() + r * c + ch, genfast_avx512::load16(src + ch));
        }
        // Every loop over the 16 rows or keys has that constant count, so that s stays in registers.
        __m512 s[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) s[r] = _mm512_setzero_ps();
        for (int64_t ch = 0; ch < c; ++ch) {  // s[r]: row r's scores over the keys
          const __m512 key_channel = _mm512_loadu_ps(keys.data() + ch * kLaneKeys);
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(query_rows[r * c + ch]), key_channel, s[r]);
        }
        transpose16(s);  // s[j]: key j's scores over the 16 rows
        __m512 m = s[0];
#pragma GCC unroll 16
        for (int j = 1; j < 16; ++j) {
          if (j >= n) s[j] = _mm512_set1_ps(-INFINITY);
          m = _mm512_max_ps(m, s[j]);
        }
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {  // padding keys: exp of at most -87, ~1e-38
          s[j] = genfast_avx512::exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(s[j], m), exp_scale));
          sum = _mm512_add_ps(sum, s[j]);
        }
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) s[j] = _mm512_mul_ps(s[j], inv);  // s[j]: key j's probabilities over the rows
        for (int64_t ch0 = 0; ch0 < c; ch0 += 16) {
          __m512 o[16];  // o[t]: channel ch0 + t of the 16 rows' outputs (16 independent sums)
#pragma GCC unroll 16
          for (int t = 0; t < 16; ++t) o[t] = _mm512_setzero_ps();
          for (int64_t j = 0; j < n; ++j) {
            const float* vj = values.data() + j * c + ch0;
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) o[t] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vj[t]), o[t]);
          }
          transpose16(o);  // o[r]: row r's 16 channels
          for (int64_t r = 0; r < rows; ++r) {
            at::BFloat16* dst = out_ptr + (((bh / heads) * nq + i0 + r) * heads + bh % heads) * c + ch0;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(o[r])));
          }
        }
      }
    }
  });
  return out;
}

// The bf16 products on AVX512-BF16's dot products (vdpbf16ps), in register tiles.
struct VectorProducts {
  static constexpr int64_t kKeyAlign = 16;  // keys are padded to a multiple of this
  static constexpr int64_t kRowAlign = 1;   // a task's buffers hold its rows rounded up to this
  static constexpr int64_t kOnePassElements = ::kOnePassElements;  // of K, for one pass over the keys

  // While a thread runs tasks (nothing to set up here).
  struct Session {};

  // S[r, j] = q[r] . k[j] for `rows` rows (q: rows of `pairs` channel pairs, q_stride apart) and
  // keys [0, len) of kp ([pairs][k_ld] channel pairs, lane = key); s: rows of s_ld floats.
  static void scores(const uint32_t* q, int64_t q_stride, int64_t rows, const uint32_t* kp, int64_t k_ld,
                     int64_t pairs, int64_t len, float* s, int64_t s_ld) {
    score_rows(rows, len, [&]<int R, int KV>(int64_t r, int64_t j) {
      scores_tile<R, KV>(q + r * q_stride, q_stride, kp, k_ld, pairs, j, s + r * s_ld, s_ld);
    });
  }

  // O[r, :] += P[r] @ V for `rows` rows: p rows of key_pairs probability pairs (p_stride apart), vp
  // [key_pairs][c] key pairs (lane = channel), o rows of c floats.
  static void accumulate(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t key_pairs, int64_t rows,
                         int64_t c, float* o) {
    accumulate_output(p, p_stride, vp, key_pairs, rows, c, o);
  }
};

// q and k [B, heads, Nq or Nk, C], v [B, heads, Nk, Cv]: views with unit channel stride (e.g.
// straight out of the qkv projection: no copies). Returns [B, Nq, heads, Cv]: the layout the
// output projection reads. Products: the bf16 products' policy (VectorProducts above).
template <typename Products>
at::Tensor attend(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Bias& bias,
                  double scale, genfast_rel_pos_attention::Products products) {
  const bool int8_scores = products.int8_scores, int8_values = products.int8_values;
  const bool fp32_scores = products.fp32 && !int8_scores, fp32_values = products.fp32 && !int8_values;
  TORCH_CHECK(!((int8_scores || int8_values) && bias.h), op, ": int8 products take no bias");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              op, ": q, k, v must be bfloat16");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(0) % 2 == 0 && t->stride(1) % 2 == 0 && t->stride(2) % 2 == 0, op,
                ": q, k, v need unit channel stride and even strides");
  const int64_t batch = q.size(0), heads = q.size(1), nq = q.size(2), n = k.size(2), c = q.size(3), cv = v.size(3);
  if (n <= kLaneKeys && nq >= kFewKeysMinQueries && !bias.h && !int8_scores && !int8_values && cv == c)
    return attend_few_keys(q, k, v, scale);
  const int64_t bh_count = batch * heads;
  constexpr int64_t key_align = Products::kKeyAlign, row_align = Products::kRowAlign;
  const int64_t n_pad = (n + key_align - 1) / key_align * key_align, pairs = c / 2, quads = c / 4, key_pairs = n_pad / 2;
  const int64_t k_ld = n_pad + kRowPad;  // the row stride of K
  const int64_t k_rows = int8_scores ? quads : pairs;  // K's rows: channel quads of s8 codes, or pairs of bf16
  const int64_t v_rows = int8_values ? n_pad / 4 : key_pairs;  // V's rows: key quads of s8 codes, or pairs of bf16
  const int64_t value_blocks = (n_pad + kValueBlock - 1) / kValueBlock;  // int8 values: V's scale rows

  // Keys per pass (see the header): all of them up to kOnePassKeys, else chunks of kKeyChunk.
  const bool one_pass = n_pad <= kOnePassKeys && n_pad * c <= Products::kOnePassElements;
  const int64_t chunk = one_pass ? n_pad : kKeyChunk;
  const int64_t s_ld = chunk + kRowPad;  // the row stride of the scores
  // Query rows per task: a whole head's, up to kMaxQueryBlock, where the keys are few (windows);
  // kQueryBlock where a pass holds many (the rows' scores stay in L2); kLongQueryBlock where the
  // keys come in chunks, so that each chunk of K and V, read from memory, serves many rows.
  const int64_t query_block = n_pad <= kFewKeys       ? std::min(nq, kMaxQueryBlock)
                              : one_pass              ? kQueryBlock
                                                      : kLongQueryBlock;
  const int64_t blocks = (nq + query_block - 1) / query_block;
  const int64_t buffer_rows = (query_block + row_align - 1) / row_align * row_align;
  // int8 values: P's terms per row of a pass, a scale and a dropped mass per block of keys.
  const int64_t pt_stride = 2 * ((chunk + kValueBlock - 1) / kValueBlock);

  // K and V re-laid out per head (see the header; padding keys are zero): once, before the tasks,
  // where a head's queries take several tasks; else by the task itself, into buffers that stay in
  // its cache. Written out and read back, the copies of many small windows were a third of their
  // attention's time (sam2.1-hiera-tiny's 1/4 and 1/8 scales, Zen 4).
  const bool shared = blocks > 1;
  const auto* k16 = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* v16 = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  // Keys [j_begin, j_end) of head bh (both even, j_end <= n_pad). K is transposed 16 keys at a
  // time: each channel pair's 16 keys fill one cache line, read from 16 rows that stay in L1 (key
  // by key, each key's row was scattered over `pairs` lines, a third of a 28.7K-key call's
  // re-layout time on Zen 4).
  // Head bh's re-laid out K and V; with int8 scores, K's codes and each key's scale and offset;
  // with int8 values, V's codes and terms.
  struct HeadBuffers {
    uint32_t* k;
    uint32_t* v;
    float* k_scale = nullptr;
    int32_t* k_offset = nullptr;
    float* v_terms = nullptr;  // int8 values: [value_blocks][2][cv] (quantize_values)
  };
  auto relayout = [&](int64_t bh, const HeadBuffers& dst_head, int64_t j_begin, int64_t j_end) {
    const int64_t real_end = std::min(j_end, n);
    uint32_t* kpb = dst_head.k;
    for (int64_t j = j_begin; j < real_end; j += 16) {
      const int64_t len = std::min<int64_t>(16, real_end - j);
      alignas(64) uint8_t codes[16][kMaxHeadDim];
      const uint32_t* rows[16];
      for (int64_t jj = 0; jj < len; ++jj) {
        const int64_t offset = row_offset(k, heads, bh, j + jj);
        if (int8_scores) {
          int32_t code_sum;
          dst_head.k_scale[j + jj] = quantize_row(reinterpret_cast<const c10::BFloat16*>(k16 + offset), c, 0,
                                                  codes[jj], &code_sum);
          dst_head.k_offset[j + jj] = 128 * code_sum;  // what the queries' u8 codes (+128) add
          rows[jj] = reinterpret_cast<const uint32_t*>(codes[jj]);
        } else {
          rows[jj] = reinterpret_cast<const uint32_t*>(k16 + offset);
        }
      }
      // 16 rows at a time, as 16 x 16 transposes in registers (stored element by element, they
      // were most of a small window's re-layout time); a short last group of keys gets zeros.
      int64_t row = 0;
      for (; row + 16 <= k_rows; row += 16) {
        __m512 block[16];
        for (int64_t jj = 0; jj < 16; ++jj)
          block[jj] = jj < len ? _mm512_castsi512_ps(_mm512_loadu_si512(rows[jj] + row)) : _mm512_setzero_ps();
        transpose16(block);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(kpb + (row + i) * k_ld + j), block[i]);
      }
      for (; row < k_rows; ++row) {
        uint32_t* dst = kpb + row * k_ld + j;
        for (int64_t jj = 0; jj < len; ++jj) dst[jj] = rows[jj][row];
      }
    }
    for (int64_t j = std::max(j_begin, n); j < j_end; ++j) {
      for (int64_t row = 0; row < k_rows; ++row) kpb[row * k_ld + j] = 0;
      if (int8_scores) dst_head.k_scale[j] = 0.0f, dst_head.k_offset[j] = 0;
    }
    uint32_t* vpb = dst_head.v;
    if (int8_values) {
      const auto value_row = [&](int64_t j) {
        return reinterpret_cast<const c10::BFloat16*>(v16 + row_offset(v, heads, bh, j));
      };
      quantize_values(value_row, n, cv, j_begin, j_end, vpb, dst_head.v_terms);
      return;
    }
    for (int64_t j2 = j_begin / 2; j2 < j_end / 2; ++j2) {
      const int64_t j = 2 * j2;
      const uint16_t* even = j < n ? v16 + row_offset(v, heads, bh, j) : nullptr;
      const uint16_t* odd = j + 1 < n ? v16 + row_offset(v, heads, bh, j + 1) : nullptr;
      uint32_t* dst = vpb + j2 * cv;
      if (even && odd) {
        for (int64_t ch = 0; ch < cv; ++ch) dst[ch] = even[ch] | static_cast<uint32_t>(odd[ch]) << 16;
      } else {
        for (int64_t ch = 0; ch < cv; ++ch) dst[ch] = (even ? even[ch] : 0u) | (odd ? static_cast<uint32_t>(odd[ch]) << 16 : 0u);
      }
    }
  };
  // Head bh's buffers in the shared tensors.
  at::Tensor kp, vp, k_scales, k_offsets, v_terms;
  auto shared_head = [&](int64_t bh) {
    HeadBuffers head{reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>()) + bh * k_rows * k_ld,
                     reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>()) + bh * v_rows * cv};
    if (int8_scores) {
      head.k_scale = k_scales.data_ptr<float>() + bh * k_ld;
      head.k_offset = k_offsets.data_ptr<int32_t>() + bh * k_ld;
    }
    if (int8_values) head.v_terms = v_terms.data_ptr<float>() + bh * value_blocks * 2 * cv;
    return head;
  };
  if (shared) {
    kp = at::empty({bh_count, k_rows, k_ld}, q.options().dtype(at::kInt));
    vp = at::empty({bh_count, v_rows, cv}, q.options().dtype(at::kInt));
    if (int8_scores) {
      k_scales = at::empty({bh_count, k_ld}, q.options().dtype(at::kFloat));
      k_offsets = at::empty({bh_count, k_ld}, q.options().dtype(at::kInt));
    }
    if (int8_values) v_terms = at::empty({bh_count, value_blocks, 2, cv}, q.options().dtype(at::kFloat));
    // In blocks of keys as well as heads: the memory attention has one head, whose re-layout of
    // ~29K keys would otherwise run on one thread while the others wait.
    const int64_t key_blocks = (n_pad + kRelayoutKeys - 1) / kRelayoutKeys;
    at::parallel_for(0, bh_count * key_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t bh = t / key_blocks, j0 = (t % key_blocks) * kRelayoutKeys;
        relayout(bh, shared_head(bh), j0, std::min(j0 + kRelayoutKeys, n_pad));
      }
    });
  }

  at::Tensor out = at::empty({batch, nq, heads, cv}, q.options());
  const auto* q16 = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const float scale_f = static_cast<float>(scale);
  // Without a bias the scale goes into the exponent: exp(scale * (s - max)), scale > 0.
  const float exp_scale_f = bias.h ? 1.0f : scale_f;
  const __m512 exp_scale = _mm512_set1_ps(exp_scale_f);
  const int64_t q_stride = q.stride(2) / 2;  // in channel pairs

  at::parallel_for(0, bh_count * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores, outputs, row_max, row_sum;
    thread_local std::vector<at::BFloat16> probs;
    thread_local std::vector<uint32_t> own_k, own_v;  // the task's own re-layout (!shared)
    thread_local std::vector<float> own_k_scale, own_v_terms, q_scale;
    thread_local std::vector<float> p_terms;  // int8 values: P's per row and block of the pass
    thread_local std::vector<int32_t> own_k_offset;
    thread_local std::vector<uint32_t> q_codes;  // int8 scores: the task's rows as u8 codes
    thread_local std::vector<float> q_wide;  // fp32 scores: the task's rows in fp32
    const typename Products::Session session;
    scores.resize(buffer_rows * s_ld);
    probs.resize(buffer_rows * s_ld);
    outputs.resize(buffer_rows * cv);
    row_max.resize(query_block);
    row_sum.resize(query_block);
    if (!shared) {
      own_k.resize(k_rows * k_ld);
      own_v.resize(v_rows * cv);
      if (int8_scores) {
        own_k_scale.resize(k_ld);
        own_k_offset.resize(k_ld);
      }
      if (int8_values) own_v_terms.resize(value_blocks * 2 * cv);
    }
    if (int8_values) p_terms.resize(query_block * pt_stride);
    if (int8_scores) {
      q_codes.resize(query_block * quads);
      q_scale.resize(query_block);
    }
    if (fp32_scores) q_wide.resize(query_block * c);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i0 = (task % blocks) * query_block;
      const int64_t rows = std::min(query_block, nq - i0);
      const auto* qb = reinterpret_cast<const uint32_t*>(q16 + row_offset(q, heads, bh, i0));
      const HeadBuffers head = shared ? shared_head(bh)
                                      : HeadBuffers{own_k.data(), own_v.data(), own_k_scale.data(), own_k_offset.data(),
                                                    own_v_terms.data()};
      if (!shared) relayout(bh, head, 0, n_pad);
      const uint32_t* kpb = head.k;
      const uint32_t* vpb = head.v;
      if (int8_scores) {
        for (int64_t r = 0; r < rows; ++r) {
          int32_t unused;
          q_scale[r] = quantize_row(reinterpret_cast<const c10::BFloat16*>(q16 + row_offset(q, heads, bh, i0 + r)), c, 128,
                                    reinterpret_cast<uint8_t*>(q_codes.data() + r * quads), &unused);
        }
      }
      if (fp32_scores) {
        for (int64_t r = 0; r < rows; ++r) {
          const auto* src = reinterpret_cast<const c10::BFloat16*>(q16 + row_offset(q, heads, bh, i0 + r));
          for (int64_t ch = 0; ch < c; ch += 16) _mm512_storeu_ps(q_wide.data() + r * c + ch, genfast_avx512::load16(src + ch));
        }
      }
      // The rows a policy rounds up to as well: past the task's they are computed, never read.
      std::fill(outputs.begin(), outputs.begin() + (rows + row_align - 1) / row_align * row_align * cv, 0.0f);
      std::fill(row_max.begin(), row_max.begin() + rows, -INFINITY);
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.0f);

      // The online softmax over the passes: each row keeps its running max m and sum l of
      // exp(scale (s - m)); a pass with a larger max rescales both, and the output, by
      // exp(scale (m_old - m_new)). One pass (the common case) rescales nothing.
      for (int64_t j0 = 0; j0 < n_pad; j0 += chunk) {
        const int64_t len = std::min(chunk, n_pad - j0), real = std::min(len, n - j0);
        float* s = scores.data();
        if (int8_scores) {
          score_rows(rows, len, [&]<int R, int KV>(int64_t r, int64_t j) {
            scores_tile_int8<R, KV>(q_codes.data() + r * quads, quads, q_scale.data() + r, kpb + j0, k_ld, quads, j,
                                    head.k_scale + j0, head.k_offset + j0, s + r * s_ld, s_ld);
          });
        } else if (fp32_scores) {
          score_rows(rows, len, [&]<int R, int KV>(int64_t r, int64_t j) {
            scores_tile<R, KV>(q_wide.data() + r * c, c, kpb + j0, k_ld, pairs, j, s + r * s_ld, s_ld);
          });
        } else {
          Products::scores(qb, q_stride, rows, kpb + j0, k_ld, pairs, len, s, s_ld);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* row = s + r * s_ld;
          add_bias(row, bias, bh * nq + i0 + r, j0, real, scale_f);
          for (int64_t j = real; j < len; ++j) row[j] = -INFINITY;
          // The row's largest score, and with int8 values each block's: P's scale in a block (its
          // largest probability) then follows from it, and the probabilities go to codes in one pass.
          float block_top[kOnePassKeys / kValueBlock];
          __m512 vmax = _mm512_set1_ps(-INFINITY);
          for (int64_t b0 = 0; b0 < len; b0 += kValueBlock) {
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int64_t j = b0, b1 = std::min(kValueBlock, len - b0) + b0; j < b1; j += 16)
              top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
            if (int8_values) block_top[b0 / kValueBlock] = _mm512_reduce_max_ps(top);
            vmax = _mm512_max_ps(vmax, top);
          }
          const float pass_max = std::max(row_max[r], _mm512_reduce_max_ps(vmax));
          if (pass_max > row_max[r] && row_max[r] != -INFINITY) {
            const float rescale = std::exp(exp_scale_f * (row_max[r] - pass_max));
            row_sum[r] *= rescale;
            float* o = outputs.data() + r * cv;
            for (int64_t ch = 0; ch < cv; ++ch) o[ch] *= rescale;
          }
          row_max[r] = pass_max;
          const __m512 m = _mm512_set1_ps(pass_max);
          __m512 vsum = _mm512_setzero_ps();
          at::BFloat16* prow = probs.data() + r * s_ld;
          const auto probability = [&](__m512 score) {  // unnormalized: exp(scale (s - max))
            return exp_to_bf16(_mm512_mul_ps(_mm512_sub_ps(score, m), exp_scale));
          };
          const auto probabilities = [&](int64_t j) {  // keys j .. j + 16 of the pass
            const __m512 e = probability(_mm512_loadu_ps(row + j));
            if (j + 16 <= real) return e;
            return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << std::max<int64_t>(real - j, 0)) - 1), e);
          };
          if (int8_values) {
            // Each block's probabilities as u8 codes of its largest / 255 (the row's bytes where
            // its bf16 would be), and the mass the codes leave out (probabilities under half a
            // step round to 0), which the output takes back on the block's mean of V.
            auto* codes = reinterpret_cast<uint8_t*>(prow);
            float* terms = p_terms.data() + r * pt_stride;
            for (int64_t b0 = 0; b0 < len; b0 += kValueBlock) {
              const int64_t b1 = std::min(kValueBlock, len - b0) + b0;
              // Its largest probability, computed as its keys' are (0 for a block of padding).
              const float top = block_top[b0 / kValueBlock];
              const float largest = top == -INFINITY ? 0.0f : _mm512_cvtss_f32(probability(_mm512_set1_ps(top)));
              const __m512 inv = _mm512_set1_ps(largest > 0.0f ? 255.0f / largest : 0.0f);
              __m512 block_sum = _mm512_setzero_ps();
              __m512i code_sum = _mm512_setzero_si512();
              for (int64_t j = b0; j < b1; j += 16) {
                const __m512 e = probabilities(j);
                block_sum = _mm512_add_ps(block_sum, e);
                const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(e, inv));  // 0..255 (saturated below)
                code_sum = _mm512_add_epi32(code_sum, code);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtusepi32_epi8(code));
              }
              vsum = _mm512_add_ps(vsum, block_sum);
              const float step = largest / 255.0f;
              terms[2 * (b0 / kValueBlock)] = step;
              terms[2 * (b0 / kValueBlock) + 1] =
                  _mm512_reduce_add_ps(block_sum) - step * static_cast<float>(_mm512_reduce_add_epi32(code_sum));
            }
          } else if (fp32_values) {  // P in fp32, over the row's scores
            for (int64_t j = 0; j < len; j += 16) {
              const __m512 e = probabilities(j);
              vsum = _mm512_add_ps(vsum, e);
              _mm512_storeu_ps(row + j, e);
            }
          } else {
            for (int64_t j = 0; j < len; j += 16) {
              const __m512 e = probabilities(j);
              vsum = _mm512_add_ps(vsum, e);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
            }
          }
          row_sum[r] += _mm512_reduce_add_ps(vsum);
        }
        if (int8_values) {
          accumulate_output_int8(reinterpret_cast<const uint32_t*>(probs.data()), s_ld / 2, p_terms.data(), pt_stride,
                                 vpb + (j0 / 4) * cv, head.v_terms + (j0 / kValueBlock) * 2 * cv, len / 4, rows, cv,
                                 outputs.data());
        } else if (fp32_values) {
          accumulate_output(static_cast<const float*>(s), s_ld, vpb + (j0 / 2) * cv, len / 2, rows, cv, outputs.data());
        } else {
          Products::accumulate(reinterpret_cast<const uint32_t*>(probs.data()), s_ld / 2, vpb + (j0 / 2) * cv, len / 2,
                               rows, cv, outputs.data());
        }
      }

      const int64_t b = bh / heads, h = bh % heads;
      for (int64_t r = 0; r < rows; ++r) {
        const float* o = outputs.data() + r * cv;
        at::BFloat16* dst = out_ptr + ((b * nq + i0 + r) * heads + h) * cv;
        const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
        for (int64_t ch = 0; ch < cv; ch += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + ch),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + ch), inv))));
      }
    }
  });
  return out;
}

}  // namespace
