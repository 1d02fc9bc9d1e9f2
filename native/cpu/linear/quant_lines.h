// A group of a tiled quantized weight (ggml_blocks.h: 16 rows x 32 k under one scale and offset a row, or
// two halves' for the 16-value sub-block types) dequantized to bf16 in the packed layout linear/bf16.cpp's
// kernel reads: 16 lines of 64 bytes, line p holding the 16 rows' values k = 2p and 2p + 1 ([k pair][row][2]).
// Shared by the strips (quant_strips.cpp) and the AMX fused path (quant_fused_amx.h).
//
// Each value is d * u + c of its group (ggml_blocks.h) in one fused multiply-add, rounded to bf16 to
// nearest even: every product in GGUF's formulas is exact in fp32 (fp16 scales times at most 13-bit
// integers), so this is the load-time dequantization's value (pyengine/model/gguf.py) rounded the same
// way, and a quantized linear here gives the bits `--weights dequantize` gives.
//
// Built where the int8 kernels' VNNI path and AVX512-BF16 are (defines PYENGINE_QLINEAR_STRIPS).
#pragma once
#include "pyengine/prefetch.h"
#include "quant_tiles.h"

#if defined(PYENGINE_QLINEAR_VNNI) && defined(__AVX512BF16__)
#define PYENGINE_QLINEAR_STRIPS 1

namespace pyengine::cpu {
namespace {

using ggml::kBlock;

// How far ahead of the group being dequantized its weight bytes are prefetched (into L1). A model's weights come
// from L3 or memory at every step, and the hardware prefetchers alone left the loop waiting on memory. For
// dequantize_group 2,048 bytes measured best beside 1,024, 4,096 and 8,192 (4,096 slowed the Q8_0 model's steps);
// a second, L2 prefetch further ahead, or prefetching the next tiles' first bytes, changed nothing
// (docs/performance.md, "quantized weights by strips").
constexpr int64_t kPrefetchBytes = 2048;

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

}  // namespace
}  // namespace pyengine::cpu
#endif
