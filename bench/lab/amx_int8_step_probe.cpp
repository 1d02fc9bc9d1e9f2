// Standalone probe: the cost of one step of linear/quant_amx.cpp's loop on one core, without the kernel
// around it: per 16 rows x 16 columns x 32 values (one group), an int8 tile product, its C tile stored,
// and the vector units' per-group scaling of C into fp32 accumulators (convert, multiply the scales,
// FMA). It shows how much of a step the tile instructions take alone, and whether a layout or a blocking
// changes it:
//   base      A rows K bytes apart (x row-major), double-buffered tile sets, 1 x 1 tile per step
//   noscale   base without the vector scaling: the tile instructions alone
//   contigA   the A tile's 16 rows contiguous (32 bytes apart)
//   2x2       two row blocks x two column tiles per step (8 tiles), not double-buffered
//
//   g++ -O3 -march=native bench/lab/amx_int8_step_probe.cpp -o /tmp/amx_step && /tmp/amx_step
//
// Prints ns per (16 x 16 x 32) step for each variant, five rounds; read the minimum per variant.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_config(const TileConfig& c) {
  asm volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
}

constexpr int K = 2048, KB = K / 32, M = 64, kTiles = 64;
alignas(64) int8_t xq[M * K];  // row-major
alignas(64) int8_t xt[M * K];  // per 16-row block and group, 16 x 32 contiguous
alignas(64) uint8_t u[KB * 512];
float dx[KB * M], d16[KB * 16], out[M * kTiles * 16];

enum Variant { kBase, kNoScale, kContigA, k2x2 };

template <int V>
double run() {
  TileConfig cfg;
  if (V == k2x2) {
    for (int i = 0; i < 2; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 32;  // A0, A1
    for (int i = 2; i < 4; ++i) cfg.rows[i] = 8, cfg.colsb[i] = 64;   // B0, B1
    for (int i = 4; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;  // C
  } else {
    for (int s = 0; s < 2; ++s) {
      cfg.rows[3 * s] = 16, cfg.colsb[3 * s] = 32;
      cfg.rows[3 * s + 1] = 8, cfg.colsb[3 * s + 1] = 64;
      cfg.rows[3 * s + 2] = 16, cfg.colsb[3 * s + 2] = 64;
    }
  }
  load_config(cfg);
  const auto t0 = std::chrono::steady_clock::now();
  alignas(64) int32_t c[4][256];
  for (int tile = 0; tile < kTiles; tile += (V == k2x2 ? 2 : 1)) {
    for (int r0 = 0; r0 < M; r0 += (V == k2x2 ? 32 : 16)) {
      __m512 acc[16], acc2[16];
      for (int m = 0; m < 16; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
      auto scale = [&](const int32_t* cj, int j, __m512* a) {
        const __m512 d = _mm512_loadu_ps(d16 + j * 16);
        for (int m = 0; m < 16; ++m) {
          const __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(cj + 16 * m));
          a[m] = _mm512_fmadd_ps(t, _mm512_mul_ps(d, _mm512_set1_ps(dx[j * M + r0 + m])), a[m]);
        }
      };
      if (V == k2x2) {
        for (int j = 0; j < KB; ++j) {
          _tile_loadd(0, xt + (r0 / 16) * 16 * K + j * 512, 32);
          _tile_loadd(1, xt + (r0 / 16 + 1) * 16 * K + j * 512, 32);
          _tile_loadd(2, u + j * 512, 64);
          _tile_loadd(3, u + j * 512, 64);
          _tile_zero(4);
          _tile_zero(5);
          _tile_zero(6);
          _tile_zero(7);
          _tile_dpbssd(4, 0, 2);
          _tile_dpbssd(5, 0, 3);
          _tile_dpbssd(6, 1, 2);
          _tile_dpbssd(7, 1, 3);
          _tile_stored(4, c[0], 64);
          _tile_stored(5, c[1], 64);
          _tile_stored(6, c[2], 64);
          _tile_stored(7, c[3], 64);
          for (int q = 0; q < 4; ++q) scale(c[q], j, q % 2 ? acc2 : acc);
        }
      } else {
        auto issue = [&](int j) {
          const int8_t* a = V == kContigA ? xt + (r0 / 16) * 16 * K + j * 512 : xq + r0 * K + j * 32;
          const int stride = V == kContigA ? 32 : K;
          if (j % 2 == 0) {
            _tile_loadd(0, a, stride);
            _tile_loadd(1, u + j * 512, 64);
            _tile_zero(2);
            _tile_dpbssd(2, 0, 1);
            _tile_stored(2, c[0], 64);
          } else {
            _tile_loadd(3, a, stride);
            _tile_loadd(4, u + j * 512, 64);
            _tile_zero(5);
            _tile_dpbssd(5, 3, 4);
            _tile_stored(5, c[1], 64);
          }
        };
        issue(0);
        for (int j = 0; j < KB; ++j) {
          if (j + 1 < KB) issue(j + 1);
          if (V != kNoScale) scale(c[j % 2], j, acc);
        }
      }
      for (int m = 0; m < 16; ++m)
        _mm512_storeu_ps(out + (r0 + m) * kTiles * 16 + tile * 16, _mm512_add_ps(acc[m], acc2[m]));
    }
  }
  _tile_release();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::puts("Linux did not grant the AMX tile state");
    return 1;
  }
  for (int i = 0; i < M * K; ++i) xq[i] = static_cast<int8_t>(rand()), xt[i] = static_cast<int8_t>(rand());
  for (auto& v : u) v = static_cast<uint8_t>(rand());
  for (auto& v : dx) v = 1.0f;
  for (auto& v : d16) v = 1.0f;
  const char* names[] = {"base", "noscale", "contigA", "2x2"};
  const double steps = static_cast<double>(kTiles) * (M / 16) * KB;
  for (int round = 0; round < 5; ++round) {
    const double t[] = {run<kBase>(), run<kNoScale>(), run<kContigA>(), run<k2x2>()};
    for (int v = 0; v < 4; ++v) std::printf("%s %.1f ns/step  ", names[v], t[v] / steps * 1e9);
    std::printf("\n");
  }
}
