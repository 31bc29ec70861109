// The host side that every variant (<isa>.cpp) shares: argument checks, per-thread scratch
// buffers, the dtype and bit-width dispatch, and the split of the work into tasks. A variant is a
// struct of static functions (see avx512.h for the math and the packed weight layout):
//
//   template <typename T> quantize_blocks(x, rows, k, xq, xs, xsum)   int8 per block of 32
//   template <int Bits, typename T> tiles(a, w, t0, y)                 outputs [16 t0, 16 (t0 + 4)), every row
//   template <typename T> quantize_tokens(x, rows, k, xq, xs, xsum)   int8 per row
//   template <typename T> dynamic_rows(xq, xs, xsum, k, w, epilogue, m0, m1, t0, y)  rows [m0, m1) x the same
//                                                                                   outputs, + bias, GELU
//
// `packed` is one tensor per layer (every tensor is an input torch.compile's wrapper must handle):
// per row group of 64 rows (one task), per group of `group_size` columns, the group's codes in
// tile layout (group_size x 64 x bits/8 bytes), then the 64 rows' fp16 scales, then their fp16
// minima. A task reads one contiguous stream. With the scales and minima in arrays of their own,
// [groups, N_padded], a task would read its codes plus two 128-byte runs 2 * N_padded bytes apart
// per group: short interleaved streams, which slowed int4 in small groups the most.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace genfast_qlinear {

constexpr int64_t kBlock = 32;  // activation quantization block
constexpr int64_t kTileRows = 16;
constexpr int64_t kTilesPerTask = 4;
constexpr int64_t kRowsPerTask = 64;  // dynamic: activation rows per task
constexpr int64_t kRowBlock = 32;     // dynamic: the activation codes hold whole blocks of this many rows

struct Activations {
  const int8_t* xq;
  const float* xs;
  const float* xsum;
  int64_t rows, k;
};

constexpr int64_t kRowGroup = kTileRows * kTilesPerTask;  // rows per task

// The packed layout's addresses (see the header). A row group is tiles [4 s, 4 s + 4).
struct Weights {
  const uint8_t* packed;
  int64_t bits, group_size, k, n;  // n: the real output rows (the layout pads to whole row groups)

  int64_t group_code_bytes() const { return group_size * kRowGroup * bits / 8; }
  int64_t group_bytes() const { return group_code_bytes() + 4 * kRowGroup; }
  // Codes of group g of row group s: its blocks one after another, each [tile][chunk].
  const uint8_t* codes(int64_t s, int64_t g) const {
    return packed + s * (k / group_size) * group_bytes() + g * group_bytes();
  }
  // The 64 rows' scales of group g of row group s; their minima follow.
  const at::Half* scales(int64_t s, int64_t g) const {
    return reinterpret_cast<const at::Half*>(codes(s, g) + group_code_bytes());
  }
  const at::Half* mins(int64_t s, int64_t g) const { return scales(s, g) + kRowGroup; }
};

// What qlinear_dynamic applies to its fp32 outputs before rounding them to the output dtype: the
// bias, then GELU (the exact, erf form). In the kernel they cost a few instructions per output;
// as passes of their own (a compiled model's bias add, ATen's GELU) they re-read and re-write the
// whole output.
struct Epilogue {
  const float* bias = nullptr;  // fp32, out_features padded with zeros to whole row groups; or none
  bool gelu = false;
};

template <typename T>
inline void store_rows(T* dst, const float* values, int64_t count) {
  for (int64_t j = 0; j < count; ++j) dst[j] = static_cast<T>(values[j]);
}

inline void check_input(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be fp32 or bf16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), op, ": packed must be contiguous uint8");
}

template <class V>
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t group_size,
                   int64_t out_features) {
  check_input("qlinear", x, packed);
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: bits must be 4 or 8");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % group_size == 0 && group_size % kBlock == 0, "qlinear: K must be whole groups of whole blocks");
  const int64_t groups = k / group_size;
  const int64_t bytes_per_row = k * bits / 8 + 4 * groups;
  const int64_t n_padded = packed.numel() / bytes_per_row;
  TORCH_CHECK(n_padded * bytes_per_row == packed.numel() && n_padded % kRowGroup == 0 &&
              out_features <= n_padded, "qlinear: packed size does not match K, bits and group size");

  // Quantized activations live in per-thread scratch space: no allocations per call but the output.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs, xsum;
  xq.resize(rows * k);
  xs.resize(rows * k / kBlock);
  xsum.resize(rows * k / kBlock);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const Activations a{xq.data(), xs.data(), xsum.data(), rows, k};
  const Weights w{packed.data_ptr<uint8_t>(), bits, group_size, k, out_features};
  auto run = [&](const auto* in, auto* out) {
    V::quantize_blocks(in, rows, k, xq.data(), xs.data(), xsum.data());
    at::parallel_for(0, n_padded / kRowGroup, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        bits == 8 ? V::template tiles<8>(a, w, task * kTilesPerTask, out)
                  : V::template tiles<4>(a, w, task * kTilesPerTask, out);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>(), y.data_ptr<float>());
  } else {
    run(xc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  }
  return y;
}

template <class V>
at::Tensor qlinear_dynamic(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                           const std::optional<at::Tensor>& bias, bool gelu) {
  check_input("qlinear_dynamic", x, packed);
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "qlinear_dynamic: K must be a multiple of 32");
  const int64_t bytes_per_row = k + 4;  // codes + fp16 scale + fp16 minimum
  const int64_t n_padded = packed.numel() / bytes_per_row;
  TORCH_CHECK(n_padded * bytes_per_row == packed.numel() && n_padded % kRowGroup == 0 &&
              out_features <= n_padded, "qlinear_dynamic: packed size does not match K (8-bit, one group)");
  TORCH_CHECK(static_cast<double>(k) * 255 * 128 < 2147483647.0, "qlinear_dynamic: K too large for int32 sums");
  std::vector<float> bias_values;  // the epilogue's fp32 copy, padded
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out_features, "qlinear_dynamic: bias must be [out_features]");
    TORCH_CHECK(b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16, "qlinear_dynamic: bias must be fp32 or bf16");
    bias_values.assign(n_padded, 0.0f);
    const at::Tensor bc = b.contiguous();
    for (int64_t j = 0; j < out_features; ++j)
      bias_values[j] = b.scalar_type() == at::kFloat ? bc.data_ptr<float>()[j] : static_cast<float>(bc.data_ptr<at::BFloat16>()[j]);
  }
  const Epilogue epilogue{bias_values.empty() ? nullptr : bias_values.data(), gelu};

  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xsum;
  // Whole blocks of kRowBlock rows: the AMX variant reads the codes 16 rows at a time, two such
  // tiles a step, and stores only the real rows' outputs.
  const int64_t rows_padded = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  xq.resize(rows_padded * k);
  xs.resize(rows);
  xsum.resize(rows);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const Weights w{packed.data_ptr<uint8_t>(), 8, k, k, out_features};
  const int64_t row_groups = n_padded / kRowGroup;
  const int64_t row_chunks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  // Pointers taken here: inside the parallel region the thread_local names are other threads' buffers.
  int8_t* xq_ptr = xq.data();
  float* xs_ptr = xs.data();
  int32_t* xsum_ptr = xsum.data();
  auto run = [&](const auto* in, auto* out) {
    V::quantize_tokens(in, rows, k, xq_ptr, xs_ptr, xsum_ptr);
    // Consecutive tasks take one chunk of activation rows (in L2) through every weight row group:
    // the weights (a few MB) stay in L3, while a large activation matrix is read from memory once.
    at::parallel_for(0, row_groups * row_chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t0 = (task % row_groups) * kTilesPerTask;
        const int64_t m_begin = (task / row_groups) * kRowsPerTask, m_end = std::min(rows, m_begin + kRowsPerTask);
        V::dynamic_rows(xq_ptr, xs_ptr, xsum_ptr, k, w, epilogue, m_begin, m_end, t0, out);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>(), y.data_ptr<float>());
  } else {
    run(xc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  }
  return y;
}

}  // namespace genfast_qlinear
