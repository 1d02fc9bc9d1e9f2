// Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS):
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// The weight stays quantized, repacked once at load into 16-row tiles (ggml_blocks.h), so decode
// streams 4.5-8.5 bits per weight instead of bf16's 16. Activations are quantized per 32-value
// block to int8 in two rows, the value and its residual (quantize_row), each with an fp32 scale
// dx = amax / 127 (round to nearest even) and its block sums for the offset term. Per (row, tile,
// 32-value group): int8 dot products of 64-byte lines (Q8_0: 8 lines; the others 4 lines x low/high
// nibbles, with the Q5/Q6 high bits or'ed in), accumulated in fp32 across groups:
//   acc[m][j] += dx[m, b] * (d[j, b] * dot[m][j] + c[j, b] * s[m, b])
// (Q6_K: per 16-value half, with the half's sum), and the two rows' results are summed (+ bias).
// A weight may be several row ranges of different types (a fused qkv of Q5_0 q/k and a Q8_0 v, as
// llama.cpp's Q4_K_M mixes): a segment table, the activations quantized once for all of them.
// SIMD paths, chosen at run time among those this build has (set_qlinear_isa, for tests):
//   avx512_vnni: vpdpbusd, the 16 rows of a tile in the lanes of one zmm, 4 activation bytes broadcast;
//   avx2: vpmaddubsw + vpmaddwd, a tile's rows in two ymm (Q8_0 on signed values: no i16 overflow);
//   scalar: a portable loop over the same layout.
// Parallel shape as linear.cpp: tiles split into one contiguous range per thread; within a range,
// groups of NT tiles x chunks of MR rows; big M in row panels so the quantized activations stay in
// L2 while the weights stream.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/ggml_blocks.h"
#include "pyengine/parallel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PYENGINE_QLINEAR_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PYENGINE_QLINEAR_VNNI 1
// GCC 12 warns inside its own _mm512_cvtph_ps (an undefined pass-through operand): a false positive
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pyengine::cpu {
namespace {

using ggml::kBlock;
using ggml::kTileRows;
using ggml::Layout;
using ggml::layout;

constexpr int64_t kMaxRows = 8;                   // rows of x per pass over a tile group
constexpr int64_t kMinParallelBytes = 32 * 1024;  // below this weight size the caller runs alone
constexpr int64_t kPanelMinRows = 64;
constexpr int64_t kPanelBytes = 256 * 1024;       // quantized x per panel

enum Isa : int { kScalar, kAvx2, kVnni };

constexpr Isa kBestIsa =
#if defined(PYENGINE_QLINEAR_VNNI)
    kVnni;
#elif defined(PYENGINE_QLINEAR_AVX2)
    kAvx2;
#else
    kScalar;
#endif

constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512_vnni"};

std::atomic<int> g_isa{kBestIsa};

struct QArgs {
  const int8_t* xq;    // [M, K]
  const float* dx;     // [M, KB]
  const float* sx;     // [M, KB]: dx * sum(xq) of the block
  const float* sh;     // [M, 2 KB]: dx * sum(xq) of each 16-value half (Q6_K)
  const uint8_t* w;    // the segment's tiles
  float* out;          // [M, ldo], this segment's first column
  int64_t M, N, K, KB, ldo;
};

// Bytes of one tile's records.
inline int64_t tile_stride(const Layout& L, int64_t KB) { return KB / L.groups() * L.record_bytes(); }

// Stored unsigned value k (0..31) of row j in a group, for the scalar paths (the IQ4 types: the signed
// level, their group_scale has c = 0).
template <int T>
inline int group_value(const uint8_t* grp, int64_t j, int64_t k) {
  constexpr Layout L = layout(T);
  if constexpr (L.lines == 8) return grp[64 * (k / 4) + 4 * j + k % 4];
  const int64_t i = k / 8, t = k % 4;
  const int high = (k % 8) >= 4;
  const uint8_t byte = grp[64 * i + 4 * j + t];
  int u = high ? byte >> 4 : byte & 0x0F;
  if constexpr (L.high_lines == 1) u |= ((grp[256 + 4 * j + t] >> (2 * i + high)) & 1) << 4;
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
  } else if constexpr (T == ggml::kQ6_K) {
    const float d = f16(0) * static_cast<float>(static_cast<int8_t>(s[32 + 16 * (2 * g + h) + j]));
    return {d, -32.0f * d};
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

template <int T>
void tile_group_scalar(const QArgs& a, int64_t t0, int nt) {
  constexpr Layout L = layout(T);
  constexpr int64_t per_half = kBlock / L.halves;
  const int64_t stride = tile_stride(L, a.KB);
  for (int64_t tile = t0; tile < t0 + nt; ++tile) {
    const uint8_t* w = a.w + tile * stride;
    const int64_t n0 = tile * kTileRows, valid = std::min(kTileRows, a.N - n0);
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
        a.out[m * a.ldo + n0 + j] = acc;
      }
    }
  }
}

// Calls f(std::integral_constant<int, I>) for I = B .. E - 1: line indices as constants, so every
// shift below is an immediate.
template <int B, int E, class F>
inline void static_for(F&& f) {
  if constexpr (B < E) {
    f(std::integral_constant<int, B>{});
    static_for<B + 1, E>(f);
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

// Line I of a group of one tile -> the unsigned values of its low (k = 8I + t) and high (8I + 4 + t)
// nibbles with their high bits, or (Q8_0) its bytes in lo. The high bits are moved into place and
// merged in one ternary-logic op each (a | (b & mask): 0xF8).
template <int T, int I>
inline void vnni_line(const uint8_t* grp, __m512i& lo, __m512i& hi) {
  constexpr Layout L = layout(T);
  const __m512i raw = _mm512_loadu_si512(grp + 64 * I);
  if constexpr (L.lines == 8) {
    lo = raw;
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(raw, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  if constexpr (L.lookup) {  // kIq4nl + 128, in each 128-bit lane
    const __m512i table = _mm512_broadcast_i32x4(_mm_set_epi8(
        static_cast<char>(241), static_cast<char>(217), static_cast<char>(197), static_cast<char>(181),
        static_cast<char>(166), static_cast<char>(153), static_cast<char>(141), static_cast<char>(129), 118, 106,
        93, 79, 63, 45, 24, 1));
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  } else if constexpr (L.high_lines == 1) {  // bit 2I (2I + 1) of the byte -> bit 4
    const __m512i bit4 = _mm512_set1_epi8(0x10), hb = _mm512_loadu_si512(grp + 256);
    lo = _mm512_ternarylogic_epi32(lo, shift16<4 - 2 * I>(hb), bit4, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, shift16<3 - 2 * I>(hb), bit4, 0xF8);
  } else if constexpr (L.high_lines == 2) {  // bits 4p, 4p + 1 (4p + 2, 4p + 3) -> bits 4, 5
    constexpr int p = 4 * (I % 2);
    const __m512i bits45 = _mm512_set1_epi8(0x30), hb = _mm512_loadu_si512(grp + 256 + 64 * (I / 2));
    lo = _mm512_ternarylogic_epi32(lo, shift16<4 - p>(hb), bits45, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, shift16<2 - p>(hb), bits45, 0xF8);
  }
}

// (d, c) of the 16 rows of one tile for group g, half h of record `rec` (group_scale, vectorised).
template <int T>
inline void vnni_scales(const uint8_t* rec, int64_t g, int h, __m512& d, __m512& c) {
  constexpr Layout L = layout(T);
  const uint8_t* s = rec + L.scales_offset();
  auto f16 = [&](int64_t off) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + off))); };
  auto bytes = [&](int64_t off) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off)); };
  if constexpr (T == ggml::kQ4_K || T == ggml::kQ5_K) {
    d = _mm512_mul_ps(f16(0), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(64 + 16 * g))));
    c = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), f16(32)),
                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(192 + 16 * g))));
  } else if constexpr (T == ggml::kQ6_K) {
    d = _mm512_mul_ps(f16(0), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(32 + 16 * (2 * g + h)))));
    c = _mm512_mul_ps(d, _mm512_set1_ps(-32.0f));
  } else if constexpr (T == ggml::kQ4_1 || T == ggml::kQ5_1) {
    d = f16(0);
    c = f16(32);
  } else if constexpr (T == ggml::kIQ4_XS) {
    d = _mm512_mul_ps(f16(0), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(32 + 16 * g))));
    c = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
  } else {
    d = f16(0);
    c = _mm512_mul_ps(d, _mm512_set1_ps(T == ggml::kQ8_0 || L.lookup ? -128.0f : T == ggml::kQ5_0 ? -16.0f : -8.0f));
  }
}

// Rows [r0, r0 + MR) x tiles [t0, t0 + NT).
template <int T, int MR, int NT>
void vnni_block(const QArgs& a, int64_t r0, int64_t t0) {
  constexpr Layout L = layout(T);
  constexpr int per_half = L.lines / L.halves;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t stride = tile_stride(L, a.KB);
  const uint8_t* w = a.w + t0 * stride;
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b % L.groups();
    const uint8_t* rec = w + b / L.groups() * L.record_bytes();
    const uint8_t* grp = rec + g * L.group_bytes();
    // activation words (4 bytes) of this block, per row
    const int32_t* xw[MR];
    for (int m = 0; m < MR; ++m) xw[m] = reinterpret_cast<const int32_t*>(a.xq + (r0 + m) * a.K + b * kBlock);
    static_for<0, L.halves>([&](auto hc) {
      constexpr int h = decltype(hc)::value;
      __m512i dot[MR][NT];
      for (int m = 0; m < MR; ++m)
        for (int t = 0; t < NT; ++t) dot[m][t] = _mm512_setzero_si512();
      static_for<h * per_half, (h + 1) * per_half>([&](auto ic) {
        constexpr int i = decltype(ic)::value;
        __m512i lo[NT], hi[NT];
        for (int t = 0; t < NT; ++t) {
          _mm_prefetch(reinterpret_cast<const char*>(grp + t * stride + 64 * i + 8 * L.group_bytes()), _MM_HINT_T0);
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
        for (int m = 0; m < MR; ++m) {
          const int64_t xb = (r0 + m) * a.KB + b;
          const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[xb]));
          acc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][t]), ds, acc[m][t]);
          acc[m][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(offset_sum<T>(a, xb, h)), acc[m][t]);
        }
      }
    });
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (t0 + t) * kTileRows;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kTileRows, a.N - n0)) - 1u);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(a.out + (r0 + m) * a.ldo + n0, mask, acc[m][t]);
  }
}

using BlockFn = void (*)(const QArgs&, int64_t, int64_t);

template <int T, int MR>
constexpr BlockFn block_fn(int nt) {
  return nt == 4 ? &vnni_block<T, MR, 4> : nt == 2 ? &vnni_block<T, MR, 2> : &vnni_block<T, MR, 1>;
}

template <int T, int... MRs>
BlockFn pick(int64_t rows, int nt, std::integer_sequence<int, MRs...>) {
  static constexpr BlockFn table[][3] = {{block_fn<T, MRs + 1>(1), block_fn<T, MRs + 1>(2), block_fn<T, MRs + 1>(4)}...};
  return table[rows - 1][nt == 4 ? 2 : nt - 1];
}

template <int T>
void tile_group_vnni(const QArgs& a, int64_t t0, int nt) {
  for (int64_t r0 = 0; r0 < a.M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, a.M - r0);
    pick<T>(rows, nt, std::make_integer_sequence<int, kMaxRows>{})(a, r0, t0);
  }
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
// come back signed (q), for avx2_block's sign trick.
template <int T, int I>
inline void avx2_line(const uint8_t* grp, int r, __m256i& lo, __m256i& hi) {
  constexpr Layout L = layout(T);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * I + 32 * r));
  if constexpr (L.lines == 8) {
    lo = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80)));
    return;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(raw, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
  if constexpr (L.lookup) {  // the signed levels, for the sign trick
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ggml::kIq4nl)));
    lo = _mm256_shuffle_epi8(table, lo);
    hi = _mm256_shuffle_epi8(table, hi);
  } else if constexpr (L.high_lines == 1) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 256 + 32 * r));
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16<4 - 2 * I>(hb), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16<3 - 2 * I>(hb), bit4));
  } else if constexpr (L.high_lines == 2) {
    constexpr int p = 4 * (I % 2);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 256 + 64 * (I / 2) + 32 * r));
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16<4 - p>(hb), bits45));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16<2 - p>(hb), bits45));
  }
}

// As vnni_scales, for rows 8r .. 8r + 7; Q8_0's and the IQ4 types' offset is 0 (their dot products are on
// signed values).
template <int T>
inline void avx2_scales(const uint8_t* rec, int64_t g, int h, int r, __m256& d, __m256& c) {
  constexpr Layout L = layout(T);
  const uint8_t* s = rec + L.scales_offset();
  auto f16 = [&](int64_t off) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off + 16 * r))); };
  auto bytes = [&](int64_t off) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + off + 8 * r)); };
  if constexpr (T == ggml::kQ4_K || T == ggml::kQ5_K) {
    d = _mm256_mul_ps(f16(0), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(64 + 16 * g))));
    c = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), f16(32)),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(192 + 16 * g))));
  } else if constexpr (T == ggml::kQ6_K) {
    d = _mm256_mul_ps(f16(0), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(32 + 16 * (2 * g + h)))));
    c = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));
  } else if constexpr (T == ggml::kQ4_1 || T == ggml::kQ5_1) {
    d = f16(0);
    c = f16(32);
  } else if constexpr (T == ggml::kIQ4_XS) {
    d = _mm256_mul_ps(f16(0), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(32 + 16 * g))));
    c = _mm256_setzero_ps();
  } else if constexpr (T == ggml::kQ8_0 || L.lookup) {
    d = f16(0);
    c = _mm256_setzero_ps();
  } else {
    d = f16(0);
    c = _mm256_mul_ps(d, _mm256_set1_ps(T == ggml::kQ5_0 ? -16.0f : -8.0f));
  }
}

// Rows [r0, r0 + MR) x one tile. vpmaddubsw sums two u8 x s8 products in int16: at most 2 * 63 * 127
// per nibble line (a low and a high line's pairs added: 32004 for Q6_K) fits; Q8_0 runs on |q| and
// sign(q) x (2 * 128 * 127), as llama.cpp does, and so do the IQ4 types' signed levels.
template <int T, int MR>
void avx2_block(const QArgs& a, int64_t r0, int64_t tile) {
  constexpr Layout L = layout(T);
  constexpr int per_half = L.lines / L.halves;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const int64_t stride = tile_stride(L, a.KB);
  const uint8_t* w = a.w + tile * stride;
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b % L.groups();
    const uint8_t* rec = w + b / L.groups() * L.record_bytes();
    const uint8_t* grp = rec + g * L.group_bytes();
    const int32_t* xw[MR];
    for (int m = 0; m < MR; ++m) xw[m] = reinterpret_cast<const int32_t*>(a.xq + (r0 + m) * a.K + b * kBlock);
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
        for (int m = 0; m < MR; ++m) {
          const int64_t xb = (r0 + m) * a.KB + b;
          const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.dx[xb]));
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][r]), ds, acc[m][r]);
          acc[m][r] = _mm256_fmadd_ps(c, _mm256_set1_ps(offset_sum<T>(a, xb, h)), acc[m][r]);
        }
      }
    });
  }
  const int64_t n0 = tile * kTileRows, valid = std::min(kTileRows, a.N - n0);
  for (int m = 0; m < MR; ++m) {
    float row[kTileRows];
    _mm256_storeu_ps(row, acc[m][0]);
    _mm256_storeu_ps(row + 8, acc[m][1]);
    std::memcpy(a.out + (r0 + m) * a.ldo + n0, row, static_cast<size_t>(valid) * sizeof(float));
  }
}

template <int T>
void tile_group_avx2(const QArgs& a, int64_t t0, int nt) {
  for (int64_t tile = t0; tile < t0 + nt; ++tile) {
    int64_t r0 = 0;
    for (; r0 + 2 <= a.M; r0 += 2) avx2_block<T, 2>(a, r0, tile);
    if (r0 < a.M) avx2_block<T, 1>(a, r0, tile);
  }
}

#endif

inline int tiles_per_group(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

template <int T>
void tile_range(const QArgs& a, int64_t begin, int64_t end, int isa) {
  const int group = tiles_per_group(std::min(a.M, kMaxRows));
  int64_t t = begin;
  for (int nt = group; nt >= 1; nt /= 2) {
    for (; t + nt <= end; t += nt) {
#if defined(PYENGINE_QLINEAR_VNNI)
      if (isa == kVnni) {
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
// and of its two 16-value halves): the value (x ~ d1 q1) and its residual (x - d1 q1 ~ d2 q2,
// d2 ~ d1 / 254), so x ~ d1 q1 + d2 q2 to about 15 bits. One int8 level alone (as llama.cpp's q8
// activations) cost 2.4% top-1 agreement on the default model against fp32 (97.6%,
// tests/test_quant_model.py); the residual row reuses every weight line the first row loads, so
// decode (bound by the weight stream) barely pays for it.
template <class Load>
void quantize_row(Load load, int64_t K, int8_t* xq, float* dx, float* sx, float* sh) {
  const int64_t KB = K / kBlock;
  for (int64_t b = 0; b < KB; ++b) {
    float v[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) v[i] = load(b * kBlock + i);
    for (int level = 0; level < 2; ++level) {
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = xq + level * K + b * kBlock;
      int32_t sum[2] = {0, 0};
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * id));
        q[i] = static_cast<int8_t>(qi);
        sum[i / 16] += qi;
        v[i] -= d * static_cast<float>(qi);  // the residual, for level 1
      }
      dx[level * KB + b] = d;
      sx[level * KB + b] = d * static_cast<float>(sum[0] + sum[1]);
      sh[2 * (level * KB + b)] = d * static_cast<float>(sum[0]);
      sh[2 * (level * KB + b) + 1] = d * static_cast<float>(sum[1]);
    }
  }
}

void check_type(int type, const char* who) {
  if (!ggml::supported(type))
    throw std::invalid_argument(std::string(who) + ": GGML type " + std::to_string(type) +
                                " has no native kernel (supported: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, "
                                "Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23)");
}

void check_k(int type, int64_t K, const char* who) {
  const int64_t values = layout(type).values;
  if (K <= 0 || K % values)
    throw std::invalid_argument(std::string(who) + ": K = " + std::to_string(K) + " is not a positive multiple of " +
                                std::to_string(values) + " (GGML type " + std::to_string(type) + ")");
}

template <class F>
void dispatch(int type, F&& f) {
  switch (type) {
    case ggml::kQ8_0: f(std::integral_constant<int, ggml::kQ8_0>{}); break;
    case ggml::kQ4_0: f(std::integral_constant<int, ggml::kQ4_0>{}); break;
    case ggml::kQ4_1: f(std::integral_constant<int, ggml::kQ4_1>{}); break;
    case ggml::kQ5_0: f(std::integral_constant<int, ggml::kQ5_0>{}); break;
    case ggml::kQ5_1: f(std::integral_constant<int, ggml::kQ5_1>{}); break;
    case ggml::kQ4_K: f(std::integral_constant<int, ggml::kQ4_K>{}); break;
    case ggml::kQ5_K: f(std::integral_constant<int, ggml::kQ5_K>{}); break;
    case ggml::kQ6_K: f(std::integral_constant<int, ggml::kQ6_K>{}); break;
    case ggml::kIQ4_NL: f(std::integral_constant<int, ggml::kIQ4_NL>{}); break;
    default: f(std::integral_constant<int, ggml::kIQ4_XS>{}); break;
  }
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
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t t = 0; t < 4; ++t) {
      const int lo = u[8 * i + t], hi = u[8 * i + 4 + t];
      grp[64 * i + 4 * j + t] = static_cast<uint8_t>((lo & 0x0F) | (hi & 0x0F) << 4);
      if (L.high_lines == 1)
        grp[256 + 4 * j + t] |= static_cast<uint8_t>(((lo >> 4) & 1) << (2 * i) | ((hi >> 4) & 1) << (2 * i + 1));
      if (L.high_lines == 2)
        grp[256 + 64 * (i / 2) + 4 * j + t] |=
            static_cast<uint8_t>(((lo >> 4) & 3) << (4 * (i % 2)) | ((hi >> 4) & 3) << (4 * (i % 2) + 2));
    }
}

}  // namespace

void set_qlinear_isa(const std::string& name) {
  for (int isa = kScalar; isa <= kBestIsa; ++isa) {
    if (name == kIsaNames[isa]) {
#if !defined(PYENGINE_QLINEAR_AVX2)
      if (isa == kAvx2) break;
#endif
      g_isa.store(isa);
      return;
    }
  }
  throw std::invalid_argument("qlinear: SIMD path '" + name + "' is not in this build (have: " +
                              qlinear_isas() + ")");
}

std::string qlinear_isas() {
  std::string names = kIsaNames[kScalar];
#if defined(PYENGINE_QLINEAR_AVX2)
  names += std::string(",") + kIsaNames[kAvx2];
#endif
#if defined(PYENGINE_QLINEAR_VNNI)
  names += std::string(",") + kIsaNames[kVnni];
#endif
  return names;
}

std::string qlinear_isa() { return kIsaNames[g_isa.load()]; }

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
  // The kernel runs on 2M int8 rows (each row of x, then its residual: quantize_row) into fp32 partial
  // results, and the two partials of a row are summed (+ bias) at the end.
  const int64_t KB = K / kBlock, M2 = 2 * M;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> scales, partial;
  xq.resize(static_cast<size_t>(M2 * K));
  scales.resize(static_cast<size_t>(4 * M2 * KB));
  partial.resize(static_cast<size_t>(M2 * N));
  int8_t* const xqb = xq.data();
  float* const dx = scales.data();
  float* const sx = dx + M2 * KB;
  float* const sh = sx + M2 * KB;
  float* const part = partial.data();
  auto& pool = ThreadPool::instance();
  const int64_t parts = M > kPanelMinRows ? pool.num_threads() : 1;
  pool.parallel_for(parts, [&](int64_t c) {
    for (int64_t r = M * c / parts; r < M * (c + 1) / parts; ++r) {
      int8_t* q = xqb + 2 * r * K;
      float *d = dx + 2 * r * KB, *s = sx + 2 * r * KB, *h = sh + 4 * r * KB;
      if (x_dtype == f32) {
        const float* row = reinterpret_cast<const float*>(x) + r * K;
        quantize_row([&](int64_t i) { return row[i]; }, K, q, d, s, h);
      } else {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x) + r * K;
        quantize_row([&](int64_t i) { return bf16_to_float(row[i]); }, K, q, d, s, h);
      }
    }
  });
  const int isa = g_isa.load();
  const int64_t panel = M2 > kPanelMinRows ? std::max<int64_t>(kMaxRows, kPanelBytes / K / kMaxRows * kMaxRows) : M2;
  for (int64_t p0 = 0; p0 < M2; p0 += panel) {
    int64_t col = 0;
    for (int64_t s = 0; s < seg[0]; ++s) {
      const int type = static_cast<int>(seg[1 + 3 * s]);
      const int64_t n = seg[2 + 3 * s], tiles = (n + kTileRows - 1) / kTileRows;
      const int64_t bytes = tiles * tile_stride(layout(type), KB);
      const int64_t chunks = bytes < kMinParallelBytes ? 1 : std::min<int64_t>(tiles, pool.num_threads());
      const QArgs a{xqb + p0 * K, dx + p0 * KB, sx + p0 * KB, sh + 2 * p0 * KB,
                    reinterpret_cast<const uint8_t*>(seg[3 + 3 * s]), part + p0 * N + col,
                    std::min(panel, M2 - p0), n, K, KB, N};
      dispatch(type, [&](auto t) {
        pool.parallel_for(chunks, [&](int64_t c) {
          tile_range<decltype(t)::value>(a, tiles * c / chunks, tiles * (c + 1) / chunks, isa);
        });
      });
      col += n;
    }
  }
  const float* b = reinterpret_cast<const float*>(bias);
  pool.parallel_for(parts, [&](int64_t c) {
    for (int64_t r = M * c / parts; r < M * (c + 1) / parts; ++r) {
      const float* hi = part + 2 * r * N;
      const float* lo = hi + N;
      if (out_dtype == f32) {
        float* o = reinterpret_cast<float*>(out) + r * N;
        for (int64_t n = 0; n < N; ++n) o[n] = hi[n] + lo[n] + (b ? b[n] : 0.0f);
      } else {
        uint16_t* o = reinterpret_cast<uint16_t*>(out) + r * N;
        for (int64_t n = 0; n < N; ++n) o[n] = float_to_bf16(hi[n] + lo[n] + (b ? b[n] : 0.0f));
      }
    }
  });
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
          // the dequantized value as GGUF defines it, d * u + c (exact: Q8_0's d * q, Q6_K's d sc (q - 32))
          const Scale s = group_scale<Ty>(rec, j, g, static_cast<int>(k / per_half));
          const float v = s.d * static_cast<float>(group_value<Ty>(rec + g * L.group_bytes(), j, k)) + s.c;
          const int64_t off = r * K + b * kBlock + k;
          if (f32) reinterpret_cast<float*>(out)[off] = v;
          else reinterpret_cast<uint16_t*>(out)[off] = float_to_bf16(v);
        }
      }
    });
  });
}

}  // namespace pyengine::cpu
