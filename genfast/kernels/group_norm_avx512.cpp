// Group normalization of a channels-last (NHWC) tensor, fp32 or bf16, in two passes over memory.
//
// Why: a UNet/VAE decoder at 256x256 and 512x512 spends a large share of its time in GroupNorm
// (`python benchmarks/diffusion_parts.py group-norm`: inductor ~100 ms and ATen ~47 ms for one bf16
// GroupNorm+SiLU of 128 x 512 x 512, against ~7 ms to read and write it once).
//
// Pass 1, statistics: pixels are split into chunks; each chunk sums (x - k) and (x - k)^2 per
// channel in fp32 vectors, with k the channel's value at the first pixel (a shift that keeps the
// one-pass variance accurate when |mean| >> std). Chunk sums are combined per group in double.
// Pass 2: y = x * a[c] + b[c] with a = rstd * weight and b = bias - mean * a, in fp32; bf16
// results are rounded to nearest even.
//
// Compiled with -mavx512f/bw; the Python side calls it only when the CPU has them and C % 16 == 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunkPixels = 128;  // a chunk of C <= 512 bf16 channels stays in L2 while summed
constexpr int64_t kChannelBlock = 64;  // 4 vectors: 8 accumulators in registers

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(at::BFloat16* dst, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// Per-channel shifted sums over pixels [p0, p1) of V vectors of channels starting at c0.
template <int V, typename T>
void block_sums(const T* x, int64_t c_total, int64_t c0, int64_t p0, int64_t p1, const float* shift, float* sum,
                float* sq) {
  __m512 s[V], q[V], k[V];
  for (int v = 0; v < V; ++v) {
    s[v] = q[v] = _mm512_setzero_ps();
    k[v] = _mm512_loadu_ps(shift + c0 + 16 * v);
  }
  for (int64_t p = p0; p < p1; ++p) {
    const T* row = x + p * c_total + c0;
    for (int v = 0; v < V; ++v) {
      const __m512 d = _mm512_sub_ps(load16(row + 16 * v), k[v]);
      s[v] = _mm512_add_ps(s[v], d);
      q[v] = _mm512_fmadd_ps(d, d, q[v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    _mm512_storeu_ps(sum + c0 + 16 * v, s[v]);
    _mm512_storeu_ps(sq + c0 + 16 * v, q[v]);
  }
}

// Per-channel shifted sums of pixels [p0, p1) into sum[C], sq[C].
template <typename T>
void chunk_sums(const T* x, int64_t c_total, int64_t p0, int64_t p1, const float* shift, float* sum, float* sq) {
  int64_t c0 = 0;
  for (; c0 + kChannelBlock <= c_total; c0 += kChannelBlock) block_sums<4>(x, c_total, c0, p0, p1, shift, sum, sq);
  for (; c0 < c_total; c0 += 16) block_sums<1>(x, c_total, c0, p0, p1, shift, sum, sq);
}

template <typename T>
void group_norm_sample(const T* x, T* y, int64_t pixels, int64_t c_total, int64_t groups, const float* weight,
                       const float* bias, double eps) {
  std::vector<float> shift(c_total);
  for (int64_t c = 0; c < c_total; ++c) shift[c] = static_cast<float>(x[c]);
  const int64_t chunks = (pixels + kChunkPixels - 1) / kChunkPixels;
  std::vector<float> sums(chunks * c_total), squares(chunks * c_total);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      chunk_sums(x, c_total, i * kChunkPixels, std::min(pixels, (i + 1) * kChunkPixels), shift.data(),
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
    for (int64_t p = begin; p < end; ++p) {
      const T* src = x + p * c_total;
      T* dst = y + p * c_total;
      for (int64_t c = 0; c < c_total; c += 16) {
        store16(dst + c, _mm512_fmadd_ps(load16(src + c), _mm512_loadu_ps(scale.data() + c),
                                         _mm512_loadu_ps(offset.data() + c)));
      }
    }
  });
}

at::Tensor group_norm_nhwc(const at::Tensor& x, int64_t groups, const at::Tensor& weight, const at::Tensor& bias,
                           double eps) {
  TORCH_CHECK(x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast),
              "group_norm_nhwc: x must be a channels-last 4-D tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "group_norm_nhwc: fp32 or bf16 only");
  const int64_t batch = x.size(0), c_total = x.size(1), pixels = x.size(2) * x.size(3);
  TORCH_CHECK(c_total % 16 == 0 && c_total % groups == 0, "group_norm_nhwc: channels must divide into groups and by 16");
  TORCH_CHECK(weight.numel() == c_total && bias.numel() == c_total, "group_norm_nhwc: weight and bias need C values");
  TORCH_CHECK(pixels > 0, "group_norm_nhwc: empty input");
  const at::Tensor w = weight.to(at::kFloat).contiguous(), b = bias.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::ChannelsLast);
  for (int64_t i = 0; i < batch; ++i) {
    if (x.scalar_type() == at::kFloat) {
      group_norm_sample(x.data_ptr<float>() + i * pixels * c_total, y.data_ptr<float>() + i * pixels * c_total,
                        pixels, c_total, groups, w.data_ptr<float>(), b.data_ptr<float>(), eps);
    } else {
      group_norm_sample(x.data_ptr<at::BFloat16>() + i * pixels * c_total,
                        y.data_ptr<at::BFloat16>() + i * pixels * c_total, pixels, c_total, groups,
                        w.data_ptr<float>(), b.data_ptr<float>(), eps);
    }
  }
  return y;
}

}  // namespace

// The schema is defined on the Python side (genfast/diffusion/group_norm.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("group_norm_nhwc", &group_norm_nhwc); }
