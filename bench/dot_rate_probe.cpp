// Standalone probe: one core's issue rate of the 512-bit dot-product instructions the CPU kernels are
// built on, as a ceiling to hold a kernel's measured rate against (a kernel at N GFLOP/s issues
// N / 64 G vdpbf16ps per second; vpdpbusd does 64 int8 products, vfmadd231ps 16 fp32 ones).
//
//   g++ -O3 -march=native bench/dot_rate_probe.cpp -o /tmp/dot_rate && /tmp/dot_rate
//
// Twelve independent accumulators (more than any latency needs), operands in registers; the last
// column takes one operand as a broadcast from memory, as the GEMM and attention kernels do.
// Best of 3 runs of 2e8 iterations.
// Measured on an AMD EPYC (Zen 4, family 25 model 17, 2 vCPUs): each 3.6 G/s, one a cycle, the
// broadcast load included. Against that, linear.cpp's vdpbf16ps GEMM at 64 rows runs at ~100% (228
// GFLOP/s on one core), prefill attention's QK and PV loops at ~80%, and qlinear's vpdpbusd kernel
// at 16 rows (Q4_1) at ~65%.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr int kAcc = 12;
constexpr long kIters = 200000000;
alignas(64) int32_t g_words[kAcc] = {1};

// Instructions per nanosecond of `step` (one instruction: accumulator j's next sum) on each of the kAcc
// accumulators, kIters times; `fold` adds the sums up at the end, so that none of them is dead code.
template <class V, class Step, class Fold>
double rate(V zero, Step step, Fold fold) {
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    V acc[kAcc];
    std::fill(acc, acc + kAcc, zero);
    for (V& v : acc) asm volatile("" : "+v"(v));  // opaque starting sums: twelve chains, none merged
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12
      for (int j = 0; j < kAcc; ++j) acc[j] = step(acc[j], j);
      asm volatile("" ::"v"(acc[0]));  // keeps the loop
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    for (int j = 1; j < kAcc; ++j) acc[0] = fold(acc[0], acc[j]);
    volatile V sink = acc[0];
    (void)sink;
    best = std::max(best, kAcc * static_cast<double>(kIters) / ns);
  }
  return best;
}

}  // namespace

int main() {
  const __m512bh pairs = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512i bytes = _mm512_set1_epi32(0x01010101);
  const __m512 ones = _mm512_set1_ps(1.0f);
  const double bf16 = rate(_mm512_setzero_ps(), [&](__m512 a, int) { return _mm512_dpbf16_ps(a, pairs, pairs); },
                           _mm512_add_ps);
  const double int8 = rate(_mm512_setzero_si512(), [&](__m512i a, int) { return _mm512_dpbusd_epi32(a, bytes, bytes); },
                           _mm512_add_epi32);
  const double fma = rate(_mm512_setzero_ps(), [&](__m512 a, int) { return _mm512_fmadd_ps(a, ones, ones); },
                          _mm512_add_ps);
  const double int8_bcast = rate(
      _mm512_setzero_si512(),
      [&](__m512i a, int j) { return _mm512_dpbusd_epi32(a, bytes, _mm512_set1_epi32(g_words[j])); }, _mm512_add_epi32);
  std::printf("one core, G instructions/s: vdpbf16ps %.2f  vpdpbusd %.2f  vfmadd231ps %.2f  vpdpbusd (broadcast "
              "from memory) %.2f\n", bf16, int8, fma, int8_bcast);
}
