// The host side every variant (<isa>.cpp) shares: argument checks, the activations' int8
// quantization, the grouping of rows by expert and the split of the work into tasks (one task:
// one expert's rows x one row group of 64 outputs). A variant is a struct with one function,
//
//   template <typename T> row_group(a, weights, rows, count, first, y)
//
// which writes outputs [first, first + 64) (those below a.n) of the `count` activation rows
// listed in `rows`, from the row group's weights (ops.py describes the layout).
//
// The math: an E2M1 value doubled is an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}, so with the
// activations quantized to int8 per block of 32 (x ≈ xs * xq, as llama.cpp's Q8 activations) a
// block's sum is xs * 2^(e-128) * dot(2 w, xq), the dot product of small integers. The variants
// look codes up as 2 w + 12 (unsigned, for the u8 x s8 dot products of VNNI and vpmaddubsw) and
// take 12 * sum(xq) off each block's dot product once.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace genfast_mxfp4 {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowGroup = 64;
constexpr int64_t kTileRows = 16;
constexpr int64_t kTiles = kRowGroup / kTileRows;
constexpr int64_t kCodeBytes = kRowGroup * kBlock / 2;  // a row group's codes of one block
constexpr int64_t kGroupBlockBytes = kCodeBytes + kRowGroup;  // then its 64 E8M0 scales
constexpr int32_t kCodeOffset = 12;  // codes are looked up as 2 w + 12

struct Activations {
  const int8_t* xq;     // [rows, k]
  const float* xs;      // [rows, k / 32]
  const int32_t* xsum;  // [rows, k / 32]: sum of the block's xq
  int64_t k, n;         // n: the output columns of y
};

// int8 per block of 32, scale amax / 127, round to nearest even.
template <typename T>
void quantize_blocks(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, int32_t* xsum) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * kBlock;
      float v[kBlock], amax = 0.f;
      for (int j = 0; j < kBlock; ++j) {
        v[j] = static_cast<float>(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(v[j] * inv));
        xq[i * kBlock + j] = static_cast<int8_t>(std::clamp(q, -127, 127));
        sum += xq[i * kBlock + j];
      }
      xs[i] = scale;
      xsum[i] = sum;
    }
  });
}

template <typename T>
inline void store_outputs(T* dst, const float* values, int64_t count) {
  for (int64_t j = 0; j < count; ++j) dst[j] = static_cast<T>(values[j]);
}

template <class V>
at::Tensor mxfp4_expert_linear(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& packed,
                               int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "mxfp4_expert_linear: x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "mxfp4_expert_linear: x must be fp32 or bf16");
  TORCH_CHECK(experts.dim() == 1 && experts.size(0) == x.size(0) && experts.scalar_type() == at::kLong,
              "mxfp4_expert_linear: experts must be [rows] int64");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "mxfp4_expert_linear: packed must be [experts, bytes] contiguous uint8");
  const int64_t rows = x.size(0), k = x.size(1), n_experts = packed.size(0);
  TORCH_CHECK(k % kBlock == 0, "mxfp4_expert_linear: K must be a multiple of 32");
  const int64_t blocks = k / kBlock;
  const int64_t group_bytes = blocks * kGroupBlockBytes;
  const int64_t groups = packed.size(1) / std::max<int64_t>(group_bytes, 1);
  TORCH_CHECK(groups * group_bytes == packed.size(1) && groups * kRowGroup >= out_features &&
              (groups - 1) * kRowGroup < out_features,
              "mxfp4_expert_linear: packed size does not match K and out_features");

  const at::Tensor xc = x.contiguous(), ec = experts.contiguous();
  const int64_t* ex = ec.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(ex[r] >= 0 && ex[r] < n_experts, "mxfp4_expert_linear: expert index out of range");
  // Rows of one expert side by side: a task reads its row group once (into L2) for all of them.
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ex[a] < ex[b]; });
  std::vector<int64_t> starts;  // start of each expert's run in `order`, then rows
  for (int64_t i = 0; i < rows; ++i)
    if (i == 0 || ex[order[i]] != ex[order[i - 1]]) starts.push_back(i);
  starts.push_back(rows);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;

  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * blocks);
  std::vector<int32_t> xsum(rows * blocks);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const Activations a{xq.data(), xs.data(), xsum.data(), k, out_features};
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  const int64_t expert_bytes = packed.size(1);
  auto run = [&](const auto* in, auto* out) {
    quantize_blocks(in, rows, k, xq.data(), xs.data(), xsum.data());
    at::parallel_for(0, runs * groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t run_index = task / groups, s = task % groups;
        const int64_t first = starts[run_index];
        const uint8_t* w = weights + ex[order[first]] * expert_bytes + s * group_bytes;
        V::row_group(a, w, order.data() + first, starts[run_index + 1] - first, s * kRowGroup, out);
      }
    });
  };
  if (rows == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>(), y.data_ptr<float>());
  } else {
    run(xc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  }
  return y;
}

}  // namespace genfast_mxfp4
