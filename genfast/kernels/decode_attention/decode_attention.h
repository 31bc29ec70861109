// Attention of one query per sequence over a KV cache (LLM decode), in fp32, as
//
//   out[b, h] = sum_j softmax_j(scale * q[b, h] . k[b, h / G, j] masked by mask[b, j]) v[b, h / G, j]
//
// with G = heads / kv_heads query heads sharing each KV head (grouped-query attention, no KV
// repeat). The host side every variant (<isa>.cpp in this folder) shares; a variant is a struct V
// of vector operations on W fp32 lanes:
//
//   using Vec; static constexpr int W;
//   zero(), set1(float), load(const float*), load(const c10::BFloat16*), store(float*, Vec),
//   fmadd(a, b, c) = a * b + c, sub(a, b), add(a, b), hsum(Vec), exp_nonpositive(Vec)
//
// Why not inductor's loops or SDPA: compiled, the multiply-sums over the cache (ops.portable) run
// one parallel loop over the KV heads (a model has few of them: threads go idle), a horizontal sum
// per key and the softmax on one thread, and stream the cache well below the memory's rate; SDPA's
// flash kernel is tiled for long queries. Here the keys are split into chunks as well as heads
// ("split-K", as flash-decoding does), so every thread streams its own part of the cache once:
//   per task (sequence, KV head, chunk of keys): the G scaled queries stay in L1; each key row is
//   loaded once and dotted with all G queries; a local softmax (max m, sum l of exp(s - m)) and
//   the unnormalized sum of p v, reading each value row once for all G queries;
//   then per head the chunks combine: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c.
// Masked keys are skipped (a sliding window or left padding costs nothing). A head whose keys are
// all masked gives zeros (SDPA would give NaN).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace genfast_decode_attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys ahead of the one being dotted whose K and V rows are fetched meanwhile: a task's rows are
// one short stream each, too short for the hardware prefetcher to reach full bandwidth.
constexpr int64_t kPrefetchRows = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < d * static_cast<int64_t>(sizeof(T)); offset += 64) __builtin_prefetch(bytes + offset);
}

// out[i * out_stride] = q[i] . key for NQ query rows of d floats.
template <class V, typename T, int NQ>
inline void dot_rows(const float* q, int64_t d, const T* key, float* out, int64_t out_stride) {
  typename V::Vec acc[NQ];
#pragma GCC unroll 4
  for (int i = 0; i < NQ; ++i) acc[i] = V::zero();
  for (int64_t c = 0; c < d; c += V::W) {
    const auto k = V::load(key + c);
#pragma GCC unroll 4
    for (int i = 0; i < NQ; ++i) acc[i] = V::fmadd(V::load(q + i * d + c), k, acc[i]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < NQ; ++i) out[i * out_stride] = V::hsum(acc[i]);
}

// o[i] (d floats) = sum_j p[i * n + j - j0] v[j] over the unmasked keys of [j0, j1), for NG rows
// of probabilities, NV vectors of columns at a time (NG x NV accumulators in registers).
template <class V, typename T, int NG, int NV>
inline void value_tile(const float* p, int64_t n, const T* v, int64_t v_stride, const bool* mask, int64_t j0,
                       int64_t j1, int64_t c0, int64_t d, float* o) {
  typename V::Vec acc[NG][NV];
#pragma GCC unroll 4
  for (int i = 0; i < NG; ++i)
#pragma GCC unroll 4
    for (int t = 0; t < NV; ++t) acc[i][t] = V::zero();
  for (int64_t j = j0; j < j1; ++j) {
    if (!mask[j]) continue;
    typename V::Vec weight[NG];
#pragma GCC unroll 4
    for (int i = 0; i < NG; ++i) weight[i] = V::set1(p[i * n + j - j0]);
    const T* row = v + j * v_stride + c0;
#pragma GCC unroll 4
    for (int t = 0; t < NV; ++t) {
      const auto x = V::load(row + t * V::W);
#pragma GCC unroll 4
      for (int i = 0; i < NG; ++i) acc[i][t] = V::fmadd(weight[i], x, acc[i][t]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NG; ++i)
#pragma GCC unroll 4
    for (int t = 0; t < NV; ++t) V::store(o + i * d + c0 + t * V::W, acc[i][t]);
}

template <class V, typename T, int NG>
inline void value_columns(const float* p, int64_t n, const T* v, int64_t v_stride, const bool* mask, int64_t j0,
                          int64_t j1, int64_t d, float* o) {
  int64_t c = 0;
  for (; c + 4 * V::W <= d; c += 4 * V::W) value_tile<V, T, NG, 4>(p, n, v, v_stride, mask, j0, j1, c, d, o);
  switch ((d - c) / V::W) {
    case 3: value_tile<V, T, NG, 3>(p, n, v, v_stride, mask, j0, j1, c, d, o); break;
    case 2: value_tile<V, T, NG, 2>(p, n, v, v_stride, mask, j0, j1, c, d, o); break;
    case 1: value_tile<V, T, NG, 1>(p, n, v, v_stride, mask, j0, j1, c, d, o); break;
    default: break;
  }
}

// One task: keys [j0, j1) of one KV head for its G queries q (G x d, fp32, already scaled).
// s: G x n scratch (n = j1 - j0); writes o (G x d, unnormalized), m and l (G each).
template <class V, typename T>
void attend_chunk(const float* q, int64_t groups, int64_t d, const T* k, int64_t k_stride, const T* v,
                  int64_t v_stride, const bool* mask, int64_t j0, int64_t j1, float* s, float* o, float* m,
                  float* l) {
  const int64_t n = j1 - j0;
  for (int64_t j = j0; j < j1; ++j) {
    float* col = s + (j - j0);
    if (!mask[j]) {
      for (int64_t g = 0; g < groups; ++g) col[g * n] = kNegInf;
      continue;
    }
    const T* key = k + j * k_stride;
    if (j + kPrefetchRows < j1) {  // the cache comes from memory (the weights evicted it); V is read next
      prefetch_row(key + kPrefetchRows * k_stride, d);
      prefetch_row(v + (j + kPrefetchRows) * v_stride, d);
    }
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) dot_rows<V, T, 4>(q + g * d, d, key, col + g * n, n);
    switch (groups - g) {
      case 3: dot_rows<V, T, 3>(q + g * d, d, key, col + g * n, n); break;
      case 2: dot_rows<V, T, 2>(q + g * d, d, key, col + g * n, n); break;
      case 1: dot_rows<V, T, 1>(q + g * d, d, key, col + g * n, n); break;
      default: break;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* row = s + g * n;
    const float row_max = *std::max_element(row, row + n);
    m[g] = row_max;
    if (row_max == kNegInf) {  // every key of this chunk is masked
      l[g] = 0.0f;
      continue;
    }
    // Masked keys come out as exp(-87), not 0: they are skipped below, and in l they add ~1e-38
    // per key to a sum of at least 1.
    const auto vmax = V::set1(row_max);
    auto vsum = V::zero();
    int64_t j = 0;
    for (; j + V::W <= n; j += V::W) {
      const auto e = V::exp_nonpositive(V::sub(V::load(row + j), vmax));
      V::store(row + j, e);
      vsum = V::add(vsum, e);
    }
    float sum = V::hsum(vsum);
    for (; j < n; ++j) sum += row[j] = std::exp(row[j] - row_max);
    l[g] = sum;
  }
  // o = P V in register tiles of up to 3 rows x 4 vectors: each value vector is loaded once per
  // tile, and the chunk's columns of V stay in L1 across the tiles. A chunk whose keys are all
  // masked (for every row alike) leaves o at 0.
  int64_t g = 0;
  for (; g + 3 <= groups; g += 3) value_columns<V, T, 3>(s + g * n, n, v, v_stride, mask, j0, j1, d, o + g * d);
  switch (groups - g) {
    case 2: value_columns<V, T, 2>(s + g * n, n, v, v_stride, mask, j0, j1, d, o + g * d); break;
    case 1: value_columns<V, T, 1>(s + g * n, n, v, v_stride, mask, j0, j1, d, o + g * d); break;
    default: break;
  }
}

// q and out in Q (fp32 or bf16: read and written in their own dtype, so a call needs no conversion
// ops), the cache in T.
template <class V, typename T, typename Q>
void attend_all(const Q* q, const T* k, const T* v, const bool* mask, int64_t mask_rows, Q* out, int64_t batch,
                int64_t heads, int64_t kv_heads, int64_t keys, int64_t d, float scale, const int64_t* q_strides,
                const int64_t* k_strides, const int64_t* v_strides) {
  const int64_t groups = heads / kv_heads;
  // Enough tasks to share the keys evenly between the threads, and at least 32 keys per task.
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = (8 * threads + batch * kv_heads - 1) / (batch * kv_heads);
  const int64_t chunk_count = std::max<int64_t>(1, std::min<int64_t>(wanted, (keys + 31) / 32));
  const int64_t chunk = (keys + chunk_count - 1) / chunk_count;
  const int64_t chunks = (keys + chunk - 1) / chunk;
  const int64_t tasks = batch * kv_heads * chunks;
  std::vector<float> part_o(tasks * groups * d), part_m(tasks * groups), part_l(tasks * groups);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * chunk), scaled(groups * d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (kv_heads * chunks), h = (t / chunks) % kv_heads, c = t % chunks;
      const int64_t j0 = c * chunk, j1 = std::min(keys, j0 + chunk);
      for (int64_t g = 0; g < groups; ++g) {
        const Q* row = q + b * q_strides[0] + (h * groups + g) * q_strides[1];
        for (int64_t i = 0; i < d; ++i) scaled[g * d + i] = static_cast<float>(row[i]) * scale;
      }
      attend_chunk<V, T>(scaled.data(), groups, d, k + b * k_strides[0] + h * k_strides[1],
                         k_strides[2], v + b * v_strides[0] + h * v_strides[1], v_strides[2],
                         mask + (mask_rows == 1 ? 0 : b) * keys, j0, j1, scores.data(),
                         part_o.data() + t * groups * d, part_m.data() + t * groups, part_l.data() + t * groups);
    }
  });
  std::vector<float> sum(d);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t first = (b * kv_heads + h) * chunks;
      for (int64_t g = 0; g < groups; ++g) {
        std::fill(sum.begin(), sum.end(), 0.0f);
        float top = kNegInf;
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part_m[(first + c) * groups + g]);
        float total = 1.0f;  // a head whose keys are all masked keeps its zeros
        if (top != kNegInf) {
          total = 0.0f;
          for (int64_t c = 0; c < chunks; ++c) {
            const float chunk_max = part_m[(first + c) * groups + g];
            if (chunk_max == kNegInf) continue;
            const float w = std::exp(chunk_max - top);
            total += w * part_l[(first + c) * groups + g];
            const float* o = part_o.data() + ((first + c) * groups + g) * d;
            for (int64_t i = 0; i < d; ++i) sum[i] += w * o[i];
          }
        }
        Q* dst = out + (b * heads + h * groups + g) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Q>(sum[i] / total);
      }
    }
  }
}

// q [B, H, 1, D]; k, v [B, KV, L, D] (any strides but the last); mask bool [B or 1, 1, 1, L].
// Returns [B, H, 1, D] in q's dtype.
template <class V>
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be [B, H, 1, D]");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "decode_attention: k and v must be [B, KV, L, D] alike");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(3), kv_heads = k.size(1), keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == d, "decode_attention: k and v must match q's batch and head size");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(d % V::W == 0, "decode_attention: the head size must be a multiple of ", V::W);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v must be contiguous in the head size");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "decode_attention: k and v must both be fp32 or both bf16");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "decode_attention: q must be fp32 or bf16");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(1) == 1 && mask.size(2) == 1 &&
                  mask.size(3) == keys && (mask.size(0) == 1 || mask.size(0) == batch),
              "decode_attention: mask must be bool [B or 1, 1, 1, L]");
  TORCH_CHECK(keys > 0, "decode_attention: no keys");
  TORCH_CHECK(q.stride(3) == 1, "decode_attention: q must be contiguous in the head size");
  const at::Tensor m = mask.reshape({mask.size(0), keys}).contiguous();
  at::Tensor out = at::empty({batch, heads, 1, d}, q.options());
  const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
  const int64_t k_strides[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t v_strides[3] = {v.stride(0), v.stride(1), v.stride(2)};
  auto run = [&](auto* query, auto* output) {
    if (k.scalar_type() == at::kFloat) {
      attend_all<V>(query, k.data_ptr<float>(), v.data_ptr<float>(), m.data_ptr<bool>(), m.size(0), output, batch,
                    heads, kv_heads, keys, d, static_cast<float>(scale), q_strides, k_strides, v_strides);
    } else {
      attend_all<V>(query, k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), m.data_ptr<bool>(), m.size(0),
                    output, batch, heads, kv_heads, keys, d, static_cast<float>(scale), q_strides, k_strides,
                    v_strides);
    }
  };
  if (q.scalar_type() == at::kFloat) {
    run(q.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace genfast_decode_attention
