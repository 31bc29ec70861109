// Attention with SAM's decomposed relative-position bias, fused, for bf16 on AVX512-BF16 CPUs:
//
//   out[b, i] = sum_j softmax_j(scale * q[b, i] . k[b, j] + rel_h[b, i, j / W] + rel_w[b, i, j % W]) v[b, j]
//
// for keys j = (row, column) on an H x W grid. The unfused form materializes the bias as a
// [B, N, N] tensor (N = 4096 for SAM's global blocks: 400 MB per head batch in bf16) and hands
// it to SDPA, so global attention is bound by writing and re-reading that tensor. Here each task
// takes 32 query rows of one head: their scores (32 x N fp32, 512 KB at N = 4096) stay in the L2
// cache, the bias is added from the two small tables while scores are still hot, and the
// softmax and P @ V follow before the next rows. Nothing of size N x N is ever written.
//
// Both products run on `vdpbf16ps` (16 lanes, each += a pair of bf16 products into fp32), so the
// scores and output accumulate in fp32 like a flash kernel; P is rounded to bf16 for P @ V.
// Operands are re-laid out once per head so every inner-loop load is one contiguous vector:
//   K as pairs of channels, [C/2][N_pad] (lane = key), for S = Q K^T;
//   V as pairs of keys,     [N_pad/2][C] (lane = channel), for O = P V.
// N is padded to a multiple of 16 with zero keys whose probabilities are set to 0.
//
// Compiled with -mavx512f/bw/bf16; the Python side calls it only when the CPU has them.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/avx512_vectors.h"

namespace {

using genfast_avx512::exp_nonpositive;

constexpr int64_t kQueryBlock = 32;  // query rows per task
constexpr int kRows = 4;             // query rows per register tile
constexpr int kKeyVectors = 4;       // 16-key vectors per register tile of S

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// S[r, j0 + 16t + l] = q[r] . k[j0 + 16t + l] for R rows and KV vectors of 16 keys.
// q: rows of C/2 channel pairs; kp: [C/2][n_pad] channel pairs.
template <int R, int KV>
inline void scores_tile(const uint32_t* q, int64_t q_stride, const uint32_t* kp, int64_t n_pad,
                        int64_t pairs, int64_t j0, float* s, int64_t s_stride) {
  __m512 acc[R][KV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c2 = 0; c2 < pairs; ++c2) {
    __m512bh keys[KV];
    for (int t = 0; t < KV; ++t) keys[t] = as_bh(_mm512_loadu_si512(kp + c2 * n_pad + j0 + 16 * t));
    for (int r = 0; r < R; ++r) {
      const __m512bh query = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * q_stride + c2])));
      for (int t = 0; t < KV; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], query, keys[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < KV; ++t) _mm512_storeu_ps(s + r * s_stride + j0 + 16 * t, acc[r][t]);
}

// O[r, :] = P[r] @ V for R rows, CV vectors of 16 channels (C = 16 * CV).
// p: rows of n_pad/2 probability pairs; vp: [n_pad/2][C] key pairs.
template <int R, int CV>
inline void output_tile(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t key_pairs, float* o) {
  constexpr int64_t c = 16 * CV;
  __m512 acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t j2 = 0; j2 < key_pairs; ++j2) {
    __m512bh values[CV];
    for (int t = 0; t < CV; ++t) values[t] = as_bh(_mm512_loadu_si512(vp + j2 * c + 16 * t));
    for (int r = 0; r < R; ++r) {
      const __m512bh prob = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * p_stride + j2])));
      for (int t = 0; t < CV; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], prob, values[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < CV; ++t) _mm512_storeu_ps(o + r * c + 16 * t, acc[r][t]);
}

template <int CV>
void output_rows(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t key_pairs, int64_t rows, float* o) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    output_tile<kRows, CV>(p + r * p_stride, p_stride, vp, key_pairs, o + r * 16 * CV);
  for (; r < rows; ++r) output_tile<1, CV>(p + r * p_stride, p_stride, vp, key_pairs, o + r * 16 * CV);
}

using OutputRowsFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*);
constexpr int kMaxChannelVectors = 8;  // head dims up to 128
constexpr OutputRowsFn kOutputRows[kMaxChannelVectors] = {
    output_rows<1>, output_rows<2>, output_rows<3>, output_rows<4>,
    output_rows<5>, output_rows<6>, output_rows<7>, output_rows<8>};

template <int R>
void score_rows(const uint32_t* q, int64_t q_stride, const uint32_t* kp, int64_t n_pad, int64_t pairs, float* s) {
  int64_t j0 = 0;
  for (; j0 + 16 * kKeyVectors <= n_pad; j0 += 16 * kKeyVectors)
    scores_tile<R, kKeyVectors>(q, q_stride, kp, n_pad, pairs, j0, s, n_pad);
  for (; j0 < n_pad; j0 += 16) scores_tile<R, 1>(q, q_stride, kp, n_pad, pairs, j0, s, n_pad);
}

// q, k, v: [B, heads, N, C] views with unit channel stride (e.g. straight out of the qkv
// projection: no copies); rel_h [B, heads, N, H], rel_w [B, heads, N, W].
// Returns [B, N, heads, C]: the layout the output projection reads.
at::Tensor rel_pos_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& rel_h, const at::Tensor& rel_w, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "rel_pos_attention: q, k, v must all be [B, heads, N, C]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "rel_pos_attention: q, k, v must be bfloat16");
  const int64_t batch = q.size(0), heads = q.size(1), n = q.size(2), c = q.size(3);
  TORCH_CHECK(c % 16 == 0 && c / 16 <= kMaxChannelVectors, "rel_pos_attention: head dim must be 16..128 in steps of 16");
  TORCH_CHECK(rel_h.dim() == 4 && rel_w.dim() == 4 && rel_h.sizes().slice(0, 3) == q.sizes().slice(0, 3) &&
                  rel_w.sizes().slice(0, 3) == q.sizes().slice(0, 3) && rel_h.size(3) * rel_w.size(3) == n,
              "rel_pos_attention: rel_h [B, heads, N, H] and rel_w [B, heads, N, W] need H * W = N");
  // Unit channel stride and even row strides, so channel pairs can be read as 32-bit words.
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(0) % 2 == 0 && t->stride(1) % 2 == 0 && t->stride(2) % 2 == 0,
                "rel_pos_attention: q, k, v need unit channel stride and even strides");
  const int64_t grid_w = rel_w.size(3), grid_h = rel_h.size(3);
  const at::Tensor bias_h = rel_h.to(at::kFloat).contiguous(), bias_w = rel_w.to(at::kFloat).contiguous();
  const int64_t bh_count = batch * heads;
  const int64_t n_pad = (n + 15) / 16 * 16, pairs = c / 2, key_pairs = n_pad / 2;
  // Element offset of row `row` of head `bh` in a [B, heads, N, C] view.
  auto row_offset = [heads](const at::Tensor& t, int64_t bh, int64_t row) {
    return (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1) + row * t.stride(2);
  };

  // One-time re-layout per head (see the header); padding keys are zero.
  at::Tensor kp = at::empty({bh_count, pairs, n_pad}, q.options().dtype(at::kInt));
  at::Tensor vp = at::empty({bh_count, key_pairs, c}, q.options().dtype(at::kInt));
  {
    const auto* k16 = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    const auto* v16 = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    auto* kp32 = reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>());
    auto* vp32 = reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>());
    at::parallel_for(0, bh_count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        uint32_t* kpb = kp32 + bh * pairs * n_pad;
        for (int64_t j = 0; j < n; ++j) {
          const auto* row = reinterpret_cast<const uint32_t*>(k16 + row_offset(k, bh, j));
          for (int64_t c2 = 0; c2 < pairs; ++c2) kpb[c2 * n_pad + j] = row[c2];
        }
        for (int64_t c2 = 0; c2 < pairs; ++c2)
          for (int64_t j = n; j < n_pad; ++j) kpb[c2 * n_pad + j] = 0;
        uint32_t* vpb = vp32 + bh * key_pairs * c;
        for (int64_t j2 = 0; j2 < key_pairs; ++j2) {
          const int64_t j = 2 * j2;
          const uint16_t* even = j < n ? v16 + row_offset(v, bh, j) : nullptr;
          const uint16_t* odd = j + 1 < n ? v16 + row_offset(v, bh, j + 1) : nullptr;
          for (int64_t ch = 0; ch < c; ++ch)
            vpb[j2 * c + ch] = (even ? even[ch] : 0u) | (odd ? static_cast<uint32_t>(odd[ch]) << 16 : 0u);
        }
      }
    });
  }

  at::Tensor out = at::empty({batch, n, heads, c}, q.options());
  const int64_t blocks = (n + kQueryBlock - 1) / kQueryBlock;
  const auto* q16 = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp32 = reinterpret_cast<const uint32_t*>(kp.data_ptr<int32_t>());
  const auto* vp32 = reinterpret_cast<const uint32_t*>(vp.data_ptr<int32_t>());
  const float* bh_ptr = bias_h.data_ptr<float>();
  const float* bw_ptr = bias_w.data_ptr<float>();
  auto* out_ptr = out.data_ptr<at::BFloat16>();
  const float scale_f = static_cast<float>(scale);
  const OutputRowsFn output_rows_fn = kOutputRows[c / 16 - 1];
  const int64_t q_stride = q.stride(2) / 2;  // in channel pairs

  at::parallel_for(0, bh_count * blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores, outputs;
    thread_local std::vector<at::BFloat16> probs;
    scores.resize(kQueryBlock * n_pad);
    probs.resize(kQueryBlock * n_pad);
    outputs.resize(kQueryBlock * c);
    float inv_sum[kQueryBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i0 = (task % blocks) * kQueryBlock;
      const int64_t rows = std::min(kQueryBlock, n - i0);
      const auto* qb = reinterpret_cast<const uint32_t*>(q16 + row_offset(q, bh, i0));
      const uint32_t* kpb = kp32 + bh * pairs * n_pad;
      float* s = scores.data();

      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows) score_rows<kRows>(qb + r * q_stride, q_stride, kpb, n_pad, pairs, s + r * n_pad);
      for (; r < rows; ++r) score_rows<1>(qb + r * q_stride, q_stride, kpb, n_pad, pairs, s + r * n_pad);

      for (r = 0; r < rows; ++r) {
        float* row = s + r * n_pad;
        const float* bias_row_h = bh_ptr + (bh * n + i0 + r) * grid_h;
        const float* bias_row_w = bw_ptr + (bh * n + i0 + r) * grid_w;
        for (int64_t kh = 0; kh < grid_h; ++kh) {
          float* seg = row + kh * grid_w;
          const float h_term = bias_row_h[kh];
          for (int64_t kw = 0; kw < grid_w; ++kw) seg[kw] = seg[kw] * scale_f + h_term + bias_row_w[kw];
        }
        for (int64_t j = n; j < n_pad; ++j) row[j] = -INFINITY;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n_pad; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
        const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        at::BFloat16* prow = probs.data() + r * n_pad;
        for (int64_t j = 0; j < n_pad; j += 16) {
          __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), row_max));
          if (j + 16 > n) e = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << (n - j)) - 1), e);  // padding keys
          vsum = _mm512_add_ps(vsum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
        }
        inv_sum[r] = 1.0f / _mm512_reduce_add_ps(vsum);
      }

      output_rows_fn(reinterpret_cast<const uint32_t*>(probs.data()), key_pairs, vp32 + bh * key_pairs * c, key_pairs,
                     rows, outputs.data());
      const int64_t b = bh / heads, h = bh % heads;
      for (r = 0; r < rows; ++r) {
        const float* o = outputs.data() + r * c;
        at::BFloat16* dst = out_ptr + ((b * n + i0 + r) * heads + h) * c;
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        for (int64_t ch = 0; ch < c; ch += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + ch),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + ch), inv))));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("rel_pos_attention", &rel_pos_attention);
}
