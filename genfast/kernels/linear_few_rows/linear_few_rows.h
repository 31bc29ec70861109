// The host side that every variant (<isa>.cpp) shares: argument checks and the
// dispatch on the row count. A variant is a struct with
//
//   using Input = ...;                          what it multiplies the weight with
//   static at::Tensor input(x)                  x as the kernel reads it: [M, K] of Input, contiguous
//   template <int M> rows(x, w, y, n0, n1, N, K)   output rows [n0, n1) for the M input rows

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace genfast_few_rows {

// How far ahead of its loads a variant prefetches each weight row's stream: 4-16 KB measured alike
// (the AVX2 variant on an Intel Xeon, the AVX-512 one on a Zen 4).
constexpr int64_t kPrefetchBytes = 8192;

template <class V, int M>
void linear_rows(const typename V::Input* x, const at::BFloat16* w, float* y, int64_t N, int64_t K) {
  // Each thread takes a contiguous run of output rows: one stream of the weight.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { V::template rows<M>(x, w, y, begin, end, N, K); });
}

template <class V>
at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_few_rows: x [M, K], weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_few_rows: the weight must be bf16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear_few_rows: x must be fp32 or bf16");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(M >= 1 && M <= 8, "linear_few_rows: 1 to 8 rows");
  TORCH_CHECK(K % 32 == 0, "linear_few_rows: K must be a multiple of 32");
  using Input = typename V::Input;
  const at::Tensor xs = V::input(x), w = weight.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* xp = xs.data_ptr<Input>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: linear_rows<V, 1>(xp, wp, yp, N, K); break;
    case 2: linear_rows<V, 2>(xp, wp, yp, N, K); break;
    case 3: linear_rows<V, 3>(xp, wp, yp, N, K); break;
    case 4: linear_rows<V, 4>(xp, wp, yp, N, K); break;
    case 5: linear_rows<V, 5>(xp, wp, yp, N, K); break;
    case 6: linear_rows<V, 6>(xp, wp, yp, N, K); break;
    case 7: linear_rows<V, 7>(xp, wp, yp, N, K); break;
    default: linear_rows<V, 8>(xp, wp, yp, N, K); break;
  }
  return y;
}

}  // namespace genfast_few_rows
