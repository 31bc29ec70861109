// What the AMX variants (*/amx.cpp) share: the permission to use the tiles and the tile
// configuration. Include only from files compiled with -mamx-tile.
//
// Linux hands the tiles' state to a process only on request (arch_prctl(ARCH_REQ_XCOMP_PERM));
// where that is refused, a variant runs its AVX-512 code instead. A variant loads its configuration
// for each task and releases the tiles after it: other code on the same thread (oneDNN's AMX
// kernels) loads configurations of its own.

#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace genfast_amx {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature's permission
constexpr int kXfeatureXtiledata = 18;     // the tiles' data

// Whether this process may use the tiles (asked once).
inline bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// LDTILECFG's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};

}  // namespace genfast_amx
