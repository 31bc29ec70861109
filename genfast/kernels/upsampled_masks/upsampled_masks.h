// The host side of the upsampled-mask variants (<isa>.cpp): what the automatic mask generator
// needs of each candidate mask at the image's size, computed from its low-resolution logits
// without writing the upsampled logits (or any full-size mask) to memory.
//
// Upsampling is F.interpolate's bilinear (align_corners=False) in fp32: source positions
// scale * (i + 0.5) - 0.5 clamped at 0, with scale = in / out in fp32; interpolated along x first
// (a * wx0 + b * wx1, the first product fused) and then along y, in that order, as ATen's CPU
// kernel does. ATen's compiler may fuse its products differently, so a value can differ from
// ATen's in the last bit, and a pixel within that of a threshold can fall on the other side.
//
// A variant supplies the vector steps as a struct V with
//   static constexpr int kLanes;                        // output columns per vector
//   using Vec = ...; using Index = ...;
//   static Index load_index(const int32_t* p);
//   static Vec load(const float* p); static Vec broadcast(float x); static void store(float* p, Vec v);
//   static Vec gather(const float* base, Index i);      // base[i[lane]]
//   static Vec lerp(Vec a, Vec w0, Vec b, Vec w1);      // fma(a, w0, b * w1)
//   static uint32_t above(Vec v, Vec t);                // lanes with v > t (false for NaN)
//
// Columns are taken kLanes at a time: each low-res row is interpolated along x into a tile of
// kLanes columns (two gathers a row), then each output row y is one lerp of two tile rows, three
// comparisons and their lane masks. Counts, boxes and column runs come from the lane masks:
// a column run starts or ends where a lane's mask changes between consecutive rows.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace genfast_upsampled_masks {

// The two source positions and their weights for each of `out` positions, as ATen's bilinear
// upsampling computes them.
struct Axis {
  std::vector<int32_t> i0, i1;
  std::vector<float> w0, w1;

  Axis(int64_t in, int64_t out, int64_t padded) : i0(padded), i1(padded), w0(padded), w1(padded) {
    const float scale = static_cast<float>(in) / static_cast<float>(out);
    for (int64_t o = 0; o < padded; ++o) {
      const int64_t j = std::min(o, out - 1);  // padding lanes repeat the last position
      const float source = std::max(scale * (static_cast<float>(j) + 0.5f) - 0.5f, 0.0f);
      const int64_t first = static_cast<int64_t>(source);
      const float lambda = std::min(std::max(source - static_cast<float>(first), 0.0f), 1.0f);
      i0[o] = static_cast<int32_t>(first);
      i1[o] = static_cast<int32_t>(first + (first < in - 1 ? 1 : 0));
      w1[o] = lambda;
      w0[o] = 1.0f - lambda;
    }
  }
};

// One mask's pixel counts and box, gathered from its lane masks.
struct Summary {
  int64_t above_high = 0, above_low = 0;  // pixels above threshold + offset, above threshold - offset
  int64_t x_min, y_min, x_max = -1, y_max = -1;  // box of the pixels above threshold
  Summary(int64_t width, int64_t height) : x_min(width), y_min(height) {}
};

// One mask, a block of kLanes columns at a time: once `tile` (rows x kLanes floats) holds the
// block's x-interpolation, row(y, values, lanes) for every output row in order (`lanes`: the bits of
// the block's columns inside the image), then block_done(first column).
template <class V, class Row, class BlockDone>
void for_each_block(const float* logits, int64_t rows, int64_t cols, const Axis& xs, const Axis& ys, int64_t width,
                    int64_t height, float* tile, Row&& row, BlockDone&& block_done) {
  constexpr int L = V::kLanes;
  for (int64_t x0 = 0; x0 < width; x0 += L) {
    const uint32_t lanes = (1u << std::min<int64_t>(L, width - x0)) - 1;
    const auto i0 = V::load_index(xs.i0.data() + x0), i1 = V::load_index(xs.i1.data() + x0);
    const auto w0 = V::load(xs.w0.data() + x0), w1 = V::load(xs.w1.data() + x0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* source = logits + r * cols;
      V::store(tile + r * L, V::lerp(V::gather(source, i0), w0, V::gather(source, i1), w1));
    }
    for (int64_t y = 0; y < height; ++y) {
      row(y,
          V::lerp(V::load(tile + ys.i0[y] * L), V::broadcast(ys.w0[y]), V::load(tile + ys.i1[y] * L),
                  V::broadcast(ys.w1[y])),
          lanes);
    }
    block_done(x0);
  }
}

inline int64_t padded(int64_t n, int lanes) { return (n + lanes - 1) / lanes * lanes; }

inline void check(const at::Tensor& logits, int64_t height, int64_t width, const char* op) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), op,
              ": logits must be contiguous float32 [N, h, w]");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(2) > 0, op, ": empty low-res masks");
  TORCH_CHECK(height > 0 && width > 0 && height < (int64_t{1} << 31) / 2 && width < (int64_t{1} << 31) / 2, op,
              ": output size out of range");
}

// Per mask: [N, 2] pixel counts above threshold + offset and above threshold - offset, and [N, 4]
// XYXY boxes (inclusive, int64) of the pixels above threshold ([0, 0, 0, 0] for an empty mask).
template <class V>
std::tuple<at::Tensor, at::Tensor> upsampled_mask_stats(const at::Tensor& logits, int64_t height, int64_t width,
                                                        double threshold, double offset) {
  check(logits, height, width, "upsampled_mask_stats");
  constexpr int L = V::kLanes;
  const int64_t n = logits.size(0), rows = logits.size(1), cols = logits.size(2);
  const Axis xs(cols, width, padded(width, L)), ys(rows, height, height);
  at::Tensor counts = at::empty({n, 2}, logits.options().dtype(at::kLong));
  at::Tensor boxes = at::empty({n, 4}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* count_out = counts.data_ptr<int64_t>();
  int64_t* box_out = boxes.data_ptr<int64_t>();
  const auto t_mid = V::broadcast(static_cast<float>(threshold));
  const auto t_high = V::broadcast(static_cast<float>(threshold + offset));
  const auto t_low = V::broadcast(static_cast<float>(threshold - offset));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(rows * L);
    for (int64_t m = begin; m < end; ++m) {
      Summary s(width, height);
      uint32_t columns = 0;  // lanes with a pixel above threshold in the current block
      for_each_block<V>(
          src + m * rows * cols, rows, cols, xs, ys, width, height, tile.data(),
          [&](int64_t y, auto value, uint32_t lanes) {
            const uint32_t mid = V::above(value, t_mid) & lanes;
            s.above_high += __builtin_popcount(V::above(value, t_high) & lanes);
            s.above_low += __builtin_popcount(V::above(value, t_low) & lanes);
            if (mid) {
              columns |= mid;
              s.y_min = std::min(s.y_min, y);
              s.y_max = std::max(s.y_max, y);
            }
          },
          [&](int64_t x0) {
            if (columns) {
              s.x_min = std::min<int64_t>(s.x_min, x0 + __builtin_ctz(columns));
              s.x_max = std::max<int64_t>(s.x_max, x0 + 31 - __builtin_clz(columns));
            }
            columns = 0;
          });
      count_out[2 * m] = s.above_high;
      count_out[2 * m + 1] = s.above_low;
      const bool empty = s.x_max < 0;
      const int64_t box[4] = {s.x_min, s.y_min, s.x_max, s.y_max};
      for (int k = 0; k < 4; ++k) box_out[4 * m + k] = empty ? 0 : box[k];
    }
  });
  return {counts, boxes};
}

// The foreground runs (pixels above threshold) of each column of each mask: (mask index, column,
// start row, end row (exclusive)), int64 [K] each, sorted by mask, column and start: what
// genfast.sam.masks.column_runs returns for the upsampled masks thresholded.
template <class V>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> upsampled_mask_runs(const at::Tensor& logits,
                                                                               int64_t height, int64_t width,
                                                                               double threshold) {
  check(logits, height, width, "upsampled_mask_runs");
  constexpr int L = V::kLanes;
  const int64_t n = logits.size(0), rows = logits.size(1), cols = logits.size(2);
  const Axis xs(cols, width, padded(width, L)), ys(rows, height, height);
  const float* src = logits.data_ptr<float>();
  const auto t_mid = V::broadcast(static_cast<float>(threshold));
  // Per mask, its runs as (column, start, end) triples, in order.
  std::vector<std::vector<int32_t>> runs(n);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(rows * L);
    std::vector<int32_t> lane_runs[L];  // a block's runs per column (start, end pairs), in row order
    int32_t start[L];
    for (int64_t m = begin; m < end; ++m) {
      std::vector<int32_t>& out = runs[m];
      uint32_t previous = 0;  // the lanes inside a run at the last row
      for_each_block<V>(
          src + m * rows * cols, rows, cols, xs, ys, width, height, tile.data(),
          [&](int64_t y, auto value, uint32_t lanes) {
            const uint32_t mask = V::above(value, t_mid) & lanes;
            for (uint32_t changed = mask ^ previous; changed; changed &= changed - 1) {
              const int c = __builtin_ctz(changed);
              if (mask >> c & 1) {
                start[c] = static_cast<int32_t>(y);
              } else {
                lane_runs[c].push_back(start[c]);
                lane_runs[c].push_back(static_cast<int32_t>(y));
              }
            }
            previous = mask;
          },
          [&](int64_t x0) {  // close the runs open at the bottom edge; the block's runs column by column
            for (int c = 0; c < L; ++c) {
              if (previous >> c & 1) {
                lane_runs[c].push_back(start[c]);
                lane_runs[c].push_back(static_cast<int32_t>(height));
              }
              for (size_t k = 0; k < lane_runs[c].size(); k += 2) {
                out.push_back(static_cast<int32_t>(x0 + c));
                out.push_back(lane_runs[c][k]);
                out.push_back(lane_runs[c][k + 1]);
              }
              lane_runs[c].clear();
            }
            previous = 0;
          });
    }
  });
  int64_t total = 0;
  for (const auto& r : runs) total += static_cast<int64_t>(r.size() / 3);
  const auto options = logits.options().dtype(at::kLong);
  at::Tensor index = at::empty({total}, options), column = at::empty({total}, options);
  at::Tensor first = at::empty({total}, options), last = at::empty({total}, options);
  int64_t *pi = index.data_ptr<int64_t>(), *pc = column.data_ptr<int64_t>();
  int64_t *ps = first.data_ptr<int64_t>(), *pe = last.data_ptr<int64_t>();
  int64_t k = 0;
  for (int64_t m = 0; m < n; ++m) {
    for (size_t j = 0; j < runs[m].size(); j += 3, ++k) {
      pi[k] = m;
      pc[k] = runs[m][j];
      ps[k] = runs[m][j + 1];
      pe[k] = runs[m][j + 2];
    }
  }
  return {index, column, first, last};
}

}  // namespace genfast_upsampled_masks
