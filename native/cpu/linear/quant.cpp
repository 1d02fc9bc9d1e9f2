// Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
// IQ4_XS):
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// The weight stays quantized, repacked once at load into 16-row tiles (ggml_blocks.h), so decode
// streams 2.6-8.5 bits per weight instead of bf16's 16. Activations are quantized per 32-value
// block to int8 in two rows, the value and its residual (quantize_row), with fp32 scales dx1 = amax / 127
// (round to nearest even) and dx2 = dx1 / 256, and their block sums for the offset term. Per (row, tile,
// 32-value group): int8 dot products of 64-byte lines (Q8_0: 8 lines; the others 4 lines x low/high
// nibbles or, for Q2_K/Q3_K, 2-bit values, with the Q5/Q6/Q3_K high bits or'ed in), accumulated in fp32
// across groups, for a row of x
// (int8 rows 1 and 2: its value and residual, s = dx * sum(xq) of the block):
//   acc[j] += d[j, b] * dx2 (256 dot1[j] + dot2[j]) + c[j, b] * (s1 + s2)      (vnni, amx, avx2: scale_pair;
//             where c is a fixed multiple of d: d[j, b] * (dx2 (256 dot1[j] + dot2[j]) + (c / d) (s1 + s2)))
//   acc[j] += dx1 d[j, b] dot1[j] + c[j, b] s1  and the same for row 2, summed  (scalar)
// (Q6_K, Q2_K, Q3_K: per 16-value half, with the half's sum); the tile's epilogue (store_row) adds the
// bias and writes straight into out. vnni and amx do the same float operations, so a row's result does not
// depend on how many rows its batch has (the path).
// A weight may be several row ranges of different types (a fused qkv of Q5_0 q/k and a Q8_0 v, as
// llama.cpp's Q4_K_M mixes): a segment table, the activations quantized once for all of them.
// SIMD paths, chosen at run time among those this build has (set_qlinear_isa, for tests):
//   amx: for M >= 8 rows of x, 16 int8 rows x one tile per tdpbsud, a 32-value group at a time (amx_block);
//        the rows after the last whole 16 and M < 8 (decode) run on the avx512_vnni path;
//   avx512_vnni: vpdpbusd, the 16 rows of a tile in the lanes of one zmm, 4 activation bytes broadcast;
//   avx2: a tile's rows in two ymm. From kJoinedMinRows rows of x, vpmaddwd on int16: each row of x's
//         pair joined (256 q1 + q2) against the weights' values widened to int16, 4 rows of x per unpacked
//         weight line; below, vpmaddubsw + vpmaddwd on the int8 pairs (Q8_0 on signed values: no i16
//         overflow), 4 int8 rows (2 of x) per unpacked weight line. Both give the same sums, so the same bits;
//   scalar: a portable loop over the same layout.
// From qlinear_strip_rows() rows of bf16 x (8 on AMX hosts, else never), linear/quant_strips.cpp runs
// instead: the weight dequantized to bf16 a strip at a time for linear/bf16.cpp's kernel, bit-identical to
// weights="dequantize".
// Parallel shape as linear/bf16.cpp: tiles split into one contiguous range per thread; within a range,
// groups of NT tiles x chunks of MR rows; big M in row panels so the quantized activations stay in
// L2 while the weights stream. The activations are quantized first, split by rows across the threads
// from kMinParallelQuant values up (a decode step of 16 rows), else on the calling thread.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/bf16_widen.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/ggml_blocks.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"
#include "pyengine/vec_reduce.h"
#include "linear.h"
#include "quant_tiles.h"

namespace pyengine::cpu {
namespace {

using ggml::kBlock;
using ggml::kTileRows;
using ggml::Layout;
using ggml::layout;

constexpr int64_t kMaxRows = 8;                   // int8 rows (4 rows of x, each with its residual) per pass
constexpr int64_t kMinParallelBytes = 32 * 1024;  // below this weight size the caller runs alone
constexpr int64_t kPanelMinRows = 64;
constexpr int64_t kMinParallelQuant = 8192;  // activation values below which the caller quantizes them alone
constexpr int64_t kPanelBytes = 256 * 1024;       // quantized x per panel
constexpr int64_t kAmxRows = 16;                  // int8 rows per AMX pass (panels are whole multiples)
// Rows of x from which the avx2 path runs on the joined activations (avx2_joined_half). Below, its int8
// pairs: a call of 1 or 2 rows (decode of 1 or 2 sequences) reads each weight line once there, and
// unpacks it for fewer products; from 3 rows the joined activations win (docs/performance.md,
// "quantized linear").
constexpr int64_t kJoinedMinRows = 3;

enum Isa : int { kScalar, kAvx2, kVnni, kAmx };

constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512_vnni", "amx"};

// Whether this build and this process can run path `isa` (AMX: Linux must grant the tile state).
bool isa_available(int isa) {
  switch (isa) {
    case kScalar: return true;
#if defined(PYENGINE_QLINEAR_AVX2)
    case kAvx2: return true;
#endif
#if defined(PYENGINE_QLINEAR_VNNI)
    case kVnni: return true;
#endif
#if defined(PYENGINE_QLINEAR_AMX)
    case kAmx: return amx_usable();
#endif
    default: return false;
  }
}

int best_isa() {
  int isa = kAmx;
  while (!isa_available(isa)) --isa;
  return isa;
}

std::atomic<int> g_isa{best_isa()};

struct QArgs {
  const int8_t* xq;    // [M, K]
  const float* dx;     // [M, KB]
  const float* sx;     // [M, KB]: dx * sum(xq) of the block
  const float* sh;     // [M, 2 KB]: dx * sum(xq) of each 16-value half (Q6_K)
  const uint8_t* w;    // the segment's tiles
  void* out;           // [M / 2, ldo] fp32 or bf16 (out_f32), this segment's first column
  const float* bias;   // [N] fp32, this segment's, or null
  bool out_f32;
  int64_t M, N, K, KB, ldo;  // M: int8 rows, a row of x and its residual after each other
  bool joined;               // avx2: each pair of rows stored joined (quantize_row_avx2)

  // The m int8 rows from row r (even).
  QArgs rows_from(int64_t r, int64_t m) const {
    QArgs a = *this;
    a.xq += r * K, a.dx += r * KB, a.sx += r * KB, a.sh += 2 * r * KB, a.M = m;
    a.out = static_cast<char*>(out) + r / 2 * ldo * (out_f32 ? 4 : 2);
    return a;
  }
};

// The sum of an int8 row pair's results (a row of x and its residual: quantize_row) for the 16
// columns of one tile from n0, plus the bias, into row r of out.
inline void store_row(const QArgs& a, int64_t r, int64_t n0, const float* sum) {
  const int64_t valid = std::min(kTileRows, a.N - n0);
  for (int64_t j = 0; j < valid; ++j) {
    const float v = sum[j] + (a.bias ? a.bias[n0 + j] : 0.0f);
    if (a.out_f32) static_cast<float*>(a.out)[r * a.ldo + n0 + j] = v;
    else static_cast<uint16_t*>(a.out)[r * a.ldo + n0 + j] = float_to_bf16(v);
  }
}

// Stored unsigned value k (0..31) of row j in a group, for the scalar paths (the IQ4 types: the signed
// level, their group_scale has c = 0).
template <int T>
inline int group_value(const uint8_t* grp, int64_t j, int64_t k) {
  constexpr Layout L = layout(T);
  if constexpr (L.lines == 8) return grp[64 * (k / 4) + 4 * j + k % 4];
  const int64_t i = k / 8, t = k % 4;
  const int high = (k % 8) >= 4;
  const uint8_t byte = grp[64 * (L.bits == 2 ? i / 2 : i) + 4 * j + t];
  int u = (byte >> ((L.bits == 2 ? 4 * (i % 2) : 0) + L.bits * high)) & ((1 << L.bits) - 1);
  if constexpr (L.high_lines == 1) u |= ((grp[64 * L.bits + 4 * j + t] >> (2 * i + high)) & 1) << L.bits;
  if constexpr (L.high_lines == 2) u |= ((grp[256 + 64 * (i / 2) + 4 * j + t] >> (4 * (i % 2) + 2 * high)) & 3) << 4;
  if constexpr (L.lookup) return ggml::kIq4nl[u];
  return u;
}

struct Scale {
  float d, c;  // value = d * u + c
};

// Scale and offset of row j, group g (of its record `rec`), half h.
template <int T>
inline Scale group_scale(const uint8_t* rec, int64_t j, int64_t g, int h) {
  constexpr Layout L = layout(T);
  const uint8_t* s = rec + L.scales_offset();
  auto f16 = [&](int64_t off) { return fp16_to_float(reinterpret_cast<const uint16_t*>(s + off)[j]); };
  if constexpr (T == ggml::kQ4_K || T == ggml::kQ5_K) {
    return {f16(0) * static_cast<float>(s[64 + 16 * g + j]), -(f16(32) * static_cast<float>(s[192 + 16 * g + j]))};
  } else if constexpr (T == ggml::kQ2_K) {
    const uint8_t sc = s[64 + 16 * (2 * g + h) + j];
    return {f16(0) * static_cast<float>(sc & 0x0F), -(f16(32) * static_cast<float>(sc >> 4))};
  } else if constexpr (T == ggml::kQ6_K || T == ggml::kQ3_K) {
    const float d = f16(0) * static_cast<float>(static_cast<int8_t>(s[32 + 16 * (2 * g + h) + j]));
    return {d, (T == ggml::kQ6_K ? -32.0f : -4.0f) * d};
  } else if constexpr (T == ggml::kQ4_1 || T == ggml::kQ5_1) {
    return {f16(0), f16(32)};
  } else if constexpr (T == ggml::kIQ4_XS) {
    return {f16(0) * static_cast<float>(static_cast<int8_t>(s[32 + 16 * g + j])), 0.0f};
  } else if constexpr (T == ggml::kIQ4_NL) {
    return {f16(0), 0.0f};
  } else {
    const float d = f16(0);
    return {d, (T == ggml::kQ8_0 ? -128.0f : T == ggml::kQ5_0 ? -16.0f : -8.0f) * d};
  }
}

// The activation sum that multiplies a group's offset c: the block's, or (Q6_K) the half's.
template <int T>
inline float offset_sum(const QArgs& a, int64_t xb, int h) {
  return layout(T).halves == 1 ? a.sx[xb] : a.sh[2 * xb + h];
}

// The bytes of one group step (a record / its groups) of each of nt tiles at `at` (stride apart), one pass
// (nt tiles) ahead, into L2: a pass reads its nt tiles' records (contiguous) side by side, so this stays a
// pass's length ahead of the reads, scale lines included, and at a pass's start the next pass's tiles are
// already on their way (the old fixed 8 groups ahead within each tile left them cold). Q8_0 was slower
// with it (its 8 full lines a group: more bytes per op), so Q8_0 keeps the near prefetch into L1 there.
// The avx2 int8 pairs (1 or 2 rows of x) prefetch one tile (its own pass) ahead, into L2, every type
// (T0 measured the same). Figures: docs/performance.md, "quantized linear".
template <int T>
inline void prefetch_ahead(const uint8_t* at, int64_t stride, int nt) {
  constexpr int64_t step = layout(T).record_bytes() / layout(T).groups();
  for (int t = 0; t < nt; ++t)
    for (int64_t off = 0; off < step; off += 64)
      prefetch<_MM_HINT_T1>(at + (nt + t) * stride + off);
}

template <int T>
void tile_group_scalar(const QArgs& a, int64_t t0, int nt) {
  constexpr Layout L = layout(T);
  constexpr int64_t per_half = kBlock / L.halves;
  const int64_t stride = tile_stride(L, a.KB);
  for (int64_t tile = t0; tile < t0 + nt; ++tile) {
    const uint8_t* w = a.w + tile * stride;
    const int64_t n0 = tile * kTileRows, valid = std::min(kTileRows, a.N - n0);
    float sum[kTileRows] = {};
    for (int64_t m = 0; m < a.M; ++m) {
      for (int64_t j = 0; j < valid; ++j) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.KB; ++b) {
          const uint8_t* rec = w + b / L.groups() * L.record_bytes();
          const int64_t g = b % L.groups();
          const uint8_t* grp = rec + g * L.group_bytes();
          const int8_t* xq = a.xq + m * a.K + b * kBlock;
          const int64_t xb = m * a.KB + b;
          for (int h = 0; h < L.halves; ++h) {
            int32_t dot = 0;
            for (int64_t k = h * per_half; k < (h + 1) * per_half; ++k) dot += group_value<T>(grp, j, k) * xq[k];
            const Scale s = group_scale<T>(rec, j, g, h);
            acc += a.dx[xb] * (s.d * static_cast<float>(dot)) + s.c * offset_sum<T>(a, xb, h);
          }
        }
        sum[j] = m % 2 ? sum[j] + acc : acc;
      }
      if (m % 2) store_row(a, m / 2, n0, sum);
    }
  }
}

#if defined(PYENGINE_QLINEAR_VNNI)

// (d, c) of the 16 rows of one tile for group g, half h of record `rec`.
template <int T>
inline void vnni_scales(const uint8_t* rec, int64_t g, int h, __m512& d, __m512& c) {
  vec_scales<T, Zmm, false>(rec, g, h, 0, d, c);
}

// Rows [r0, r0 + MR) x tiles [t0, t0 + NT).
template <int T, int MR, int NT>
void vnni_block(const QArgs& a, int64_t r0, int64_t t0) {
  constexpr Layout L = layout(T);
  constexpr int per_half = L.lines / L.halves;
  __m512 acc[MR / 2][NT];  // per row pair
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  const int64_t stride = tile_stride(L, a.KB);
  const uint8_t* w = a.w + t0 * stride;
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b % L.groups();
    const uint8_t* rec = w + b / L.groups() * L.record_bytes();
    const uint8_t* grp = rec + g * L.group_bytes();
    // The block's activation words (4 bytes), per row, copied side by side: the broadcasts then read one
    // pointer at fixed offsets, where MR row pointers spilled GCC's general registers (a reload every few
    // products). The empty asm keeps x one pointer walking the rows: without it GCC made MR pointers again
    // and Q8_0 ran slower than before (docs/performance.md, "quantized linear").
    alignas(32) int32_t xw[MR][kBlock / 4];
    const int8_t* x = a.xq + r0 * a.K + b * kBlock;
    for (int m = 0; m < MR; ++m, x += a.K) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(xw[m]), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      asm("" : "+r"(x));
    }
    if constexpr (L.lines != 8) prefetch_ahead<T>(w + b * L.record_bytes() / L.groups(), stride, NT);
    static_for<0, L.halves>([&](auto hc) {
      constexpr int h = decltype(hc)::value;
      __m512i dot[MR][NT];
      for (int m = 0; m < MR; ++m)
        for (int t = 0; t < NT; ++t) dot[m][t] = _mm512_setzero_si512();
      static_for<h * per_half, (h + 1) * per_half>([&](auto ic) {
        constexpr int i = decltype(ic)::value;
        __m512i lo[NT], hi[NT];
        for (int t = 0; t < NT; ++t) {
          if constexpr (L.lines == 8)
            prefetch<_MM_HINT_T0>(grp + t * stride + 64 * i + 8 * L.group_bytes());
          vnni_line<T, i>(grp + t * stride, lo[t], hi[t]);
        }
        for (int m = 0; m < MR; ++m) {
          if constexpr (L.lines == 8) {
            const __m512i xv = _mm512_set1_epi32(xw[m][i]);
            for (int t = 0; t < NT; ++t) dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], lo[t], xv);
          } else {
            const __m512i xl = _mm512_set1_epi32(xw[m][2 * i]), xh = _mm512_set1_epi32(xw[m][2 * i + 1]);
            for (int t = 0; t < NT; ++t) {
              dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], lo[t], xl);
              dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], hi[t], xh);
            }
          }
        }
      });
      for (int t = 0; t < NT; ++t) {
        __m512 d, c;
        vnni_scales<T>(rec + t * stride, g, h, d, c);
        for (int p = 0; p < MR / 2; ++p) {
          const int64_t x1 = (r0 + 2 * p) * a.KB + b, x2 = x1 + a.KB;
          acc[p][t] = scale_pair<T, false, Zmm>(dot[2 * p][t], dot[2 * p + 1][t], a.dx[x2], d, c,
                                                offset_sum<T>(a, x1, h) + offset_sum<T>(a, x2, h), acc[p][t]);
        }
      }
    });
  }
  for (int t = 0; t < NT; ++t) {
    for (int p = 0; p < MR / 2; ++p) {
      alignas(64) float sum[kTileRows];
      _mm512_store_ps(sum, acc[p][t]);
      store_row(a, r0 / 2 + p, (t0 + t) * kTileRows, sum);
    }
  }
}

using BlockFn = void (*)(const QArgs&, int64_t, int64_t);

// NT = 4 only for a lone row pair (tiles_per_group): no block of more rows is built with 4 tiles.
template <int T, int MR>
constexpr BlockFn block_fn(int nt) {
  if (nt == 4) {
    if constexpr (MR == 2) return &vnni_block<T, MR, 4>;
    else return nullptr;
  }
  return nt == 2 ? &vnni_block<T, MR, 2> : &vnni_block<T, MR, 1>;
}

// MR = 2 (P + 1): row pairs.
template <int T, int... P>
BlockFn pick(int64_t rows, int nt, std::integer_sequence<int, P...>) {
  static constexpr BlockFn table[][3] = {
      {block_fn<T, 2 * (P + 1)>(1), block_fn<T, 2 * (P + 1)>(2), block_fn<T, 2 * (P + 1)>(4)}...};
  return table[rows / 2 - 1][nt == 4 ? 2 : nt - 1];
}

template <int T>
void tile_group_vnni(const QArgs& a, int64_t t0, int nt) {
  for (int64_t r0 = 0; r0 < a.M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, a.M - r0);
    pick<T>(rows, nt, std::make_integer_sequence<int, kMaxRows / 2>{})(a, r0, t0);
  }
}

#endif

#if defined(PYENGINE_QLINEAR_AMX)

// AMX (tdpbsud: signed activation bytes x unsigned weight bytes), for M >= 16 int8 rows: 16 rows (8
// rows of x, each with its residual) x one tile per pass, one dot product per 32-value group (Q6_K:
// per 16-value half, k values):
//   A (tmm0 / tmm3): 16 rows x k bytes of xq, where they lie (stride K)
//   B (tmm1 / tmm4): k / 4 rows x 64 bytes, row q = k 4q .. 4q + 3 of the tile's 16 rows: the group's
//       lines unpacked to bytes (vnni_line: line i's low nibbles in row 2i, high in 2i + 1), once per
//       tile for all its row blocks; Q8_0's lines are B rows where they lie
//   C (tmm2 / tmm5): 16 rows x 16 int32, stored for the vector units to scale: per row pair (a row of x
//       and its residual) acc += d * (dx1 C1 + dx2 C2) + c * (s1 + s2)
// The two tile sets alternate between groups: the next group's dot product is issued before this one's
// scaling, so the tile unit runs while the vector units scale. The scaling (a store and reload of C per
// group) bounds it: faster than the vnni path on the 4-bit types, level on Q8_0 (docs/performance.md,
// "quantized linear").

// C[16][16] = A . B on tile set S (the tile numbers must be literals).
template <int S>
inline void amx_dot(const int8_t* x, int64_t x_stride, const uint8_t* w, int32_t* c) {
  if constexpr (S == 0) {
    _tile_loadd(0, x, x_stride);
    _tile_loadd(1, w, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c, 64);
  } else {
    _tile_loadd(3, x, x_stride);
    _tile_loadd(4, w, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 3, 4);
    _tile_stored(5, c, 64);
  }
}

// Rows [r0, r0 + 16) x one tile; `unpacked`: its groups' B rows (512 bytes a group), unused for Q8_0.
template <int T>
void amx_block(const QArgs& a, int64_t r0, int64_t tile, const uint8_t* unpacked) {
  constexpr Layout L = layout(T);
  constexpr int k = kBlock / L.halves;
  const uint8_t* w = a.w + tile * tile_stride(L, a.KB);
  __m512 acc[kAmxRows / 2];
  for (auto& v : acc) v = _mm512_setzero_ps();
  alignas(64) int32_t c[2][kAmxRows][kTileRows];
  // step j = (group, half): its dot product on tile set j % 2, scaled after the next step's is issued
  const int64_t steps = a.KB * L.halves;
  auto dot = [&](int64_t j) {
    const int64_t b = j / L.halves, g = b % L.groups();
    const int h = static_cast<int>(j % L.halves);
    const uint8_t* rec = w + b / L.groups() * L.record_bytes();
    const int8_t* x = a.xq + r0 * a.K + b * kBlock + h * k;
    const uint8_t* bw = (L.lines == 8 ? rec + g * L.group_bytes() : unpacked + b * 512) + h * 512 / L.halves;
    if (j % 2 == 0) amx_dot<0>(x, a.K, bw, c[0][0]);
    else amx_dot<1>(x, a.K, bw, c[1][0]);
  };
  dot(0);
  for (int64_t j = 0; j < steps; ++j) {
    if (j + 1 < steps) dot(j + 1);
    const int64_t b = j / L.halves, g = b % L.groups();
    const int h = static_cast<int>(j % L.halves), set = static_cast<int>(j % 2);
    __m512 d, off;
    vnni_scales<T>(w + b / L.groups() * L.record_bytes(), g, h, d, off);
    for (int p = 0; p < kAmxRows / 2; ++p) {
      const int64_t x1 = (r0 + 2 * p) * a.KB + b, x2 = x1 + a.KB;
      acc[p] = scale_pair<T, false, Zmm>(_mm512_load_si512(c[set][2 * p]), _mm512_load_si512(c[set][2 * p + 1]),
                                         a.dx[x2], d, off, offset_sum<T>(a, x1, h) + offset_sum<T>(a, x2, h), acc[p]);
    }
  }
  for (int p = 0; p < kAmxRows / 2; ++p) {
    alignas(64) float sum[kTileRows];
    _mm512_store_ps(sum, acc[p]);
    store_row(a, r0 / 2 + p, tile * kTileRows, sum);
  }
}

// Tiles [begin, end) for a.M, a multiple of 16 rows.
template <int T>
void tile_range_amx(const QArgs& a, int64_t begin, int64_t end) {
  constexpr Layout L = layout(T);
  struct alignas(64) Row {
    uint8_t bytes[64];
  };
  static thread_local std::vector<Row> unpacked;  // a tile's B rows, 8 a group
  if (L.lines != 8) unpacked.resize(static_cast<size_t>(8 * a.KB));
  uint8_t* u = reinterpret_cast<uint8_t*>(unpacked.data());
  configure_int8_tile_sets<T>();
  for (int64_t tile = begin; tile < end; ++tile) {
    if constexpr (L.lines != 8) {
      const uint8_t* w = a.w + tile * tile_stride(L, a.KB);
      for (int64_t b = 0; b < a.KB; ++b) {
        const uint8_t* grp = w + b / L.groups() * L.record_bytes() + b % L.groups() * L.group_bytes();
        static_for<0, L.lines>([&](auto ic) {
          constexpr int i = decltype(ic)::value;
          __m512i lo, hi;
          vnni_line<T, i>(grp, lo, hi);
          _mm512_store_si512(u + 512 * b + 128 * i, lo);
          _mm512_store_si512(u + 512 * b + 128 * i + 64, hi);
        });
      }
    }
    for (int64_t r0 = 0; r0 < a.M; r0 += kAmxRows) amx_block<T>(a, r0, tile, u);
  }
  _tile_release();
}

#endif

#if defined(PYENGINE_QLINEAR_AVX2)

// shift16 for ymm.
template <int S>
inline __m256i shift16(__m256i v) {
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

// As vnni_line, for rows 8r .. 8r + 7 of the tile (bytes 32r .. 32r + 31 of each line); Q8_0's bytes
// come back signed (q), as do the IQ4 types' levels.
template <int T, int I>
inline void avx2_line(const uint8_t* grp, int r, __m256i& lo, __m256i& hi) {
  constexpr Layout L = layout(T);
  const uint8_t* line = grp + 64 * (L.bits == 2 ? I / 2 : I) + 32 * r;
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  if constexpr (L.lines == 8) {
    lo = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
    return;
  }
  constexpr int at = L.bits == 2 ? 4 * (I % 2) : 0;
  const __m256i mask = _mm256_set1_epi8((1 << L.bits) - 1);
  lo = _mm256_and_si256(shift16<-at>(raw), mask);
  hi = _mm256_and_si256(shift16<-at - L.bits>(raw), mask);
  if constexpr (L.lookup) {  // the signed levels
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ggml::kIq4nl)));
    lo = _mm256_shuffle_epi8(table, lo);
    hi = _mm256_shuffle_epi8(table, hi);
  } else if constexpr (L.high_lines == 1) {
    const __m256i top = _mm256_set1_epi8(1 << L.bits);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * L.bits + 32 * r));
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16<L.bits - 2 * I>(hb), top));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16<L.bits - 1 - 2 * I>(hb), top));
  } else if constexpr (L.high_lines == 2) {
    constexpr int p = 4 * (I % 2);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 256 + 64 * (I / 2) + 32 * r));
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16<4 - p>(hb), bits45));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16<2 - p>(hb), bits45));
  }
}

// vec_scales' vector: 8 rows of a tile.
struct Ymm {
  using F = __m256;
  using I = __m256i;
  static F f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static F u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(p))); }
  static F u4(const uint8_t* p, bool high) {
    const __m256i b = _mm256_cvtepu8_epi32(bytes(p));
    return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
  }
  static F i8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(p))); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static I join(I hi, I lo) { return _mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
};

// As vnni_scales, for rows 8r .. 8r + 7; Q8_0's and the IQ4 types' values signed (avx2_line).
template <int T>
inline void avx2_scales(const uint8_t* rec, int64_t g, int h, int r, __m256& d, __m256& c) {
  vec_scales<T, Ymm, true>(rec, g, h, 8 * r, d, c);
}

// Int8 rows [r0, r0 + MR) x one tile, for calls of fewer than kJoinedMinRows rows of x. vpmaddubsw sums
// two u8 x s8 products in int16: at most 2 * 63 * 127 per nibble line (a low and a high line's pairs
// added: 32004 for Q6_K) fits; Q8_0 runs on |q| and sign(q) x (2 * 128 * 127), as llama.cpp does, and so
// do the IQ4 types' signed levels.
// Not inlined: inlined into tile_range with its prefetch, it changed GCC's code for the joined kernel
// there (slower).
template <int T, int MR>
__attribute__((noinline)) void avx2_pair_block(const QArgs& a, int64_t r0, int64_t tile) {
  constexpr Layout L = layout(T);
  constexpr int per_half = L.lines / L.halves;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR / 2][2];  // per row pair (a row of x and its residual) and 8-row half of the tile
  for (auto& pair : acc) pair[0] = pair[1] = _mm256_setzero_ps();
  const int64_t stride = tile_stride(L, a.KB);
  const uint8_t* w = a.w + tile * stride;
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b % L.groups();
    const uint8_t* rec = w + b / L.groups() * L.record_bytes();
    const uint8_t* grp = rec + g * L.group_bytes();
    const int32_t* xw[MR];
    for (int m = 0; m < MR; ++m) xw[m] = reinterpret_cast<const int32_t*>(a.xq + (r0 + m) * a.K + b * kBlock);
    prefetch_ahead<T>(w + b * L.record_bytes() / L.groups(), stride, 1);
    static_for<0, L.halves>([&](auto hc) {
      constexpr int h = decltype(hc)::value;
      __m256i dot[MR][2];
      for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
      static_for<h * per_half, (h + 1) * per_half>([&](auto ic) {
        constexpr int i = decltype(ic)::value;
        for (int r = 0; r < 2; ++r) {
          __m256i lo, hi;
          avx2_line<T, i>(grp, r, lo, hi);
          for (int m = 0; m < MR; ++m) {
            __m256i pairs;
            if constexpr (L.lines == 8) {
              const __m256i xv = _mm256_set1_epi32(xw[m][i]);
              pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xv, lo));
            } else if constexpr (L.lookup) {  // two signed lines: each pair sum up to 2 * 127 * 127 alone
              const __m256i xl = _mm256_set1_epi32(xw[m][2 * i]), xh = _mm256_set1_epi32(xw[m][2 * i + 1]);
              dot[m][r] = _mm256_add_epi32(
                  dot[m][r], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo)), ones));
              pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi));
            } else {
              pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xw[m][2 * i])),
                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xw[m][2 * i + 1])));
            }
            dot[m][r] = _mm256_add_epi32(dot[m][r], _mm256_madd_epi16(pairs, ones));
          }
        }
      });
      for (int r = 0; r < 2; ++r) {
        __m256 d, c;
        avx2_scales<T>(rec, g, h, r, d, c);
        for (int p = 0; p < MR / 2; ++p) {
          const int64_t x1 = (r0 + 2 * p) * a.KB + b, x2 = x1 + a.KB;
          acc[p][r] = scale_pair<T, true, Ymm>(dot[2 * p][r], dot[2 * p + 1][r], a.dx[x2], d, c,
                                               offset_sum<T>(a, x1, h) + offset_sum<T>(a, x2, h), acc[p][r]);
        }
      }
    });
  }
  for (int p = 0; p < MR / 2; ++p) {
    float sum[kTileRows];
    _mm256_storeu_ps(sum, acc[p][0]);
    _mm256_storeu_ps(sum + 8, acc[p][1]);
    store_row(a, r0 / 2 + p, tile * kTileRows, sum);
  }
}

// The low and high byte of each 16-bit lane of `bytes` as int16 (Signed: the bytes are int8): a line's
// values k0 + t for even t, and for odd t.
template <bool Signed>
inline void split_bytes(__m256i bytes, __m256i& even, __m256i& odd) {
  if constexpr (Signed) {
    even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
    odd = _mm256_srai_epi16(bytes, 8);
  } else {
    even = _mm256_and_si256(bytes, _mm256_set1_epi16(0xFF));
    odd = _mm256_srli_epi16(bytes, 8);
  }
}

// Rows [x0, x0 + MX) of x x one tile, on the joined int16 activations (quantize_row_avx2: row x's pair
// of int8 rows as 256 q1 + q2, each 4 values in the order 0, 2, 1, 3). A line's bytes (row j's k0 + t
// at byte 4j + t) split into their even and odd bytes as int16; vpmaddwd against the broadcast words
// (x[k0], x[k0 + 2]) and (x[k0 + 1], x[k0 + 3]) then leaves row j's sum over the four k in lane j. So
// one vpmaddwd does 16 of x's products where the int8 pair took two vpmaddubsw and two vpmaddwd for 32
// (on some AVX2 cores all of them issue on one pipe), and the int32 sum is 256 dot1 + dot2 exactly: scale_joined
// does the vnni path's float operations on it. |w| <= 128 and |x| <= 256 * 127 + 127 keep a group's
// sum of 32 products within int32. One 8-row half of the tile at a time (r), 4 rows of x per pass: both
// halves at once, each broadcast serving two products, ran out of registers (slower); 2 or 3 rows of
// x per pass ran as 4.
template <int T, int MX>
void avx2_joined_half(const QArgs& a, int64_t x0, int64_t tile, int r, float (*sum)[kTileRows]) {
  constexpr Layout L = layout(T);
  constexpr bool Signed = L.lines == 8 || L.lookup;
  constexpr int per_half = L.lines / L.halves;
  __m256 acc[MX];
  for (auto& v : acc) v = _mm256_setzero_ps();
  const int64_t stride = tile_stride(L, a.KB);
  const uint8_t* w = a.w + tile * stride;
  const int32_t* xw[MX];  // the joined values' words (2 values each)
  for (int m = 0; m < MX; ++m) xw[m] = reinterpret_cast<const int32_t*>(a.xq + 2 * (x0 + m) * a.K);
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b % L.groups();
    const uint8_t* rec = w + b / L.groups() * L.record_bytes();
    const uint8_t* grp = rec + g * L.group_bytes();
    static_for<0, L.halves>([&](auto hc) {
      constexpr int h = decltype(hc)::value;
      __m256i dot[MX];
      for (auto& v : dot) v = _mm256_setzero_si256();
      // `bytes`: k0 + t at byte 4j + t, k0 = 2 word
      auto add_line = [&](__m256i bytes, int64_t word) {
        __m256i even, odd;
        split_bytes<Signed>(bytes, even, odd);
        for (int m = 0; m < MX; ++m) {
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(even, _mm256_set1_epi32(xw[m][word])));
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(odd, _mm256_set1_epi32(xw[m][word + 1])));
          // the sum in a register here: else GCC reassociates the adds, keeps every product on the stack
          // and sums them at the group's end (slower)
          asm("" : "+x"(dot[m]));
        }
      };
      static_for<h * per_half, (h + 1) * per_half>([&](auto ic) {
        constexpr int i = decltype(ic)::value;
        __m256i lo, hi;
        avx2_line<T, i>(grp, r, lo, hi);
        if constexpr (L.lines == 8) {  // k = 4i .. 4i + 3
          add_line(lo, 16 * b + 2 * i);
        } else {  // lo: k = 8i .. 8i + 3, hi: 8i + 4 .. 8i + 7
          add_line(lo, 16 * b + 4 * i);
          add_line(hi, 16 * b + 4 * i + 2);
        }
      });
      __m256 d, c;
      avx2_scales<T>(rec, g, h, r, d, c);
      for (int m = 0; m < MX; ++m) {
        const int64_t x1 = 2 * (x0 + m) * a.KB + b, x2 = x1 + a.KB;
        acc[m] = scale_joined<T, true, Ymm>(dot[m], a.dx[x2], d, c, offset_sum<T>(a, x1, h) + offset_sum<T>(a, x2, h),
                                            acc[m]);
      }
    });
  }
  for (int m = 0; m < MX; ++m) _mm256_storeu_ps(sum[m] + 8 * r, acc[m]);
}

template <int T, int MX>
void avx2_joined_block(const QArgs& a, int64_t x0, int64_t tile) {
  float sum[MX][kTileRows];
  for (int r = 0; r < 2; ++r) avx2_joined_half<T, MX>(a, x0, tile, r, sum);
  for (int m = 0; m < MX; ++m) store_row(a, x0 + m, tile * kTileRows, sum[m]);
}

template <int T>
void tile_group_avx2(const QArgs& a, int64_t t0, int nt) {
  for (int64_t tile = t0; tile < t0 + nt; ++tile) {
    if (!a.joined) {
      int64_t r0 = 0;
      for (; r0 + 4 <= a.M; r0 += 4) avx2_pair_block<T, 4>(a, r0, tile);
      if (r0 < a.M) avx2_pair_block<T, 2>(a, r0, tile);
      continue;
    }
    const int64_t rows = a.M / 2;
    int64_t x0 = 0;
    for (; x0 + 4 <= rows; x0 += 4) avx2_joined_block<T, 4>(a, x0, tile);
    switch (rows - x0) {
      case 3: avx2_joined_block<T, 3>(a, x0, tile); break;
      case 2: avx2_joined_block<T, 2>(a, x0, tile); break;
      case 1: avx2_joined_block<T, 1>(a, x0, tile); break;
      default: break;
    }
  }
}

#endif

// Tiles per vnni_block pass for `rows` int8 rows (MR): each broadcast activation word feeds NT tiles, each
// weight line MR rows. MR x NT dot products + MR / 2 x NT accumulators stay within the 32 zmm registers
// (MR = 8, NT = 2: 16 + 8). NT = 2 from 3 int8 rows: faster than 1 at every M from 16 up, the same at
// M = 1 (docs/performance.md, "quantized linear").
inline int tiles_per_group(int64_t rows) { return rows <= 2 ? 4 : 2; }

template <int T>
void tile_range(const QArgs& all, int64_t begin, int64_t end, int isa) {
  QArgs a = all;
#if defined(PYENGINE_QLINEAR_AMX)
  if (isa == kAmx) {  // whole 16-row blocks on AMX, the rows after them on the vnni path
    const int64_t rows = a.M / kAmxRows * kAmxRows;
    if (rows > 0) tile_range_amx<T>(a.rows_from(0, rows), begin, end);
    if (rows == a.M) return;
    a = a.rows_from(rows, a.M - rows);
    isa = kVnni;
  }
#endif
  const int group = tiles_per_group(std::min(a.M, kMaxRows));
  int64_t t = begin;
  for (int nt = group; nt >= 1; nt /= 2) {
    for (; t + nt <= end; t += nt) {
#if defined(PYENGINE_QLINEAR_VNNI)
      if (isa >= kVnni) {
        tile_group_vnni<T>(a, t, nt);
        continue;
      }
#endif
#if defined(PYENGINE_QLINEAR_AVX2)
      if (isa == kAvx2) {
        tile_group_avx2<T>(a, t, nt);
        continue;
      }
#endif
      tile_group_scalar<T>(a, t, nt);
    }
  }
}

// One row of x (bf16 or fp32) -> two rows of int8 blocks, their scales and scaled sums (of the block,
// and of its two 16-value halves): the value (x ~ d1 q1, d1 = amax / 127) and its residual
// (x - d1 q1 ~ d2 q2, d2 = d1 / 256, q2 clamped to +-127: the residual is within d1 / 2, so only a
// rounding tie reaches 128), so x ~ d1 q1 + d2 q2 to about 15 bits. d2 a power of two below d1 lets
// the kernels join the two rows' dot products in int32 (scale_pair). One int8 level alone (as llama.cpp's q8
// activations) cost top-1 agreement on the default model against fp32 (tests/test_quant_model.py;
// docs/performance.md, "quantized linear"); the residual row reuses every weight line the first row loads, so
// decode (bound by the weight stream) barely pays for it.
// Each SIMD path does the scalar loop's float operations in its order (q = nearbyint(v / d) as v * (1 / d),
// round to nearest even; the residual v - d q): the same bits on every path. The scalar loop alone was
// a visible share of a batch-1 decode step.
struct QuantRow {
  int8_t* xq;  // [2, K]
  float *dx, *sx, *sh;  // [2, KB], [2, KB], [2, 2 KB]
  int64_t K, KB;
  bool joined;  // the avx2 path from kJoinedMinRows rows: xq's two rows stored joined (quantize_row_avx2)

  // Level `level` of block b: its scale d, and the sums of q over the block's two halves.
  void put(int level, int64_t b, float d, int32_t sum0, int32_t sum1) const {
    const int64_t i = level * KB + b;
    dx[i] = d;
    sx[i] = d * static_cast<float>(sum0 + sum1);
    sh[2 * i] = d * static_cast<float>(sum0);
    sh[2 * i + 1] = d * static_cast<float>(sum1);
  }
};

constexpr float kResidualStep = 1.0f / 256.0f;  // d2 / d1
constexpr int32_t kQMax = 127;

// A level's scale d -> the multiplier that rounds values to its codes (0 for an all-zero block).
inline float inverse_of(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

template <class Load>
void quantize_row_scalar(Load load, const QuantRow& r) {
  for (int64_t b = 0; b < r.KB; ++b) {
    float v[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) v[i] = load(b * kBlock + i);
    float d = 0.0f;  // the level's scale: d1 = amax / 127, then d2 = d1 / 256
    for (int level = 0; level < 2; ++level) {
      if (level == 0) {
        float amax = 0.0f;
        for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
        d = amax / 127.0f;
      } else {
        d *= kResidualStep;
      }
      const float id = inverse_of(d);
      int8_t* q = r.xq + level * r.K + b * kBlock;
      int32_t sum[2] = {0, 0};
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t qi = std::clamp(static_cast<int32_t>(std::nearbyint(v[i] * id)), -kQMax, kQMax);
        q[i] = static_cast<int8_t>(qi);
        sum[i / 16] += qi;
        v[i] -= d * static_cast<float>(qi);  // the residual, for level 1
      }
      r.put(level, b, d, sum[0], sum[1]);
    }
  }
}

#if defined(PYENGINE_QLINEAR_VNNI)
// Blocks of 32 values, two zmm each (one per half), 16 blocks at a time: each level's maxima and the
// sums of q are reduced for all 16 at once (hmax16, hsum16), and its scales take one vector division.
// One block at a time, each of those reductions and divisions was a serial chain of its own (about
// 100 cycles a block). The sums of q add
// whole numbers below 2^24 in fp32, so they are exact; the scales are the scalar loop's divisions.
void quantize_row_avx512(const void* x, bool f32, const QuantRow& r) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < r.KB; b0 += 16) {
    const int nb = static_cast<int>(std::min<int64_t>(16, r.KB - b0));
    const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1);
    __m512 v[16][2];
    for (int j = 0; j < nb; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t at = (b0 + j) * kBlock + 16 * h;
        v[j][h] = f32 ? _mm512_loadu_ps(static_cast<const float*>(x) + at)
                      : load_bf16x16(static_cast<const uint16_t*>(x) + at);
      }
    __m512 d = zero;  // the level's scales, lane j = block j: d1 = amax / 127, then d2 = d1 / 256
    const __m512i qmax = _mm512_set1_epi32(kQMax), qmin = _mm512_set1_epi32(-kQMax);
    for (int level = 0; level < 2; ++level) {
      __m512 sums[2][16];  // sums[h][j]: block j's q in half h, as floats
      if (level == 0) {
        __m512 m[16];
        for (int j = 0; j < 16; ++j)
          m[j] = j < nb ? _mm512_max_ps(_mm512_abs_ps(v[j][0]), _mm512_abs_ps(v[j][1])) : zero;
        d = _mm512_div_ps(hmax16(m), _mm512_set1_ps(127.0f));
      } else {
        d = _mm512_mul_ps(d, _mm512_set1_ps(kResidualStep));
      }
      const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), d);
      alignas(64) float ds[16], ids[16];
      _mm512_store_ps(ds, d);
      _mm512_store_ps(ids, id);
      for (int j = 0; j < 16; ++j) {
        if (j >= nb) {
          sums[0][j] = sums[1][j] = zero;
          continue;
        }
        for (int h = 0; h < 2; ++h) {
          const __m512i q = _mm512_max_epi32(
              qmin, _mm512_min_epi32(qmax, _mm512_cvtps_epi32(_mm512_mul_ps(v[j][h], _mm512_set1_ps(ids[j])))));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.xq + level * r.K + (b0 + j) * kBlock + 16 * h),
                           _mm512_cvtepi32_epi8(q));
          sums[h][j] = _mm512_cvtepi32_ps(q);
          v[j][h] = _mm512_sub_ps(v[j][h], _mm512_mul_ps(_mm512_set1_ps(ds[j]), sums[h][j]));
        }
      }
      // QuantRow::put for the 16 blocks: dx = d, sx = d (sum0 + sum1), sh = (d sum0, d sum1) per block
      const __m512 n0 = hsum16(sums[0]), n1 = hsum16(sums[1]);
      const __m512 sum0 = _mm512_mul_ps(d, n0), sum1 = _mm512_mul_ps(d, n1);
      const int64_t i = level * r.KB + b0;
      _mm512_mask_storeu_ps(r.dx + i, live, d);
      _mm512_mask_storeu_ps(r.sx + i, live, _mm512_mul_ps(d, _mm512_add_ps(n0, n1)));
      const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
      const uint32_t pairs = nb == 16 ? ~0u : (1u << 2 * nb) - 1;  // sh lanes in use: two per block
      _mm512_mask_storeu_ps(r.sh + 2 * i, static_cast<__mmask16>(pairs), _mm512_permutex2var_ps(sum0, lo, sum1));
      _mm512_mask_storeu_ps(r.sh + 2 * i + 16, static_cast<__mmask16>(pairs >> 16),
                            _mm512_permutex2var_ps(sum0, hi, sum1));
    }
  }
}
#endif

#if defined(PYENGINE_QLINEAR_AVX2)
// A block is four ymm of 8 values. r.joined: the two levels' codes are stored joined, for
// avx2_joined_half's vpmaddwd: 256 q1 + q2 as int16 (|q| <= 127: it fits) in the pair's 2K bytes, each
// 4 values in the order 0, 2, 1, 3. The scales and sums are the other paths' either way.
void quantize_row_avx2(const void* x, bool f32, const QuantRow& r) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < r.KB; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t at = b * kBlock + 8 * i;
      v[i] = f32 ? _mm256_loadu_ps(static_cast<const float*>(x) + at)
                 : _mm256_castsi256_ps(_mm256_slli_epi32(
                       _mm256_cvtepu16_epi32(_mm_loadu_si128(
                           reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + at))), 16));
    }
    float d = 0.0f;  // the level's scale: d1 = amax / 127, then d2 = d1 / 256
    __m256i joined[4];
    for (int level = 0; level < 2; ++level) {
      if (level == 0)
        d = hmax256(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)))) /
            127.0f;
      else
        d *= kResidualStep;
      const float id = inverse_of(d);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_max_epi32(_mm256_set1_epi32(-kQMax), _mm256_min_epi32(_mm256_set1_epi32(kQMax),
                   _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)))));
        v[i] = _mm256_sub_ps(v[i], _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q[i])));
        if (r.joined) joined[i] = level == 0 ? _mm256_slli_epi32(q[i], 8) : _mm256_add_epi32(joined[i], q[i]);
      }
      if (!r.joined) {  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.xq + level * r.K + b * kBlock), packed);
      }
      int32_t sum[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        sum[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
      }
      r.put(level, b, d, sum[0], sum[1]);
    }
    if (!r.joined) continue;
    // 4 values 0, 2, 1, 3 in each 128-bit lane; the pack interleaves the lanes of its two sources,
    // the permute puts them back
    for (int i = 0; i < 4; i += 2) {
      const __m256i lo = _mm256_shuffle_epi32(joined[i], _MM_SHUFFLE(3, 1, 2, 0));
      const __m256i hi = _mm256_shuffle_epi32(joined[i + 1], _MM_SHUFFLE(3, 1, 2, 0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.xq) + 2 * b + i / 2,
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0)));
    }
  }
}
#endif

// Row x (fp32 or bf16, K values) on the SIMD path `isa`.
void quantize_row(const void* x, bool f32, int isa, const QuantRow& r) {
#if defined(PYENGINE_QLINEAR_VNNI)
  if (isa >= kVnni) return quantize_row_avx512(x, f32, r);
#endif
#if defined(PYENGINE_QLINEAR_AVX2)
  if (isa == kAvx2) return quantize_row_avx2(x, f32, r);
#endif
  if (f32) quantize_row_scalar([&](int64_t i) { return static_cast<const float*>(x)[i]; }, r);
  else quantize_row_scalar([&](int64_t i) { return bf16_to_float(static_cast<const uint16_t*>(x)[i]); }, r);
}

void check_type(int type, const char* who) {
  if (!ggml::supported(type))
    throw std::invalid_argument(std::string(who) + ": GGML type " + std::to_string(type) +
                                " has no native kernel (supported: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, "
                                "Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, "
                                "IQ4_XS = 23)");
}

void check_k(int type, int64_t K, const char* who) {
  const int64_t values = layout(type).values;
  if (K <= 0 || K % values)
    throw std::invalid_argument(std::string(who) + ": K = " + std::to_string(K) + " is not a positive multiple of " +
                                std::to_string(values) + " (GGML type " + std::to_string(type) + ")");
}

// One GGUF block of row j -> its unsigned values u[values], and its scale fields into the record's
// scales `s` (ggml_blocks.h).
void unpack_block(int type, const uint8_t* blk, int64_t j, uint8_t* u, uint8_t* s) {
  auto f16 = [&](int64_t field, const uint8_t* from) { std::memcpy(s + field + 2 * j, from, 2); };
  auto nibbles = [&](const uint8_t* qs) {
    for (int64_t k = 0; k < 32; ++k) u[k] = k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4;
  };
  auto fifth_bits = [&](const uint8_t* qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    for (int64_t k = 0; k < 32; ++k) u[k] |= ((bits >> k) & 1) << 4;
  };
  switch (type) {
    case ggml::kQ8_0:
      f16(0, blk);
      for (int64_t k = 0; k < 32; ++k) u[k] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + k]) + 128);
      break;
    case ggml::kQ4_0: f16(0, blk); nibbles(blk + 2); break;
    case ggml::kQ4_1: f16(0, blk); f16(32, blk + 2); nibbles(blk + 4); break;
    case ggml::kQ5_0: f16(0, blk); nibbles(blk + 6); fifth_bits(blk + 2); break;
    case ggml::kQ5_1: f16(0, blk); f16(32, blk + 2); nibbles(blk + 8); fifth_bits(blk + 4); break;
    case ggml::kIQ4_NL: f16(0, blk); nibbles(blk + 2); break;
    case ggml::kIQ4_XS: {
      f16(0, blk);
      const int high = blk[2] | blk[3] << 8;  // scales_h: 2 bits a sub-block
      for (int64_t g = 0; g < 8; ++g) {
        const int ls = ((blk[4 + g / 2] >> (4 * (g % 2))) & 0x0F) | ((high >> (2 * g)) & 3) << 4;
        s[32 + 16 * g + j] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
        for (int64_t k = 0; k < 32; ++k) {
          const uint8_t byte = blk[8 + 16 * g + k % 16];
          u[32 * g + k] = k < 16 ? byte & 0x0F : byte >> 4;
        }
      }
      break;
    }
    case ggml::kQ4_K:
    case ggml::kQ5_K: {
      f16(0, blk);
      f16(32, blk + 2);
      const uint8_t* q = blk + 4;  // the 12 bytes of 6-bit (sc, m) pairs
      for (int64_t g = 0; g < 8; ++g) {
        s[64 + 16 * g + j] = g < 4 ? q[g] & 63 : (q[g + 4] & 0x0F) | ((q[g - 4] >> 6) << 4);
        s[192 + 16 * g + j] = g < 4 ? q[g + 4] & 63 : (q[g + 4] >> 4) | ((q[g] >> 6) << 4);
      }
      const bool q5 = type == ggml::kQ5_K;
      const uint8_t* qs = blk + (q5 ? 48 : 16);
      for (int64_t g = 0; g < 8; ++g)
        for (int64_t l = 0; l < 32; ++l) {
          const uint8_t byte = qs[32 * (g / 2) + l];
          u[32 * g + l] = static_cast<uint8_t>((g % 2 ? byte >> 4 : byte & 0x0F) | (q5 ? ((blk[16 + l] >> g) & 1) << 4 : 0));
        }
      break;
    }
    case ggml::kQ2_K:
    case ggml::kQ3_K: {  // value 128 n + 32 i + l: bits 2i, 2i + 1 of qs[32 n + l]; Q3_K: bit 4n + i of hmask[l]
      const bool q3 = type == ggml::kQ3_K;
      const uint8_t* qs = blk + (q3 ? 32 : 16);
      for (int64_t v = 0; v < 256; ++v) {
        const int64_t n = v / 128, i = v / 32 % 4, l = v % 32;
        u[v] = static_cast<uint8_t>((qs[32 * n + l] >> (2 * i)) & 3);
        if (q3) u[v] |= static_cast<uint8_t>(((blk[l] >> (4 * n + i)) & 1) << 2);
      }
      if (!q3) {
        f16(0, blk + 80);
        f16(32, blk + 82);
        for (int64_t sub = 0; sub < 16; ++sub) s[64 + 16 * sub + j] = blk[sub];
        break;
      }
      f16(0, blk + 108);
      const uint8_t* sc = blk + 96;  // sixteen 6-bit scales: low nibbles in bytes 0-7, top bits in bytes 8-11
      for (int64_t sub = 0; sub < 16; ++sub) {
        const int low = sub < 8 ? sc[sub] & 0x0F : sc[sub - 8] >> 4;
        const int ls = low | ((sc[8 + sub % 4] >> (2 * (sub / 4))) & 3) << 4;
        s[32 + 16 * sub + j] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
      }
      break;
    }
    case ggml::kQ6_K: {
      f16(0, blk + 208);
      for (int64_t sub = 0; sub < 16; ++sub) s[32 + 16 * sub + j] = blk[192 + sub];
      for (int64_t n = 0; n < 2; ++n) {
        const uint8_t* ql = blk + 64 * n;
        const uint8_t* qh = blk + 128 + 32 * n;
        uint8_t* y = u + 128 * n;
        for (int64_t l = 0; l < 32; ++l) {
          y[l] = static_cast<uint8_t>((ql[l] & 0x0F) | (qh[l] & 3) << 4);
          y[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4);
          y[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
          y[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
      }
    }
  }
}

// Row j's 32 values u of one group into the group's lines (ggml_blocks.h).
void pack_group(const Layout& L, const uint8_t* u, int64_t j, uint8_t* grp) {
  if (L.lines == 8) {
    for (int64_t k = 0; k < 32; ++k) grp[64 * (k / 4) + 4 * j + k % 4] = u[k];
    return;
  }
  const int mask = (1 << L.bits) - 1;
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t t = 0; t < 4; ++t) {
      const int lo = u[8 * i + t], hi = u[8 * i + 4 + t];
      const int at = L.bits == 2 ? 4 * (i % 2) : 0;  // 2-bit types: two lines a stored line
      grp[64 * (L.bits == 2 ? i / 2 : i) + 4 * j + t] |=
          static_cast<uint8_t>(((lo & mask) | (hi & mask) << L.bits) << at);
      if (L.high_lines == 1)
        grp[64 * L.bits + 4 * j + t] |=
            static_cast<uint8_t>(((lo >> L.bits) & 1) << (2 * i) | ((hi >> L.bits) & 1) << (2 * i + 1));
      if (L.high_lines == 2)
        grp[256 + 64 * (i / 2) + 4 * j + t] |=
            static_cast<uint8_t>(((lo >> 4) & 3) << (4 * (i % 2)) | ((hi >> 4) & 3) << (4 * (i % 2) + 2));
    }
}

}  // namespace

void set_qlinear_isa(const std::string& name) {
  for (int isa = kScalar; isa <= kAmx; ++isa) {
    if (name == kIsaNames[isa] && isa_available(isa)) {
      g_isa.store(isa);
      return;
    }
  }
  throw std::invalid_argument("qlinear: SIMD path '" + name + "' is not in this build (have: " +
                              qlinear_isas() + ")");
}

std::string qlinear_isas() {
  std::string names;
  for (int isa = kScalar; isa <= kAmx; ++isa)
    if (isa_available(isa)) names += std::string(names.empty() ? "" : ",") + kIsaNames[isa];
  return names;
}

std::string qlinear_isa() { return kIsaNames[g_isa.load()]; }

std::string qlinear_path(int64_t M, int64_t K) {
  if (qlinear_strip_rows() > 0 && M >= qlinear_strip_rows() && linear_bf16_simd(K)) return "strips";
  return kIsaNames[g_isa.load()];
}

int64_t qpacked_bytes(int type, int64_t N, int64_t K) {
  check_type(type, "qpack");
  check_k(type, K, "qpack");
  return (N + kTileRows - 1) / kTileRows * tile_stride(layout(type), K / kBlock);
}

void qpack(int type, uintptr_t src, int64_t N, int64_t K, uintptr_t dst) {
  check_type(type, "qpack");
  check_k(type, K, "qpack");
  if (N <= 0) throw std::invalid_argument("qpack: need N > 0");
  const Layout L = layout(type);
  const int64_t nb = K / L.values, rb = L.record_bytes(), tiles = (N + kTileRows - 1) / kTileRows;
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src);
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  std::memset(out, 0, static_cast<size_t>(tiles * nb * rb));
  uint8_t u[256];
  for (int64_t n = 0; n < N; ++n) {
    const int64_t tile = n / kTileRows, j = n % kTileRows;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rec = out + (tile * nb + b) * rb;
      unpack_block(type, in + (n * nb + b) * L.block_bytes, j, u, rec + L.scales_offset());
      for (int64_t g = 0; g < L.groups(); ++g) pack_group(L, u + kBlock * g, j, rec + g * L.group_bytes());
    }
  }
}

void qlinear(uintptr_t x, int x_dtype, uintptr_t segments, uintptr_t bias, uintptr_t out, int64_t M, int64_t N,
             int64_t K, int out_dtype) {
  // segment table: count, then (GGML type, rows, tiled weight address) per row range
  const int64_t* seg = reinterpret_cast<const int64_t*>(segments);
  int64_t rows = 0;
  for (int64_t s = 0; s < seg[0]; ++s) {
    const int type = static_cast<int>(seg[1 + 3 * s]);
    check_type(type, "qlinear");
    check_k(type, K, "qlinear");
    rows += seg[2 + 3 * s];
  }
  if (M < 0 || N <= 0 || rows != N)
    throw std::invalid_argument("qlinear: need M >= 0 and N > 0 rows, all in the segment table's row ranges");
  const int f32 = static_cast<int>(DType::kFloat32), bf16 = static_cast<int>(DType::kBFloat16);
  if ((out_dtype != f32 && out_dtype != bf16) || (x_dtype != f32 && x_dtype != bf16))
    throw std::invalid_argument("qlinear: x and out dtypes must be fp32 or bf16");
  if (M == 0) return;
  if (x_dtype == bf16 && qlinear_strips(reinterpret_cast<const uint16_t*>(x), seg, reinterpret_cast<const float*>(bias),
                                        reinterpret_cast<void*>(out), M, N, K, out_dtype == f32))
    return;  // many rows: the weight dequantized a strip at a time for the bf16 kernel (linear/quant_strips.cpp)
  // The kernel runs on 2M int8 rows (each row of x, then its residual: quantize_row); each tile's
  // epilogue sums a row pair's results (+ bias) into out.
  const int64_t KB = K / kBlock, M2 = 2 * M;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> scales;
  xq.resize(static_cast<size_t>(M2 * K));
  scales.resize(static_cast<size_t>(4 * M2 * KB));
  int8_t* const xqb = xq.data();
  float* const dx = scales.data();
  float* const sx = dx + M2 * KB;
  float* const sh = sx + M2 * KB;
  const int isa = g_isa.load();
  const bool x_f32 = x_dtype == f32, out_f32 = out_dtype == f32, joined = isa == kAvx2 && M >= kJoinedMinRows;
  auto& pool = ThreadPool::instance();
  // Split by rows from a decode step's 16 x 576 up (~5 us on one thread, the helper otherwise idle): the
  // calling thread quantizes before every projection while the helpers wait for the tiles.
  const int64_t parts = M * K < kMinParallelQuant ? 1 : std::min<int64_t>(M, pool.num_threads());
  pool.parallel_for(parts, [&](int64_t c) {
    for (int64_t r = M * c / parts; r < M * (c + 1) / parts; ++r)
      quantize_row(reinterpret_cast<const char*>(x) + r * K * (x_f32 ? 4 : 2), x_f32, isa,
                   {xqb + 2 * r * K, dx + 2 * r * KB, sx + 2 * r * KB, sh + 4 * r * KB, K, KB, joined});
  });
  const int64_t panel = M2 > kPanelMinRows ? std::max<int64_t>(kAmxRows, kPanelBytes / K / kAmxRows * kAmxRows) : M2;
  const int64_t out_bytes = out_f32 ? 4 : 2;
  for (int64_t p0 = 0; p0 < M2; p0 += panel) {
    int64_t col = 0;
    for (int64_t s = 0; s < seg[0]; ++s) {
      const int type = static_cast<int>(seg[1 + 3 * s]);
      const int64_t n = seg[2 + 3 * s], tiles = (n + kTileRows - 1) / kTileRows;
      const int64_t bytes = tiles * tile_stride(layout(type), KB);
      const int64_t chunks = bytes < kMinParallelBytes ? 1 : std::min<int64_t>(tiles, pool.num_threads());
      const QArgs a{xqb + p0 * K, dx + p0 * KB, sx + p0 * KB, sh + 2 * p0 * KB,
                    reinterpret_cast<const uint8_t*>(seg[3 + 3 * s]),
                    reinterpret_cast<char*>(out) + (p0 / 2 * N + col) * out_bytes,
                    bias ? reinterpret_cast<const float*>(bias) + col : nullptr, out_f32,
                    std::min(panel, M2 - p0), n, K, KB, N, joined};
      dispatch(type, [&](auto t) {
        pool.parallel_for(chunks, [&](int64_t c) {
          tile_range<decltype(t)::value>(a, tiles * c / chunks, tiles * (c + 1) / chunks, isa);
        });
      });
      col += n;
    }
  }
}

void qembedding(uintptr_t ids, int64_t T, uintptr_t packed, int type, int64_t N, int64_t K, uintptr_t out,
                int out_dtype) {
  check_type(type, "qembedding");
  check_k(type, K, "qembedding");
  const int64_t* tok = reinterpret_cast<const int64_t*>(ids);
  for (int64_t r = 0; r < T; ++r)
    if (tok[r] < 0 || tok[r] >= N) throw std::out_of_range("qembedding: token id " + std::to_string(tok[r]) +
                                                           " outside [0, " + std::to_string(N) + ")");
  const int64_t KB = K / kBlock;
  const bool f32 = out_dtype == static_cast<int>(DType::kFloat32);
  dispatch(type, [&](auto tc) {
    constexpr int Ty = decltype(tc)::value;
    constexpr Layout L = layout(Ty);
    constexpr int64_t per_half = kBlock / L.halves;
    const int64_t stride = tile_stride(L, KB);
    ThreadPool::instance().parallel_for(T, [&](int64_t r) {
      const int64_t n = tok[r], j = n % kTileRows;
      const uint8_t* w = reinterpret_cast<const uint8_t*>(packed) + n / kTileRows * stride;
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* rec = w + b / L.groups() * L.record_bytes();
        const int64_t g = b % L.groups();
        for (int64_t k = 0; k < kBlock; ++k) {
          // the dequantized value as GGUF defines it, d * u + c in one rounding (fused: Q6_K's d sc u alone
          // can need 25 bits), as gguf.py's load-time dequantization and linear/quant_strips.cpp round it
          const Scale s = group_scale<Ty>(rec, j, g, static_cast<int>(k / per_half));
          const float v = std::fma(s.d, static_cast<float>(group_value<Ty>(rec + g * L.group_bytes(), j, k)), s.c);
          const int64_t off = r * K + b * kBlock + k;
          if (f32) reinterpret_cast<float*>(out)[off] = v;
          else reinterpret_cast<uint16_t*>(out)[off] = float_to_bf16(v);
        }
      }
    });
  });
}

}  // namespace pyengine::cpu
