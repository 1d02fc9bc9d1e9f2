// Quantized linear layers at many rows (M >= strip rows, bf16 activations): the weight is dequantized a
// strip at a time into bf16, in exactly the packed layout linear/bf16.cpp's kernel reads (16-output tiles of
// k pairs), and that kernel (AMX tiles, else AVX-512) runs its tile loop over all M rows of the strip.
//
// Why: the int8 kernels (linear/quant.cpp) scale every 32-value group's int32 sums through the vector units,
// which bounds them at many rows (about half the bf16 AMX GEMM's rate on the same shapes). Here the
// dequantization is paid once per strip per call, shared by all M rows, and the weight is still read at
// its quantized size. A strip is a few tiles x all of K, about kStripBytes of bf16: it stays in L2
// while the rows stream past. Up to kFusedRows rows on AMX (a decode step of a few streams), each group
// goes through L1 instead: dequantized and multiplied at once (fused_block), with the same bits; the
// 4-bit types with one scale a group look their values up in a per-row table (fused_rows_block).
//
// Each value is d * u + c of its group (ggml_blocks.h) in one fused multiply-add, rounded to bf16 to
// nearest even: every product in GGUF's formulas is exact in fp32 (fp16 scales times at most 13-bit
// integers), so this is the load-time dequantization's value (pyengine/model/gguf.py) rounded the same
// way, and a quantized linear here gives the bits `--weights dequantize` gives.
#include <algorithm>
#include <atomic>
#include <vector>

#include "linear.h"
#include "pyengine/amx.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"
#include "quant_tiles.h"

namespace pyengine::cpu {
namespace {

using ggml::kBlock;
using ggml::kTileRows;

// From this many rows, where linear_bf16 runs on AMX tiles: from 7-8 rows the fused path below beat the
// int8 kernels (their AMX path from 8 rows included) on a 2-core AMX host, 4-, 5-, 6- and 8-bit types alike
// (docs/performance.md, "quantized weights by strips"). Without AMX the default is 0 (never): linear_bf16's
// vdpbf16ps kernel does half the products per instruction of the int8 kernels' vpdpbusd, and there the
// strips lose at every M; on AVX512-FP16 builds its kernel is avx512_fp32 (bf16 widened to fp32 FMAs), and
// they still lose (bench/engine/bench_quant_steps.py).
constexpr int64_t kAmxStripRows = 8;
constexpr int64_t kStripBytes = 256 * 1024;  // bf16 per strip: a share of L2 beside x's rows and the output
// How far ahead of the group being dequantized its weight bytes are prefetched (into L1). A model's
// weights come from L3 or memory at every step, and the hardware prefetchers alone left the loop
// waiting (without the prefetch a 16-row step's projections took 1.6x as long). For dequantize_group
// 2,048 bytes measured best beside 1,024, 4,096 and 8,192 (4,096 slowed the Q8_0 model's steps); the
// table lookups (dequantize_rows) go through a group faster and want 4,096. A second, L2 prefetch further
// ahead, or prefetching the next tiles' first bytes, changed nothing (docs/performance.md, "quantized
// weights by strips").
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kRowsPrefetchBytes = 4096;

std::atomic<int64_t> g_strip_rows{linear_path(kBlock) == "amx" ? kAmxStripRows : 0};

#if defined(PYENGINE_QLINEAR_VNNI) && defined(__AVX512BF16__)
#define PYENGINE_QLINEAR_STRIPS 1

#if defined(__AVX512VBMI__)
// A group's scale d and offset c per row in line order: lane 2j + i of part p is row 8p + j's.
struct LineScales {
  __m512 d[2], c[2];

  LineScales(__m512 d16, __m512 c16) {  // row j in lane j
    for (int p = 0; p < 2; ++p) {
      const __m512i rows = _mm512_set_epi32(8 * p + 7, 8 * p + 7, 8 * p + 6, 8 * p + 6, 8 * p + 5, 8 * p + 5,
                                            8 * p + 4, 8 * p + 4, 8 * p + 3, 8 * p + 3, 8 * p + 2, 8 * p + 2,
                                            8 * p + 1, 8 * p + 1, 8 * p, 8 * p);
      d[p] = _mm512_permutexvar_ps(rows, d16);
      c[p] = _mm512_permutexvar_ps(rows, c16);
    }
  }
};

// Rows 8p .. 8p + 7's values k0 + t and k0 + t + 1 of `bytes` (row j's value k0 + t at byte 4j + t) as
// 32-bit integers in line order (lane 2j + i: row 8p + j's k0 + t + i): one zeroing vpermb does the shifts,
// masks and the interleave of the rows' pairs.
template <int t, int p>
inline __m512i pair_values(__m512i bytes) {
  constexpr auto at = [](int lane) { return 4 * (8 * p + lane / 2) + t + lane % 2; };
  const __m512i idx = _mm512_set_epi32(at(15), at(14), at(13), at(12), at(11), at(10), at(9), at(8), at(7), at(6),
                                       at(5), at(4), at(3), at(2), at(1), at(0));
  return _mm512_maskz_permutexvar_epi8(0x1111111111111111ULL, idx, bytes);  // byte 0 of each lane
}

// Values k0 + t and k0 + t + 1 of each row in `bytes` as d * u + c, rounded to bf16 -> line (k0 + t) / 2
// at `out` (linear/bf16.cpp's packed layout: 16 rows x the k pair). Always inlined, as store_quad: called
// out of line, each of these is a few instructions behind a call.
template <int t>
__attribute__((always_inline)) inline void store_line(uint16_t* out, __m512i bytes, const LineScales& s) {
  const __m512 v0 = _mm512_fmadd_ps(s.d[0], _mm512_cvtepi32_ps(pair_values<t, 0>(bytes)), s.c[0]);
  const __m512 v1 = _mm512_fmadd_ps(s.d[1], _mm512_cvtepi32_ps(pair_values<t, 1>(bytes)), s.c[1]);
  _mm512_store_si512(out + t * 16, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
}

// The 4 values of each row in `bytes` (k = k0 .. k0 + 3) -> lines k0 / 2 and k0 / 2 + 1 at `out`.
__attribute__((always_inline)) inline void store_quad(uint16_t* out, __m512i bytes, const LineScales& s) {
  store_line<0>(out, bytes, s);
  store_line<2>(out, bytes, s);
}
#else  // shifts and masks per byte, then the rows' pairs interleaved after the rounding
struct LineScales {
  __m512 d, c;  // row j in lane j

  LineScales(__m512 d16, __m512 c16) : d(d16), c(c16) {}
};

// One 64-byte output line: 16 rows x the k pair (v0, v1), rounded to bf16 (linear/bf16.cpp's packed layout).
inline void store_pair(uint16_t* line, __m512 v0, __m512 v1) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_store_si512(line, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(v1, v0)));
}

// Byte t of each 32-bit lane of `bytes` (row j's value k = 4 i + t of a line), as d * u + c.
template <int t>
inline __m512 value(__m512i bytes, const LineScales& s) {
  __m512i u = bytes;
  if constexpr (t > 0) u = _mm512_srli_epi32(u, 8 * t);
  if constexpr (t < 3) u = _mm512_and_si512(u, _mm512_set1_epi32(0xFF));
  return _mm512_fmadd_ps(s.d, _mm512_cvtepi32_ps(u), s.c);
}

// The 4 values of each row in `bytes` (k = k0 .. k0 + 3) -> lines k0 / 2 and k0 / 2 + 1 at `out`.
inline void store_quad(uint16_t* out, __m512i bytes, const LineScales& s) {
  store_pair(out, value<0>(bytes, s), value<1>(bytes, s));
  store_pair(out + 32, value<2>(bytes, s), value<3>(bytes, s));
}
#endif

// Half h's LineScales of group g of record `rec`.
template <int T>
inline LineScales half_scales(const uint8_t* rec, int64_t g, int h) {
  __m512 d, c;
  vec_scales<T, Zmm, false>(rec, g, h, 0, d, c);
  return {d, c};
}

// Group b of one tile (its records at `tile`) -> 16 bf16 lines of 32 at `out` (linear/bf16.cpp's packed
// layout: the group's 16 k pairs x 16 rows x 2), its weight bytes kPrefetchBytes ahead fetched on the way.
template <int T>
inline void dequantize_group(const uint8_t* tile, int64_t b, uint16_t* out) {
  constexpr Layout L = layout(T);
  constexpr int lines_per_half = L.lines / L.halves;
  constexpr int64_t group_bytes = L.record_bytes() / L.groups();  // a tile's bytes per 32 k, on average
  const uint8_t* rec = tile + b / L.groups() * L.record_bytes();
  const char* ahead = reinterpret_cast<const char*>(tile + b * group_bytes) + kPrefetchBytes;
  for (int64_t o = 0; o < group_bytes; o += 64) prefetch<_MM_HINT_T0>(ahead + o);
  const int64_t g = b % L.groups();
  const uint8_t* grp = rec + g * L.group_bytes();
  const LineScales s0 = half_scales<T>(rec, g, 0), s1 = L.halves == 2 ? half_scales<T>(rec, g, 1) : s0;
  static_for<0, L.lines>([&](auto ic) {
    constexpr int i = decltype(ic)::value;
    const LineScales& s = i / lines_per_half == 0 ? s0 : s1;
    __m512i lo, hi;
    vnni_line<T, i>(grp, lo, hi);
    if constexpr (L.lines == 8) {  // k = 4i .. 4i + 3
      store_quad(out + 2 * i * 32, lo, s);
    } else {  // low nibbles k = 8i .. 8i + 3, high 8i + 4 .. 8i + 7
      store_quad(out + 4 * i * 32, lo, s);
      store_quad(out + (4 * i + 2) * 32, hi, s);
    }
  });
}

// Tiles [begin, end) of a type-T weight (KB groups a row) -> bf16 lines at `out` ([tile, K / 2, 16, 2]).
template <int T>
void dequantize_strip(const uint8_t* w, int64_t KB, int64_t begin, int64_t end, uint16_t* out) {
  const int64_t stride = tile_stride(layout(T), KB);
  for (int64_t tile = begin; tile < end; ++tile)
    for (int64_t b = 0; b < KB; ++b, out += kBlock / 2 * 32) dequantize_group<T>(w + tile * stride, b, out);
}

#if defined(PYENGINE_AMX)
#define PYENGINE_QLINEAR_FUSED 1

// Up to kFusedRows rows (decode steps of a few streams), the strips' round trip through L2 costs more than
// the products: per tile pair, each group is dequantized into two 1 KB buffers that the tile loads read
// from L1 right away, and the products are those of linear/bf16.cpp's AMX kernel in the same k order, so
// the bits are the strips'. Rows 16 .. 31 of x are a second row block of fewer tile rows (the
// configuration; and rows 0 .. M - 1 the first where M < 16), so x needs no zero-padded copy.
//
// The loop is software-pipelined: group b + 1 is dequantized between group b's tile products. On AMX
// cores the vector work does not run beside a tile product issued right after it; spread between the
// products, and not read by a tile load straight after its stores, it does (about 10% of a step).
constexpr int64_t kFusedRows = 32;

// Rows [0, M) (M <= 32) x output tiles [t0, t0 + NT) of a type-T weight -> c [32][32] fp32.
// tmm 2i + j: C of row block i, output tile j; tmm4, 5: A of row blocks 0, 1; tmm6, 7: B of tiles 0, 1.
template <int T, int NT>
void fused_block(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t t0, float* c) {
  const int64_t KB = K / kBlock, stride = tile_stride(layout(T), KB), x_stride = K * 2;
  const bool two = M > 16;
  alignas(64) uint16_t buf[2][NT][kBlock / 2 * 32];  // a group's lines per tile, alternating between groups
  for (int t = 0; t < NT; ++t) dequantize_group<T>(w + (t0 + t) * stride, 0, buf[0][t]);
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if (two) _tile_zero(2);
  if (NT == 2 && two) _tile_zero(3);
  for (int64_t b = 0; b < KB; ++b) {
    uint16_t(&lines)[NT][kBlock / 2 * 32] = buf[b % 2];
    _tile_loadd(4, x + b * kBlock, x_stride);
    if (two) _tile_loadd(5, x + 16 * K + b * kBlock, x_stride);
    _tile_loadd(6, lines[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(2, 5, 6);
    if (b + 1 < KB) dequantize_group<T>(w + t0 * stride, b + 1, buf[(b + 1) % 2][0]);
    if constexpr (NT == 2) {
      _tile_loadd(7, lines[1], 64);
      _tile_dpbf16ps(1, 4, 7);
      if (two) _tile_dpbf16ps(3, 5, 7);
      if (b + 1 < KB) dequantize_group<T>(w + (t0 + 1) * stride, b + 1, buf[(b + 1) % 2][1]);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NT == 2) _tile_stored(1, c + 16, 128);
  if (two) _tile_stored(2, c + 16 * 32, 128);
  if (NT == 2 && two) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// fused_block over tiles [begin, end) of a segment (its first output column col, `rows` of them), + bias,
// into out (N columns a row), bf16 rounded to nearest even as linear/bf16.cpp's kernel does.
template <int T>
void fused_range(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t begin, int64_t end, int64_t col,
                 int64_t rows, const float* bias, void* out, int64_t N, bool out_f32) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(std::min<int64_t>(M, 16));
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(std::max<int64_t>(M - 16, 1));
  load_tile_config(cfg);
  alignas(64) float c[32 * 32];
  for (int64_t t0 = begin; t0 < end; t0 += 2) {
    const int nt = static_cast<int>(std::min<int64_t>(2, end - t0));
    if (nt == 2) fused_block<T, 2>(x, M, K, w, t0, c);
    else fused_block<T, 1>(x, M, K, w, t0, c);
    for (int t = 0; t < nt; ++t) {
      const int64_t n0 = (t0 + t) * kTileRows, valid = std::min(kTileRows, rows - n0);
      if (valid <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col + n0) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + m * 32 + t * 16), bv);
        const int64_t off = m * N + col + n0;
        if (out_f32) _mm512_mask_storeu_ps(static_cast<float*>(out) + off, mask, v);
        else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + off, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
  _tile_release();
}

#if defined(__AVX512VBMI__)
#define PYENGINE_QLINEAR_ROW_TABLES 1

// The 4-bit types with one scale and offset per row for all of a group (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS):
// a row's group takes only 16 values, d * u + c for its 16 possible u, so the fused path rounds those 16
// to bf16 once and looks each value up (vpermw) instead of converting and scaling it. The lookup makes a
// row of the group, so here the weight is the A tile (16 rows x 32 k) and x the B tile (its k pairs x
// 16 rows: pack_x_pairs), and each C tile is [weight row][x row]. Per 32 values: a byte permute, a shift,
// a ternary op and the lookup, and half a table (two FMAs and a bf16 pack make two rows' tables), against
// dequantize_group's two permutes, converts and FMAs and a pack; 1.2x faster on a Q4_K group. The values
// are the same fp32 d * u + c rounded the same way, and the products linear/bf16.cpp's AMX kernel's in the
// same k order, with A and B swapped: the same bits.
template <int T>
constexpr bool row_tables() {
  constexpr Layout L = layout(T);
  return L.bits == 4 && L.high_lines == 0 && L.halves == 1;
}

// x [M][K] bf16 -> [16-row block][K / 2][16][2]: each block's k pairs as AMX B rows, rows past M zero.
void pack_x_pairs(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp) {
  const auto* pairs = reinterpret_cast<const int32_t*>(x);
  const int64_t P = K / 2;
  const __m512i row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int32_t>(P)));
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const __mmask16 rows = static_cast<__mmask16>((1u << std::min<int64_t>(16, M - r0)) - 1u);
    for (int64_t p = 0; p < P; ++p, xp += 16)
      _mm512_storeu_si512(xp, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, row, pairs + r0 * P + p, 4));
  }
}

// Group b's d and c for one tile's 16 rows -> s[0 .. 15], s[16 .. 31], as vec_scales gives them. Q4_K's
// fp16 d and dmin, shared by a record's 8 groups, are converted once a record.
template <int T>
struct GroupScales {
  const uint8_t* tile;
  int64_t record = -1;
  __m512 d, minus_dmin;  // Q4_K: the current record's

  void operator()(int64_t b, float* s) {
    constexpr Layout L = layout(T);
    const uint8_t* rec = tile + b / L.groups() * L.record_bytes();
    const int64_t g = b % L.groups();
    __m512 dv, cv;
    if constexpr (T == ggml::kQ4_K) {
      const uint8_t* f = rec + L.scales_offset();
      if (b / L.groups() != record) {
        record = b / L.groups();
        d = Zmm::f16(f);
        minus_dmin = Zmm::mul(Zmm::f16(f + 32), Zmm::set1(-1.0f));
      }
      dv = Zmm::mul(d, Zmm::u8(f + 64 + 16 * g));
      cv = Zmm::mul(minus_dmin, Zmm::u8(f + 192 + 16 * g));
    } else {
      vec_scales<T, Zmm, false>(rec, g, 0, 0, dv, cv);
    }
    _mm512_store_ps(s, dv);
    _mm512_store_ps(s + 16, cv);
  }
};

// The unsigned values a nibble stands for, as floats in nibble order: itself, or kIq4nl + 128.
template <int T>
inline __m512 nibble_values() {
  alignas(64) float u[16];
  for (int q = 0; q < 16; ++q) u[q] = static_cast<float>(layout(T).lookup ? ggml::kIq4nl[q] + 128 : q);
  return _mm512_load_ps(u);
}

// Group b of one tile -> 16 rows x 32 bf16 at `out` (row-major: an AMX A tile); s: its group_scales.
template <int T>
inline void dequantize_rows(const uint8_t* tile, int64_t b, const float* s, uint16_t* out) {
  constexpr Layout L = layout(T);
  constexpr int64_t group_bytes = L.record_bytes() / L.groups();
  const uint8_t* grp = tile + b / L.groups() * L.record_bytes() + b % L.groups() * L.group_bytes();
  const char* ahead = reinterpret_cast<const char*>(tile + b * group_bytes) + kRowsPrefetchBytes;
  for (int64_t o = 0; o < group_bytes; o += 64) prefetch<_MM_HINT_T0>(ahead + o);
  // Line I's byte 4j + t holds row j's k = 8I + t (low nibble) and 8I + 4 + t (high nibble). A 4 x 4
  // transpose of 32-bit lanes in each 128-bit lane: lane l of rows[r] is row 4l + r's 16 bytes, line I's at 4I.
  __m512i line[4];
  for (int i = 0; i < 4; ++i) line[i] = _mm512_loadu_si512(grp + 64 * i);
  const __m512i t0 = _mm512_unpacklo_epi32(line[0], line[1]), t1 = _mm512_unpackhi_epi32(line[0], line[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(line[2], line[3]), t3 = _mm512_unpackhi_epi32(line[2], line[3]);
  const __m512i rows[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                           _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
  // Word k of row 4l + r: its byte (k = 8I + t or 8I + 4 + t -> byte 16l + 4I + t), twice.
  static constexpr auto spread = [] {
    struct alignas(64) Index {
      uint8_t v[4][64];
    } a{};
    for (int l = 0; l < 4; ++l)
      for (int k = 0; k < 32; ++k) a.v[l][2 * k] = a.v[l][2 * k + 1] = static_cast<uint8_t>(16 * l + 4 * (k / 8) + k % 4);
    return a;
  }();
  const __m512 u = nibble_values<T>();
  const __m512i nibble = _mm512_set1_epi16(0x0F);
#pragma GCC unroll 8
  for (int j = 0; j < 16; j += 2) {
    // Rows j and j + 1's values, rounded as the strips round them: table words 0-15 and 16-31.
    const __m512 v0 = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), u, _mm512_set1_ps(s[16 + j]));
    const __m512 v1 = _mm512_fmadd_ps(_mm512_set1_ps(s[j + 1]), u, _mm512_set1_ps(s[17 + j]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i bytes = _mm512_permutexvar_epi8(_mm512_load_si512(spread.v[(j + h) / 4]), rows[(j + h) % 4]);
      const __m512i shifted = _mm512_mask_srli_epi16(bytes, 0xF0F0F0F0u, bytes, 4);  // the high nibbles' k
      const __m512i index = _mm512_ternarylogic_epi32(shifted, nibble, _mm512_set1_epi16(h ? 16 : 0), 0xEA);
      _mm512_store_si512(out + (j + h) * 32, _mm512_permutexvar_epi16(index, table));
    }
  }
}

// fused_block with the weight as A: x's rows [0, M) (M <= 32; xp: pack_x_pairs) x output tiles
// [t0, t0 + NT) -> c [32 weight rows][32 x rows] fp32.
// tmm 2i + j: C of x block i, weight tile j; tmm4, 5: A of weight tiles 0, 1; tmm6, 7: B of x blocks 0, 1.
template <int T, int NT>
void fused_rows_block(const uint32_t* xp, int64_t M, int64_t K, const uint8_t* w, int64_t t0, float* c) {
  const int64_t KB = K / kBlock, stride = tile_stride(layout(T), KB), block_pairs = K / 2 * 16;
  const bool two = M > 16;
  // Pipelined as fused_block; each group's scales are stored two groups ahead of the broadcasts that
  // read them (a load straight after a store waits on it).
  alignas(64) uint16_t buf[2][NT][kBlock * 16];
  alignas(64) float scales[3][NT][32];
  const uint8_t* tile[NT];
  GroupScales<T> group_scales[NT];
  for (int t = 0; t < NT; ++t) {
    tile[t] = w + (t0 + t) * stride;
    group_scales[t].tile = tile[t];
    group_scales[t](0, scales[0][t]);
    if (KB > 1) group_scales[t](1, scales[1][t]);
    dequantize_rows<T>(tile[t], 0, scales[0][t], buf[0][t]);
  }
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if (two) _tile_zero(2);
  if (NT == 2 && two) _tile_zero(3);
  for (int64_t b = 0; b < KB; ++b) {
    uint16_t(&lines)[NT][kBlock * 16] = buf[b % 2];
    for (int t = 0; t < NT; ++t)
      if (b + 2 < KB) group_scales[t](b + 2, scales[(b + 2) % 3][t]);
    _tile_loadd(6, xp + b * 16 * 16, 64);
    if (two) _tile_loadd(7, xp + block_pairs + b * 16 * 16, 64);
    _tile_loadd(4, lines[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(2, 4, 7);
    if (b + 1 < KB) dequantize_rows<T>(tile[0], b + 1, scales[(b + 1) % 3][0], buf[(b + 1) % 2][0]);
    if constexpr (NT == 2) {
      _tile_loadd(5, lines[1], 64);
      _tile_dpbf16ps(1, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
      if (b + 1 < KB) dequantize_rows<T>(tile[1], b + 1, scales[(b + 1) % 3][1], buf[(b + 1) % 2][1]);
    }
  }
  _tile_stored(0, c, 128);
  if constexpr (NT == 2) _tile_stored(1, c + 16 * 32, 128);
  if (two) _tile_stored(2, c + 16, 128);
  if (NT == 2 && two) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// fused_range for a row_tables type, from x packed by pack_x_pairs.
template <int T>
void fused_rows_range(const uint32_t* xp, int64_t M, int64_t K, const uint8_t* w, int64_t begin, int64_t end,
                      int64_t col, int64_t rows, const float* bias, void* out, int64_t N, bool out_f32) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[6] = static_cast<uint16_t>(4 * std::min<int64_t>(M, 16));
  cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[7] = static_cast<uint16_t>(4 * std::max<int64_t>(M - 16, 1));
  load_tile_config(cfg);
  alignas(64) float c[32 * 32];
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(32));
  for (int64_t t0 = begin; t0 < end; t0 += 2) {
    const int nt = static_cast<int>(std::min<int64_t>(2, end - t0));
    if (nt == 2) fused_rows_block<T, 2>(xp, M, K, w, t0, c);
    else fused_rows_block<T, 1>(xp, M, K, w, t0, c);
    for (int t = 0; t < nt; ++t) {
      const int64_t n0 = (t0 + t) * kTileRows, valid = std::min(kTileRows, rows - n0);
      if (valid <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col + n0) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + t * 16 * 32 + m, 4), bv);
        const int64_t off = m * N + col + n0;
        if (out_f32) _mm512_mask_storeu_ps(static_cast<float*>(out) + off, mask, v);
        else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + off, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
  _tile_release();
}
#endif
#endif

// One strip: tiles [begin, end) of the segment whose first output column is col.
struct Strip {
  int type;
  const uint8_t* w;
  int64_t begin, end, col, rows;  // rows: the segment's
};

#endif

}  // namespace

void set_qlinear_strip_rows(int64_t rows) { g_strip_rows.store(std::max<int64_t>(rows, 0)); }

int64_t qlinear_strip_rows() { return g_strip_rows.load(); }

bool qlinear_strips(const uint16_t* x, const int64_t* seg, const float* bias, void* out, int64_t M, int64_t N,
                    int64_t K, bool out_f32) {
#if defined(PYENGINE_QLINEAR_STRIPS)
  const int64_t min_rows = g_strip_rows.load();
  if (min_rows == 0 || M < min_rows || !linear_bf16_simd(K)) return false;
  const int64_t KB = K / kBlock, tile_bytes = K * kTileRows * 2;
  auto& pool = ThreadPool::instance();
  // Strips of at most about kStripBytes, a multiple of the thread count where the segment has the tiles
  // for it: equal shares (at 3 strips for 2 threads, one thread idled a third of the time). A strip is
  // whole tile pairs, the AMX kernel's blocks, so its output rows leave as full 64-byte lines.
  std::vector<Strip> strips;
  const int64_t threads = pool.num_threads();
  for (int64_t s = 0, col = 0; s < seg[0]; col += seg[2 + 3 * s], ++s) {
    const int64_t rows = seg[2 + 3 * s], tiles = (rows + kTileRows - 1) / kTileRows;
    const int64_t rounds = (tiles * tile_bytes + kStripBytes * threads - 1) / (kStripBytes * threads);
    const int64_t n = std::min((tiles + 1) / 2, rounds * threads);
    for (int64_t i = 0; i < n; ++i) {
      const TileRange r = tile_pair_range(tiles, i, n);
      strips.push_back({static_cast<int>(seg[1 + 3 * s]), reinterpret_cast<const uint8_t*>(seg[3 + 3 * s]), r.begin,
                        r.end, col, rows});
    }
  }
#if defined(PYENGINE_QLINEAR_FUSED)
  if (M <= kFusedRows && linear_path(K) == "amx") {  // linear_bf16 would run on AMX tiles here
#if defined(PYENGINE_QLINEAR_ROW_TABLES)
    static thread_local std::vector<uint32_t> packed;
    const bool any_tables = std::any_of(strips.begin(), strips.end(), [](const Strip& s) {
      bool tables = false;
      dispatch(s.type, [&](auto t) { tables = row_tables<decltype(t)::value>(); });
      return tables;
    });
    if (any_tables) {
      packed.resize(static_cast<size_t>((M + 15) / 16 * 16 * K / 2 + 16));
      pack_x_pairs(x, M, K, packed.data());
    }
    const uint32_t* xp = packed.data();
#endif
    pool.parallel_for(static_cast<int64_t>(strips.size()), [&](int64_t i) {
      const Strip& s = strips[i];
      dispatch(s.type, [&](auto t) {
        constexpr int T = decltype(t)::value;
#if defined(PYENGINE_QLINEAR_ROW_TABLES)
        if constexpr (row_tables<T>()) {
          fused_rows_range<T>(xp, M, K, s.w, s.begin, s.end, s.col, s.rows, bias, out, N, out_f32);
          return;
        }
#endif
        fused_range<T>(x, M, K, s.w, s.begin, s.end, s.col, s.rows, bias, out, N, out_f32);
      });
    });
    return true;
  }
#endif
  const Bf16Rows xr(x, M, K);
  pool.parallel_for(static_cast<int64_t>(strips.size()), [&](int64_t i) {
    const Strip& s = strips[i];
    struct alignas(64) Line {
      uint16_t v[32];
    };
    static thread_local std::vector<Line> buffer;
    buffer.resize(static_cast<size_t>((s.end - s.begin) * K / 2));
    uint16_t* const w = buffer.front().v;
    dispatch(s.type, [&](auto t) { dequantize_strip<decltype(t)::value>(s.w, KB, s.begin, s.end, w); });
    const int64_t n0 = s.col + s.begin * kTileRows;
    xr.run(w, bias ? bias + n0 : nullptr, static_cast<char*>(out) + n0 * (out_f32 ? 4 : 2),
           std::min(s.rows, s.end * kTileRows) - s.begin * kTileRows, N, out_f32);
  });
  return true;
#else
  (void)x, (void)seg, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)out_f32;
  return false;
#endif
}

}  // namespace pyengine::cpu
