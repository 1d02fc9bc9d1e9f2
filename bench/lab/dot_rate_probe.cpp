// Standalone probe: one core's issue rate of the 512-bit dot-product instructions the CPU kernels are
// built on, as a ceiling to hold a kernel's measured rate against (a kernel at N GFLOP/s issues
// N / 64 G vdpbf16ps per second; vpdpbusd does 64 int8 products, vfmadd231ps 16 fp32 ones), and which
// other instructions share their pipes.
//
//   g++ -O3 -march=native bench/lab/dot_rate_probe.cpp -o /tmp/dot_rate && /tmp/dot_rate
//
// Twelve independent accumulators (more than any latency needs), operands in registers, best of 3 runs.
// Then vpdpbusd's rate with one other instruction beside each dot product (its result feeding the dot
// product, its sources opaque so that it cannot leave the loop): about the rate alone where the other
// instruction goes to other pipes, half of it where it takes a dot-product pipe for the cycle.
// Measured on an AMD EPYC (Zen 4, family 25 model 17, 2 vCPUs): each dot product and the FMA 3.6 G/s,
// one a cycle. Beside vpdpbusd: broadcasts from memory, vpandd, vpsrlw, vpaddd, vcvtdq2ps, vaddps and
// vmaxps are free (3.3-3.6); vmulps, vfmadd231ps, vcvtph2ps, vgf2p8affineqb, vpermt2w, vpmaddwd and
// vscalefps halve it (1.8); shuffles (vpshufb, vpermb) and vcvtne2ps2bf16 cost about a third (2.2-2.7).
// So a kernel's float scaling steps take dot products' slots on this CPU, its integer unpacking does not.
// Against the dot rate, linear/bf16.cpp's vdpbf16ps GEMM at 64 rows runs at ~100% (228 GFLOP/s on one core),
// prefill attention's QK and PV loops at ~80%, and qlinear's vpdpbusd kernel at 16 rows (Q4_1) at ~75%
// (its two dot-product pipes also run a multiply and two FMAs per 16 dot products: ~82% at best).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr int kAcc = 12;
constexpr long kIters = 50000000;
alignas(64) int32_t g_words[kAcc] = {1};

// Instructions per nanosecond of `step` (one instruction: accumulator j's next sum) on each of the kAcc
// accumulators, kIters times; `fold` adds the sums up at the end, so that none of them is dead code.
// `words` is made opaque each iteration: a step that reads it cannot be hoisted out of the loop.
template <class V, class Step, class Fold>
double rate(V zero, Step step, Fold fold) {
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    V acc[kAcc];
    std::fill(acc, acc + kAcc, zero);
    for (V& v : acc) asm volatile("" : "+v"(v));  // opaque starting sums: twelve chains, none merged
    const int32_t* words = g_words;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < kIters; ++i) {
      asm volatile("" : "+r"(words));
#pragma GCC unroll 12
      for (int j = 0; j < kAcc; ++j) acc[j] = step(acc[j], j, words);
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

// vpdpbusd's rate with instruction `ins` (AT&T operand order: %1, %2 sources, %0 the result that the dot
// product reads) beside each one.
#define BESIDE_DPBUSD(name, ins)                                                                          \
  std::printf("  %-24s %.2f\n", name, rate(_mm512_setzero_si512(), [&](__m512i a, int, const int32_t*) { \
                __m512i w;                                                                                \
                asm volatile(ins : "=v"(w) : "v"(other), "v"(bytes));                                     \
                return _mm512_dpbusd_epi32(a, w, bytes);                                                  \
              }, _mm512_add_epi32))

int main() {
  const __m512bh pairs = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512i bytes = _mm512_set1_epi32(0x01010101);
  const __m512 ones = _mm512_set1_ps(1.0f);
  const auto add_ps = _mm512_add_ps;
  const auto add_epi32 = _mm512_add_epi32;
  const double bf16 = rate(_mm512_setzero_ps(), [&](__m512 a, int, const int32_t*) {
    return _mm512_dpbf16_ps(a, pairs, pairs); }, add_ps);
  const double int8 = rate(_mm512_setzero_si512(), [&](__m512i a, int, const int32_t*) {
    return _mm512_dpbusd_epi32(a, bytes, bytes); }, add_epi32);
  const double fma = rate(_mm512_setzero_ps(), [&](__m512 a, int, const int32_t*) {
    return _mm512_fmadd_ps(a, ones, ones); }, add_ps);
  std::printf("one core, G instructions/s: vdpbf16ps %.2f  vpdpbusd %.2f  vfmadd231ps %.2f\n", bf16, int8, fma);

  std::printf("vpdpbusd, G/s, with one of these beside each:\n");
  const double bcast = rate(_mm512_setzero_si512(), [&](__m512i a, int j, const int32_t* w) {
    return _mm512_dpbusd_epi32(a, bytes, _mm512_set1_epi32(w[j])); }, add_epi32);
  std::printf("  %-24s %.2f\n", "vpbroadcastd (memory)", bcast);
  __m512i other = _mm512_set1_epi32(0x3c003c00);
  asm volatile("" : "+v"(other));
  BESIDE_DPBUSD("vpandd", "vpandd %1, %2, %0");
  BESIDE_DPBUSD("vpsrlw", "vpsrlw $4, %1, %0");
  BESIDE_DPBUSD("vpaddd", "vpaddd %1, %2, %0");
  BESIDE_DPBUSD("vcvtdq2ps", "vcvtdq2ps %1, %0");
  BESIDE_DPBUSD("vaddps", "vaddps %1, %2, %0");
  BESIDE_DPBUSD("vmaxps", "vmaxps %1, %2, %0");
  BESIDE_DPBUSD("vmulps", "vmulps %1, %2, %0");
  BESIDE_DPBUSD("vfmadd231ps", "vmovdqa64 %2, %0\n\tvfmadd231ps %1, %1, %0");
  BESIDE_DPBUSD("vcvtph2ps", "vcvtph2ps %t1, %0");
  BESIDE_DPBUSD("vgf2p8affineqb", "vgf2p8affineqb $0, %1, %2, %0");
  BESIDE_DPBUSD("vpmaddwd", "vpmaddwd %1, %2, %0");
  BESIDE_DPBUSD("vscalefps", "vscalefps %1, %2, %0");
  BESIDE_DPBUSD("vpermt2w", "vmovdqa64 %2, %0\n\tvpermt2w %1, %1, %0");
  BESIDE_DPBUSD("vpshufb", "vpshufb %1, %2, %0");
  BESIDE_DPBUSD("vpermb", "vpermb %1, %2, %0");
  BESIDE_DPBUSD("vcvtne2ps2bf16", "vcvtne2ps2bf16 %1, %2, %0");
}
