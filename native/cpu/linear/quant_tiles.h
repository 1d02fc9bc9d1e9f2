// The tiled quantized layout (ggml_blocks.h) decoded with SIMD: shared by the int8 kernels
// (linear/quant.cpp) and the dequantizing strips (linear/quant_strips.cpp).
#pragma once

#include <cstdint>
#include <utility>

#include "pyengine/ggml_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PYENGINE_QLINEAR_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PYENGINE_QLINEAR_VNNI 1
// GCC 12 warns inside its own _mm512_cvtph_ps, _mm512_srli_epi32 (an undefined pass-through operand):
// false positives
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#if defined(PYENGINE_QLINEAR_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PYENGINE_QLINEAR_AMX 1
#include "pyengine/amx.h"
#endif

namespace pyengine::cpu {

using ggml::Layout;
using ggml::layout;

// Bytes of one tile's records.
inline int64_t tile_stride(const Layout& L, int64_t KB) { return KB / L.groups() * L.record_bytes(); }

// Calls f(std::integral_constant<int, I>) for I = B .. E - 1: line indices as constants, so every
// shift below is an immediate.
template <int B, int E, class F>
inline void static_for(F&& f) {
  if constexpr (B < E) {
    f(std::integral_constant<int, B>{});
    static_for<B + 1, E>(f);
  }
}

// Whether type T's offset c is a fixed multiple of its scale d (offset_ratio), rather than a field of its own
// (the types with a minimum: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K).
template <int T>
constexpr bool fixed_offset() {
  return T != ggml::kQ4_1 && T != ggml::kQ5_1 && T != ggml::kQ2_K && T != ggml::kQ4_K && T != ggml::kQ5_K;
}

// c / d for a fixed_offset type: minus its values' zero point. Signed: the path multiplies Q8_0's and the
// IQ4 types' values signed (c = 0), else their unsigned u (value + 128).
template <int T, bool Signed>
constexpr float offset_ratio() {
  static_assert(fixed_offset<T>());
  if constexpr (T == ggml::kQ6_K) return -32.0f;
  else if constexpr (T == ggml::kQ3_K) return -4.0f;
  else if constexpr (T == ggml::kQ8_0 || layout(T).lookup) return Signed ? 0.0f : -128.0f;
  else return T == ggml::kQ5_0 ? -16.0f : -8.0f;
}

// group_scale for the rows [r0, r0 + V's lanes) of one tile, group g, half h of record `rec`, as vectors
// V (Zmm, Ymm: loads of the scale fields, mul, set1); Signed as for offset_ratio.
template <int T, class V, bool Signed>
inline void vec_scales(const uint8_t* rec, int64_t g, int h, int64_t r0, typename V::F& d, typename V::F& c) {
  constexpr Layout L = layout(T);
  const uint8_t* s = rec + L.scales_offset();
  auto f16 = [&](int64_t field) { return V::f16(s + field + 2 * r0); };
  auto u8 = [&](int64_t field) { return V::u8(s + field + r0); };
  auto i8 = [&](int64_t field) { return V::i8(s + field + r0); };
  if constexpr (T == ggml::kQ2_K) {  // the scale byte: sc in its low nibble, m in its high one
    const uint8_t* sc = s + 64 + 16 * (2 * g + h) + r0;
    d = V::mul(f16(0), V::u4(sc, false));
    c = V::mul(V::mul(f16(32), V::set1(-1.0f)), V::u4(sc, true));
  } else if constexpr (T == ggml::kQ4_K || T == ggml::kQ5_K) {
    d = V::mul(f16(0), u8(64 + 16 * g));
    c = V::mul(V::mul(f16(32), V::set1(-1.0f)), u8(192 + 16 * g));
  } else if constexpr (T == ggml::kQ4_1 || T == ggml::kQ5_1) {
    d = f16(0);
    c = f16(32);
  } else {
    if constexpr (T == ggml::kQ6_K || T == ggml::kQ3_K) d = V::mul(f16(0), i8(32 + 16 * (2 * g + h)));
    else d = T == ggml::kIQ4_XS ? V::mul(f16(0), i8(32 + 16 * g)) : f16(0);
    c = V::mul(d, V::set1(offset_ratio<T, Signed>()));
  }
}

// One group's (or half's) int32 dot products against a row of x joined from its int8 pair (256 dot1 +
// dot2: a row of x and its residual, scales 256 dx2 and dx2) for V's rows of a tile (Zmm: 16, Ymm: 8),
// scaled into acc (d, c: vec_scales with the same Signed; s12: the pair's offset sums added). Shared by
// the int8 kernels: see linear/quant.cpp's top. Where c is a fixed multiple of d (fixed_offset),
// d (t + (c / d) s12) takes one FMA fewer.
template <int T, bool Signed, class V>
inline typename V::F scale_joined(typename V::I joined_dot, float dx2, typename V::F d, typename V::F c, float s12,
                                  typename V::F acc) {
  const typename V::F joined = V::to_float(joined_dot);
  if constexpr (fixed_offset<T>()) {
    (void)c;  // vec_scales' c: its multiply is dead code here
    return V::fmadd(V::fmadd(joined, V::set1(dx2), V::set1(offset_ratio<T, Signed>() * s12)), d, acc);
  }
  return V::fmadd(c, V::set1(s12), V::fmadd(V::mul(joined, V::set1(dx2)), d, acc));
}

// scale_joined for the pair's two dot products. They join in int32 (|dot1| <= 32 * 255 * 127, so
// 256 dot1 + dot2 fits), one float multiply fewer: on some cores the float multiplies and FMAs issue on
// the same two pipes as vpdpbusd, so each one here is a dot product less.
template <int T, bool Signed, class V>
inline typename V::F scale_pair(typename V::I dot1, typename V::I dot2, float dx2, typename V::F d,
                                typename V::F c, float s12, typename V::F acc) {
  return scale_joined<T, Signed, V>(V::join(dot1, dot2), dx2, d, c, s12, acc);
}

// f(std::integral_constant<int, T>) for GGML type `type` (one with a kernel: ggml::supported).
template <class F>
inline void dispatch(int type, F&& f) {
  switch (type) {
    case ggml::kQ8_0: f(std::integral_constant<int, ggml::kQ8_0>{}); break;
    case ggml::kQ4_0: f(std::integral_constant<int, ggml::kQ4_0>{}); break;
    case ggml::kQ4_1: f(std::integral_constant<int, ggml::kQ4_1>{}); break;
    case ggml::kQ5_0: f(std::integral_constant<int, ggml::kQ5_0>{}); break;
    case ggml::kQ5_1: f(std::integral_constant<int, ggml::kQ5_1>{}); break;
    case ggml::kQ2_K: f(std::integral_constant<int, ggml::kQ2_K>{}); break;
    case ggml::kQ3_K: f(std::integral_constant<int, ggml::kQ3_K>{}); break;
    case ggml::kQ4_K: f(std::integral_constant<int, ggml::kQ4_K>{}); break;
    case ggml::kQ5_K: f(std::integral_constant<int, ggml::kQ5_K>{}); break;
    case ggml::kQ6_K: f(std::integral_constant<int, ggml::kQ6_K>{}); break;
    case ggml::kIQ4_NL: f(std::integral_constant<int, ggml::kIQ4_NL>{}); break;
    default: f(std::integral_constant<int, ggml::kIQ4_XS>{}); break;
  }
}

#if defined(PYENGINE_QLINEAR_VNNI)

// v shifted left by S bits within 16-bit lanes (right for S < 0).
template <int S>
inline __m512i shift16(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  else return v;
}

// The high nibble of every byte of v, as a byte: a shift and a mask. One GF(2) affine op (GFNI) would do
// it in one, but on some cores vgf2p8affineqb issues on the two pipes that run vpdpbusd (a 1:1 mix
// halves the dot products' rate; shifts and masks go to the other pipes), and the shift measured faster
// (bench/lab/dot_rate_probe.cpp shows which ops share the pipes; docs/performance.md, "quantized linear").
inline __m512i high_nibbles(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }

// Line I of a group of one tile -> the unsigned values of its low (k = 8I + t) and high (8I + 4 + t)
// nibbles (2-bit types: 2-bit values) with their high bits, or (Q8_0) its bytes in lo. The high bits
// are moved into place and merged in one ternary-logic op each (a | (b & mask): 0xF8).
template <int T, int I>
inline void vnni_line(const uint8_t* grp, __m512i& lo, __m512i& hi) {
  constexpr Layout L = layout(T);
  const __m512i raw = _mm512_loadu_si512(grp + 64 * (L.bits == 2 ? I / 2 : I));
  if constexpr (L.lines == 8) {
    lo = raw;
    return;
  }
  if constexpr (L.bits == 4) {
    lo = _mm512_and_si512(raw, _mm512_set1_epi8(0x0F));
    hi = high_nibbles(raw);
  } else {
    constexpr int at = 4 * (I % 2);  // 2-bit types: the line's first bit in its stored line's bytes
    const __m512i mask = _mm512_set1_epi8(0x03);
    lo = _mm512_and_si512(shift16<-at>(raw), mask);
    hi = _mm512_and_si512(shift16<-at - 2>(raw), mask);
  }
  if constexpr (L.lookup) {  // kIq4nl + 128, in each 128-bit lane
    const __m512i table = _mm512_broadcast_i32x4(_mm_set_epi8(
        static_cast<char>(241), static_cast<char>(217), static_cast<char>(197), static_cast<char>(181),
        static_cast<char>(166), static_cast<char>(153), static_cast<char>(141), static_cast<char>(129), 118, 106,
        93, 79, 63, 45, 24, 1));
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  } else if constexpr (L.high_lines == 1) {  // bit 2I (2I + 1) of the byte -> bit 4 (Q3_K: bit 2)
    const __m512i top = _mm512_set1_epi8(1 << L.bits), hb = _mm512_loadu_si512(grp + 64 * L.bits);
    lo = _mm512_ternarylogic_epi32(lo, shift16<L.bits - 2 * I>(hb), top, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, shift16<L.bits - 1 - 2 * I>(hb), top, 0xF8);
  } else if constexpr (L.high_lines == 2) {  // bits 4p, 4p + 1 (4p + 2, 4p + 3) -> bits 4, 5
    constexpr int p = 4 * (I % 2);
    const __m512i bits45 = _mm512_set1_epi8(0x30), hb = _mm512_loadu_si512(grp + 256 + 64 * (I / 2));
    lo = _mm512_ternarylogic_epi32(lo, shift16<4 - p>(hb), bits45, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, shift16<2 - p>(hb), bits45, 0xF8);
  }
}

// vec_scales' vector: 16 rows of a tile, one per fp32 lane.
struct Zmm {
  using F = __m512;
  using I = __m512i;
  static F f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static F u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(p))); }
  static F u4(const uint8_t* p, bool high) {  // the low or high nibble of each byte
    const __m512i b = _mm512_cvtepu8_epi32(bytes(p));
    return _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
  }
  static F i8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(p))); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static I join(I hi, I lo) { return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
};

#endif

#if defined(PYENGINE_QLINEAR_AMX)
// The two AMX-INT8 tile sets of linear/quant.cpp's amx path: set s is tmm(3s) A
// (16 rows of k bytes: k = a block of type T's int8 values, or half of one), tmm(3s+1) B (k/4 rows of 64
// bytes: 16 columns of 4 bytes) and tmm(3s+2) C (16 rows of 16 int32).
template <int T>
inline void configure_int8_tile_sets() {
  constexpr int k = ggml::kBlock / ggml::layout(T).halves;
  TileConfig cfg;
  for (int set = 0; set < 2; ++set) {
    cfg.rows[3 * set] = 16, cfg.colsb[3 * set] = k;
    cfg.rows[3 * set + 1] = k / 4, cfg.colsb[3 * set + 1] = 64;
    cfg.rows[3 * set + 2] = 16, cfg.colsb[3 * set + 2] = 64;
  }
  load_tile_config(cfg);
}
#endif

// linear/quant_strips.cpp: out = x @ W^T (+ bias) for bf16 x of M rows and qlinear's segment table, where
// M >= qlinear_strip_rows() and linear/bf16.cpp has a SIMD kernel; false (nothing done) otherwise.
bool qlinear_strips(const uint16_t* x, const int64_t* seg, const float* bias, void* out, int64_t M, int64_t N,
                    int64_t K, bool out_f32);

}  // namespace pyengine::cpu
