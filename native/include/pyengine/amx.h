// AMX (Advanced Matrix Extensions) on Linux: the process must ask the kernel for the tile state once
// before any tile instruction; each thread loads a tile configuration (TileConfig) before use.
#pragma once

#if defined(__AMX_TILE__)
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
// bench/bench_llamacpp.py).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace pyengine

#endif
