// The quantized linear layers up to kFusedRows rows on AMX (decode steps of a few streams): each 32-value
// group of a tile pair is dequantized into L1 (quant_lines.h's lines, or quant_rows.h's rows for the
// 4-bit types with one scale a group) and multiplied at once on bf16 tiles, so the bits are the strips'
// (quant_strips.cpp). Output: out[M][N] (+ bias), fp32 or bf16 rounded to nearest even, as
// linear/bf16.cpp's kernel writes it.
//
// Built with AMX-TILE/BF16 beside the strips (defines PYENGINE_QLINEAR_FUSED).
#pragma once
#include <algorithm>

#include "pyengine/amx.h"
#include "quant_lines.h"
#include "quant_rows.h"

#if defined(PYENGINE_QLINEAR_STRIPS) && defined(PYENGINE_AMX)
#define PYENGINE_QLINEAR_FUSED 1

namespace pyengine::cpu {
namespace {

using ggml::kTileRows;

// Up to kFusedRows rows (decode steps of a few streams), the strips' round trip through L2 costs more than
// the products: per tile pair, each group is dequantized into two 1 KB buffers that the tile loads read
// from L1 right away, and the products are those of linear/bf16.cpp's AMX kernel in the same k order, so
// the bits are the strips'. Rows 16 .. 31 of x are a second row block of fewer tile rows (the
// configuration; and rows 0 .. M - 1 the first where M < 16), so x needs no zero-padded copy.
//
// The loop is software-pipelined: group b + 1 is dequantized between group b's tile products. On AMX
// cores the vector work does not run beside a tile product issued right after it; spread between the
// products, and not read by a tile load straight after its stores, it does (docs/performance.md,
// "quantized weights by strips").
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

// A block's nt output tiles (the first t0, a segment whose first output column is col, `rows` of them) from
// c, + bias, into out (N columns a row), bf16 rounded to nearest even as linear/bf16.cpp's kernel does.
// c: [x row][32] (fused_block) or, Transposed, [weight row][32] (fused_rows_block).
template <bool Transposed>
inline void write_block(const float* c, int nt, int64_t t0, int64_t M, int64_t col, int64_t rows, const float* bias,
                        void* out, int64_t N, bool out_f32) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(32));
  for (int t = 0; t < nt; ++t) {
    const int64_t n0 = (t0 + t) * kTileRows, valid = std::min(kTileRows, rows - n0);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col + n0) : _mm512_setzero_ps();
    for (int64_t m = 0; m < M; ++m) {
      const __m512 cv = Transposed ? _mm512_i32gather_ps(column, c + t * 16 * 32 + m, 4)
                                   : _mm512_load_ps(c + m * 32 + t * 16);
      const __m512 v = _mm512_add_ps(cv, bv);
      const int64_t off = m * N + col + n0;
      if (out_f32) _mm512_mask_storeu_ps(static_cast<float*>(out) + off, mask, v);
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + off, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// fused_block over tiles [begin, end) of a segment (its first output column col, `rows` of them), each block
// written out by write_block.
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
    write_block<false>(c, nt, t0, M, col, rows, bias, out, N, out_f32);
  }
  _tile_release();
}

#if defined(PYENGINE_QLINEAR_ROW_TABLES)
// x [M][K] bf16 -> [16-row block][K / 2][16][2]: each block's k pairs as AMX B rows, rows past M zero.
inline void pack_x_pairs(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp) {
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

// fused_block with the weight as A: x's rows [0, M) (M <= 32; xp: pack_x_pairs) x output tiles
// [t0, t0 + NT) -> c [32 weight rows][32 x rows] fp32.
// tmm 2i + j: C of x block i, weight tile j; tmm4, 5: A of weight tiles 0, 1; tmm6, 7: B of x blocks 0, 1.
template <int T, int NT>
void fused_rows_block(const uint32_t* xp, int64_t M, int64_t K, const uint8_t* w, int64_t t0, float* c) {
  const int64_t KB = K / kBlock, stride = tile_stride(layout(T), KB), block_pairs = K / 2 * 16;
  const bool two = M > 16;
  // Pipelined as fused_block; each group's scales are stored two groups ahead of the broadcasts that
  // read them (a load straight after a store waits on it).
  alignas(64) uint16_t buf[2][NT][kBlock * 16];  // a group's rows (the A tiles) per tile, alternating
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
    uint16_t(&a)[NT][kBlock * 16] = buf[b % 2];
    for (int t = 0; t < NT; ++t)
      if (b + 2 < KB) group_scales[t](b + 2, scales[(b + 2) % 3][t]);
    _tile_loadd(6, xp + b * 16 * 16, 64);
    if (two) _tile_loadd(7, xp + block_pairs + b * 16 * 16, 64);
    _tile_loadd(4, a[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(2, 4, 7);
    if (b + 1 < KB) dequantize_rows<T>(tile[0], b + 1, scales[(b + 1) % 3][0], buf[(b + 1) % 2][0]);
    if constexpr (NT == 2) {
      _tile_loadd(5, a[1], 64);
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
  for (int64_t t0 = begin; t0 < end; t0 += 2) {
    const int nt = static_cast<int>(std::min<int64_t>(2, end - t0));
    if (nt == 2) fused_rows_block<T, 2>(xp, M, K, w, t0, c);
    else fused_rows_block<T, 1>(xp, M, K, w, t0, c);
    write_block<true>(c, nt, t0, M, col, rows, bias, out, N, out_f32);
  }
  _tile_release();
}
#endif

}  // namespace
}  // namespace pyengine::cpu
#endif
