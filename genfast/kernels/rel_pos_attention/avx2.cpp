// Attention with SAM's decomposed relative-position bias, fused, for AVX2 + FMA CPUs:
//
//   out[b, i] = sum_j softmax_j(scale * q[b, i] . k[b, j] + rel_h[b, i, j / W] + rel_w[b, i, j % W]) v[b, j]
//
// and `attention`, the same without a bias and with any number of queries: the same ops as
// avx512.cpp (which explains why they are fused), computed in fp32
// throughout: CPUs without AVX-512 have no bf16 dot-product instruction, so SAM runs in fp32 there
// and the inputs may be float32 or bfloat16 (widened on load; the output has the input's dtype).
//
// Each task takes kQueryBlock query rows of one head. Their scaled queries (16 x C) stay in L1,
// their scores (16 x N fp32: 256 KB at N = 4096) in L2, where the bias is added, the softmax
// taken (the scores are overwritten by unnormalized probabilities) and P @ V accumulated.
// Operands are re-laid out once per head so every inner-loop load is one contiguous 8-lane vector:
//   K as blocks of 8 keys, [N_pad/8][C][8], for S = Q K^T (lane = key);
//   V row by row,          [N_pad][C],      for O = P V   (lane = channel).
// N is padded to a multiple of 8 with zero keys whose probabilities are set to 0. Both products
// keep their K or V slice in L1 across the block's rows: keys tile-by-tile for S, and chunks of
// kKeyChunk keys for O (whose accumulators are reloaded from L1 per chunk).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/avx2_vectors.h"
#include "rel_pos_attention.h"

namespace {

using namespace genfast_avx2;
using genfast_rel_pos_attention::Bias;

constexpr int64_t kQueryBlock = 16;  // query rows per task
constexpr int kRows = 4;             // query rows per register tile (divides kQueryBlock)
constexpr int kKeyVectors = 3;       // 8-key vectors per register tile of S: 4 x 3 accumulators
constexpr int kChannelVectors = 2;   // 8-channel vectors per register tile of O: 4 x 2 accumulators
constexpr int64_t kKeyChunk = 64;    // keys per chunk of O = P V (64 x C fp32 of V: 16 KB at C = 64)

// S[r, 8 * (kb + t) + l] = q[r] . k[8 * (kb + t) + l] for R rows and KV blocks of 8 keys.
// q: R rows of C floats; kp: [N_pad/8][C][8].
template <int R, int KV>
inline void scores_tile(const float* q, int64_t c, const float* kp, int64_t kb, float* s, int64_t s_stride) {
  __m256 acc[R][KV];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < KV; ++t) acc[r][t] = _mm256_setzero_ps();
  const float* keys = kp + kb * c * 8;
  for (int64_t ch = 0; ch < c; ++ch) {
    __m256 key[KV];
    #pragma GCC unroll 8
    for (int t = 0; t < KV; ++t) key[t] = _mm256_loadu_ps(keys + (t * c + ch) * 8);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 query = _mm256_broadcast_ss(q + r * c + ch);
      #pragma GCC unroll 8
      for (int t = 0; t < KV; ++t) acc[r][t] = _mm256_fmadd_ps(query, key[t], acc[r][t]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < KV; ++t) _mm256_storeu_ps(s + r * s_stride + 8 * (kb + t), acc[r][t]);
}

// S for `rows` rows (a multiple of R) against all n_pad keys; each key tile is reused by every row tile.
template <int R>
void score_rows(const float* q, int64_t rows, int64_t c, const float* kp, int64_t n_pad, float* s) {
  const int64_t key_blocks = n_pad / 8;
  int64_t kb = 0;
  for (; kb + kKeyVectors <= key_blocks; kb += kKeyVectors)
    for (int64_t r = 0; r < rows; r += R) scores_tile<R, kKeyVectors>(q + r * c, c, kp, kb, s + r * n_pad, n_pad);
  for (; kb < key_blocks; ++kb)
    for (int64_t r = 0; r < rows; r += R) scores_tile<R, 1>(q + r * c, c, kp, kb, s + r * n_pad, n_pad);
}

// O[r, ch0 : ch0 + 8 CV] += P[r, j0 : j1] @ V[j0 : j1, ch0 : ch0 + 8 CV] for R rows.
template <int R, int CV>
inline void output_tile(const float* p, int64_t p_stride, const float* vp, int64_t c, int64_t j0, int64_t j1,
                        int64_t ch0, float* o) {
  __m256 acc[R][CV];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < CV; ++t) acc[r][t] = _mm256_loadu_ps(o + r * c + ch0 + 8 * t);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 value[CV];
    #pragma GCC unroll 8
    for (int t = 0; t < CV; ++t) value[t] = _mm256_loadu_ps(vp + j * c + ch0 + 8 * t);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 prob = _mm256_broadcast_ss(p + r * p_stride + j);
      #pragma GCC unroll 8
      for (int t = 0; t < CV; ++t) acc[r][t] = _mm256_fmadd_ps(prob, value[t], acc[r][t]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < CV; ++t) _mm256_storeu_ps(o + r * c + ch0 + 8 * t, acc[r][t]);
}

// O = P V for `rows` rows (a multiple of R), V in chunks of kKeyChunk keys that every row tile reuses.
template <int R>
void output_rows(const float* p, int64_t rows, int64_t n_pad, const float* vp, int64_t c, float* o) {
  std::fill(o, o + rows * c, 0.0f);
  for (int64_t j0 = 0; j0 < n_pad; j0 += kKeyChunk) {
    const int64_t j1 = std::min(j0 + kKeyChunk, n_pad);
    for (int64_t r = 0; r < rows; r += R) {
      int64_t ch = 0;
      for (; ch + 8 * kChannelVectors <= c; ch += 8 * kChannelVectors)
        output_tile<R, kChannelVectors>(p + r * n_pad, n_pad, vp, c, j0, j1, ch, o + r * c);
      for (; ch < c; ch += 8) output_tile<R, 1>(p + r * n_pad, n_pad, vp, c, j0, j1, ch, o + r * c);
    }
  }
}

// Bias, softmax numerator and 1 / denominator of one score row, in place: row[j] becomes
// exp(row[j] + bias_h[j / W] + bias_w[j % W] - max) (no bias where bias_h is null), zero for the
// padding keys j >= n.
float softmax_row(float* row, const float* bias_h, const float* bias_w, int64_t grid_h, int64_t grid_w,
                  int64_t n, int64_t n_pad) {
  for (int64_t kh = 0; bias_h && kh < grid_h; ++kh) {
    float* seg = row + kh * grid_w;
    const float h_term = bias_h[kh];
    for (int64_t kw = 0; kw < grid_w; ++kw) seg[kw] += h_term + bias_w[kw];
  }
  for (int64_t j = n; j < n_pad; ++j) row[j] = -INFINITY;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n_pad; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
  const __m256 row_max = _mm256_set1_ps(hmax(vmax));
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n_pad; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), row_max));
    _mm256_storeu_ps(row + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float padding = 0.0f;  // exp of the clamped -inf: tiny but not zero
  for (int64_t j = n; j < n_pad; ++j) {
    padding += row[j];
    row[j] = 0.0f;
  }
  return 1.0f / (hsum(vsum) - padding);
}

// q [B, heads, Nq, C], k [B, heads, Nk, C], v [B, heads, Nk, Cv]: views, any strides. Returns
// [B, Nq, heads, Cv].
template <typename T>
at::Tensor attention_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Bias& bias,
                           double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), nq = q.size(2), n = k.size(2), c = q.size(3), cv = v.size(3);
  const int64_t grid_h = bias.grid_h, grid_w = bias.grid_w;
  const int64_t bh_count = batch * heads, n_pad = (n + 7) / 8 * 8;
  // Element (bh, row, ch) of a [B, heads, N, C] view, any strides.
  auto at_ = [heads](const at::Tensor& t, const T* data, int64_t bh, int64_t row, int64_t ch) {
    return static_cast<float>(
        data[(bh / heads) * t.stride(0) + (bh % heads) * t.stride(1) + row * t.stride(2) + ch * t.stride(3)]);
  };
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();

  // One-time re-layout per head (see the header); padding keys are zero.
  at::Tensor kp = at::zeros({bh_count, n_pad / 8, c, 8}, q.options().dtype(at::kFloat));
  at::Tensor vp = at::zeros({bh_count, n_pad, cv}, q.options().dtype(at::kFloat));
  float* kp_data = kp.data_ptr<float>();
  float* vp_data = vp.data_ptr<float>();
  at::parallel_for(0, bh_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      float* kpb = kp_data + bh * n_pad * c;
      float* vpb = vp_data + bh * n_pad * cv;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t ch = 0; ch < c; ++ch) kpb[((j / 8) * c + ch) * 8 + j % 8] = at_(k, k_data, bh, j, ch);
        for (int64_t ch = 0; ch < cv; ++ch) vpb[j * cv + ch] = at_(v, v_data, bh, j, ch);
      }
    }
  });

  at::Tensor out = at::empty({batch, nq, heads, cv}, q.options());
  T* out_data = out.data_ptr<T>();
  const float scale_f = static_cast<float>(scale);
  const int64_t blocks = (nq + kQueryBlock - 1) / kQueryBlock;

  at::parallel_for(0, bh_count * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> queries, scores, outputs;
    queries.resize(kQueryBlock * c);
    scores.resize(kQueryBlock * n_pad);
    outputs.resize(kQueryBlock * cv);
    float inv_sum[kQueryBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i0 = (task % blocks) * kQueryBlock;
      const int64_t rows = std::min(kQueryBlock, nq - i0);
      // Whole register tiles: rows past the end are zero queries whose results are dropped.
      const int64_t tiled_rows = (rows + kRows - 1) / kRows * kRows;
      std::fill(queries.begin(), queries.end(), 0.0f);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t ch = 0; ch < c; ++ch) queries[r * c + ch] = at_(q, q_data, bh, i0 + r, ch) * scale_f;
      const float* kpb = kp_data + bh * n_pad * c;
      float* s = scores.data();
      score_rows<kRows>(queries.data(), tiled_rows, c, kpb, n_pad, s);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = bh * nq + i0 + r;
        inv_sum[r] = softmax_row(s + r * n_pad, bias.h ? bias.h + row * grid_h : nullptr,
                                 bias.w ? bias.w + row * grid_w : nullptr, grid_h, grid_w, n, n_pad);
      }
      for (int64_t r = rows; r < tiled_rows; ++r) std::fill(s + r * n_pad, s + (r + 1) * n_pad, 0.0f);
      output_rows<kRows>(s, tiled_rows, n_pad, vp_data + bh * n_pad * cv, cv, outputs.data());
      const int64_t b = bh / heads, h = bh % heads;
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = out_data + ((b * nq + i0 + r) * heads + h) * cv;
        for (int64_t ch = 0; ch < cv; ++ch) dst[ch] = static_cast<T>(outputs[r * cv + ch] * inv_sum[r]);
      }
    }
  });
  return out;
}

// q [B, heads, Nq, C], k [B, heads, Nk, C], v [B, heads, Nk, Cv]: views, any strides (e.g.
// straight out of the qkv projection). Returns [B, Nq, heads, Cv] in q's dtype: the layout the
// output projection reads.
at::Tensor attend(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Bias& bias,
                  double scale, genfast_rel_pos_attention::Products products) {
  // products.fp32 needs nothing: this variant multiplies in fp32 throughout.
  TORCH_CHECK(!products.int8_scores && !products.int8_values, op,
              ": int8 products need the AVX-512 variant (AVX512-VNNI)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              op, ": q, k, v must all be float32 or all bfloat16");
  if (q.scalar_type() == at::kBFloat16) return attention_typed<at::BFloat16>(q, k, v, bias, scale);
  return attention_typed<float>(q, k, v, bias, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("rel_pos_attention", &genfast_rel_pos_attention::rel_pos_attention<attend>);
  m.impl("attention", &genfast_rel_pos_attention::attention<attend>);
}
