// fp16 dot products with fp32 results, shared by the attention kernels that run products in fp16 FMAs on
// AVX512-FP16 CPUs (attention/paged.cpp's fp8 decode, attention/prefill_fp16.h's avx512_fp16 PV): operands are
// scaled by powers of two (exact) so that short fp16 sums can neither overflow nor sink into
// subnormals, and each accumulator holds pairs of fp16 sums that are added in fp32 at the end.
#pragma once

#if defined(__AVX512FP16__)
#include <immintrin.h>

#include <algorithm>

namespace pyengine {

// 2^e and 2^-e for the e (at most 100) that brings x's binary exponent to `top`: x 2^e in [2^top,
// 2^(top + 1)), for x >= 0 (x = 0: e = 100). getexp and scalef, not ilogb and ldexp: a row's q and
// every chunk's weights take one, and the libm calls were a visible share of an fp8 decode step.
struct Pow2 {
  __m512 up;
  float down;
};
inline Pow2 pow2_to(float x, float top) {
  const __m128 v = _mm_set_ss(x);
  const float e = std::min(100.0f, top - _mm_cvtss_f32(_mm_getexp_ss(v, v)));
  return {_mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(e)),
          _mm_cvtss_f32(_mm_scalef_ss(_mm_set_ss(1.0f), _mm_set_ss(-e)))};
}

// The 16 fp32 sums of a vector of fp16 pairs (each lane's two halves added in fp32).
inline __m512 half_pairs_to_ps(__m512h h) {
  const __m512i x = _mm512_castph_si512(h);
  const __m256i lo = _mm512_cvtepi32_epi16(x), hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16));
  return _mm512_add_ps(_mm512_cvtxph_ps(_mm256_castsi256_ph(lo)), _mm512_cvtxph_ps(_mm256_castsi256_ph(hi)));
}

}  // namespace pyengine
#endif
