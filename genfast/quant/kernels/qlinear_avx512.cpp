// y = x @ W^T for weights stored as unsigned 8-bit or 4-bit codes with a per (row, group) fp16
// scale and minimum: W[n, k] = u[n, k] * scale[g, n] + min[g, n], g = k / group_size.
//
// Activations are quantized on the fly to int8 per block of 32 (x ≈ xs[b] * xq[k], as llama.cpp's
// Q8 activations), so the inner product runs on AVX512-VNNI `vpdpbusd` (64 u8 x s8 products per
// instruction): per block, sum_k u*x = xs[b] * dot(u, xq), and the minimum contributes
// min * sum_k x, with sum_k x taken from the same quantized x so the two terms stay consistent.
//
// Weight layout ("tiles", made by genfast/quant/kernels/__init__.py): rows in tiles of 16; a tile
// holds, for each chunk of 4 (int8) or 8 (int4) columns, 64 bytes = 16 rows x 4 bytes, so one
// vpdpbusd with 4 broadcast activation bytes serves 16 output rows and no horizontal sums are
// needed. For int4 the low nibbles hold columns 8c..8c+3 and the high nibbles 8c+4..8c+7.
// Scales and minima are [groups, N_padded] so the 16 rows of a tile load as one vector.
//
// Compiled with -mavx512f/bw/vl/vnni/f16c; the Python side calls it only when the CPU has them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 32;  // activation quantization block
constexpr int64_t kTileRows = 16;

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, float* xsum) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* src = x + m * k + b * kBlock;
        float v[kBlock];
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) {
          v[i] = static_cast<float>(src[i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float scale = amax / 127.f;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        int32_t sum = 0;
        int8_t* dst = xq + m * k + b * kBlock;
        for (int i = 0; i < kBlock; ++i) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * inv));
          dst[i] = static_cast<int8_t>(q);
          sum += q;
        }
        xs[m * blocks + b] = scale;
        xsum[m * blocks + b] = scale * static_cast<float>(sum);
      }
    }
  });
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Dot products of one activation block (32 values) with NT tiles of 16 rows. Several tiles
// share each activation broadcast, and two accumulators per tile keep independent vpdpbusd
// chains in flight.
template <int Bits, int NT>
inline void block_dots(const uint8_t* const* w, const int8_t* xq, __m512i* dot) {
  __m512i acc0[NT], acc1[NT];
  for (int i = 0; i < NT; ++i) acc0[i] = acc1[i] = _mm512_setzero_si512();
  if constexpr (Bits == 8) {
#pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2) {
      const __m512i x0 = broadcast4(xq + 4 * c), x1 = broadcast4(xq + 4 * c + 4);
      for (int i = 0; i < NT; ++i) {
        acc0[i] = _mm512_dpbusd_epi32(acc0[i], _mm512_loadu_si512(w[i] + c * 64), x0);
        acc1[i] = _mm512_dpbusd_epi32(acc1[i], _mm512_loadu_si512(w[i] + (c + 1) * 64), x1);
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i x0 = broadcast4(xq + 8 * c), x1 = broadcast4(xq + 8 * c + 4);
      for (int i = 0; i < NT; ++i) {
        const __m512i v = _mm512_loadu_si512(w[i] + c * 64);
        acc0[i] = _mm512_dpbusd_epi32(acc0[i], _mm512_and_si512(v, low), x0);
        acc1[i] = _mm512_dpbusd_epi32(acc1[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), low), x1);
      }
    }
  }
  for (int i = 0; i < NT; ++i) dot[i] = _mm512_add_epi32(acc0[i], acc1[i]);
}

struct Activations {
  const int8_t* xq;
  const float* xs;
  const float* xsum;
  int64_t rows, k;
};

struct Weights {
  const uint8_t* packed;
  const at::Half* scales;
  const at::Half* mins;
  int64_t group_size, n_padded, n;
};

// Output rows [16 * t0, 16 * (t0 + NT)) for every activation row.
template <int Bits, int NT, typename T>
void tile_run(const Activations& a, const Weights& w, int64_t t0, T* y) {
  const int64_t blocks = a.k / kBlock;
  const int64_t blocks_per_group = w.group_size / kBlock;
  const int64_t block_bytes = kBlock * kTileRows * Bits / 8;
  const int64_t tile_bytes = blocks * block_bytes;
  for (int64_t m = 0; m < a.rows; ++m) {
    const int8_t* xrow = a.xq + m * a.k;
    const float* xs_row = a.xs + m * blocks;
    const float* xsum_row = a.xsum + m * blocks;
    __m512 out[NT];
    for (int i = 0; i < NT; ++i) out[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < a.k / w.group_size; ++g) {
      __m512 acc[NT];
      for (int i = 0; i < NT; ++i) acc[i] = _mm512_setzero_ps();
      float group_sum = 0.f;
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const uint8_t* ptrs[NT];
        for (int i = 0; i < NT; ++i) ptrs[i] = w.packed + (t0 + i) * tile_bytes + b * block_bytes;
        __m512i dot[NT];
        block_dots<Bits, NT>(ptrs, xrow + b * kBlock, dot);
        const __m512 xscale = _mm512_set1_ps(xs_row[b]);
        for (int i = 0; i < NT; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), xscale, acc[i]);
        group_sum += xsum_row[b];
      }
      const __m512 sum = _mm512_set1_ps(group_sum);
      for (int i = 0; i < NT; ++i) {
        const int64_t offset = g * w.n_padded + (t0 + i) * kTileRows;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + offset)));
        const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + offset)));
        out[i] = _mm512_fmadd_ps(minimum, sum, _mm512_fmadd_ps(scale, acc[i], out[i]));
      }
    }
    for (int i = 0; i < NT; ++i) {
      alignas(64) float result[kTileRows];
      _mm512_store_ps(result, out[i]);
      const int64_t first = (t0 + i) * kTileRows;
      const int64_t count = std::min<int64_t>(kTileRows, w.n - first);
      T* dst = y + m * w.n + first;
      for (int64_t j = 0; j < count; ++j) dst[j] = static_cast<T>(result[j]);
    }
  }
}

constexpr int64_t kTilesPerTask = 4;

template <int Bits, typename T>
void qlinear_tiles(const Activations& a, const Weights& w, T* y) {
  const int64_t tiles = w.n_padded / kTileRows;
  const int64_t tasks = (tiles + kTilesPerTask - 1) / kTilesPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t0 = task * kTilesPerTask;
      switch (std::min(kTilesPerTask, tiles - t0)) {
        case 4: tile_run<Bits, 4>(a, w, t0, y); break;
        case 3: tile_run<Bits, 3>(a, w, t0, y); break;
        case 2: tile_run<Bits, 2>(a, w, t0, y); break;
        default: tile_run<Bits, 1>(a, w, t0, y); break;
      }
    }
  });
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& mins, int64_t bits, int64_t group_size, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "qlinear: x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: x must be fp32 or bf16");
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: bits must be 4 or 8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "qlinear: packed must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf, "qlinear: scales/mins must be fp16");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % group_size == 0 && group_size % kBlock == 0, "qlinear: K must be whole groups of whole blocks");
  const int64_t n_padded = scales.size(1);
  TORCH_CHECK(n_padded % kTileRows == 0 && out_features <= n_padded, "qlinear: bad padded row count");
  TORCH_CHECK(scales.size(0) == k / group_size && mins.sizes() == scales.sizes(), "qlinear: scales shape mismatch");
  TORCH_CHECK(packed.numel() == n_padded * k * bits / 8, "qlinear: packed size mismatch");
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous(), "qlinear: scales/mins must be contiguous");

  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({rows, k / kBlock}, x.options().dtype(at::kFloat));
  at::Tensor xsum = at::empty({rows, k / kBlock}, x.options().dtype(at::kFloat));
  at::Tensor y = at::empty({rows, out_features}, x.options());

  AT_DISPATCH_SWITCH(x.scalar_type(), "qlinear",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      quantize_rows(xc.data_ptr<scalar_t>(), rows, k, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      quantize_rows(xc.data_ptr<scalar_t>(), rows, k, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
    }));

  const Activations a{xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>(), rows, k};
  const Weights w{packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(),
                  group_size, n_padded, out_features};
  if (x.scalar_type() == at::kFloat) {
    bits == 8 ? qlinear_tiles<8>(a, w, y.data_ptr<float>()) : qlinear_tiles<4>(a, w, y.data_ptr<float>());
  } else {
    bits == 8 ? qlinear_tiles<8>(a, w, y.data_ptr<at::BFloat16>()) : qlinear_tiles<4>(a, w, y.data_ptr<at::BFloat16>());
  }
  return y;
}

}  // namespace

// The schema is defined on the Python side (genfast/quant/kernels/__init__.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("qlinear", &qlinear);
}
