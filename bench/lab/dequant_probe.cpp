// Standalone probe: what a group of a Q4_K weight costs to dequantize to bf16 on one core, in the two forms the
// strips and fused kernels use (no tile products, no threads, no Python). A [8192, 2048] weight of random
// nibbles (scales 1.0), walked tile by tile, group by group:
//   lines  quant_lines.h's dequantize_group: 16 k-pair lines of 16 rows (the bf16 kernel's B operand)
//   rows   quant_rows.h's GroupScales + dequantize_rows: 16 rows of 32 k by table lookup (an A operand)
//
//   g++ -O3 -march=native -fno-math-errno -Inative/include -Inative/cpu/linear bench/lab/dequant_probe.cpp \
//       -o /tmp/dequant_probe && /tmp/dequant_probe
//
// Needs AVX512-BF16, VNNI and VBMI (quant_rows.h). Figures: docs/performance.md, "quantized weights by strips".
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "quant_rows.h"

using namespace pyengine::cpu;
namespace ggml = pyengine::ggml;

int main() {
  constexpr int T = ggml::kQ4_K;
  constexpr Layout L = layout(T);
  const int64_t N = 8192, K = 2048, KB = K / kBlock, tiles = N / ggml::kTileRows, stride = tile_stride(L, KB);
  std::vector<uint8_t> w(static_cast<size_t>(tiles * stride));
  std::mt19937 rng(0);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  for (int64_t t = 0; t < tiles; ++t)  // each record's fp16 d and dmin of its 16 rows: 1.0, not random bits
    for (int64_t r = 0; r < KB / L.groups(); ++r) {
      uint8_t* f = w.data() + t * stride + r * L.record_bytes() + L.scales_offset();
      for (int i = 0; i < 32; ++i) f[2 * i] = 0x00, f[2 * i + 1] = 0x3C;
    }
  alignas(64) static uint16_t out[2][kBlock * 16];
  alignas(64) float scales[32];
  using Clock = std::chrono::steady_clock;
  double best_lines = 1e9, best_rows = 1e9;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = Clock::now();
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t b = 0; b < KB; ++b) dequantize_group<T>(w.data() + t * stride, b, out[b & 1]);
    const auto t1 = Clock::now();
    for (int64_t t = 0; t < tiles; ++t) {
      GroupScales<T> group_scales{w.data() + t * stride};
      for (int64_t b = 0; b < KB; ++b) {
        group_scales(b, scales);
        dequantize_rows<T>(w.data() + t * stride, b, scales, out[b & 1]);
      }
    }
    const auto t2 = Clock::now();
    best_lines = std::min(best_lines, std::chrono::duration<double, std::milli>(t1 - t0).count());
    best_rows = std::min(best_rows, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  std::printf("Q4_K [%ld, %ld], one core, min of 5: lines %.3f ms, rows %.3f ms (checksum %d)\n", static_cast<long>(N),
              static_cast<long>(K), best_lines, best_rows, out[0][3] + out[1][7]);
}
