// A group of a tiled quantized weight dequantized to bf16 rows by table lookup, for the 4-bit types with one
// scale and offset a row for all of a group: 16 rows x 32 k, row-major (an AMX A tile). The AMX fused path
// (quant_fused_amx.h) multiplies them with the weight as A.
//
// Built where the strips are (quant_lines.h) and AVX512-VBMI (vpermb) is (defines
// PYENGINE_QLINEAR_ROW_TABLES).
#pragma once
#include "quant_lines.h"

#if defined(PYENGINE_QLINEAR_STRIPS) && defined(__AVX512VBMI__)
#define PYENGINE_QLINEAR_ROW_TABLES 1

namespace pyengine::cpu {
namespace {

// kPrefetchBytes (quant_lines.h) for dequantize_rows: it goes through a group faster than
// dequantize_group, and 2,048 bytes ahead left it waiting on memory.
constexpr int64_t kRowsPrefetchBytes = 4096;

// The 4-bit types with one scale and offset per row for all of a group (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS): a
// row's group takes only 16 values, d * u + c for its 16 possible u, so the fused path rounds those 16 to bf16
// once and looks each value up (vpermw) instead of converting and scaling it. The lookup makes a row of the
// group, so here the weight is the A tile (16 rows x 32 k) and x the B tile (its k pairs x 16 rows:
// pack_x_pairs), and each C tile is [weight row][x row]. Per 32 values: a byte permute, a shift, a ternary op and
// the lookup, and half a table (two FMAs and a bf16 pack make two rows' tables), against dequantize_group's two
// permutes, converts and FMAs and a pack. The values are the same fp32 d * u + c rounded the same way, and the
// products linear/bf16.cpp's AMX kernel's in the same k order, with A and B swapped: the same bits.
template <int T>
constexpr bool row_tables() {
  constexpr Layout L = layout(T);
  return L.bits == 4 && L.high_lines == 0 && L.halves == 1;
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
      for (int k = 0; k < 32; ++k)
        a.v[l][2 * k] = a.v[l][2 * k + 1] = static_cast<uint8_t>(16 * l + 4 * (k / 8) + k % 4);
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
      // Words k = 8I + 4 .. 8I + 7 take their byte's high nibble; then (word & 15) | 16h: row j + h's table.
      const __m512i shifted = _mm512_mask_srli_epi16(bytes, 0xF0F0F0F0u, bytes, 4);
      const __m512i index = _mm512_ternarylogic_epi32(shifted, nibble, _mm512_set1_epi16(h ? 16 : 0), 0xEA);
      _mm512_store_si512(out + (j + h) * 32, _mm512_permutexvar_epi16(index, table));
    }
  }
}

}  // namespace
}  // namespace pyengine::cpu
#endif
