// Linear layer on bf16 weights: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation.
//
// The AVX-512 kernels are built for decode, where M (tokens in the step) is 1..64 and the time is the
// weight stream: every weight byte is read from memory exactly once per call and reused for all M
// rows. Prefill (M in the thousands) runs in panels of rows (on a CPU without AMX, close to torch's
// bf16 GEMM: docs/performance.md, "bf16 linear"), so the model keeps no other copy. Where AMX is
// usable, the tile path below runs instead.
//
// Layouts (element strides, all contiguous):
//   x       [M, K] bf16.
//   packed  [NB, KP, 16, 2] bf16 with NB = ceil(N / 16), KP = ceil(K / 2):
//           packed[nb, kp, j, i] = W[16 * nb + j, 2 * kp + i], zero where that is outside W.
//           One 64-byte line holds 16 outputs x 2 k: exactly the B operand of _mm512_dpbf16_ps.
//           Tile nb (16 outputs, all of K) is one contiguous run of KP * 64 bytes.
//   bias    [N] fp32, or none (0).
//   out     [M, N] bf16 (rounded once, to nearest even) or fp32.
//
// Parallel shape: the NB tiles are split into contiguous ranges, a few per thread (taken in turn; prompts'
// ranges shrink towards the end, pair_cuts) when the weight is big enough (kMinParallelBytes), else the
// caller runs everything. Within a range, groups of NT tiles (NT = 4 for M <= 4, 1 for M = 9..15, else 2:
// NT x (rows of a block) accumulators <= 16 zmm) are streamed together; each 64-byte weight line is loaded
// once and fed to every row of a 16-row chunk of x (of 2 tiles: two blocks of 8 rows, the second reading
// it from L1; see tile_group). Rows beyond 16 re-read the group's tiles from L2, not from memory.
// x is first repacked by the caller into k pairs, xp[r0 * KP + kp * MR + m] = (x[r, 2kp], x[r, 2kp+1])
// as one 32-bit word (r = r0 + m, chunks of MR <= 16 rows from r0; the pair past an odd K is zero),
// so the kernel broadcasts consecutive words from one pointer; for avx512_fp32 each pair as two fp32
// words instead (xp[2 (r0 * KP + kp * MR + m) + i] = x[r, 2kp + i]).
// Each of the NT streams is prefetched ahead into L2 (tile_block): faster batch-1 decode steps than the
// hardware prefetchers alone (into L1 was slower; docs/performance.md, "bf16 linear").
// SIMD: AVX512-BF16 when the build targets it, else a plain loop (correct, slower). Two kernels over
// the same layouts (set_linear_path picks one for tests):
//   avx512_bf16  vdpbf16ps: per 64-byte line, one instruction per row.
//   avx512_fp32  each line widened to fp32 (its even and odd k: a shift and an and), then two fp32 FMAs
//                per row, x already in fp32 (pack_x): odd k first, as vdpbf16ps adds them, and the
//                bf16 x bf16 products are exact in fp32, so both give the same bits (bar subnormals,
//                which vdpbf16ps flushes to zero). The default on builds whose -march has
//                AVX512-FP16 (kPreferFp32Fma): there vdpbf16ps measured a quarter of the FMA rate,
//                and this kernel is faster from M = 16 up, the same at M = 1 (a weight stream either
//                way; docs/performance.md, "bf16 linear").
//
// AMX (builds and CPUs with AMX-BF16, K a multiple of 32; every M): the same packed weight is the B
// operand of the tile product as it lies (a tile's 16 k pairs x 16 outputs x 2 are 16 consecutive
// 64-byte lines) and x is the A operand in place (16 rows x 32 k, stride K), so nothing is repacked
// but the last partial 16 rows (into a zero-padded copy). Blocks of 32 rows x 32 outputs (4
// accumulator tiles, 2 A and 2 B tiles per 32 k); each thread takes a range of output tiles and walks
// all rows, 32 at a time, over it. Several times the vdpbf16ps kernel's rate from M = 16 up, the same
// at M = 1 (a weight stream either way; docs/performance.md, "bf16 linear"). It is chosen by K alone, for every M, because the two paths round differently
// and a row's result must not depend on its batch. set_linear_path("avx512_*") turns it off (tests).
// Bf16Rows (linear/linear.h) is this tile loop for callers that make the packed tiles themselves
// (linear/quant_strips.cpp, from quantized weights); linear_bf16 runs on it too.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/amx.h"
#include "pyengine/bf16_widen.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"
#include "pyengine/simd_transpose.h"
#include "linear.h"

#include "pyengine/simd.h"

namespace pyengine::cpu {
namespace {

constexpr int64_t kTileN = 16;
constexpr int64_t kTileLine = 32;                  // bf16 elements per (tile, k pair): 64 bytes
constexpr int64_t kMaxRows = 16;                   // rows of x per pass over a tile group
constexpr int kBlockRows = 8;                      // rows per block of a chunk of 2 tiles (see tile_group)
constexpr int64_t kMinParallelBytes = 64 * 1024;   // below this weight size the caller runs alone
constexpr int64_t kRangesPerThread = 4;            // tile ranges per thread (see linear_bf16)
constexpr int64_t kPanelMinRows = 256;             // above this many rows, x goes in L2-sized panels
constexpr int64_t kPanelBytes = 256 * 1024;        // ... of about this many bytes (packed x)

// The kernel paths; set_linear_path forces an AVX-512 one (tests), kBest picks amx where it runs, else
// the better of the two AVX-512 kernels for this -march (kPreferFp32Fma, bf16_widen.h).
enum class Path { kBest, kFp32, kBf16 };
std::atomic<Path> g_forced{Path::kBest};

struct Args {
  const uint32_t* xp;  // packed x: one word per k pair and row, two for avx512_fp32
  const uint16_t* w;
  const float* bias;
  void* out;
  int64_t M, N, K, KP;
  bool out_f32;
  int64_t ldo;  // out's row stride (elements)
  bool wide;    // the avx512_fp32 kernel
};

// Words of packed x per k pair and row: one (two bf16), or two (fp32) for the avx512_fp32 kernel.
constexpr int64_t x_words(bool wide) { return wide ? 2 : 1; }

// NT * MR accumulators <= 16 zmm, MR = rows of a block (see tile_group).
inline int tiles_per_group(int64_t rows) { return rows <= 4 ? 4 : rows <= kBlockRows || rows == kMaxRows ? 2 : 1; }

#if defined(__AVX512BF16__)

// The epilogue of both paths (Args, AmxArgs): output tile `tile` (16 columns, masked at N) of a row =
// its fp32 sums + bias, stored as fp32 or bf16 (rows ldo apart).
struct TileStore {
  int64_t n0;
  __mmask16 mask;
  __m512 bias;

  template <class A>
  TileStore(const A& a, int64_t tile) : n0(tile * kTileN) {
    mask = static_cast<__mmask16>((1u << std::min<int64_t>(kTileN, a.N - n0)) - 1u);
    bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
  }

  template <class A>
  void store(const A& a, int64_t row, __m512 sums) const {
    const __m512 v = _mm512_add_ps(sums, bias);
    const int64_t off = row * a.ldo + n0;
    if (a.out_f32) _mm512_mask_storeu_ps(static_cast<float*>(a.out) + off, mask, v);
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + off, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
};

// TileStore for two whole output tiles side by side (32 columns): a row's 32 values leave in one unmasked
// store of 64 bytes (bf16, both halves rounded by one vcvtne2ps2bf16: the same bits) or two (fp32).
// Two masked 32-byte stores per row cost far more over the bare tile loop (bench/lab/amx_probe.cpp;
// docs/performance.md, "bf16 linear").
struct TilePairStore {
  int64_t n0;
  __m512 bias0, bias1;

  template <class A>
  TilePairStore(const A& a, int64_t tile) : n0(tile * kTileN) {
    bias0 = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    bias1 = a.bias ? _mm512_loadu_ps(a.bias + n0 + kTileN) : _mm512_setzero_ps();
  }

  template <class A>
  void store(const A& a, int64_t row, __m512 sums0, __m512 sums1) const {
    const __m512 v0 = _mm512_add_ps(sums0, bias0), v1 = _mm512_add_ps(sums1, bias1);
    const int64_t off = row * a.ldo + n0;
    if (a.out_f32) {
      _mm512_storeu_ps(static_cast<float*>(a.out) + off, v0);
      _mm512_storeu_ps(static_cast<float*>(a.out) + off + kTileN, v1);
    } else {
      _mm512_storeu_si512(static_cast<uint16_t*>(a.out) + off, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
  }
};

// Rows [r0, r0 + MR) x tiles [t0, t0 + NT); xp at row r0's first k pair, the next pair ld words on
// (the rows of its 16-row chunk).
template <int MR, int NT, bool WIDE>
void tile_block(const Args& a, const uint32_t* xp, int64_t ld, int64_t r0, int64_t t0) {
  // Weight lines prefetched ahead per stream, into L2 (past a tile's end: harmless). A line feeds MR
  // dot products, so with more rows the same distance is less time: 16 lines left 8..16-row blocks
  // waiting on memory; 64 and 128 measured the same (docs/performance.md, "bf16 linear").
  constexpr int64_t prefetch_lines = MR >= 8 ? 64 : 16;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t tile_stride = a.KP * kTileLine;
  const uint16_t* w = a.w + t0 * tile_stride;
  for (int64_t kp = 0; kp < a.KP; ++kp, xp += ld) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) {
      prefetch<_MM_HINT_T1>(w + t * tile_stride + (kp + prefetch_lines) * kTileLine);
      wv[t] = _mm512_load_si512(w + t * tile_stride + kp * kTileLine);
    }
    if constexpr (WIDE) {
      for (int t = 0; t < NT; ++t) {  // the line's k = 2kp and 2kp + 1 of its 16 outputs, in fp32
        const __m512 even = bf16_even(wv[t]), odd = bf16_odd(wv[t]);
        for (int m = 0; m < MR; ++m) {
          const __m512 x0 = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(xp[2 * m])));
          const __m512 x1 = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(xp[2 * m + 1])));
          acc[m][t] = _mm512_fmadd_ps(x0, even, _mm512_fmadd_ps(x1, odd, acc[m][t]));
        }
      }
    } else {
      for (int m = 0; m < MR; ++m) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xp[m]));
        for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, (__m512bh)wv[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const TileStore out(a, t0 + t);
    for (int m = 0; m < MR; ++m) out.store(a, r0 + m, acc[m][t]);
  }
}

using BlockFn = void (*)(const Args&, const uint32_t*, int64_t, int64_t, int64_t);

template <int MR, bool WIDE>
constexpr BlockFn block_fn(int nt) {
  return nt == 4 ? &tile_block<MR, 4, WIDE> : nt == 2 ? &tile_block<MR, 2, WIDE> : &tile_block<MR, 1, WIDE>;
}

template <bool WIDE, int... MRs>
BlockFn pick(int64_t rows, int nt, std::integer_sequence<int, MRs...>) {
  static constexpr BlockFn table[][3] = {
      {block_fn<MRs + 1, WIDE>(1), block_fn<MRs + 1, WIDE>(2), block_fn<MRs + 1, WIDE>(4)}...};
  return table[rows - 1][nt == 4 ? 2 : nt - 1];
}

inline BlockFn block_for(int64_t rows, int nt, bool wide) {
  return wide ? pick<true>(rows, nt, std::make_integer_sequence<int, kMaxRows>{})
              : pick<false>(rows, nt, std::make_integer_sequence<int, kMaxRows>{});
}

// Tiles [t0, t0 + nt) for all rows, in 16-row chunks: one block, or, for 2 tiles over more than 8 rows,
// two halves. A 16-row chunk as one block of 16 x 1 tile loads 17 values (a weight line, 16 broadcasts)
// per 16 products: two 8 x 2 blocks load 10, and a core that issues two 512-bit loads per cycle beside
// its two vdpbf16ps keeps up. (M = 9..15 keeps one block of 1 tile: its halves of 5..7 rows x 2 tiles,
// too few sums to cover the product latency, were slower.) Each sum is the same chain of products in k order either
// way: the same bits.
void tile_group(const Args& a, int64_t t0, int nt) {
  const int64_t words = x_words(a.wide);
  for (int64_t r0 = 0; r0 < a.M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, a.M - r0);
    const uint32_t* xp = a.xp + r0 * a.KP * words;
    const int64_t half = nt == 1 || rows <= kBlockRows ? rows : (rows + 1) / 2;
    block_for(half, nt, a.wide)(a, xp, rows * words, r0, t0);
    if (half < rows) block_for(rows - half, nt, a.wide)(a, xp + half * words, rows * words, r0 + half, t0);
  }
}

#else  // portable path: same layout, plain loops

void tile_group(const Args& a, int64_t t0, int nt) {
  for (int64_t tile = t0; tile < t0 + nt; ++tile) {
    const uint16_t* w = a.w + tile * a.KP * kTileLine;
    const int64_t n0 = tile * kTileN;
    const int64_t valid = std::min<int64_t>(kTileN, a.N - n0);
    for (int64_t m = 0; m < a.M; ++m) {
      const int64_t r0 = m / kMaxRows * kMaxRows, rows = std::min(kMaxRows, a.M - r0);
      const uint32_t* xp = a.xp + r0 * a.KP + (m - r0);
      float acc[kTileN] = {};
      for (int64_t kp = 0; kp < a.KP; ++kp) {
        const uint32_t pair = xp[kp * rows];
        const float x0 = bf16_to_float(static_cast<uint16_t>(pair)), x1 = bf16_to_float(pair >> 16);
        const uint16_t* line = w + kp * kTileLine;
        for (int64_t j = 0; j < kTileN; ++j)
          acc[j] += x0 * bf16_to_float(line[2 * j]) + x1 * bf16_to_float(line[2 * j + 1]);
      }
      for (int64_t j = 0; j < valid; ++j) {
        const float v = acc[j] + (a.bias ? a.bias[n0 + j] : 0.0f);
        const int64_t off = m * a.ldo + n0 + j;
        if (a.out_f32) {
          static_cast<float*>(a.out)[off] = v;
        } else {
          static_cast<uint16_t*>(a.out)[off] = float_to_bf16(v);
        }
      }
    }
  }
}

#endif

#if defined(PYENGINE_AMX)

// One AMX call's operands: x rows in 16-row blocks (the last one possibly a zero-padded copy).
struct AmxArgs {
  const uint16_t* x;     // [M, K] bf16
  const uint16_t* tail;  // [16, K]: rows [M / 16 * 16, M) then zeros, or null when M % 16 == 0
  const uint16_t* w;
  const float* bias;
  void* out;
  int64_t M, N, K, KP;
  bool out_f32;
  int64_t ldo;

  const uint16_t* block(int64_t r0) const { return r0 + 16 <= M ? x + r0 * K : tail; }
};

// Rows [r0, r0 + 16 RB) x tiles [t0, t0 + NT) into c [32][32] fp32 (rows past M: whatever, unused).
// tmm 2i + j: C of row block i, output tile j; tmm4, 5: A of row blocks 0, 1; tmm6, 7: B of tiles 0, 1.
template <int RB, int NT>
void amx_block(const AmxArgs& a, int64_t r0, int64_t t0, float* c) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && NT == 2) _tile_zero(3);
  const uint16_t* x0 = a.block(r0);
  const uint16_t* x1 = RB == 2 ? a.block(r0 + 16) : nullptr;
  const int64_t tile_stride = a.KP * kTileLine, x_stride = a.K * 2;
  const uint16_t* w = a.w + t0 * tile_stride;
  // Each A and B tile is reloaded for the next 32 k right after its last product is issued, so the loads
  // run while the products queued before them execute, instead of the next products all waiting on loads
  // issued at the top of the loop (a tile register is not renamed: a load waits for the products reading
  // its old value). Each C tile still sums its products in k order: the same bits.
  const int64_t KB = a.K / 32;
  _tile_loadd(4, x0, x_stride);
  if constexpr (RB == 2) _tile_loadd(5, x1, x_stride);
  _tile_loadd(6, w, 64);
  if constexpr (NT == 2) _tile_loadd(7, w + tile_stride, 64);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const bool next = kb + 1 < KB;
    const int64_t xo = (kb + 1) * 32, wo = (kb + 1) * 16 * kTileLine;
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if (next) _tile_loadd(4, x0 + xo, x_stride);
    if constexpr (RB == 2) {
      _tile_dpbf16ps(2, 5, 6);
      if (next) _tile_loadd(6, w + wo, 64);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
      if (next) _tile_loadd(5, x1 + xo, x_stride);
    } else if (next) {
      _tile_loadd(6, w + wo, 64);
    }
    if constexpr (NT == 2) {
      if (next) _tile_loadd(7, w + tile_stride + wo, 64);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NT == 2) _tile_stored(1, c + 16, 128);
  if constexpr (RB == 2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (RB == 2 && NT == 2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// Output tiles [begin, end) for all rows: blocks of 32 rows x 2 tiles, bias added, rounded if bf16.
// Rows outermost: a block's 32 rows of x stay in L1 while this thread's tiles of the weight (its share,
// at most a few MB for these models) stream past from L2.
void amx_range(const AmxArgs& a, int64_t begin, int64_t end) {
  alignas(64) float c[32 * 32];
  configure_tiles(8);
  for (int64_t r0 = 0; r0 < a.M; r0 += 32) {
    const int64_t rows = std::min<int64_t>(32, a.M - r0);
    for (int64_t t0 = begin; t0 < end; t0 += 2) {
      const int nt = std::min<int64_t>(2, end - t0);
      if (rows > 16) (nt == 2 ? amx_block<2, 2> : amx_block<2, 1>)(a, r0, t0, c);
      else (nt == 2 ? amx_block<1, 2> : amx_block<1, 1>)(a, r0, t0, c);
      if (nt == 2 && (t0 + 2) * kTileN <= a.N) {
        const TilePairStore out(a, t0);
        for (int64_t m = 0; m < rows; ++m) out.store(a, r0 + m, _mm512_load_ps(c + m * 32), _mm512_load_ps(c + m * 32 + 16));
        continue;
      }
      for (int t = 0; t < nt; ++t) {
        const TileStore out(a, t0 + t);
        for (int64_t m = 0; m < rows; ++m) out.store(a, r0 + m, _mm512_load_ps(c + m * 32 + t * 16));
      }
    }
  }
  _tile_release();
}

// By the weight's shape alone, never by M: the two paths round differently, and a row's result must not
// depend on how many rows came with it.
bool use_amx(int64_t K) {
  return g_forced.load(std::memory_order_relaxed) == Path::kBest && K % 32 == 0 && amx_usable();
}

#endif

#if defined(__AVX512BF16__)
// In place: r[i] (8 64-bit words) becomes (r[0][i], ..., r[7][i]).
inline void transpose8x8_epi64(__m512i (&r)[8]) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved, even and odd words
    t[2 * i] = _mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // h: even (0) or odd (1) words
    u[4 * h] = _mm512_shuffle_i64x2(t[h], t[2 + h], 0x88);
    u[4 * h + 1] = _mm512_shuffle_i64x2(t[h], t[2 + h], 0xdd);
    u[4 * h + 2] = _mm512_shuffle_i64x2(t[4 + h], t[6 + h], 0x88);
    u[4 * h + 3] = _mm512_shuffle_i64x2(t[4 + h], t[6 + h], 0xdd);
    r[h] = _mm512_shuffle_i64x2(u[4 * h], u[4 * h + 2], 0x88);
    r[4 + h] = _mm512_shuffle_i64x2(u[4 * h], u[4 * h + 2], 0xdd);
    r[2 + h] = _mm512_shuffle_i64x2(u[4 * h + 1], u[4 * h + 3], 0x88);
    r[6 + h] = _mm512_shuffle_i64x2(u[4 * h + 1], u[4 * h + 3], 0xdd);
  }
}
#endif

// x [M, K] -> xp (layout above): a k pair as one word of two bf16, or (wide) as two fp32 words. Per
// 16-row chunk a transpose (a row's k pairs -> a k pair's rows), in registers with AVX-512: pair by pair,
// the stores land a chunk's width apart and every one missed L1 (a visible share of a prefill's
// profile: docs/performance.md, "bf16 linear"). Wide, 8 rows x 8
// pairs at a time: each row's 8 pairs widened to 8 64-bit words, transposed, stored as 8 runs of 64
// bytes. bf16 words, all rows x 16 pairs at a time: a 16 x 16 transpose of 32-bit words, missing rows
// zero and not stored. The rest (wide: rows past a multiple of 8; pairs past the last whole run; the
// odd-K last pair) pair by pair.
void pack_x(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp, bool wide) {
  const int64_t KP = (K + 1) / 2;
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, M - r0);
    uint32_t* chunk = xp + r0 * KP * x_words(wide);
    int64_t full = 0, full_rows = 0;  // pairs [0, full) of rows [0, full_rows) done
#if defined(__AVX512BF16__)
    if (wide) {
      full = K / 2 / 8 * 8, full_rows = rows / 8 * 8;
      for (int64_t m0 = 0; m0 < full_rows; m0 += 8)
        for (int64_t kp = 0; kp < full; kp += 8) {
          __m512i r[8];
          for (int i = 0; i < 8; ++i) {
            r[i] = _mm512_castps_si512(load_bf16x16(x + (r0 + m0 + i) * K + 2 * kp));
          }
          transpose8x8_epi64(r);
          for (int j = 0; j < 8; ++j) _mm512_storeu_si512(chunk + 2 * ((kp + j) * rows + m0), r[j]);
        }
    } else {  // 16 pairs of all rows at a time (missing rows zero, not stored)
      full = K / 32 * 16, full_rows = rows;
      const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1u);
      for (int64_t kp = 0; kp < full; kp += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < rows ? _mm512_loadu_si512(x + (r0 + i) * K + 2 * kp) : _mm512_setzero_si512();
        transpose16x16_epi32(r);
        for (int j = 0; j < 16; ++j) _mm512_mask_storeu_epi32(chunk + (kp + j) * rows, live, r[j]);
      }
    }
#endif
    for (int64_t m = 0; m < rows; ++m) {
      const uint16_t* row = x + (r0 + m) * K;
      for (int64_t kp = m < full_rows ? full : 0; kp < KP; ++kp) {
        const uint32_t lo = row[2 * kp], hi = 2 * kp + 1 < K ? row[2 * kp + 1] : 0;
        if (wide) {
          chunk[2 * (kp * rows + m)] = lo << 16;
          chunk[2 * (kp * rows + m) + 1] = hi << 16;
        } else {
          chunk[kp * rows + m] = lo | hi << 16;
        }
      }
    }
  }
}

// The AVX-512 kernel that runs where AMX does not.
bool use_wide() {
  const Path forced = g_forced.load(std::memory_order_relaxed);
  return forced == Path::kFp32 || (forced != Path::kBf16 && kPreferFp32Fma);
}

// Tiles [begin, end): groups of NT, then the remainder in groups of 2 and 1.
void tile_range(const Args& a, int64_t begin, int64_t end) {
  const int group = tiles_per_group(std::min(a.M, kMaxRows));
  int64_t t = begin;
  for (int nt = group; nt >= 1; nt /= 2)
    for (; t + nt <= end; t += nt) tile_group(a, t, nt);
}

// Where linear_bf16 cuts `tiles` output tiles into ranges, for the pool to hand out in turn: ranges of whole
// tile pairs (AMX's blocks), cuts[i] to cuts[i + 1]. Several per thread, so that where a helper is off its
// core (a shared host) the others take its share instead of waiting for its one range (one range per
// thread: the calling thread of a 64-row prompt step waited through much of its GEMM time on a loaded host).
//   M <= kMaxRows (decode: a weight stream): kRangesPerThread equal ranges per thread.
//   more rows (compute-bound): ranges shrinking from 1 / (threads x kRangesPerThread) of the pairs left
//   down to one pair, so the loop ends within one pair's time on every thread. With equal ranges, the 18
//   pairs of a 576-output projection made 8 ranges of 2 or 3, and a thread idled for up to a range at the
//   end. Shrinking ranges won for the small projections and cost the large one (gate_up, whose 96 pairs
//   split evenly) a little (docs/performance.md, "bf16 linear").
std::vector<int64_t> pair_cuts(int64_t tiles, int64_t M, int threads) {
  const int64_t pairs = (tiles + 1) / 2, ranges = threads * kRangesPerThread;
  std::vector<int64_t> cuts{0};
  if (M <= kMaxRows) {
    const int64_t n = std::min(pairs, ranges);
    for (int64_t i = 0; i < n; ++i) cuts.push_back(tile_pair_range(tiles, i, n).end);
    return cuts;
  }
  for (int64_t done = 0; done < pairs;) {
    done += (pairs - done + ranges - 1) / ranges;
    cuts.push_back(std::min(tiles, 2 * done));
  }
  return cuts;
}

}  // namespace

void linear_bf16(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out, int64_t M, int64_t N, int64_t K,
                 int out_dtype) {
  if (M < 0 || N <= 0 || K <= 0) throw std::invalid_argument("linear_bf16: need M >= 0, N > 0, K > 0");
  if (out_dtype != static_cast<int>(DType::kFloat32) && out_dtype != static_cast<int>(DType::kBFloat16))
    throw std::invalid_argument("linear_bf16: out dtype must be fp32 or bf16");
  if (packed % 64 != 0) throw std::invalid_argument("linear_bf16: packed weight must be 64-byte aligned");
  if (M == 0) return;
  const Bf16Rows rows(reinterpret_cast<const uint16_t*>(x), M, K);
  const int64_t tiles = (N + kTileN - 1) / kTileN, tile_elems = (K + 1) / 2 * kTileLine;
  const bool out_f32 = out_dtype == static_cast<int>(DType::kFloat32);
  const std::vector<int64_t> cuts = tiles * tile_elems * 2 < kMinParallelBytes
                                        ? std::vector<int64_t>{0, tiles}
                                        : pair_cuts(tiles, M, ThreadPool::instance().num_threads());
  ThreadPool::instance().parallel_for(static_cast<int64_t>(cuts.size()) - 1, [&](int64_t c) {
    const int64_t begin = cuts[c], end = cuts[c + 1], n0 = begin * kTileN;
    rows.run(reinterpret_cast<const uint16_t*>(packed) + begin * tile_elems,
             bias ? reinterpret_cast<const float*>(bias) + n0 : nullptr,
             reinterpret_cast<char*>(out) + n0 * (out_f32 ? 4 : 2), std::min(N, end * kTileN) - n0, N, out_f32);
  });
}

bool linear_bf16_simd(int64_t K) { return linear_path(K) != "portable"; }

Bf16Rows::Bf16Rows(const uint16_t* x, int64_t M, int64_t K) : x_(x), M_(M), K_(K) {
#if defined(PYENGINE_AMX)
  if (use_amx(K)) {
    amx_ = true;
    static thread_local std::vector<uint16_t> tail;
    const int64_t full = M / 16 * 16;
    if (full < M) {
      tail.assign(16 * K, 0);
      std::memcpy(tail.data(), x + full * K, (M - full) * K * 2);
      tail_ = tail.data();
    }
    return;
  }
#endif
  static thread_local std::vector<uint32_t> xp;
  const int64_t KP = (K + 1) / 2;
#if defined(__AVX512BF16__)
  wide_ = use_wide();
#endif
  xp.resize(static_cast<size_t>(M * KP * x_words(wide_)));
  uint32_t* const xbuf = xp.data();  // this thread's buffer (a worker's thread_local xp is another)
  // One 16-row chunk per item: a 64-row prompt step's chunks pack in parallel too (on the calling
  // thread alone the helpers waited for them).
  ThreadPool::instance().parallel_for((M + kMaxRows - 1) / kMaxRows, [&](int64_t c) {
    const int64_t r0 = c * kMaxRows;
    pack_x(x + r0 * K, std::min(kMaxRows, M - r0), K, xbuf + r0 * KP * x_words(wide_), wide_);
  });
  xp_ = xbuf;
}

void Bf16Rows::run(const uint16_t* w, const float* bias, void* out, int64_t N, int64_t ldo, bool out_f32) const {
  const int64_t tiles = (N + kTileN - 1) / kTileN, KP = (K_ + 1) / 2;
#if defined(PYENGINE_AMX)
  if (amx_) {
    amx_range({x_, tail_, w, bias, out, M_, N, K_, KP, out_f32, ldo}, 0, tiles);
    return;
  }
#endif
  // Panels of x rows (about kPanelBytes, whole 16-row chunks) stay in L2 while every tile of the
  // weight streams past them; one pass over all rows would re-read x from L3 for every tile.
  const int64_t words = x_words(wide_);
  const int64_t panel =
      M_ > kPanelMinRows ? std::max<int64_t>(1, kPanelBytes / (KP * 4 * words * kMaxRows)) * kMaxRows : M_;
  for (int64_t p0 = 0; p0 < M_; p0 += panel)
    tile_range({xp_ + p0 * KP * words, w, bias, static_cast<char*>(out) + p0 * ldo * (out_f32 ? 4 : 2),
                std::min(panel, M_ - p0), N, K_, KP, out_f32, ldo, wide_},
               0, tiles);
}

void set_linear_path(const std::string& name) {
  if (name == "amx") g_forced.store(Path::kBest);
  else if (name == "avx512_fp32") g_forced.store(Path::kFp32);
  else if (name == "avx512_bf16") g_forced.store(Path::kBf16);
  else throw std::invalid_argument("linear path must be amx, avx512_fp32 or avx512_bf16, got " + name);
}

std::string linear_path(int64_t K) {
#if defined(PYENGINE_AMX)
  if (use_amx(K)) return "amx";
#else
  (void)K;
#endif
#if defined(__AVX512BF16__)
  return use_wide() ? "avx512_fp32" : "avx512_bf16";
#else
  return "portable";
#endif
}

}  // namespace pyengine::cpu
