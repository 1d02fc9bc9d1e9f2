// The generic decode path's inner loops (paged.cpp's run_item), over K/V chunks already dequantized
// to fp32 rows of Dp floats:
//   qk          scores of one q row against nv K rows
//   softmax_pv  the online-softmax update of one row (running max m, sum l, accumulator acc) with nv
//               scores (log2 units) and V rows
// In 16-float AVX-512 vectors, 8-float AVX2 + FMA vectors, or portable 16-lane strips the compiler
// can vectorize, by the build's -march.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "pyengine/simd.h"
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"

namespace pyengine::fp32_chunks {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)

inline __mmask16 tail_mask(int64_t n) { return n <= 0 ? 0 : n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

// An online-softmax row's new running max after the scores sc[0, nv), and in alpha the factor
// 2^(m - m_new) that rescales what the row has accumulated (0 on its first chunk, m = -inf).
inline float online_max(const float* sc, int64_t nv, float m, float& alpha) {
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t t0 = 0; t0 < nv; t0 += 16)
    vmax = _mm512_mask_max_ps(vmax, tail_mask(nv - t0), vmax, _mm512_loadu_ps(sc + t0));
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  alpha = std::exp2(m - m_new);
  return m_new;
}

// Writes scores for tokens [0, round_up(nv, 16)); lanes past nv are garbage (never read).
template <int NC>
void qk(const float* q, const float* K, int64_t Dp, int64_t nv, float* sc) {
  const int64_t nc = NC ? NC : Dp / 16;
  for (int64_t t0 = 0; t0 < nv; t0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const float* kb = K + t0 * Dp;
    for (int64_t c = 0; c < nc; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + c * 16);
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kb + i * Dp + c * 16), acc[i]);
    }
    _mm512_storeu_ps(sc + t0, hsum16(acc));
  }
}

template <int NC>
void softmax_pv(float* sc, int64_t nv, const float* V, int64_t Dp, float& m, float& l, float* acc) {
  float alpha;
  const float m_new = online_max(sc, nv, m, alpha);
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < nv; t0 += 16) {
    const __m512 p = _mm512_maskz_mov_ps(tail_mask(nv - t0), exp2_512(_mm512_sub_ps(_mm512_loadu_ps(sc + t0), vm)));
    _mm512_storeu_ps(sc + t0, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  m = m_new;
  // acc = acc * alpha + sum_t p_t V_t, four 16-float chunks at a time with two token streams.
  const int64_t nc = NC ? NC : Dp / 16;
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t c = 0; c < nc; c += 4) {
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (c + i) * 16), va), b[i] = _mm512_setzero_ps();
    const float* vb = V + c * 16;
    int64_t t = 0;
    for (; t + 1 < nv; t += 2) {
      const __m512 p0 = _mm512_set1_ps(sc[t]), p1 = _mm512_set1_ps(sc[t + 1]);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + t * Dp + i * 16), a[i]);
        b[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vb + (t + 1) * Dp + i * 16), b[i]);
      }
    }
    if (t < nv) {
      const __m512 p0 = _mm512_set1_ps(sc[t]);
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vb + t * Dp + i * 16), a[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + (c + i) * 16, _mm512_add_ps(a[i], b[i]));
  }
}

#elif defined(__AVX2__) && defined(__FMA__)  // AVX2: the same loops in 8-float vectors

// Lanes [0, n) all ones (n clamped to 0..8): the valid scores of an 8-token group.
inline __m256 lanes_below(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))), idx));
}

// Sums of each of 8 vectors, as one vector (lane i = sum of v[i]).
inline __m256 hsum8x8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // lanes: v0..3 lo | v0..3 hi
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Writes scores for tokens [0, round_up(nv, 8)); lanes past nv are garbage (never read).
template <int NC>
void qk(const float* q, const float* K, int64_t Dp, int64_t nv, float* sc) {
  for (int64_t t0 = 0; t0 < nv; t0 += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const float* kb = K + t0 * Dp;
    for (int64_t c = 0; c < Dp; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + i * Dp + c), acc[i]);
    }
    _mm256_storeu_ps(sc + t0, hsum8x8(acc));
  }
}

// acc[0, 8 * W) = acc * alpha + sum_t p_t V_t (W 8-float chunks from acc and V), two token streams.
template <int W>
inline void pv_chunks(const float* sc, int64_t nv, const float* vb, int64_t Dp, __m256 va, float* acc) {
  __m256 a[W], b[W];
  for (int i = 0; i < W; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * 8), va), b[i] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 1 < nv; t += 2) {
    const __m256 p0 = _mm256_broadcast_ss(sc + t), p1 = _mm256_broadcast_ss(sc + t + 1);
    for (int i = 0; i < W; ++i) {
      a[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vb + t * Dp + i * 8), a[i]);
      b[i] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vb + (t + 1) * Dp + i * 8), b[i]);
    }
  }
  if (t < nv) {
    const __m256 p0 = _mm256_broadcast_ss(sc + t);
    for (int i = 0; i < W; ++i) a[i] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vb + t * Dp + i * 8), a[i]);
  }
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(acc + i * 8, _mm256_add_ps(a[i], b[i]));
}

template <int NC>
void softmax_pv(float* sc, int64_t nv, const float* V, int64_t Dp, float& m, float& l, float* acc) {
  __m256 vmax = _mm256_set1_ps(kNegInf);
  for (int64_t t0 = 0; t0 < nv; t0 += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(sc + t0), lanes_below(nv - t0)));
  const float m_new = std::max(m, hmax256(vmax));
  const float alpha = std::exp2(m - m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < nv; t0 += 8) {
    const __m256 p = _mm256_and_ps(exp2_256(_mm256_sub_ps(_mm256_loadu_ps(sc + t0), vm)), lanes_below(nv - t0));
    _mm256_storeu_ps(sc + t0, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  l = l * alpha + hsum256(vsum);
  m = m_new;
  // four 8-float chunks at a time (Dp is a multiple of 16: a last pair of chunks where Dp % 32 == 16)
  const __m256 va = _mm256_set1_ps(alpha);
  int64_t c = 0;
  for (; c + 32 <= Dp; c += 32) pv_chunks<4>(sc, nv, V + c, Dp, va, acc + c);
  if (c < Dp) pv_chunks<2>(sc, nv, V + c, Dp, va, acc + c);
}

#else  // portable: 16-lane strips the compiler can vectorize

template <int NC>
void qk(const float* q, const float* K, int64_t Dp, int64_t nv, float* sc) {
  for (int64_t t = 0; t < nv; ++t) {
    float a[16] = {};
    const float* k = K + t * Dp;
    for (int64_t c = 0; c < Dp; c += 16)
      for (int i = 0; i < 16; ++i) a[i] += q[c + i] * k[c + i];
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += a[i];
    sc[t] = s;
  }
}

template <int NC>
void softmax_pv(float* sc, int64_t nv, const float* V, int64_t Dp, float& m, float& l, float* acc) {
  float mx = kNegInf;
  for (int64_t t = 0; t < nv; ++t) mx = std::max(mx, sc[t]);
  const float m_new = std::max(m, mx);
  const float alpha = std::exp2(m - m_new);
  float sum = 0.0f;
  for (int64_t t = 0; t < nv; ++t) sum += (sc[t] = std::exp2(sc[t] - m_new));
  l = l * alpha + sum;
  m = m_new;
  for (int64_t d = 0; d < Dp; ++d) acc[d] *= alpha;
  for (int64_t t = 0; t < nv; ++t) {
    const float p = sc[t];
    const float* v = V + t * Dp;
    for (int64_t d = 0; d < Dp; ++d) acc[d] += p * v[d];
  }
}

#endif

}  // namespace pyengine::fp32_chunks
