// Standalone AMX probes: what the tile unit of this core does with the tile sequences our kernels issue,
// outside the engine (no threads, no Python, operands hot in L1/L2). Linux x86-64 with AMX-BF16:
//
//   g++ -O2 -march=native bench/lab/amx_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe
//
// Each line: ns per unit (min of 5 runs) and what it amounts to.
//   gemm       linear/bf16.cpp's 2x2 block (32 rows x 2 tiles, K = 576) over a 14-tile strip, 64 rows: the strip
//              in L2 / all operands in L1 / the tile loads taken out of the loop (the products alone);
//              then with the epilogue storing each tile's rows with masked 32-byte stores, or a pair's rows
//              in one 64-byte store (linear/bf16.cpp's TilePairStore).
//   attention  attention/prefill_amx.h's tile work for one 16-row group and a 64-token chunk (D = 64): QK
//              (8 products, S stored), PV (O loaded, 8 products, O stored), both; then both followed by
//              register-only FMAs, alone and interleaved: whether vector work runs under the tile products.
// Measured on a 2-core Xeon with AMX (family 6, model 167): gemm 1.7-1.8 TFLOP/s with the strip in L2 or
// everything in L1 alike, 2.9-3.0 without the loads in the loop (the tile loads bound it: one 1 KB load per
// product is the most reuse 8 tile registers allow); masked stores +65%, paired +7%. Attention: QK + PV
// 166-170 ns, FMAs alone 50, FMAs after the tile work 237-253, interleaved 212-230: vector work hardly runs
// under the tile products, so the prefill kernel's parts add up (attention/prefill_amx.h, AmxPipeline).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iterator>

namespace {

constexpr int K = 576, KB = K / 32, M = 64, TILES = 14, NOUT = 3072, D = 64, GROUPS = 24;

alignas(64) uint16_t X[M * K];             // activations, rows K apart (the A operand in place)
alignas(64) uint16_t W[TILES * K * 16];    // packed weight tiles [tile][K / 2][16][2]
alignas(64) float C[32 * 32];              // one block's accumulators
alignas(64) uint16_t OUT[M * NOUT];        // the output rows the strip's columns go into
alignas(64) uint16_t Q[GROUPS * 16 * D];   // attention: q rows of 24 groups
alignas(64) uint16_t KT[4 * 16 * D];       // a chunk's K: 4 groups [D / 2][16][2]
alignas(64) uint16_t V[64 * D];            // a chunk's V: [32 pairs][D][2]
alignas(64) uint16_t P[16 * 64];           // probabilities [16 rows][64 tokens]
alignas(64) float S[2][16 * 64];           // scores
alignas(64) float O[GROUPS][16 * D];       // accumulators
__m512 g_acc[8];
float g_sink;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void configure() {
  alignas(64) static unsigned char cfg[64];
  cfg[0] = 1;
  for (int i = 0; i < 8; ++i) reinterpret_cast<uint16_t*>(cfg + 16)[i] = 64, cfg[48 + i] = 16;
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

// Rows [r0, r0 + 32) x tiles t0, t0 + 1 into C; loads for the next 32 k issued right after their last use.
// loads = false: the first k step's operands only (the products alone).
template <bool loads>
void gemm_block(int r0, int t0) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const uint16_t *x0 = X + r0 * K, *x1 = X + (r0 + 16) * K, *w = W + t0 * K * 16;
  const int64_t xs = K * 2, ts = K * 16;
  _tile_loadd(4, x0, xs); _tile_loadd(5, x1, xs); _tile_loadd(6, w, 64); _tile_loadd(7, w + ts, 64);
  for (int kb = 0; kb < KB; ++kb) {
    const bool next = loads && kb + 1 < KB;
    const int64_t xo = (kb + 1) * 32, wo = (kb + 1) * 512;
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (next) _tile_loadd(4, x0 + xo, xs);
    _tile_dpbf16ps(2, 5, 6);
    if (next) _tile_loadd(6, w + wo, 64);
    _tile_dpbf16ps(3, 5, 7);
    if (next) {
      _tile_loadd(5, x1 + xo, xs);
      _tile_loadd(7, w + ts + wo, 64);
    }
  }
  _tile_stored(0, C, 128); _tile_stored(1, C + 16, 128); _tile_stored(2, C + 512, 128); _tile_stored(3, C + 528, 128);
}

void store_masked(int r0, int t0) {
  for (int t = 0; t < 2; ++t)
    for (int m = 0; m < 32; ++m)
      _mm256_mask_storeu_epi16(OUT + (r0 + m) * NOUT + (t0 + t) * 16, 0xffff,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(C + m * 32 + t * 16)));
}

void store_paired(int r0, int t0) {
  for (int m = 0; m < 32; ++m)
    _mm512_storeu_si512(OUT + (r0 + m) * NOUT + t0 * 16,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(C + m * 32 + 16), _mm512_load_ps(C + m * 32)));
}

// 0: strip in L2, 1: every block on the same operands (L1), 2: no loads in the loop, 3/4: + epilogues.
void gemm(int mode) {
  for (int r0 = 0; r0 < M; r0 += 32)
    for (int t0 = 0; t0 < TILES; t0 += 2) {
      if (mode == 2) gemm_block<false>(r0, t0);
      else gemm_block<true>(mode == 1 ? 0 : r0, mode == 1 ? 0 : t0);
      if (mode == 3) store_masked(r0, t0);
      if (mode == 4) store_paired(r0, t0);
    }
  g_sink += C[5];
}

// S = q . K of 4 token groups (C tmm0..3, A tmm4/5, B tmm6/7 in turn), stored.
void qk(const uint16_t* q, float* s) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, q, D * 2);
  _tile_loadd(6, KT, 64); _tile_dpbf16ps(0, 4, 6); _tile_loadd(7, KT + 1024, 64); _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(6, KT + 2048, 64); _tile_dpbf16ps(2, 4, 6); _tile_loadd(7, KT + 3072, 64); _tile_dpbf16ps(3, 4, 7);
  _tile_loadd(5, q + 32, D * 2);
  _tile_loadd(6, KT + 512, 64); _tile_dpbf16ps(0, 5, 6); _tile_loadd(7, KT + 1536, 64); _tile_dpbf16ps(1, 5, 7);
  _tile_loadd(6, KT + 2560, 64); _tile_dpbf16ps(2, 5, 6); _tile_loadd(7, KT + 3584, 64); _tile_dpbf16ps(3, 5, 7);
  _tile_stored(0, s, 256); _tile_stored(1, s + 16, 256); _tile_stored(2, s + 32, 256); _tile_stored(3, s + 48, 256);
}

// o[16][64] += P . V over two 32-token blocks: O loaded, 8 products, stored.
void pv(float* o) {
  _tile_loadd(0, o, D * 4); _tile_loadd(1, o + 16, D * 4); _tile_loadd(2, o + 32, D * 4); _tile_loadd(3, o + 48, D * 4);
  for (int b = 0; b < 2; ++b) {
    const uint16_t* v = V + b * 32 * D;
    if (b == 0) _tile_loadd(4, P, 128);
    else _tile_loadd(5, P + 32, 128);
    if (b == 0) {
      _tile_loadd(6, v, D * 4); _tile_dpbf16ps(0, 4, 6); _tile_loadd(7, v + 32, D * 4); _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, v + 64, D * 4); _tile_dpbf16ps(2, 4, 6); _tile_loadd(7, v + 96, D * 4); _tile_dpbf16ps(3, 4, 7);
    } else {
      _tile_loadd(6, v, D * 4); _tile_dpbf16ps(0, 5, 6); _tile_loadd(7, v + 32, D * 4); _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, v + 64, D * 4); _tile_dpbf16ps(2, 5, 6); _tile_loadd(7, v + 96, D * 4); _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, o, D * 4); _tile_stored(1, o + 16, D * 4); _tile_stored(2, o + 32, D * 4); _tile_stored(3, o + 48, D * 4);
}

// n rounds of 8 independent FMAs on registers: vector work that touches no memory.
__attribute__((noinline)) void fmas(int n) {
  __m512 a0 = g_acc[0], a1 = g_acc[1], a2 = g_acc[2], a3 = g_acc[3], a4 = g_acc[4], a5 = g_acc[5], a6 = g_acc[6],
         a7 = g_acc[7];
  const __m512 m = _mm512_set1_ps(0.999f);
  for (int j = 0; j < n; ++j) {
    a0 = _mm512_fmadd_ps(a0, m, m), a1 = _mm512_fmadd_ps(a1, m, m), a2 = _mm512_fmadd_ps(a2, m, m);
    a3 = _mm512_fmadd_ps(a3, m, m), a4 = _mm512_fmadd_ps(a4, m, m), a5 = _mm512_fmadd_ps(a5, m, m);
    a6 = _mm512_fmadd_ps(a6, m, m), a7 = _mm512_fmadd_ps(a7, m, m);
  }
  g_acc[0] = a0, g_acc[1] = a1, g_acc[2] = a2, g_acc[3] = a3, g_acc[4] = a4, g_acc[5] = a5, g_acc[6] = a6, g_acc[7] = a7;
}

// One group-chunk per group: 0 QK, 1 PV, 2 both, 3 FMAs alone, 4 both then FMAs, 5 FMAs in two halves.
void attention(int mode) {
  for (int g = 0; g < GROUPS; ++g) {
    if (mode == 3) {
      fmas(40);
      continue;
    }
    if (mode != 1) qk(Q + g * 16 * D, S[g & 1]);
    if (mode == 5) fmas(20);
    if (mode != 0) pv(O[g]);
    if (mode == 4) fmas(40);
    if (mode == 5) fmas(20);
  }
}

template <class F>
double best_ns(F&& f, int iters) {
  double best = 1e30;
  for (int run = 0; run < 5; ++run) {
    const double t0 = now();
    for (int i = 0; i < iters; ++i) f();
    best = std::min(best, (now() - t0) / iters);
  }
  return best * 1e9;
}

}  // namespace

int main() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::puts("no AMX tile state from Linux");
    return 1;
  }
  std::fill(std::begin(X), std::end(X), 0x3f80);  // bf16 1.0: finite products
  std::fill(std::begin(W), std::end(W), 0x3c00);
  std::fill(std::begin(Q), std::end(Q), 0x3c00);
  std::fill(std::begin(KT), std::end(KT), 0x3c00);
  std::fill(std::begin(V), std::end(V), 0x3c00);
  std::fill(std::begin(P), std::end(P), 0x3c00);
  configure();
  const char* gemm_names[] = {"strip in L2", "operands in L1", "no loads", "+ masked stores", "+ paired stores"};
  const double flops = 2.0 * M * TILES * 16 * K;
  for (int mode = 0; mode < 5; ++mode) {
    const double ns = best_ns([&] { gemm(mode); }, 2000);
    std::printf("gemm       %-18s %8.0f ns  %5.2f TFLOP/s\n", gemm_names[mode], ns, flops / ns / 1e3);
  }
  const char* attn_names[] = {"QK", "PV", "QK + PV", "FMAs alone", "QK + PV, FMAs", "FMAs interleaved"};
  for (int mode = 0; mode < 6; ++mode) {
    const double ns = best_ns([&] { attention(mode); }, 20000) / GROUPS;
    std::printf("attention  %-18s %8.1f ns per group-chunk\n", attn_names[mode], ns);
  }
  _tile_release();
  std::printf("(%g)\n", static_cast<double>(g_sink));
}
