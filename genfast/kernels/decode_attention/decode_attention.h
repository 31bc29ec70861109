// Attention of queries over a KV cache (LLM decode, and prefill or speculative verification:
// several queries per sequence), in fp32, as
//
//   out[b, h, s] = sum_j softmax_j(scale * q[b, h, s] . k[b, h / G, j] masked by mask[b, s, j]) v[b, h / G, j]
//
// with G = heads / kv_heads query heads sharing each KV head (grouped-query attention, no KV
// repeat). The host side every variant (<isa>.cpp in this folder) shares; a variant is a struct V
// of vector operations on W fp32 lanes:
//
//   using Vec; static constexpr int W;
//   zero(), set1(float), load(const float*), load(const c10::BFloat16*), store(float*, Vec),
//   fmadd(a, b, c) = a * b + c, sub(a, b), add(a, b), max(a, b), hsum(Vec), hmax(Vec),
//   exp_nonpositive(Vec), zero_where_neginf(e, s) = e where s > -inf, else 0
//
// Why not inductor's loops or SDPA: compiled, the multiply-sums over the cache (ops.portable) run
// one parallel loop over the KV heads (a model has few of them: threads go idle), a horizontal sum
// per key and the softmax on one thread, and stream the cache well below the memory's rate; SDPA's
// flash kernel is tiled for long queries. Here the keys are split into chunks as well as heads
// ("split-K", as flash-decoding does), so every thread streams its own part of the cache once:
//   per chunk (sequence, query position, KV head, chunk of keys): the G scaled queries stay in L1;
//   each key row is loaded once and dotted with all G queries; a local softmax (max m, sum l of
//   exp(s - m)) and the unnormalized sum o of p v, reading each value row once for all G queries;
//   then per query the chunks combine: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c.
// Masked keys are skipped (a sliding window or left padding costs nothing). A query whose keys are
// all masked gives zeros (SDPA would give NaN).
//
// Invariance: a query's output is a function of its vector, its mask row and the keys and values
// that row admits, bit for bit: not of the key count, the batch, the other queries of the call or
// the thread count. A serving engine needs this for deterministic greedy decoding: a prompt must
// give the same logits prefilled whole, in chunks or from a prefix cache, and decoded alone or
// beside other sequences. Hence:
//   - chunks are kChunk keys aligned at key 0, never sized from the thread or key count;
//   - a chunk's sums always run over its full width: keys past the end and masked keys count
//     exactly 0 (not exp(-87)), so where the key count ends never moves a key between lanes;
//   - the chunks combine in chunk order, skipping those with no visible key;
//   - per-query arithmetic does not depend on how the queries are grouped in registers, and the
//     chunk and combine steps are one compiled function each (noinline), whichever scheme calls.
// Which scheme runs (split-K with partials for every chunk, or a task per query row with a
// buffer of its own) depends on the sizes; the results do not.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// The keys of one chunk: a multiple of 16 (both variants' lane counts), so that its softmax sums
// fill whole vectors. Longer chunks leave fewer partials to write and combine (64 cost a long
// decode ~10%), shorter ones more tasks for a short cache and less work past a causal edge.
constexpr int64_t kChunk = 128;

// One chunk: keys [j0, j0 + kChunk) of one KV head for its G queries q (G x d, fp32, already
// scaled), of which [j0, j1) exist (j1 <= j0 + kChunk; the rest count as masked). Rows up to
// prefetch_end are fetched ahead. s: G x kChunk scratch; writes o (G x d, unnormalized), m and l
// (G each). The chunk must have a visible key.
template <class V, typename T>
__attribute__((noinline)) void attend_chunk(const float* q, int64_t groups, int64_t d, const T* k, int64_t k_stride,
                                            const T* v, int64_t v_stride, const bool* mask, int64_t j0, int64_t j1,
                                            int64_t prefetch_end, float* s, float* o, float* m, float* l) {
  constexpr int64_t n = kChunk;
  for (int64_t j = j0; j < j0 + n; ++j) {
    float* col = s + (j - j0);
    if (j >= j1 || !mask[j]) {
      for (int64_t g = 0; g < groups; ++g) col[g * n] = kNegInf;
      continue;
    }
    const T* key = k + j * k_stride;
    if (j + kPrefetchRows < prefetch_end) {  // the cache comes from memory (the weights evicted it); V is read next
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
    auto vmax = V::load(row);
    for (int64_t j = V::W; j < n; j += V::W) vmax = V::max(vmax, V::load(row + j));
    const float row_max = V::hmax(vmax);
    m[g] = row_max;
    vmax = V::set1(row_max);
    // Masked and absent keys count exactly 0 (the exp stops at e^-87): the sum then does not
    // depend on where the keys end.
    auto vsum = V::zero();
    for (int64_t j = 0; j < n; j += V::W) {
      const auto x = V::load(row + j);
      const auto e = V::zero_where_neginf(V::exp_nonpositive(V::sub(x, vmax)), x);
      V::store(row + j, e);
      vsum = V::add(vsum, e);
    }
    l[g] = V::hsum(vsum);
  }
  // o = P V in register tiles of up to 3 rows x 4 vectors: each value vector is loaded once per
  // tile, and the chunk's columns of V stay in L1 across the tiles.
  int64_t g = 0;
  for (; g + 3 <= groups; g += 3) value_columns<V, T, 3>(s + g * n, n, v, v_stride, mask, j0, j1, d, o + g * d);
  switch (groups - g) {
    case 2: value_columns<V, T, 2>(s + g * n, n, v, v_stride, mask, j0, j1, d, o + g * d); break;
    case 1: value_columns<V, T, 1>(s + g * n, n, v, v_stride, mask, j0, j1, d, o + g * d); break;
    default: break;
  }
}

// One query's output (d floats into res) from its chunks' partials: o at o + c * o_stride, m and
// l at m[c * ml_stride], l[c * ml_stride], for c < chunks; a chunk with no visible key has m = -inf.
// Skips those, in chunk order; all masked gives zeros.
template <class V>
__attribute__((noinline)) void combine(const float* o, int64_t o_stride, const float* m, const float* l,
                                       int64_t ml_stride, int64_t chunks, int64_t d, float* res) {
  for (int64_t i = 0; i < d; i += V::W) V::store(res + i, V::zero());
  float top = kNegInf;
  for (int64_t c = 0; c < chunks; ++c) top = std::max(top, m[c * ml_stride]);
  if (top == kNegInf) return;
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float chunk_max = m[c * ml_stride];
    if (chunk_max == kNegInf) continue;
    const float w = std::exp(chunk_max - top);
    total = std::fma(w, l[c * ml_stride], total);
    const auto vw = V::set1(w);
    const float* oc = o + c * o_stride;
    for (int64_t i = 0; i < d; i += V::W) V::store(res + i, V::fmadd(vw, V::load(oc + i), V::load(res + i)));
  }
  for (int64_t i = 0; i < d; ++i) res[i] /= total;
}

// Whether keys [j0, j1) of a mask row hold a visible one.
inline bool any_visible(const bool* mask, int64_t j0, int64_t j1) {
  return std::memchr(mask + j0, 1, static_cast<size_t>(j1 - j0)) != nullptr;
}

// Runs fn(tasks' index) for every index in [0, tasks) on the threads, each thread taking the next
// index when it finishes one (tasks of unequal cost, e.g. causal rows, spread evenly); fn gets
// its thread's scratch, made once per thread by make().
template <typename Make, typename Fn>
void for_each_task(int64_t tasks, Make make, Fn fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto scratch = make();
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(scratch, t);
  });
}

// Above this many floats of partials (every query row's chunks at once), each task takes whole
// query rows with a partial buffer of its own instead (a long prefill would need gigabytes).
constexpr int64_t kSplitBudget = int64_t{1} << 22;

// q and out in Q (fp32 or bf16: read and written in their own dtype, so a call needs no conversion
// ops), the cache in T. mask: [mask_batch, mask_queries, keys] bool.
template <class V, typename T, typename Q>
void attend_all(const Q* q, const T* k, const T* v, const bool* mask, int64_t mask_batch, int64_t mask_queries,
                Q* out, int64_t batch, int64_t heads, int64_t queries, int64_t kv_heads, int64_t keys, int64_t d,
                float scale, const int64_t* q_strides, const int64_t* k_strides, const int64_t* v_strides) {
  const int64_t groups = heads / kv_heads;
  const int64_t chunks = (keys + kChunk - 1) / kChunk;
  const int64_t threads = at::get_num_threads();
  // A query row: (sequence b, query position s, KV head h), its G queries dotted together.
  const int64_t rows = batch * queries * kv_heads;
  struct Row {
    int64_t b, s, h;
  };
  auto row_of = [&](int64_t r) { return Row{r / (queries * kv_heads), (r / kv_heads) % queries, r % kv_heads}; };
  auto mask_row = [&](const Row& r) {
    return mask + ((mask_batch == 1 ? 0 : r.b) * mask_queries + (mask_queries == 1 ? 0 : r.s)) * keys;
  };
  auto load_queries = [&](const Row& r, float* scaled) {
    for (int64_t g = 0; g < groups; ++g) {
      const Q* src = q + r.b * q_strides[0] + (r.h * groups + g) * q_strides[1] + r.s * q_strides[2];
      for (int64_t i = 0; i < d; ++i) scaled[g * d + i] = static_cast<float>(src[i]) * scale;
    }
  };
  // Chunks [c0, c1) of a row, partials at part_o + c * groups * d, part_m + c * groups, part_l alike.
  auto run_chunks = [&](const Row& r, int64_t c0, int64_t c1, const float* scaled, float* scores, float* part_o,
                        float* part_m, float* part_l) {
    const bool* row_mask = mask_row(r);
    const T* kh = k + r.b * k_strides[0] + r.h * k_strides[1];
    const T* vh = v + r.b * v_strides[0] + r.h * v_strides[1];
    const int64_t prefetch_end = std::min(keys, c1 * kChunk);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * kChunk, j1 = std::min(keys, j0 + kChunk);
      if (!any_visible(row_mask, j0, j1)) {
        std::fill(part_m + c * groups, part_m + (c + 1) * groups, kNegInf);
        continue;
      }
      attend_chunk<V, T>(scaled, groups, d, kh, k_strides[2], vh, v_strides[2], row_mask, j0, j1, prefetch_end,
                         scores, part_o + c * groups * d, part_m + c * groups, part_l + c * groups);
    }
  };
  auto finish = [&](const Row& r, const float* part_o, const float* part_m, const float* part_l, float* res) {
    for (int64_t g = 0; g < groups; ++g) {
      combine<V>(part_o + g * d, groups * d, part_m + g, part_l + g, groups, chunks, d, res);
      Q* dst = out + ((r.b * heads + r.h * groups + g) * queries + r.s) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Q>(res[i]);
    }
  };
  struct Scratch {
    std::vector<float> scaled, scores, o, m, l, res;
  };
  const int64_t row_floats = chunks * groups * (d + 2);
  if (rows < 16 * threads && rows * row_floats <= kSplitBudget) {
    // Few query rows (decode): split each row's chunks between tasks too, so that every thread
    // streams its share of the cache; the partials of every chunk wait for the combine.
    const int64_t wanted = std::min(chunks, (8 * threads + rows - 1) / rows);
    const int64_t per_task = (chunks + wanted - 1) / wanted;
    const int64_t splits = (chunks + per_task - 1) / per_task;
    // Kept between calls (decode calls this once per layer and step): a fresh buffer this large
    // would come from mmap and fault its pages in every time.
    thread_local std::vector<float> partials;
    partials.resize(std::max(partials.size(), static_cast<size_t>(rows * row_floats)));
    float* part_o = partials.data();
    float* part_m = part_o + rows * chunks * groups * d;
    float* part_l = part_m + rows * chunks * groups;
    for_each_task(
        rows * splits,
        [&] { return Scratch{std::vector<float>(groups * d), std::vector<float>(groups * kChunk), {}, {}, {}, {}}; },
        [&](Scratch& scratch, int64_t t) {
          const int64_t r = t / splits, c0 = (t % splits) * per_task, c1 = std::min(chunks, c0 + per_task);
          const Row row = row_of(r);
          load_queries(row, scratch.scaled.data());
          run_chunks(row, c0, c1, scratch.scaled.data(), scratch.scores.data(), part_o + r * chunks * groups * d,
                     part_m + r * chunks * groups, part_l + r * chunks * groups);
        });
    // The combine reads every chunk's partials once: in parallel only where that outweighs
    // waking the threads.
    const int64_t grain = std::max<int64_t>(1, 16384 / (chunks * groups * d));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> res(d);
      for (int64_t r = begin; r < end; ++r)
        finish(row_of(r), part_o + r * chunks * groups * d, part_m + r * chunks * groups, part_l + r * chunks * groups,
               res.data());
    });
    return;
  }
  // Many query rows (prefill, large batches): a task per row, its chunks' partials in a buffer of
  // its thread's. The longest rows first (a causal mask makes the last positions the dearest), so
  // that the threads finish together.
  for_each_task(
      rows,
      [&] {
        return Scratch{std::vector<float>(groups * d),          std::vector<float>(groups * kChunk),
                       std::vector<float>(chunks * groups * d), std::vector<float>(chunks * groups),
                       std::vector<float>(chunks * groups),     std::vector<float>(d)};
      },
      [&](Scratch& scratch, int64_t t) {
        Row row = row_of(t);
        row.s = queries - 1 - row.s;
        load_queries(row, scratch.scaled.data());
        run_chunks(row, 0, chunks, scratch.scaled.data(), scratch.scores.data(), scratch.o.data(), scratch.m.data(),
                   scratch.l.data());
        finish(row, scratch.o.data(), scratch.m.data(), scratch.l.data(), scratch.res.data());
      });
}

// q [B, H, S, D]; k, v [B, KV, L, D] (any strides but the last); mask bool [B or 1, 1, S or 1, L].
// Returns [B, H, S, D] in q's dtype.
template <class V>
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(q.dim() == 4, "decode_attention: q must be [B, H, S, D]");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "decode_attention: k and v must be [B, KV, L, D] alike");
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), d = q.size(3), kv_heads = k.size(1),
                keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == d, "decode_attention: k and v must match q's batch and head size");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(d % V::W == 0, "decode_attention: the head size must be a multiple of ", V::W);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k and v must be contiguous in the head size");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "decode_attention: k and v must both be fp32 or both bf16");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "decode_attention: q must be fp32 or bf16");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(1) == 1 &&
                  (mask.size(2) == 1 || mask.size(2) == queries) && mask.size(3) == keys &&
                  (mask.size(0) == 1 || mask.size(0) == batch),
              "decode_attention: mask must be bool [B or 1, 1, S or 1, L]");
  TORCH_CHECK(keys > 0, "decode_attention: no keys");
  TORCH_CHECK(q.stride(3) == 1, "decode_attention: q must be contiguous in the head size");
  at::Tensor out = at::empty({batch, heads, queries, d}, q.options());
  if (out.numel() == 0) return out;
  const at::Tensor m = mask.reshape({mask.size(0), mask.size(2), keys}).contiguous();
  const int64_t q_strides[3] = {q.stride(0), q.stride(1), q.stride(2)};
  const int64_t k_strides[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t v_strides[3] = {v.stride(0), v.stride(1), v.stride(2)};
  auto run = [&](auto* query, auto* output) {
    if (k.scalar_type() == at::kFloat) {
      attend_all<V>(query, k.data_ptr<float>(), v.data_ptr<float>(), m.data_ptr<bool>(), m.size(0), m.size(1), output,
                    batch, heads, queries, kv_heads, keys, d, static_cast<float>(scale), q_strides, k_strides,
                    v_strides);
    } else {
      attend_all<V>(query, k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), m.data_ptr<bool>(), m.size(0),
                    m.size(1), output, batch, heads, queries, kv_heads, keys, d, static_cast<float>(scale), q_strides,
                    k_strides, v_strides);
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
