// AMX tiles, shared by the CPU kernels that use them (prefill attention and the bf16 linear on bf16
// tiles, the quantized linear on int8 tiles).
//
// Linux grants a process the tile state only when asked (amx_usable). A kernel configures the tiles it
// uses (configure_tiles, or load_tile_config for other shapes) on the thread that runs it and releases
// them (_tile_release) when done: the configuration is per thread, and OpenMP workers run other kernels
// in between. PYENGINE_AMX is defined when the build targets AVX512-BF16 and AMX-TILE/BF16 (-march).
#pragma once

#if defined(__AMX_TILE__)
#if defined(__AVX512BF16__) && defined(__AMX_BF16__)
#define PYENGINE_AMX 1
#endif
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pyengine {

// The palette-1 configuration: per tile register, its rows and bytes per row.
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

// Loads `cfg` on this thread. The asm makes the config's stores visible first: GCC 12 can drop stores to
// a local that only _tile_loadconfig reads, leaving tiles of 0 rows (llama.cpp's SIGILL on AMX hosts,
// bench/compare/bench_llamacpp.py).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Tiles tmm0 .. tmm(n - 1) as whole tiles: 16 rows x 64 bytes.
inline void configure_tiles(int n) {
  TileConfig cfg;
  for (int i = 0; i < n; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  load_tile_config(cfg);
}

}  // namespace pyengine
#endif
