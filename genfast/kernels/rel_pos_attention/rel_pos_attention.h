// The host side both variants (<isa>.cpp) share: the two ops' shape checks and their entry
// points. A variant supplies the attention itself as
//
//   at::Tensor attend(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
//                     const Bias& bias, double scale, Products products);
//
// which checks what is its own (the dtypes it computes on, the strides it reads, whether it has
// int8 products) and returns [B, Nq, heads, Cv] (v's channels) in q's dtype.
// products.int8_scores: q . k computed on q and k quantized to int8 per row and per key (absmax
// scales); products.int8_values: P @ V on P as u8 codes (a scale per query row and block of keys)
// and V as s8 codes (a scale per block of keys and channel). Both need an int8 dot product (AVX512-VNNI); a variant without one refuses
// them. Never with a bias. products.fp32: the products not on int8 codes multiply the bf16
// operands widened to fp32 (FMAs) instead of on bf16 dot products; for CPUs whose bf16 dot
// products are slower than their fp32 FMAs (a variant that computes in fp32 anyway ignores it).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace genfast_rel_pos_attention {

constexpr int64_t kMaxHeadDim = 256;  // SAM 2's memory attention: one head of 256 channels

// The bias of a rel_pos_attention call: per query row, grid_h + grid_w fp32 terms (null: none).
// Key j sits at row j / grid_w, column j % grid_w of the grid.
struct Bias {
  const float* h = nullptr;  // [B * heads, Nq, grid_h]
  const float* w = nullptr;  // [B * heads, Nq, grid_w]
  int64_t grid_h = 0, grid_w = 0;
};

// How the attention's two products are computed (see the top of this file).
struct Products {
  bool int8_scores = false;  // S = Q K^T on int8 codes
  bool int8_values = false;  // O = P V on int8 codes
  bool fp32 = false;         // the others on fp32 FMAs of the widened bf16 operands
};

using Attend = at::Tensor (*)(const char*, const at::Tensor&, const at::Tensor&, const at::Tensor&, const Bias&,
                              double, Products);

inline void check_shapes(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes().slice(0, 3) == v.sizes().slice(0, 3) &&
                  q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              op, ": q [B, heads, Nq, C], k [B, heads, Nk, C], v [B, heads, Nk, Cv]");
  for (const int64_t dim : {q.size(3), v.size(3)})
    TORCH_CHECK(dim % 16 == 0 && dim >= 16 && dim <= kMaxHeadDim, op, ": head dims must be 16..", kMaxHeadDim,
                " in steps of 16");
  TORCH_CHECK(k.size(2) > 0, op, ": no keys");
  // The AVX-512 variant folds the scale into the softmax's exponent, which needs it positive.
  TORCH_CHECK(scale > 0, op, ": the scale must be positive");
}

// q, k, v: [B, heads, N, C]; rel_h [B, heads, N, H], rel_w [B, heads, N, W] with H * W = N.
// Returns [B, N, heads, C]: the layout the output projection reads.
template <Attend attend>
at::Tensor rel_pos_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rel_h,
                             const at::Tensor& rel_w, double scale, bool fp32_products) {
  check_shapes("rel_pos_attention", q, k, v, scale);
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "rel_pos_attention: q, k, v must all be [B, heads, N, C]");
  TORCH_CHECK(rel_h.dim() == 4 && rel_w.dim() == 4 && rel_h.sizes().slice(0, 3) == q.sizes().slice(0, 3) &&
                  rel_w.sizes().slice(0, 3) == q.sizes().slice(0, 3) && rel_h.size(3) * rel_w.size(3) == q.size(2),
              "rel_pos_attention: rel_h [B, heads, N, H] and rel_w [B, heads, N, W] need H * W = N");
  const at::Tensor bias_h = rel_h.to(at::kFloat).contiguous(), bias_w = rel_w.to(at::kFloat).contiguous();
  const Bias bias{bias_h.data_ptr<float>(), bias_w.data_ptr<float>(), rel_h.size(3), rel_w.size(3)};
  return attend("rel_pos_attention", q, k, v, bias, scale, Products{false, false, fp32_products});
}

// q [B, heads, Nq, C], k [B, heads, Nk, C], v [B, heads, Nk, Cv]: softmax(scale * q k^T) v, as
// [B, Nq, heads, Cv]. (Cv may differ from C: SAM 2's memory attention multiplies P by the memory
// before its value projection, which has 64 channels where the projected values have 256.)
template <Attend attend>
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool int8_scores,
                     bool int8_values, bool fp32_products) {
  check_shapes("attention", q, k, v, scale);
  return attend("attention", q, k, v, Bias{}, scale, Products{int8_scores, int8_values, fp32_products});
}

}  // namespace genfast_rel_pos_attention
