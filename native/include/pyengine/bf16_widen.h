// bf16 -> fp32 in AVX-512 registers, shared by the kernels that run bf16 data on fp32 FMAs instead of
// vdpbf16ps (linear/bf16.cpp's avx512_fp32, attention/prefill_avx512.h's avx512_fp32 and avx512_fp16's QK).
//
// kPreferFp32Fma (linear/bf16.cpp): builds whose -march has AVX512-FP16 run the fp32 linear kernel by
// default where AMX does not: on such a core without AMX exposed, vdpbf16ps issued at a quarter of the
// fp32 FMA rate (docs/performance.md, "bf16 linear"). CPUs without AVX512-FP16 keep vdpbf16ps. (Prompt
// attention picks its own path on the same builds: avx512_fp16.)
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>

namespace pyengine {

#if defined(__AVX512FP16__)
constexpr bool kPreferFp32Fma = true;
#else
constexpr bool kPreferFp32Fma = false;
#endif

#if defined(__AVX512F__)
// A line of 16 bf16 pairs (one per 32-bit lane, as vdpbf16ps reads them): the fp32 values of each
// pair's first (even) and second (odd) element. vdpbf16ps adds the odd product first; bf16 x bf16
// products are exact in fp32, so two FMAs in that order give its bits (subnormals aside: it flushes them).
inline __m512 bf16_even(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 bf16_odd(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 16 consecutive bf16 at p as fp32.
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

}  // namespace pyengine
