// The AMX variant: the AVX-512 variant (avx512.h) with both bf16 products on AMX-BF16 tiles.
// On Intel's cores vdpbf16ps issues at a quarter of the fp32 FMA's rate, so the AVX-512 variant
// multiplies there in fp32 (`products.fp32`), and SDPA, whose products oneDNN runs on the tiles,
// beat it wherever there were more than a few keys. A `tdpbf16ps` does 16 x 16 x 32 multiply-adds.
//
// The AVX-512 variant's layouts are already the tiles' operands: K as channel pairs [C/2][N_pad +
// 16] (lane = key) is B for S = Q K^T (16 rows of channel pairs, 16 keys of 4 bytes each), V as
// key pairs [N_pad/2][C] (lane = channel) is B for O = P V (16 rows of key pairs, 16 channels).
// The A operands are the query rows as they lie in q (16 rows of 32 channels) and P's rows in
// bf16 (16 rows of 32 keys). A step is 32 rows x 32 keys (S) or 32 channels (O): 4 accumulator
// tiles, 2 A and 2 B tiles, the 8 tiles there are. S goes to the task's scores, as the AVX-512
// variant's does, and the online softmax between the products is that variant's; O accumulates
// in the task's fp32 outputs, which each step loads into its accumulators and stores back.
//
// So that every tile is whole: keys are padded to a multiple of 32 (with zero keys, whose
// probabilities are 0), the task's buffers hold its rows rounded up to 32 (rows past the task's
// are computed and never read), and a last group of fewer than 32 query rows is copied into a
// zeroed block. Heads of a multiple of 32 channels, in the keys and in the values, run on the
// tiles (Hiera's 96, the memory attention's 256 and its memory's 64, SAM's 64, the DiTs' 64 and
// 128); other heads, and a process that Linux refuses the tiles, run the AVX-512 code with its
// bf16 products in fp32 (every CPU with AMX is Intel's).
// The fp32 products run as in that variant where asked for. int8 products are refused: on the
// tiles bf16 is faster than the AVX-512 variant's int8 products (`vpdpbusd`), which are there for
// CPUs without AMX.

#include <torch/library.h>

#include "../common/amx_tiles.h"
#include "avx512.h"

namespace {

constexpr int64_t kTileDepthPairs = 16;  // channel (or key) pairs in an A or B tile: 32 bf16
constexpr int64_t kStep = 32;  // rows, keys or channels of a step: two tiles' worth
static_assert(kStep == 2 * kTileDepthPairs, "a step's channels are one tile's depth");

// Tiles 0-3: fp32 accumulators (16 rows x 16 columns); 4-5: A (16 rows x 32 bf16); 6-7: B (16
// rows of 16 pairs).
genfast_amx::TileConfig step_config() {
  genfast_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  return config;
}

// Accumulator tiles 0-3 (rows 0-15 and 16-31 by columns 0-15 and 16-31) += A x B over depth_pairs
// pairs of depth (a multiple of kTileDepthPairs): A's two row tiles a0, a1 (rows a_ld words apart,
// a step of depth kTileDepthPairs words along them), B's two column tiles at b and b + 16 (rows of
// pairs b_ld words apart, kTileDepthPairs rows a step).
inline void accumulate_steps(const uint32_t* a0, const uint32_t* a1, int64_t a_ld, const uint32_t* b, int64_t b_ld,
                             int64_t depth_pairs) {
  for (int64_t d = 0; d < depth_pairs; d += kTileDepthPairs) {
    _tile_loadd(4, a0 + d, 4 * a_ld);
    _tile_loadd(5, a1 + d, 4 * a_ld);
    _tile_loadd(6, b + d * b_ld, 4 * b_ld);
    _tile_loadd(7, b + d * b_ld + 16, 4 * b_ld);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// The accumulator tiles to or from fp32 rows (c0: the first 16 rows, c1: the next, ld floats apart).
inline void store_accumulators(float* c0, float* c1, int64_t ld) {
  _tile_stored(0, c0, 4 * ld);
  _tile_stored(1, c0 + 16, 4 * ld);
  _tile_stored(2, c1, 4 * ld);
  _tile_stored(3, c1 + 16, 4 * ld);
}

inline void load_accumulators(const float* c0, const float* c1, int64_t ld) {
  _tile_loadd(0, c0, 4 * ld);
  _tile_loadd(1, c0 + 16, 4 * ld);
  _tile_loadd(2, c1, 4 * ld);
  _tile_loadd(3, c1 + 16, 4 * ld);
}

struct TileProducts {
  static constexpr int64_t kKeyAlign = kStep;
  static constexpr int64_t kRowAlign = kStep;
  // One pass over the keys only while K holds at most this many elements, half the AVX-512
  // variant's bound: Hiera's global blocks (4096 keys of 96 channels) run faster on the tiles in
  // chunks, SAM's (64 channels, with the bias) and the DiTs' at 512x512 in one pass (notes.md,
  // "AMX attention").
  static constexpr int64_t kOnePassElements = 4096 * 64;

  // Loads the tile configuration while a thread runs tasks, and releases the tiles after.
  struct Session {
    Session() {
      static const genfast_amx::TileConfig config = step_config();
      _tile_loadconfig(&config);
    }
    ~Session() { _tile_release(); }
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
  };

  // As VectorProducts::scores, with len and 2 * pairs multiples of 32; s holds rows rounded up to 32.
  static void scores(const uint32_t* q, int64_t q_stride, int64_t rows, const uint32_t* kp, int64_t k_ld,
                     int64_t pairs, int64_t len, float* s, int64_t s_ld) {
    alignas(64) uint32_t last[kStep * kMaxHeadDim / 2];
    for (int64_t r0 = 0; r0 < rows; r0 += kStep) {
      const uint32_t* q0 = q + r0 * q_stride;
      int64_t stride = q_stride;
      if (r0 + kStep > rows) {  // the last rows, fewer than a step's: a zeroed block of their own
        std::memset(last, 0, 4 * kStep * pairs);
        for (int64_t r = r0; r < rows; ++r) std::memcpy(last + (r - r0) * pairs, q + r * q_stride, 4 * pairs);
        q0 = last;
        stride = pairs;
      }
      const uint32_t* q1 = q0 + 16 * stride;
      float* s0 = s + r0 * s_ld;
      float* s1 = s0 + 16 * s_ld;
      for (int64_t j = 0; j < len; j += kStep) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        accumulate_steps(q0, q1, stride, kp + j, k_ld, pairs);
        store_accumulators(s0 + j, s1 + j, s_ld);
      }
    }
  }

  // As VectorProducts::accumulate, with key_pairs a multiple of 16 and c of 32; p and o hold rows
  // rounded up to 32.
  static void accumulate(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t key_pairs, int64_t rows,
                         int64_t c, float* o) {
    for (int64_t r0 = 0; r0 < rows; r0 += kStep) {
      const uint32_t* p0 = p + r0 * p_stride;
      const uint32_t* p1 = p0 + 16 * p_stride;
      for (int64_t ch = 0; ch < c; ch += kStep) {
        float* o0 = o + r0 * c + ch;
        float* o1 = o0 + 16 * c;
        load_accumulators(o0, o1, c);
        accumulate_steps(p0, p1, p_stride, vp + ch, c, key_pairs);
        store_accumulators(o0, o1, c);
      }
    }
  }
};

at::Tensor attend_on_tiles(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const Bias& bias, double scale, genfast_rel_pos_attention::Products products) {
  TORCH_CHECK(!products.int8_scores && !products.int8_values, op,
              ": int8 products need the AVX-512 variant (AVX512-VNNI without AMX)");
  if (genfast_amx::tiles_permitted() && q.size(3) % kStep == 0 && v.size(3) % kStep == 0)  // shapes checked by the caller
    return attend<TileProducts>(op, q, k, v, bias, scale, products);
  products.fp32 = true;  // Intel's vdpbf16ps is slower than its fp32 FMAs
  return attend<VectorProducts>(op, q, k, v, bias, scale, products);
}

}  // namespace

TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("rel_pos_attention", &genfast_rel_pos_attention::rel_pos_attention<attend_on_tiles>);
  m.impl("attention", &genfast_rel_pos_attention::attention<attend_on_tiles>);
}
