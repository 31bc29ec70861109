// AVX2 + FMA: y = x W^T for fp32 rows x [M, K] and a bf16 weight W [N, K], in fp32, for the many
// rows of a prefill (the few-row kernel takes 1 to 5).
//
// Why: on a CPU without native bf16, `--dtype auto` computes in fp32 and stores the weights in
// bf16 (half the bytes a decode step reads). A prefill would then upcast each weight (a pass of
// aten's over the whole weight) and hand it to MKL's sgemm, which packs it again into panels. Here
// the weight is widened while it is packed into the GEMM's panels, which the GEMM has to write
// anyway (`benchmarks/linear_kernels.py --prefill` compares the two).
//
// The loops are the classic blocked GEMM (Goto's; BLIS's names): each thread takes a range of
// output columns (weight rows); for each KC-deep slice of K it packs its weight rows into fp32
// panels of NR columns (kept in the thread's cache, read once per MC rows of x), packs MC rows of
// x into panels of MR rows, and the micro-kernel multiplies an MR x KC panel by a KC x NR panel
// into MR x NR sums held in 12 ymm registers: per k, 2 loads of the weight, 6 broadcasts of x,
// 12 FMAs.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace {

constexpr int64_t MR = 6;    // rows of x per micro-kernel
constexpr int64_t NR = 16;   // output columns per micro-kernel: two ymm
constexpr int64_t KC = 256;  // depth of a slice: an NR panel of it is 16 KB, in L1
constexpr int64_t MC = 96;   // rows of x packed at a time: 96 KB, in L2
constexpr int64_t NC = 4096; // weight rows packed at a time: 4 MB of panels, in L3
static_assert(NC % NR == 0, "a thread's panel buffer holds NC columns: whole panels only");

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

Buffer aligned_floats(int64_t count) {
  const size_t bytes = static_cast<size_t>((count * sizeof(float) + 63) / 64 * 64);
  Buffer buffer(static_cast<float*>(std::aligned_alloc(64, bytes)));
  TORCH_CHECK(buffer, "linear_widening_gemm: cannot allocate ", bytes, " bytes of packing buffers");
  return buffer;
}

// Weight rows [n0, n0 + nc) and columns [k0, k0 + kc) as fp32 panels of NR rows: panel p holds,
// for each k, the NR weights of rows n0 + p * NR + j (j < NR) contiguously; rows past N are zero.
// 8 x 8 blocks are widened and transposed in registers.
void pack_weight(const c10::BFloat16* w, int64_t N, int64_t K, int64_t n0, int64_t nc, int64_t k0, int64_t kc,
                 float* out) {
  for (int64_t p = 0; p * NR < nc; ++p) {
    float* panel = out + p * NR * kc;
    for (int64_t half = 0; half < NR; half += 8) {
      const int64_t row0 = n0 + p * NR + half;
      const int64_t rows = std::clamp<int64_t>(N - row0, 0, 8);
      int64_t k = 0;
      if (rows == 8) {
        for (; k + 8 <= kc; k += 8) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (row0 + j) * K + k0 + k));
            r[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
          }
          // 8 x 8 transpose: r[j][i] -> t[i][j]
          const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
          const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
          const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
          const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
          const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
          const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
          const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
          const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
          const __m256 t[8] = {
              _mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
              _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
              _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
              _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31),
          };
          for (int i = 0; i < 8; ++i) _mm256_store_ps(panel + (k + i) * NR + half, t[i]);
        }
      }
      for (; k < kc; ++k) {  // the depth's tail, and the last panel's rows past N
        for (int64_t j = 0; j < 8; ++j) {
          panel[k * NR + half + j] = j < rows ? static_cast<float>(w[(row0 + j) * K + k0 + k]) : 0.0f;
        }
      }
    }
  }
}

// Rows [m0, m0 + mc) and columns [k0, k0 + kc) of x as panels of MR rows: for each k, the MR
// values contiguously; rows past M are zero.
void pack_rows(const float* x, int64_t M, int64_t K, int64_t m0, int64_t mc, int64_t k0, int64_t kc, float* out) {
  for (int64_t p = 0; p * MR < mc; ++p) {
    float* panel = out + p * MR * kc;
    for (int64_t i = 0; i < MR; ++i) {
      const int64_t row = m0 + p * MR + i;
      if (row < M) {
        const float* src = x + row * K + k0;
        for (int64_t k = 0; k < kc; ++k) panel[k * MR + i] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) panel[k * MR + i] = 0.0f;
      }
    }
  }
}

// An MR x NR block of y: the product of an x panel and a weight panel over kc, stored (first
// slice of K) or added to what y holds. Only `rows` x `cols` of it are written (the edges).
void micro_kernel(int64_t kc, const float* a, const float* b, float* y, int64_t ldy, bool accumulate, int64_t rows,
                  int64_t cols) {
  // Every loop over the rows is unrolled: indexed only by constants, the 12 sums stay in registers
  // (a loop left rolled makes the array live on the stack, stored to at every k).
  // The block of y is fetched now, while the k loop runs: its rows lie N floats apart, a stride the
  // hardware prefetcher does not follow, and y (M x NC) is far larger than the caches, so without
  // this the loads and stores at the end wait on memory once per slice of K.
  __m256 sums[MR][2];
#pragma GCC unroll 6
  for (int64_t i = 0; i < MR; ++i) {
    sums[i][0] = sums[i][1] = _mm256_setzero_ps();
    if (i < rows) {
      _mm_prefetch(reinterpret_cast<const char*>(y + i * ldy), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(y + i * ldy + cols - 1), _MM_HINT_T0);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int64_t i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i);
      sums[i][0] = _mm256_fmadd_ps(x, b0, sums[i][0]);
      sums[i][1] = _mm256_fmadd_ps(x, b1, sums[i][1]);
    }
    a += MR;
    b += NR;
  }
  if (rows == MR && cols == NR) {
#pragma GCC unroll 6
    for (int64_t i = 0; i < MR; ++i) {
      float* out = y + i * ldy;
      __m256 lo = sums[i][0], hi = sums[i][1];
      if (accumulate) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(out));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(out + 8));
      }
      _mm256_storeu_ps(out, lo);
      _mm256_storeu_ps(out + 8, hi);
    }
    return;
  }
  alignas(32) float block[MR][NR];
#pragma GCC unroll 6
  for (int64_t i = 0; i < MR; ++i) {
    _mm256_store_ps(block[i], sums[i][0]);
    _mm256_store_ps(block[i] + 8, sums[i][1]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) y[i * ldy + j] = accumulate ? y[i * ldy + j] + block[i][j] : block[i][j];
  }
}

// Output columns [n0, n0 + nc) of y = x W^T, nc <= NC, for all M rows.
void gemm_block(const float* x, const c10::BFloat16* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                int64_t nc, float* weight_panels, float* row_panels) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    pack_weight(w, N, K, n0, nc, k0, kc, weight_panels);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      pack_rows(x, M, K, m0, mc, k0, kc, row_panels);
      for (int64_t j = 0; j < nc; j += NR) {
        const float* b = weight_panels + j * kc;
        for (int64_t i = 0; i < mc; i += MR) {
          micro_kernel(kc, row_panels + i * kc, b, y + (m0 + i) * N + n0 + j, N, k0 > 0,
                       std::min(MR, mc - i), std::min(NR, nc - j));
        }
      }
    }
  }
}

at::Tensor linear_widening_gemm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_widening_gemm: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_widening_gemm: x must be fp32");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_widening_gemm: the weight must be bf16");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = xc.data_ptr<float>();
  const auto* wp = wc.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  // Threads split the output columns in whole panels: each packs only its own weight rows.
  const int64_t panels = (N + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const int64_t n1 = std::min(end * NR, N);
    const Buffer weight_panels = aligned_floats(std::min(NC, (end - begin) * NR) * KC);
    const Buffer row_panels = aligned_floats((MC + MR - 1) / MR * MR * KC);
    for (int64_t n0 = begin * NR; n0 < n1; n0 += NC) {
      gemm_block(xp, wp, yp, M, N, K, n0, std::min(NC, n1 - n0), weight_panels.get(), row_panels.get());
    }
  });
  return y;
}

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) { m.impl("linear_widening_gemm", &linear_widening_gemm); }
