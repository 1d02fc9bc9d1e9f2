// Standalone probe: how fast one core reads a buffer as tiles of a given size in random order (as the
// decode kernel reads a paged KV cache's blocks), with software prefetches some tiles ahead, against
// the same buffer read in order. A few bf16 dot products per 64-byte line stand for the kernel's work.
//
//   g++ -O2 -march=native bench/scatter_read_probe.cpp -o /tmp/scatter && /tmp/scatter 2048 6144 16384
//
// Arguments: tile sizes in bytes (multiples of 64). Per tile size and work (dot products per line):
// GB/s of the in-order read (hardware prefetchers only), the shuffled tiles with no prefetch, and
// the shuffled tiles with L2 (T1) prefetches 4 / 8 / 16 tiles ahead, and with L1 (T0) prefetches 8
// ahead; best of 5, cache flushed first.
// Measured on a 2-core Xeon with AMX (family 6, model 167), work 1: in order ~11 GB/s; shuffled with
// T1 prefetches ~7.5 (2 KB tiles), ~8.7 (4 and 6 KB), ~10.6 (16 KB). Why attention/paged.cpp's decode items
// span a block's adjacent kv heads: 6 KB runs instead of 2 KB at the default model's shape. On an AMD
// EPYC (Zen 4, family 25 model 17), work 1: in order ~25 GB/s; shuffled with no prefetch ~7.5, with
// T1 prefetches ~15.5 (2 KB), ~18 (6 KB), ~19 (64 KB), with T0 ~8: why decode attention prefetches to
// L2 there.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr size_t kBytes = 64ull << 20, kFlush = 1ull << 30;
char* g_buf;
char* g_flush;
float g_sink;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void flush() {
  __m512i a = _mm512_setzero_si512();
  for (size_t i = 0; i < kFlush; i += 64) a = _mm512_add_epi32(a, _mm512_load_si512(g_flush + i));
  g_sink += static_cast<float>(_mm512_reduce_add_epi32(a));
}

// One pass over the tiles in `order`, prefetching (to HINT's level) the lines of the tile `ahead`
// places later.
template <int WORK, _mm_hint HINT = _MM_HINT_T1>
double pass(const std::vector<size_t>& order, size_t tile, int ahead) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  flush();
  const double t0 = now();
  for (size_t i = 0; i < order.size(); ++i) {
    const char* p = g_buf + order[i] * tile;
    const char* pf = ahead && i + ahead < order.size() ? g_buf + order[i + ahead] * tile : nullptr;
    for (size_t l = 0; l < tile; l += 64) {
      if (pf) _mm_prefetch(pf + l, HINT);
      const __m512bh v = (__m512bh)_mm512_load_si512(p + l);
      for (int w = 0; w < WORK; ++w) acc[(l >> 6) & 3] = _mm512_dpbf16_ps(acc[(l >> 6) & 3], v, v);
    }
  }
  const double t = now() - t0;
  g_sink += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  return t;
}

template <int WORK>
void report(size_t tile) {
  std::vector<size_t> in_order(kBytes / tile), shuffled;
  for (size_t i = 0; i < in_order.size(); ++i) in_order[i] = i;
  shuffled = in_order;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
  auto gbps = [&](const std::vector<size_t>& order, int ahead, auto pass_fn) {
    double best = 1e9;
    for (int r = 0; r < 5; ++r) best = std::min(best, pass_fn(order, tile, ahead));
    return kBytes / best / 1e9;
  };
  auto t1 = pass<WORK, _MM_HINT_T1>;
  std::printf("tile %6zu B, work %d: in order %5.1f | shuffled %5.1f | T1 ahead 4 %5.1f, 8 %5.1f, 16 %5.1f"
              " | T0 ahead 8 %5.1f GB/s\n",
              tile, WORK, gbps(in_order, 0, t1), gbps(shuffled, 0, t1), gbps(shuffled, 4, t1), gbps(shuffled, 8, t1),
              gbps(shuffled, 16, t1), gbps(shuffled, 8, pass<WORK, _MM_HINT_T0>));
}

}  // namespace

int main(int argc, char** argv) {
  g_buf = static_cast<char*>(std::aligned_alloc(4096, kBytes));
  g_flush = static_cast<char*>(std::aligned_alloc(4096, kFlush));
  std::memset(g_buf, 1, kBytes);
  std::memset(g_flush, 2, kFlush);
  for (int a = 1; a < argc; ++a) {
    const size_t tile = std::strtoul(argv[a], nullptr, 10);
    if (tile == 0 || tile % 64 != 0) {
      std::fprintf(stderr, "tile sizes must be positive multiples of 64, got %s\n", argv[a]);
      return 1;
    }
    report<1>(tile);
    report<3>(tile);
  }
  return g_sink == 12345.0f;  // keeps the sums alive
}
