// The AMX variant: the AVX-512 variant (avx512.h), with qlinear_dynamic's products on AMX-INT8
// tiles. `vpdpbusd` does 64 multiply-adds an instruction per port; `tdpbsud` does 16 x 16 x 32 of
// them on tiles of our packed layout, at several times the rate, so the compute-bound layers of
// SAM and diffusion (thousands of activation rows) run near their memory and epilogue costs.
//
// The packed layout needs no change: a tile's block of 32 columns is [chunk c][row r][byte j],
// 8 rows of 64 bytes, which is exactly AMX's B operand for K = 32 (K/4 rows of 16 columns x 4
// bytes; our output rows are its columns). A `tdpbsud` takes as long with K = 32 as with the
// 64 a tile can hold, so these tiles reach half the unit's peak; 64 would need another layout.
// The activation codes are the A operand, 16 rows x 32 bytes: this variant quantizes them into
// those tiles' order ([16-row block][32-column block][row][byte], `TiledCodes`), so that a tile
// loads 512 consecutive bytes rather than 16 rows K bytes apart (for K a multiple of 1,024 those
// rows would share four of L1's 64 sets). `tdpbsud` multiplies signed A by unsigned B, our s8
// activations by u8 weight codes, as `vpdpbusd` does; the int32 sums then go through the same
// epilogue (avx512.h: TileOutputs).
//
// A step is 32 activation rows x 32 output rows: 4 accumulator tiles, 2 A and 2 B tiles, the 8
// tiles there are. Where Linux refuses the tiles, the AVX-512 code runs instead
// (common/amx_tiles.h).

#include <torch/library.h>

#include "../common/amx_tiles.h"
#include "avx512.h"

namespace {

using genfast_amx::TileConfig;
using genfast_amx::tiles_permitted;

// Tiles 0-3: int32 sums (16 rows x 16 outputs); 4-5: activation codes (16 rows x 32 bytes);
// 6-7: weight codes (8 rows x 64 bytes: 32 columns of 16 outputs).
TileConfig step_config() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = 16, config.colsb[t] = kBlock;
  for (int t = 6; t < 8; ++t) config.rows[t] = kBlock / 4, config.colsb[t] = 64;
  return config;
}

constexpr int64_t kTileBytes = 16 * kBlock;  // an activation tile: 16 rows x 32 columns

// Where activation m's codes for columns [j, j + 16) go in the tiles' order.
struct TiledCodes {
  int64_t k;
  int64_t operator()(int64_t m, int64_t j) const {
    return ((m / 16) * (k / kBlock) + j / kBlock) * kTileBytes + (m % 16) * kBlock + j % kBlock;
  }
};

// y rows [m_begin, m_end) x outputs [16 * t0, 16 * (t0 + kTilesPerTask)), m_begin a multiple of
// kRowBlock; the codes (TiledCodes) hold whole blocks of kRowBlock rows (qlinear.h).
template <typename T>
void dynamic_rows_on_tiles(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, const Weights& w,
                           const Epilogue& epilogue, int64_t m_begin, int64_t m_end, int64_t t0, T* y) {
  static_assert(kRowBlock == 32 && kTilesPerTask % 2 == 0, "a step is two tiles of rows by two of outputs");
  constexpr int64_t block_bytes = kBlock * kTileRows;
  const int64_t s = t0 / kTilesPerTask;
  const uint8_t* base = w.codes(s, 0);  // one group: all of K
  static const TileConfig config = step_config();
  _tile_loadconfig(&config);
  alignas(64) int32_t sums[2][2][16][16];  // [row tile][output tile][row][output]
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowBlock) {
    // Rows [m0, m0 + 16) start (m0 / 16) * (k / 32) tiles of 512 bytes in: at m0 * k.
    const int8_t* rows0 = xq + m0 * k;
    const int8_t* rows1 = rows0 + 16 * k;
    for (int pair = 0; pair < kTilesPerTask; pair += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const uint8_t* block = base + (b * kTilesPerTask + pair) * block_bytes;
        _tile_loadd(4, rows0 + b * kTileBytes, kBlock);
        _tile_loadd(5, rows1 + b * kTileBytes, kBlock);
        _tile_loadd(6, block, 64);
        _tile_loadd(7, block + block_bytes, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
      }
      _tile_stored(0, sums[0][0], 64);
      _tile_stored(1, sums[0][1], 64);
      _tile_stored(2, sums[1][0], 64);
      _tile_stored(3, sums[1][1], 64);
      for (int o = 0; o < 2; ++o) {
        if ((t0 + pair + o) * kTileRows >= w.n) break;
        const TileOutputs outputs(w, epilogue, t0, pair + o);
        for (int64_t m = m0; m < std::min(m_end, m0 + kRowBlock); ++m) {
          const int64_t r = m - m0;
          outputs.store(_mm512_load_si512(sums[r / 16][o][r % 16]), xs[m], xsum[m], y + m * w.n);
        }
      }
    }
  }
  _tile_release();
}

struct Amx : Avx512 {
  template <typename T>
  static void quantize_tokens(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xs, int32_t* xsum) {
    if (tiles_permitted()) {
      quantize_rows_per_token(x, rows, k, xq, xs, xsum, TiledCodes{k});
    } else {
      Avx512::quantize_tokens(x, rows, k, xq, xs, xsum);
    }
  }
  template <typename T>
  static void dynamic_rows(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, const Weights& w,
                           const Epilogue& epilogue, int64_t m_begin, int64_t m_end, int64_t t0, T* y) {
    if (tiles_permitted()) {
      dynamic_rows_on_tiles(xq, xs, xsum, k, w, epilogue, m_begin, m_end, t0, y);
    } else {
      Avx512::dynamic_rows(xq, xs, xsum, k, w, epilogue, m_begin, m_end, t0, y);
    }
  }
};

}  // namespace

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("qlinear", &genfast_qlinear::qlinear<Amx>);
  m.impl("qlinear_dynamic", &genfast_qlinear::qlinear_dynamic<Amx>);
}
