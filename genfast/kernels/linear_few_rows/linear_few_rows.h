// The host side that every variant (<isa>.cpp) shares: argument checks, and the row count split
// into groups the variant computes together. A variant is a struct with
//
//   using Input = ...;                          what it multiplies the weight with
//   static constexpr int kGroupRows;            the most rows it computes at once
//   static at::Tensor input(x)                  x as the kernel reads it: [M, K] of Input, contiguous
//   template <int M> rows(x, w, y, n0, n1, N, K)   output rows [n0, n1) for M <= kGroupRows input rows
//
// A variant sums each output in one fixed order (its chains over K and their final additions do
// not depend on M), and a group's rows never meet: so every row's result is the same bits whatever
// the row count, the grouping or the thread count. Batch-invariant serving rests on this: a token
// gets the same logits prefilled whole, in chunks, after a cached prefix or beside other rows.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace genfast_few_rows {

// How far ahead of its loads a variant prefetches each weight row's stream: 4-16 KB measured alike
// (the AVX2 variant on an Intel Xeon, the AVX-512 one on a Zen 4).
constexpr int64_t kPrefetchBytes = 8192;

// Weight bytes of the output rows that every group of input rows passes over in turn (many rows:
// a prefill): small enough to stay in L2 between the groups.
constexpr int64_t kTileBytes = 256 * 1024;

// Output rows [n0, n1) for `rows` (1..kGroupRows) input rows starting at x, written from y.
template <class V>
void some_rows(int64_t rows, const typename V::Input* x, const at::BFloat16* w, float* y, int64_t n0, int64_t n1,
               int64_t N, int64_t K) {
  static_assert(V::kGroupRows >= 1 && V::kGroupRows <= 4, "a variant computes 1 to 4 rows at once");
  switch (rows) {
    case 1: V::template rows<1>(x, w, y, n0, n1, N, K); break;
    case 2: if constexpr (V::kGroupRows >= 2) V::template rows<2>(x, w, y, n0, n1, N, K); break;
    case 3: if constexpr (V::kGroupRows >= 3) V::template rows<3>(x, w, y, n0, n1, N, K); break;
    default: if constexpr (V::kGroupRows >= 4) V::template rows<4>(x, w, y, n0, n1, N, K); break;
  }
}

template <class V>
void linear_rows(const typename V::Input* x, const at::BFloat16* w, float* y, int64_t M, int64_t N, int64_t K) {
  // Each thread takes a contiguous run of output rows: one stream of the weight. With more input
  // rows than one group, the run goes by tiles of output rows, and every group passes over a tile
  // while its weights are in cache.
  const int64_t tile = M <= V::kGroupRows ? N : std::max<int64_t>(1, kTileBytes / (K * 2));
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += tile) {
      const int64_t n_end = std::min(end, n + tile);
      for (int64_t m = 0; m < M; m += V::kGroupRows) {
        some_rows<V>(std::min<int64_t>(V::kGroupRows, M - m), x + m * K, w, y + m * N, n, n_end, N, K);
      }
    }
  });
}

template <class V>
at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_few_rows: x [M, K], weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_few_rows: the weight must be bf16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear_few_rows: x must be fp32 or bf16");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 32 == 0, "linear_few_rows: K must be a multiple of 32");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const at::Tensor xs = V::input(x), w = weight.contiguous();
  linear_rows<V>(xs.data_ptr<typename V::Input>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace genfast_few_rows
