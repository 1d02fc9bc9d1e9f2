// reshape_and_cache (CPU): write this step's K/V rows into the paged KV cache.
//
// Layouts (element strides, all row-major):
//   key, value      [T, KVH, D]; token stride key_stride / value_stride, heads and D contiguous
//                   (so a column slice of a fused QKV projection works without a copy)
//   k_cache [NB, KVH, D/L, BS, L], v_cache [NB, KVH, BS/L, D, L]: the CPU cache layout (kv_layout.h),
//                   L = 4 for fp8/int8 caches, 2 otherwise. Per (block, kv head) tile, K holds groups of
//                   L dims of each token and V groups of L tokens of each dim: the operand layouts of
//                   the decode kernel's dot products, so attention reads them without shuffles.
//   k_scales, v_scales [NB, KVH, BS] fp32 (fp8/int8 caches only)
//   slot_mapping    [T] int64, slot = block * BS + offset; -1 = skip the token
//   query           [T, H, D] or null; token stride query_stride: this step's q (in K's basis), for which
//                   fp8 and int8 caches round K (round_k_for_queries)
// Source dtype fp32/bf16/fp16; the cache has the same dtype (plain copy) or fp8 e4m3 / int8
// (quantized per (token, kv head) row, see kv_quant.h: fp8 picks the best of 16 scales).
// Parallel shape: tokens in contiguous ranges over the thread pool; every (token, kv head) row is
// independent. Slots are validated up front so a bad slot raises before anything is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/bf16_widen.h"
#include "pyengine/dtype.h"
#include "pyengine/kv_layout.h"
#include "pyengine/kv_quant.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"
#include "pyengine/simd_transpose.h"
#include "pyengine/vec_reduce.h"

#include "pyengine/simd.h"

namespace pyengine {
namespace {

size_t elem_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kFloat8E4M3:
    case DType::kInt8: return 1;
  }
  return 0;
}

void row_to_float(const void* src, DType t, int64_t n, float* dst) {
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, t == DType::kBFloat16
                                  ? load_bf16x16(s + i)
                                  : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
#endif
  for (; i < n; ++i) dst[i] = t == DType::kBFloat16 ? bf16_to_float(s[i]) : fp16_to_float(s[i]);
}

#if defined(__AVX512F__)
// e4m3's rounding of magnitudes a (float_to_fp8e4m3 then fp8e4m3_to_float) on the fp32 bits: 3 mantissa
// bits, ties to even, at most 448; below 2^-6 steps of 2^-9.
inline __m512 fp8_round_magnitude(__m512 a) {
  const __m512i b = _mm512_castps_si512(a);
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7ffff)),
                                                      _mm512_and_si512(_mm512_srli_epi32(b, 20), _mm512_set1_epi32(1))),
                                     _mm512_set1_epi32(~0xfffff));
  const __m512 normal = _mm512_min_ps(_mm512_castsi512_ps(r), _mm512_set1_ps(kFp8E4M3Max));
  const __m512 sub = _mm512_mul_ps(
      _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
      _mm512_set1_ps(0.001953125f));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), normal, sub);
}

inline __m512 sign_of(__m512 y) { return _mm512_and_ps(y, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN))); }
#endif

#if defined(__AVX512F__)
// Lanes [0, n - i) of the 16 from element i.
inline __mmask16 lanes_from(int64_t i, int64_t n) {
  return n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
}

// The row's largest magnitude, NaNs skipped as std::max(absmax, |x|) skips them (vmaxps returns its
// second operand where the first is NaN).
float row_absmax(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(lanes_from(i, n), x + i)), m);
  return _mm512_reduce_max_ps(m);
}

// x / scale (0 where scale is not > 0), as kv_scaled.
inline __m512 scaled(__m512 x, float scale) {
  return scale > 0.0f ? _mm512_div_ps(x, _mm512_set1_ps(scale)) : _mm512_setzero_ps();
}

// float_to_int8 of 16 values: nearest even, saturating to +-127, NaN -> -127 (the conversion gives
// INT32_MIN for it; values of a row over its own scale never leave [-127.5, 127.5] otherwise).
inline __m512i int8_codes(__m512 y) {
  const __m512i c = _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_min_epi32(_mm512_max_epi32(c, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
}

// float_to_fp8e4m3 of 16 values, bit for bit: the code of |y|'s e4m3 rounding (fp8_round_magnitude; at
// most 448, inf included), NaN -> 0x7f, the sign in bit 7.
inline __m512i fp8_codes(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y), a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __m512 an = fp8_round_magnitude(_mm512_castsi512_ps(a));
  const __m512i nb = _mm512_castps_si512(an);
  // normals: exponent rebiased 127 -> 7 above the 3 mantissa bits; below 2^-6 the count of 2^-9 steps
  __m512i code = _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(nb, 23), _mm512_set1_epi32(120)), 3),
                                 _mm512_and_si512(_mm512_srli_epi32(nb, 20), _mm512_set1_epi32(7)));
  code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(an, _mm512_set1_ps(0.015625f), _CMP_LT_OQ),
                               _mm512_cvtps_epi32(_mm512_mul_ps(an, _mm512_set1_ps(512.0f))));  // exact
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
  return _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
}

// An e4m3 row's scale: the first of the kFp8ScaleSteps candidates (kv_quant.h) of least squared error,
// all 16 errors summed at once (lane j of the tree's result: candidate j's). The errors are estimates:
// |x| times 1 / scale (not x / scale, which rounds differently only at ties), values below e4m3's
// normals rounded as normals (their errors are under 2^-10 of the scale), so the choice between two
// scales of almost equal error may differ from fp8_sq_error's.
float fp8_row_scale(const float* x, int64_t n, float absmax) {
  static_assert(kFp8ScaleSteps == 16, "one candidate per lane");
  alignas(64) float scale[16], inv[16];
  for (int j = 0; j < 16; ++j) {
    scale[j] = fp8_scale_candidate(absmax, j);
    inv[j] = scale[j] > 0.0f ? 1.0f / scale[j] : 0.0f;
  }
  const __m512i half = _mm512_set1_epi32(0x7ffff), one = _mm512_set1_epi32(1), keep = _mm512_set1_epi32(~0xfffff);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 ax = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes_from(i, n), x + i));
    for (int j = 0; j < 16; ++j) {
      const __m512i b = _mm512_castps_si512(_mm512_mul_ps(ax, _mm512_set1_ps(inv[j])));
      const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, half), _mm512_and_si512(_mm512_srli_epi32(b, 20), one)), keep);
      const __m512 e = _mm512_fmsub_ps(_mm512_min_ps(_mm512_castsi512_ps(r), _mm512_set1_ps(kFp8E4M3Max)),
                                       _mm512_set1_ps(scale[j]), ax);
      acc[j] = _mm512_fmadd_ps(e, e, acc[j]);
    }
  }
  const __m512 err = hsum16(acc);
  const __mmask16 least = _mm512_cmp_ps_mask(err, _mm512_set1_ps(_mm512_reduce_min_ps(err)), _CMP_EQ_OQ);
  return scale[least ? __builtin_ctz(least) : 0];  // none: NaN errors (NaN in x), as the scalar loop keeps j = 0
}

// Quantizes one row of n values into dst, returning its scale (kv_quant.h's codecs, 16 values a step).
float quantize_row(const float* x, int64_t n, DType cache, void* dst) {
  const float absmax = row_absmax(x, n);
  const bool fp8 = cache == DType::kFloat8E4M3;
  const float scale = fp8 ? fp8_row_scale(x, n, absmax) : kv_scale(absmax, kInt8Max);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes_from(i, n);
    const __m512 y = scaled(_mm512_maskz_loadu_ps(m, x + i), scale);
    _mm512_mask_cvtepi32_storeu_epi8(static_cast<char*>(dst) + i, m, fp8 ? fp8_codes(y) : int8_codes(y));
  }
  return scale;
}
#else
// An e4m3 row's scale: the first of the kFp8ScaleSteps candidates (kv_quant.h) of least squared error.
float fp8_row_scale_portable(const float* x, int64_t n, float absmax) {
  float best = 0.0f, best_err = 0.0f;
  for (int j = 0; j < kFp8ScaleSteps; ++j) {
    const float scale = fp8_scale_candidate(absmax, j);
    float err = 0.0f;
    for (int64_t i = 0; i < n; ++i) err += fp8_sq_error(x[i], scale);
    if (j == 0 || err < best_err) best = scale, best_err = err;
  }
  return best;
}

// Quantizes one row of n values into dst, returning its scale.
float quantize_row_portable(const float* x, int64_t n, DType cache, void* dst) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  if (cache == DType::kFloat8E4M3) {
    const float scale = fp8_row_scale_portable(x, n, absmax);
    uint8_t* d = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_fp8e4m3(kv_scaled(x[i], scale));
    return scale;
  }
  const float scale = kv_scale(absmax, kInt8Max);
  int8_t* d = static_cast<int8_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_int8(kv_scaled(x[i], scale));
  return scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// The AVX-512 codecs above in 8-lane vectors, for rows of a multiple of 8 values (head dims; others
// take the portable loops). The portable scale search (16 candidates x 64 values, each through
// float_to_fp8e4m3) made an fp8 write many times an int8 one (docs/performance.md, "KV cache writes").
inline __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

// fp8_round_magnitude in 8 lanes.
inline __m256 fp8_round_magnitude8(__m256 a) {
  const __m256i b = _mm256_castps_si256(a);
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7ffff)),
                                                      _mm256_and_si256(_mm256_srli_epi32(b, 20), _mm256_set1_epi32(1))),
                                     _mm256_set1_epi32(~0xfffff));
  const __m256 normal = _mm256_min_ps(_mm256_castsi256_ps(r), _mm256_set1_ps(kFp8E4M3Max));
  const __m256 sub = _mm256_mul_ps(
      _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
      _mm256_set1_ps(0.001953125f));
  return _mm256_blendv_ps(normal, sub, _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
}

// fp8_codes in 8 lanes (int32 codes).
inline __m256i fp8_codes8(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y), a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256 an = fp8_round_magnitude8(_mm256_castsi256_ps(a));
  const __m256i nb = _mm256_castps_si256(an);
  __m256i code = _mm256_or_si256(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(nb, 23), _mm256_set1_epi32(120)), 3),
                                 _mm256_and_si256(_mm256_srli_epi32(nb, 20), _mm256_set1_epi32(7)));
  const __m256i sub = _mm256_castps_si256(_mm256_cmp_ps(an, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
  code = _mm256_blendv_epi8(code, _mm256_cvtps_epi32(_mm256_mul_ps(an, _mm256_set1_ps(512.0f))), sub);  // exact
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
  return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
}

// int8_codes in 8 lanes (vcvtps2dq rounds to nearest even; NaN gives INT32_MIN, clamped to -127).
inline __m256i int8_codes8(__m256 y) {
  const __m256i c = _mm256_cvtps_epi32(y);
  return _mm256_min_epi32(_mm256_max_epi32(c, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
}

// The low byte of each of c's 8 lanes, to dst[0..8).
inline void store_low_bytes8(__m256i c, void* dst) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(c, pick);
  const uint32_t lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b)));
  const uint32_t hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1)));
  std::memcpy(dst, &lo, 4);
  std::memcpy(static_cast<char*>(dst) + 4, &hi, 4);
}

// fp8_row_scale in 8 lanes: the candidates 8 at a time, each one's error summed in a register of its own
// (the same estimates as the AVX-512 loop's).
float fp8_row_scale8(const float* x, int64_t n, float absmax) {
  float scale[kFp8ScaleSteps], inv[kFp8ScaleSteps], err[kFp8ScaleSteps];
  for (int j = 0; j < kFp8ScaleSteps; ++j) {
    scale[j] = fp8_scale_candidate(absmax, j);
    inv[j] = scale[j] > 0.0f ? 1.0f / scale[j] : 0.0f;
  }
  const __m256i half = _mm256_set1_epi32(0x7ffff), one = _mm256_set1_epi32(1), keep = _mm256_set1_epi32(~0xfffff);
  for (int j0 = 0; j0 < kFp8ScaleSteps; j0 += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 ax = abs8(_mm256_loadu_ps(x + i));
      for (int j = 0; j < 8; ++j) {
        const __m256i b = _mm256_castps_si256(_mm256_mul_ps(ax, _mm256_set1_ps(inv[j0 + j])));
        const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(b, half), _mm256_and_si256(_mm256_srli_epi32(b, 20), one)), keep);
        const __m256 e = _mm256_fmsub_ps(_mm256_min_ps(_mm256_castsi256_ps(r), _mm256_set1_ps(kFp8E4M3Max)),
                                         _mm256_set1_ps(scale[j0 + j]), ax);
        acc[j] = _mm256_fmadd_ps(e, e, acc[j]);
      }
    }
    for (int j = 0; j < 8; ++j) err[j0 + j] = hsum256(acc[j]);
  }
  int best = 0;  // the first least; NaN errors (NaN in x) keep candidate 0, as the portable loop does
  for (int j = 1; j < kFp8ScaleSteps; ++j)
    if (err[j] < err[best]) best = j;
  return scale[best];
}

float quantize_row(const float* x, int64_t n, DType cache, void* dst) {
  if (n % 8 != 0) return quantize_row_portable(x, n, cache, dst);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(abs8(_mm256_loadu_ps(x + i)), m);  // NaN skipped
  const float absmax = hmax256(m);
  const bool fp8 = cache == DType::kFloat8E4M3;
  const float scale = fp8 ? fp8_row_scale8(x, n, absmax) : kv_scale(absmax, kInt8Max);
  const __m256 by = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {  // x / scale, 0 where scale is not > 0 (kv_scaled)
    const __m256 y = scale > 0.0f ? _mm256_div_ps(_mm256_loadu_ps(x + i), by) : zero;
    store_low_bytes8(fp8 ? fp8_codes8(y) : int8_codes8(y), static_cast<char*>(dst) + i);
  }
  return scale;
}
#else
float quantize_row(const float* x, int64_t n, DType cache, void* dst) { return quantize_row_portable(x, n, cache, dst); }
#endif
#endif

// K rows of fp8 and int8 caches are rounded for the queries that will read them. A query's score error
// is q.e (e: the row's rounding error, dequantized - x); queries share a large common direction, along
// which this token's own q points, so an error along it shifts every later query's score alike. From
// round-to-nearest `codes`, values move to their other neighbouring code (at most once each, up to
// kMaxFlips, the best first) while that lowers
//   J(e) = sum_g (u_g . e)^2 + |e|^2 / D      u_g: this token's q of head g of the group, unit length
// where |e|^2 / D stands for the queries' other directions. It narrows the logprob change and raises
// top-1 agreement with an fp32 cache for both dtypes (tests/test_kv_accuracy.py; docs/performance.md,
// "KV cache accuracy").
constexpr int kMaxFlips = 16;

float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  sum = hsum256(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The least of c[i] = a[i] + sum_g p[g] b[g][i] over i < D (b [G][D]): its index (the first of equals)
// and value. One pass, c never stored.
std::pair<int64_t, float> least_change(const float* a, const float* b, const float* p, int64_t G, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 least = _mm512_set1_ps(INFINITY);
    __m512i at = _mm512_setzero_si512();
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < D; i += 16) {
      __m512 c = _mm512_loadu_ps(a + i);
      for (int64_t g = 0; g < G; ++g) c = _mm512_fmadd_ps(_mm512_set1_ps(p[g]), _mm512_loadu_ps(b + g * D + i), c);
      const __mmask16 lower = _mm512_cmp_ps_mask(c, least, _CMP_LT_OQ);  // strict: a lane keeps its first
      least = _mm512_mask_mov_ps(least, lower, c);
      at = _mm512_mask_mov_epi32(at, lower, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i))));
    }
    const float m = _mm512_reduce_min_ps(least);
    const __mmask16 eq = _mm512_cmp_ps_mask(least, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return {eq ? _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), eq, at)) : 0, m};
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {  // the same in 8 lanes
    __m256 least = _mm256_set1_ps(INFINITY);
    __m256i at = _mm256_setzero_si256();
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < D; i += 8) {
      __m256 c = _mm256_loadu_ps(a + i);
      for (int64_t g = 0; g < G; ++g) c = _mm256_fmadd_ps(_mm256_set1_ps(p[g]), _mm256_loadu_ps(b + g * D + i), c);
      const __m256 lower = _mm256_cmp_ps(c, least, _CMP_LT_OQ);
      least = _mm256_blendv_ps(least, c, lower);
      at = _mm256_blendv_epi8(at, _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(i))), _mm256_castps_si256(lower));
    }
    alignas(32) float lv[8];
    alignas(32) int32_t iv[8];
    _mm256_store_ps(lv, least);
    _mm256_store_si256(reinterpret_cast<__m256i*>(iv), at);
    float m = lv[0];
    for (int k = 1; k < 8; ++k) m = std::min(m, lv[k]);
    int64_t best = INT32_MAX;
    for (int k = 0; k < 8; ++k)
      if (lv[k] == m) best = std::min<int64_t>(best, iv[k]);
    return {best == INT32_MAX ? 0 : best, m};
  }
#endif
  int64_t best = 0;
  float m = INFINITY;
  for (int64_t i = 0; i < D; ++i) {
    float c = a[i];
    for (int64_t g = 0; g < G; ++g) c += p[g] * b[g * D + i];
    if (c < m || i == 0) best = i, m = c;
  }
  return {best, m};
}

// u [G][D] unit rows; scratch >= (3 + G) * D floats + G. codes: fp8 e4m3 or int8 (cache), nearest.
void round_k_for_queries(const float* x, int64_t D, float scale, const float* u, int64_t G, DType cache,
                         uint8_t* codes, float* scratch) {
  if (!(scale > 0.0f)) return;
  float *d = scratch, *a = d + D, *e = a + D, *b = e + D, *p = b + G * D;  // b [G][D]
  const float lambda = 1.0f / static_cast<float>(D);
  const bool int8 = cache == DType::kInt8;
  // d: the move to the other neighbour (0: none); e: the rounding error; a: J's change less its p terms.
  // int8's other neighbour is one level up or down, toward x (none past +-127).
  int64_t i0 = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale), lam = _mm512_set1_ps(lambda), tiny = _mm512_set1_ps(0.015625f),
               sub_step = _mm512_set1_ps(0.001953125f), zero = _mm512_setzero_ps();
  const __m512i ulp = _mm512_set1_epi32(1 << 20);  // one step of a 3-bit mantissa
  for (; i0 + 16 <= D; i0 += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i0), y = _mm512_div_ps(xv, s);
    __m512 dv, ev;
    __mmask16 movable;
    if (int8) {
      const __m512 c = _mm512_cvtepi32_ps(int8_codes(y));
      const __mmask16 up = _mm512_cmp_ps_mask(y, c, _CMP_GT_OQ) & _mm512_cmp_ps_mask(c, _mm512_set1_ps(kInt8Max), _CMP_LT_OQ);
      const __mmask16 down = _mm512_cmp_ps_mask(y, c, _CMP_LT_OQ) & _mm512_cmp_ps_mask(c, _mm512_set1_ps(-kInt8Max), _CMP_GT_OQ);
      dv = _mm512_mask_blend_ps(up, _mm512_mask_blend_ps(down, zero, _mm512_sub_ps(zero, s)), s);
      ev = _mm512_fmsub_ps(c, s, xv);
      movable = up | down;
    } else {
      const __m512 ay = _mm512_abs_ps(y), an = fp8_round_magnitude(ay);
      const __m512i bits = _mm512_castps_si512(an);
      const __mmask16 up = _mm512_cmp_ps_mask(an, ay, _CMP_LT_OQ) &
                           _mm512_cmp_ps_mask(an, _mm512_set1_ps(kFp8E4M3Max), _CMP_LT_OQ);
      const __mmask16 down = _mm512_cmp_ps_mask(an, ay, _CMP_GT_OQ);
      const __m512 above = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(an, tiny, _CMP_LT_OQ),
                                                _mm512_castsi512_ps(_mm512_add_epi32(bits, ulp)), _mm512_add_ps(an, sub_step));
      const __m512 below = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(an, tiny, _CMP_LE_OQ),
                                                _mm512_castsi512_ps(_mm512_sub_epi32(bits, ulp)), _mm512_sub_ps(an, sub_step));
      const __m512 other = _mm512_mask_blend_ps(up, _mm512_mask_blend_ps(down, an, below), above);
      const __m512 sign = sign_of(y);
      dv = _mm512_mul_ps(_mm512_xor_ps(_mm512_sub_ps(other, an), sign), s);
      ev = _mm512_sub_ps(_mm512_mul_ps(_mm512_xor_ps(an, sign), s), xv);
      movable = up | down;
    }
    const __m512 av = _mm512_mul_ps(lam, _mm512_mul_ps(dv, _mm512_fmadd_ps(_mm512_set1_ps(2.0f), ev, dv)));
    _mm512_storeu_ps(d + i0, dv);
    _mm512_storeu_ps(e + i0, ev);
    _mm512_storeu_ps(a + i0, _mm512_mask_blend_ps(movable, _mm512_set1_ps(INFINITY), av));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 s = _mm256_set1_ps(scale), lam = _mm256_set1_ps(lambda), tiny = _mm256_set1_ps(0.015625f),
               sub_step = _mm256_set1_ps(0.001953125f), sign_bit = _mm256_set1_ps(-0.0f);
  const __m256i ulp = _mm256_set1_epi32(1 << 20);
  for (; i0 + 8 <= D; i0 += 8) {  // the same in 8 lanes
    const __m256 xv = _mm256_loadu_ps(x + i0), y = _mm256_div_ps(xv, s);
    __m256 dv, ev, movable;
    if (int8) {
      const __m256 c = _mm256_cvtepi32_ps(int8_codes8(y));
      const __m256 up = _mm256_and_ps(_mm256_cmp_ps(y, c, _CMP_GT_OQ), _mm256_cmp_ps(c, _mm256_set1_ps(kInt8Max), _CMP_LT_OQ));
      const __m256 down = _mm256_and_ps(_mm256_cmp_ps(y, c, _CMP_LT_OQ), _mm256_cmp_ps(c, _mm256_set1_ps(-kInt8Max), _CMP_GT_OQ));
      dv = _mm256_blendv_ps(_mm256_and_ps(down, _mm256_xor_ps(s, sign_bit)), s, up);
      ev = _mm256_fmsub_ps(c, s, xv);
      movable = _mm256_or_ps(up, down);
    } else {
      const __m256 ay = abs8(y), an = fp8_round_magnitude8(ay);
      const __m256i bits = _mm256_castps_si256(an);
      const __m256 up = _mm256_and_ps(_mm256_cmp_ps(an, ay, _CMP_LT_OQ),
                                      _mm256_cmp_ps(an, _mm256_set1_ps(kFp8E4M3Max), _CMP_LT_OQ));
      const __m256 down = _mm256_cmp_ps(an, ay, _CMP_GT_OQ);
      const __m256 above = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_add_epi32(bits, ulp)), _mm256_add_ps(an, sub_step),
                                            _mm256_cmp_ps(an, tiny, _CMP_LT_OQ));
      const __m256 below = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_sub_epi32(bits, ulp)), _mm256_sub_ps(an, sub_step),
                                            _mm256_cmp_ps(an, tiny, _CMP_LE_OQ));
      const __m256 other = _mm256_blendv_ps(_mm256_blendv_ps(an, below, down), above, up);
      const __m256 sign = _mm256_and_ps(y, sign_bit);
      dv = _mm256_mul_ps(_mm256_xor_ps(_mm256_sub_ps(other, an), sign), s);
      ev = _mm256_sub_ps(_mm256_mul_ps(_mm256_xor_ps(an, sign), s), xv);
      movable = _mm256_or_ps(up, down);
    }
    const __m256 av = _mm256_mul_ps(lam, _mm256_mul_ps(dv, _mm256_fmadd_ps(_mm256_set1_ps(2.0f), ev, dv)));
    _mm256_storeu_ps(d + i0, dv);
    _mm256_storeu_ps(e + i0, ev);
    _mm256_storeu_ps(a + i0, _mm256_blendv_ps(_mm256_set1_ps(INFINITY), av, movable));
  }
#endif
  for (int64_t i = i0; i < D; ++i) {
    if (int8) {
      const float c = static_cast<float>(static_cast<int8_t>(codes[i])), y = kv_scaled(x[i], scale);
      d[i] = y > c && c < kInt8Max ? scale : y < c && c > -kInt8Max ? -scale : 0.0f;
      e[i] = c * scale - x[i];
    } else {
      const uint8_t c = codes[i], m = c & 0x7f;
      const float v = fp8e4m3_to_float(c), av = std::fabs(v), ay = std::fabs(kv_scaled(x[i], scale));
      const int other = av < ay && m < 0x7e ? (c & 0x80) | (m + 1) : av > ay ? (c & 0x80) | (m - 1) : -1;
      d[i] = other < 0 ? 0.0f : (fp8e4m3_to_float(static_cast<uint8_t>(other)) - v) * scale;
      e[i] = v * scale - x[i];
    }
    a[i] = d[i] == 0.0f ? INFINITY : d[i] * d[i] * lambda + 2.0f * lambda * e[i] * d[i];
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* ug = u + g * D;
    p[g] = dot(ug, e, D);
    for (int64_t i = 0; i < D; ++i) {
      a[i] += d[i] * d[i] * ug[i] * ug[i];
      b[g * D + i] = 2.0f * d[i] * ug[i];
    }
  }
  for (int flip = 0; flip < kMaxFlips; ++flip) {
    const auto [best, change] = least_change(a, b, p, G, D);
    if (!(change < 0.0f)) break;
    // d points to the other neighbour: away from zero (m + 1) when its sign is the code's
    const uint8_t c = codes[best];
    if (int8) codes[best] = static_cast<uint8_t>(d[best] > 0.0f ? c + 1 : c - 1);  // two's complement
    else codes[best] = static_cast<uint8_t>((d[best] > 0.0f) != ((c & 0x80) != 0) ? c + 1 : c - 1);
    for (int64_t g = 0; g < G; ++g) p[g] += u[g * D + best] * d[best];
    a[best] = INFINITY;  // moved once
  }
}

// The unit q rows of the G heads that read kv head h, from query's token row q (src dtype).
void unit_queries(const char* q, DType t, int64_t h, int64_t G, int64_t D, size_t es, float* u) {
  row_to_float(q + h * G * D * es, t, G * D, u);
  for (int64_t g = 0; g < G; ++g) {
    const float n = dot(u + g * D, u + g * D, D);
    const float inv = n > 0.0f ? 1.0f / std::sqrt(n) : 0.0f;
    for (int64_t i = 0; i < D; ++i) u[g * D + i] *= inv;
  }
}

// One token's K and V rows (elements of T: the cache's bytes) into its (block, kv head) tiles at token
// offset `off` (kv_layout.h): K as D / L groups of L consecutive elements, BS * L apart; V element by
// element, L apart. Plain typed stores: the generic memcpy per group (2-4 bytes of a size known only
// at run time) cost a library call each, 96 per token and head.
template <typename T>
void scatter_row(const T* k_row, const T* v_row, T* k_tile, T* v_tile, int64_t off, int64_t BS, int64_t D) {
  constexpr int64_t L = kv_lane(sizeof(T));
  T* kd = k_tile + kv_k_offset(off, 0, BS, L);
  for (int64_t j = 0; j < D; j += L, kd += BS * L)
    for (int64_t i = 0; i < L; ++i) kd[i] = k_row[j + i];
  T* vd = v_tile + kv_v_offset(off, 0, D, L);
  for (int64_t d = 0; d < D; ++d) vd[d * L] = v_row[d];
}

// scatter_row for a cache of es-byte elements.
void scatter_row(const void* k_row, const void* v_row, void* k_tile, void* v_tile, int64_t off, int64_t BS, int64_t D,
                 size_t es) {
  switch (es) {
    case 1:
      return scatter_row(static_cast<const uint8_t*>(k_row), static_cast<const uint8_t*>(v_row),
                         static_cast<uint8_t*>(k_tile), static_cast<uint8_t*>(v_tile), off, BS, D);
    case 2:
      return scatter_row(static_cast<const uint16_t*>(k_row), static_cast<const uint16_t*>(v_row),
                         static_cast<uint16_t*>(k_tile), static_cast<uint16_t*>(v_tile), off, BS, D);
    default:
      return scatter_row(static_cast<const uint32_t*>(k_row), static_cast<const uint32_t*>(v_row),
                         static_cast<uint32_t*>(k_tile), static_cast<uint32_t*>(v_tile), off, BS, D);
  }
}

#if defined(__AVX512BW__)
// The 16 tokens of a 2-byte cache's block group at token offset off0 (a multiple of 16), from token rows
// k + i k_stride and v + i v_stride (i < 16), at once: each K dims pair's 16 tokens are one 64-byte
// line (a 16 x 16 transpose of 32-bit pairs per 32 dims), each V token pair its D dims interleaved.
// Row by row (scatter_row) that is D / 2 stores of 4 bytes a line apart and D of 2 bytes per token and
// head, about twice the time (docs/performance.md, "KV cache writes"). D a multiple of 32.
void write_group16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, uint16_t* k_tile,
                   uint16_t* v_tile, int64_t off0, int64_t BS, int64_t D) {
  for (int64_t j0 = 0; j0 < D / 2; j0 += 16) {  // dims pairs j0 .. j0 + 15
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k + i * k_stride + 2 * j0);
    transpose16x16_epi32(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(k_tile + kv_k_offset(off0, 2 * (j0 + j), BS, 2), r[j]);
  }
  // element 2 d + i of a pair's interleaved run: dim d of token i; lo for dims d0 .. d0 + 15, hi the rest
  alignas(64) static constexpr uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < 8; ++p) {
    const uint16_t* a = v + 2 * p * v_stride;
    uint16_t* dst = v_tile + kv_v_offset(off0 + 2 * p, 0, D, 2);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i x = _mm512_loadu_si512(a + d0), y = _mm512_loadu_si512(a + v_stride + d0);
      _mm512_storeu_si512(dst + 2 * d0, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + 2 * d0 + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}
#endif

}  // namespace

void reshape_and_cache_cpu(const void* key, const void* value, void* k_cache, void* v_cache, float* k_scales,
                           float* v_scales, const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                           int64_t head_dim, int64_t key_stride, int64_t value_stride, int64_t num_blocks,
                           int64_t block_size, DType src_dtype, DType cache_dtype, const void* query,
                           int64_t query_stride, int64_t num_heads) {
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < -1 || slot >= num_slots)
      throw std::invalid_argument("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) +
                                  " is outside [-1, " + std::to_string(num_slots) +
                                  ") (num_blocks * block_size; -1 = skip)");
  }
  const bool quant = cache_dtype == DType::kFloat8E4M3 || cache_dtype == DType::kInt8;
  if (!quant && cache_dtype != src_dtype) throw std::invalid_argument("cache dtype must match key/value dtype");
  if (quant && (k_scales == nullptr || v_scales == nullptr))
    throw std::invalid_argument("fp8/int8 caches need k_scales and v_scales");
  const int64_t lane = kv_lane(elem_size(cache_dtype));
  if (block_size % lane || head_dim % lane)
    throw std::invalid_argument("block_size and head_dim must be multiples of " + std::to_string(lane) +
                                " (the CPU cache layout)");
  const bool for_queries = quant && query != nullptr;
  if (for_queries && (num_heads <= 0 || num_heads % num_kv_heads))
    throw std::invalid_argument("num_heads must be a positive multiple of num_kv_heads");
  const int64_t G = for_queries ? num_heads / num_kv_heads : 0;
  const size_t src_es = elem_size(src_dtype), cache_es = elem_size(cache_dtype);
  const size_t tile_bytes = block_size * head_dim * cache_es;

  // The lines a token's rows go to, fetched for writing (prefetchw where the CPU has it) while the token
  // before is written: in a decode step each token writes to a block of its own sequence, cold, in lines
  // scattered over its tiles (K: one per L dims), and the stores would wait on one miss after another.
  // Until prefetch.h GCC had deleted these prefetches, so the gain first credited to them came from the
  // typed stores of the same change; with them in the binary, alternating runs showed no change either
  // way (docs/performance.md, "KV cache writes"). They stay: they cost nothing measurable.
  const int64_t line_elems = 64 / cache_es;
  auto prefetch_rows = [&](int64_t slot) {
    if (slot < 0) return;
    const int64_t blk = slot / block_size, off = slot % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const char* kd = static_cast<const char*>(k_cache) + (blk * num_kv_heads + h) * tile_bytes;
      const char* vd = static_cast<const char*>(v_cache) + (blk * num_kv_heads + h) * tile_bytes;
      for (int64_t j = 0; j < head_dim; j += lane)
        prefetch_for_write(kd + kv_k_offset(off, j, block_size, lane) * cache_es);
      for (int64_t d = 0; d < head_dim * lane; d += line_elems)
        prefetch_for_write(vd + (kv_v_offset(off, 0, head_dim, lane) + d) * cache_es);
    }
  };
  // A block's 16 tokens at a time where a chunk holds them in a row (write_group16): prompt chunks run
  // in whole 16-token groups where they have 64 tokens or more.
  bool groups = false;
#if defined(__AVX512BW__)
  groups = !quant && cache_es == 2 && src_es == 2 && head_dim % 32 == 0 && block_size % 16 == 0;
#endif
  // Chunks of whole groups where there are 64 tokens or more: cut where a slot starts a group (a chunk
  // whose first slot is mid-block has its groups shifted by the rest of the block's).
  const int64_t unit = groups && num_tokens >= 64 ? 16 : 1;
  const int64_t shift = unit > 1 && slot_mapping[0] >= 0 ? (16 - slot_mapping[0] % 16) % 16 : 0;
  const int64_t units = (num_tokens - shift + unit - 1) / unit;
#if defined(__AVX512BW__)
  auto group_at = [&](int64_t t, int64_t t1) {  // tokens [t, t + 16) go to one block's group, in order
    if (!groups || t + 16 > t1 || slot_mapping[t] < 0 || slot_mapping[t] % 16) return false;
    for (int64_t i = 1; i < 16; ++i)
      if (slot_mapping[t + i] != slot_mapping[t] + i) return false;
    return true;
  };
#endif
  auto& pool = ThreadPool::instance();
  const int64_t nchunks = std::min<int64_t>(units, pool.num_threads() * 4);
  pool.parallel_for(nchunks, [&](int64_t c) {
    const int64_t t0 = c == 0 ? 0 : shift + unit * (units * c / nchunks);
    const int64_t t1 = std::min(num_tokens, shift + unit * (units * (c + 1) / nchunks));
    std::vector<float> row(quant ? head_dim : 0);
    std::vector<char> kcodes(quant ? head_dim : 0), vcodes(quant ? head_dim : 0);
    std::vector<float> u(G * head_dim), scratch((3 + G) * head_dim + G);
    for (int64_t t = t0; t < t1; ++t) {
#if defined(__AVX512BW__)
      if (group_at(t, t1)) {
        const int64_t blk = slot_mapping[t] / block_size, off0 = slot_mapping[t] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t tile = blk * num_kv_heads + h;
          write_group16(static_cast<const uint16_t*>(key) + t * key_stride + h * head_dim, key_stride,
                        static_cast<const uint16_t*>(value) + t * value_stride + h * head_dim, value_stride,
                        static_cast<uint16_t*>(k_cache) + tile * block_size * head_dim,
                        static_cast<uint16_t*>(v_cache) + tile * block_size * head_dim, off0, block_size, head_dim);
        }
        t += 15;
        continue;
      }
#endif
      if (t + 1 < t1) prefetch_rows(slot_mapping[t + 1]);
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t tile = blk * num_kv_heads + h, row_idx = tile * block_size + off;
        const char* ks = static_cast<const char*>(key) + (t * key_stride + h * head_dim) * src_es;
        const char* vs = static_cast<const char*>(value) + (t * value_stride + h * head_dim) * src_es;
        char* kd = static_cast<char*>(k_cache) + tile * tile_bytes;
        char* vd = static_cast<char*>(v_cache) + tile * tile_bytes;
        if (!quant) {
          scatter_row(ks, vs, kd, vd, off, block_size, head_dim, cache_es);
          continue;
        }
        row_to_float(ks, src_dtype, head_dim, row.data());
        k_scales[row_idx] = quantize_row(row.data(), head_dim, cache_dtype, kcodes.data());
        if (for_queries) {
          unit_queries(static_cast<const char*>(query) + t * query_stride * src_es, src_dtype, h, G, head_dim, src_es,
                       u.data());
          round_k_for_queries(row.data(), head_dim, k_scales[row_idx], u.data(), G, cache_dtype,
                              reinterpret_cast<uint8_t*>(kcodes.data()), scratch.data());
        }
        row_to_float(vs, src_dtype, head_dim, row.data());
        v_scales[row_idx] = quantize_row(row.data(), head_dim, cache_dtype, vcodes.data());
        scatter_row(kcodes.data(), vcodes.data(), kd, vd, off, block_size, head_dim, 1);
      }
    }
  });
}

}  // namespace pyengine
