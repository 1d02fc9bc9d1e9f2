// AMX tiles (bf16), shared by the CPU kernels that use them (prefill attention, the bf16 linear).
//
// PYENGINE_AMX is defined when the build targets AVX512-BF16 and AMX-TILE/BF16 (-march); amx_usable()
// then says whether Linux grants this process the tile state. A kernel configures the tiles it uses
// (configure_tiles) on the thread that runs it and releases them (_tile_release) when done: the
// configuration is per thread, and OpenMP workers run other kernels in between.
#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PYENGINE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pyengine {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Asks Linux once for the AMX tile state (XFEATURE_XTILEDATA) for this process.
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tiles tmm0 .. tmm(n - 1) as whole tiles: 16 rows x 64 bytes.
inline void configure_tiles(int n) {
  TileConfig cfg;
  for (int i = 0; i < n; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  _tile_loadconfig(&cfg);
}

}  // namespace pyengine
#endif
