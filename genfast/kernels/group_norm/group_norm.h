// The host side of the channels-last GroupNorm variants (<isa>.cpp): checks, the
// statistics of pass 1 combined per group, and the two passes' parallel split. A variant supplies
// the vector loops as a struct V with
//   static void chunk_sums(const T* x, int64_t c_total, int64_t p0, int64_t p1, const float* shift,
//                          float* sum, float* sq);      // per-channel shifted sums over pixels [p0, p1)
//   static void scale_shift(const T* src, T* dst, int64_t c_total, const float* scale, const float* offset);
//                                                     // one pixel: dst = src * scale + offset
//
// Pass 1, statistics: pixels are split into chunks; each chunk sums (x - k) and (x - k)^2 per
// channel in fp32, with k the channel's value at the first pixel (a shift that keeps the one-pass
// variance accurate when |mean| >> std). Chunk sums are combined per group in double.
// Pass 2: y = x * a[c] + b[c] with a = rstd * weight and b = bias - mean * a, in fp32; bf16
// results are rounded to nearest even.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace genfast_group_norm {

constexpr int64_t kChunkPixels = 128;  // a chunk of C <= 512 bf16 channels stays in L2 while summed

template <class V, typename T>
void group_norm_sample(const T* x, T* y, int64_t pixels, int64_t c_total, int64_t groups, const float* weight,
                       const float* bias, double eps) {
  std::vector<float> shift(c_total);
  for (int64_t c = 0; c < c_total; ++c) shift[c] = static_cast<float>(x[c]);
  const int64_t chunks = (pixels + kChunkPixels - 1) / kChunkPixels;
  std::vector<float> sums(chunks * c_total), squares(chunks * c_total);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      V::chunk_sums(x, c_total, i * kChunkPixels, std::min(pixels, (i + 1) * kChunkPixels), shift.data(),
                    sums.data() + i * c_total, squares.data() + i * c_total);
    }
  });

  // Per channel: S = sum(x - k), Q = sum((x - k)^2); per group of channels, with m the group mean,
  // sum((x - m)^2) = sum_c Q + 2 (k - m) S + n (k - m)^2.
  const int64_t per_group = c_total / groups;
  std::vector<double> s(c_total, 0.0), q(c_total, 0.0);
  for (int64_t i = 0; i < chunks; ++i) {
    for (int64_t c = 0; c < c_total; ++c) {
      s[c] += sums[i * c_total + c];
      q[c] += squares[i * c_total + c];
    }
  }
  std::vector<float> scale(c_total), offset(c_total);
  const double n = static_cast<double>(pixels);
  for (int64_t g = 0; g < groups; ++g) {
    double total = 0.0;
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) total += s[c] + n * shift[c];
    const double mean = total / (n * per_group);
    double m2 = 0.0;
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
      const double d = shift[c] - mean;
      m2 += q[c] + 2.0 * d * s[c] + n * d * d;
    }
    const double rstd = 1.0 / std::sqrt(std::max(m2 / (n * per_group), 0.0) + eps);
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
      const double a = rstd * weight[c];
      scale[c] = static_cast<float>(a);
      offset[c] = static_cast<float>(bias[c] - mean * a);
    }
  }

  at::parallel_for(0, pixels, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      V::scale_shift(x + p * c_total, y + p * c_total, c_total, scale.data(), offset.data());
  });
}

template <class V>
at::Tensor group_norm_nhwc(const at::Tensor& x, int64_t groups, const at::Tensor& weight, const at::Tensor& bias,
                           double eps) {
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast),
              "group_norm_nhwc: x must be a channels-last 4-D tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "group_norm_nhwc: fp32 or bf16 only");
  const int64_t batch = x.size(0), c_total = x.size(1), pixels = x.size(2) * x.size(3);
  TORCH_CHECK(groups > 0 && c_total % 16 == 0 && c_total % groups == 0,
              "group_norm_nhwc: channels must divide into groups and by 16");
  TORCH_CHECK(weight.numel() == c_total && bias.numel() == c_total, "group_norm_nhwc: weight and bias need C values");
  TORCH_CHECK(pixels > 0, "group_norm_nhwc: empty input");
  const at::Tensor w = weight.to(at::kFloat).contiguous(), b = bias.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::ChannelsLast);
  for (int64_t i = 0; i < batch; ++i) {
    if (x.scalar_type() == at::kFloat) {
      group_norm_sample<V>(x.data_ptr<float>() + i * pixels * c_total, y.data_ptr<float>() + i * pixels * c_total,
                           pixels, c_total, groups, w.data_ptr<float>(), b.data_ptr<float>(), eps);
    } else {
      group_norm_sample<V>(x.data_ptr<at::BFloat16>() + i * pixels * c_total,
                           y.data_ptr<at::BFloat16>() + i * pixels * c_total, pixels, c_total, groups,
                           w.data_ptr<float>(), b.data_ptr<float>(), eps);
    }
  }
  return y;
}

}  // namespace genfast_group_norm
