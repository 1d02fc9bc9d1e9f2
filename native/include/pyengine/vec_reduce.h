// Horizontal sums and maxima shared by the CPU kernels: of one ymm (8 floats) for the AVX2 paths, and
// of 16 zmm at once for AVX-512.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace pyengine {

#if defined(__AVX512F__)
// op over the lanes of each of 16 vectors, as one vector (lane i = v[i]'s lanes combined): a
// transpose-and-combine tree, 15 shuffle pairs in all where one vector's own reduction takes 4.
template <class Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = op(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Sums of each of 16 vectors (lane i = sum of v[i]).
inline __m512 hsum16(const __m512* v) {
  return reduce16(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

// Maxima of each of 16 vectors (lane i = max of v[i]).
inline __m512 hmax16(const __m512* v) {
  return reduce16(v, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
}
#endif

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

}  // namespace pyengine
#endif
