// Vectorized expf (Cephes polynomial, |rel err| < 2e-7) shared by the CPU kernels.
// exp512: inputs clamped to [-104, 89], so exp(-inf) = 0 (scalef handles the denormal range).
// exp256: inputs clamped to [-87.3, 88.3]; below that it returns ~1e-38 rather than 0.
// exp2_512 / exp2_256: 2^x for x <= 0 (the online softmax's probabilities, attention/paged.cpp), clamped at
// -127: 2^round(x) times a degree-6 Taylor polynomial of 2^f on [-0.5, 0.5]; exp2_256(-127) is 0.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pyengine {

#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.54035304e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// 2^f on [-0.5, 0.5] to the precision of attention weights (rounded to bf16, u8 or 15-bit codes next,
// 2^-9 relative or coarser): a degree-4 polynomial fitted to the relative error (2.8e-6), exact at f = 0
// so a row's top score still weighs exactly 1; coefficients from the highest power. The decode
// kernels' exp2_weights (attention/paged.cpp, attention/decode_avx2.h) evaluate it.
constexpr float kExp2Weights[5] = {0.00958278402686119f, 0.055906277149915695f, 0.24024099111557007f,
                                   0.6931242346763611f, 1.0f};

#if defined(__AVX2__) && defined(__FMA__)
// p * 2^n for whole n in [-127, 128]: n put in the exponent field (n = -127 gives 0).
inline __m256 times_pow2_256(__m256 p, __m256 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  return times_pow2_256(p, n);
}

inline __m256 exp2_256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.54035304e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.33335581e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61812911e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55041087e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40226507e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147181e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return times_pow2_256(p, n);
}
#endif

}  // namespace pyengine
