// The avx512_bf16 and avx512_fp32 micro-kernels of the prefill kernel (attention/prefill.cpp's
// row_group runs them) and the vectorized softmax every SIMD path shares (prefill_fp16.h, prefill_amx.h).
//
// Reads (prefill_chunks.h's layouts): q rows [NR][D] bf16; the chunk's K groups [D/2][16][2] bf16
// (line j at k[g] + j kld[g]: 16 tokens of a dims pair, 64 bytes) and V groups [8][D][2] bf16 (token
// pair i at v[g] + 2 D i: 16 dims of the pair per 64-byte line); scores s [NR][kChunk] fp32. Writes s
// (QK), p [NR][kChunk] bf16 (fp16 for pv_half: store_probabilities) and the accumulators o [NR][D]
// fp32 (PV).
//   avx512_bf16  vdpbf16ps on the lines as they lie (qk_avx, pv_avx: AvxKernels)
//   avx512_fp32  each line widened in registers to fp32, two FMAs per row (qk_fp32, pv_fp32: Fp32Kernels)
// Builds for AVX512-BF16 (-march): #if defined(__AVX512BF16__).
#pragma once
#if defined(__AVX512BF16__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "prefill.h"
#include "prefill_chunks.h"
#include "pyengine/bf16_widen.h"
#include "pyengine/half_pairs.h"
#include "pyengine/simd.h"
#include "pyengine/vec_exp.h"

namespace pyengine {
namespace {

inline __mmask16 tail_mask(int n) { return n <= 0 ? 0 : n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return (__m512bh)_mm512_set1_epi32(w);
}

// tanh(x) = 1 - 2 / (e^2x + 1) (exp512 saturates, so large |x| give +-1).
inline __m512 tanh512(__m512 x) {
  const __m512 e = exp512(_mm512_add_ps(x, x));
  return _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}

// 2^x for x <= 0 (clamped at -126): 2^round(x) times a degree-3 minimax polynomial of 2^f on
// [-0.5, 0.5], 7.5e-5 relative error: the probabilities are rounded to bf16 (2^-9) right after.
inline __m512 exp2_prob(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.51709794e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.42609710e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93260968e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99928176e-1f));
  return _mm512_scalef_ps(p, n);
}

// A row's probabilities e (tokens 16 g .. 16 g + 15 in e[g]) into p: bf16, or (kHalf, for pv_half) fp16
// times the 2^k bringing `total`, their sum, into [2^6, 2^7), with unit = 2^-k.
template <bool kHalf>
inline void store_probabilities(const __m512 (&e)[4], [[maybe_unused]] float total, uint16_t* p,
                                [[maybe_unused]] float& unit) {
  if constexpr (kHalf) {
#if defined(__AVX512FP16__)
    const Pow2 u = pow2_to(total, 6.0f);
    for (int g = 0; g < 4; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * g),
                          _mm256_castph_si256(_mm512_cvtxps_ph(_mm512_mul_ps(e[g], u.up))));
    unit = u.down;
#endif
  } else {
    for (int g = 0; g < 4; g += 2)  // tokens 16 g .. 16 g + 31, one vector
      _mm512_storeu_si512(p + 16 * g, (__m512i)_mm512_cvtne2ps_pbh(e[g + 1], e[g]));
  }
}

// As softmax_row_portable, with m in log2 units (scores times log2 e, so exp is exp2). The running
// max moves only when a score passes it by more than kMaxSlack: until then the row's probabilities
// stay <= 2^kMaxSlack (harmless in fp32 and bf16), alpha is exactly 1 (the accumulator is not
// rescaled) and the row needs no horizontal max. Plain scores (no softcap, no per-token K scales)
// stay raw dot products until the exponent, where one fused multiply-subtract scales them and
// subtracts the max; rows that see the whole chunk skip the masks.
template <bool kHalf>
__attribute__((noinline)) float softmax_row_general(const RowSoftmax& c, const float* s, int lo, int hi, float& m,
                                                    float& l, uint16_t* p, float& p_unit) {
  __m512 x[4];
  __mmask16 keep[4];
  const bool capped = c.softcap > 0.0f, plain = !capped && !c.ks, masked = lo > 0 || hi < kChunk;
  const float unit = capped ? c.scale / c.softcap : c.scale * kLog2e;  // raw score -> log2 units (or tanh's)
  const __m512 scale = _mm512_set1_ps(unit);
  const __m512 cap = _mm512_set1_ps(c.softcap * kLog2e);
  const __m512 limit = _mm512_set1_ps(plain ? (m + kMaxSlack) / unit : m + kMaxSlack);  // in x's units
  __mmask16 over = 0;
  for (int g = 0; g < 4; ++g) {
    keep[g] = tail_mask(hi - 16 * g) & static_cast<__mmask16>(~tail_mask(lo - 16 * g));
    __m512 v = _mm512_loadu_ps(s + 16 * g);
    if (!plain) {
      v = _mm512_mul_ps(v, scale);
      if (c.ks) v = _mm512_mul_ps(v, _mm512_loadu_ps(c.ks + 16 * g));
      if (capped) v = _mm512_mul_ps(cap, tanh512(v));
    }
    x[g] = v;
    over |= _mm512_mask_cmp_ps_mask(keep[g], v, limit, _CMP_NLE_UQ);  // NaN counts as over
  }
  float m_new = m;
  if (over || m == kNegInf) {
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (int g = 0; g < 4; ++g) vmax = _mm512_mask_max_ps(vmax, keep[g], vmax, x[g]);
    m_new = std::max(m, _mm512_reduce_max_ps(vmax) * (plain ? unit : 1.0f));  // unit > 0: max commutes
  }
  const float alpha = m_new == m ? 1.0f : std::exp2(m - m_new);
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps(), e[4];
  for (int g = 0; g < 4; ++g) {
    e[g] = exp2_prob(plain ? _mm512_fmsub_ps(x[g], scale, vm) : _mm512_sub_ps(x[g], vm));
    if (masked) e[g] = _mm512_maskz_mov_ps(keep[g], e[g]);
    sum = _mm512_add_ps(sum, e[g]);
    if (c.vs) e[g] = _mm512_mul_ps(e[g], _mm512_loadu_ps(c.vs + 16 * g));
  }
  const float row_sum = _mm512_reduce_add_ps(sum);
  const float stored =  // the sum of what p holds (times the V scales)
      kHalf && c.vs ? _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]))) : row_sum;
  store_probabilities<kHalf>(e, stored, p, p_unit);
  l = l * alpha + row_sum;
  m = m_new;
  return alpha;
}

// softmax_row_general's common row, inlined into the row loop: plain scores (no softcap, no per-token
// scales) of a chunk the row sees whole, with no masks to build, no stack frame and no branch but the
// rare max update. A row's scalar overhead cost as much as its vector work in the general function.
template <bool kHalf>
__attribute__((always_inline)) inline float softmax_row_full(float unit, float inv_unit, const float* s, float& m, float& l,
                                                             uint16_t* p, float& p_unit) {
  const __m512 scale = _mm512_set1_ps(unit), limit = _mm512_set1_ps((m + kMaxSlack) * inv_unit);
  __m512 x[4];
  __mmask16 over = 0;
  for (int g = 0; g < 4; ++g) {
    x[g] = _mm512_loadu_ps(s + 16 * g);
    over |= _mm512_cmp_ps_mask(x[g], limit, _CMP_NLE_UQ);  // NaN counts as over
  }
  float m_new = m;
  if (over || m == kNegInf) {
    const __m512 vmax = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
    m_new = std::max(m, _mm512_reduce_max_ps(vmax) * unit);
  }
  const float alpha = m_new == m ? 1.0f : std::exp2(m - m_new);
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps(), e[4];
  for (int g = 0; g < 4; ++g) {
    e[g] = exp2_prob(_mm512_fmsub_ps(x[g], scale, vm));
    sum = _mm512_add_ps(sum, e[g]);
  }
  const float row_sum = _mm512_reduce_add_ps(sum);
  store_probabilities<kHalf>(e, row_sum, p, p_unit);
  l = l * alpha + row_sum;
  m = m_new;
  return alpha;
}

// Whether a chunk's rows may take softmax_row_full where they see it whole: plain scores (no softcap, no
// per-token K scales) and no V scales.
inline bool full_rows_allowed(const RowSoftmax& c) { return c.softcap == 0.0f && !c.ks && !c.vs; }

// kHalf: fp16 probabilities, scaled per row (store_probabilities), for pv_half.
template <bool kHalf>
__attribute__((always_inline)) inline float softmax_row_avx(const RowSoftmax& c, const float* s, int lo, int hi, float& m,
                                                            float& l, uint16_t* p, float& unit) {
  if (full_rows_allowed(c) && lo == 0 && hi == kChunk)
    return softmax_row_full<kHalf>(c.scale * kLog2e, 1.0f / (c.scale * kLog2e), s, m, l, p, unit);
  return softmax_row_general<kHalf>(c, s, lo, hi, m, l, p, unit);
}

// softmax_rows for the SIMD paths. Where every row sees the whole chunk and the scores are plain (in a
// long prompt, every chunk of a row group but the ones on its diagonal), softmax_row_full runs in a loop
// with no call in it: the constants of its exponent stay in registers. In softmax_rows, whose loop also
// calls softmax_row_general, GCC rebuilt them and the row's scale (a division) for every row.
template <bool kHalf>
int softmax_group(int nr, const RowSoftmax& c, const float* s, const int* lo, const int* hi, float* m, float* l,
                  uint16_t* p, float* alpha, float* p_unit) {
  bool full = full_rows_allowed(c);
  for (int r = 0; r < nr; ++r) full = full && lo[r] == 0 && hi[r] == kChunk;
  if (!full) return softmax_rows<softmax_row_avx<kHalf>>(nr, c, s, lo, hi, m, l, p, alpha, p_unit, [](int) {});
  const float unit = c.scale * kLog2e, inv_unit = 1.0f / unit;
  for (int r = 0; r < nr; ++r)
    alpha[r] = softmax_row_full<kHalf>(unit, inv_unit, s + r * kChunk, m[r], l[r], p + r * kChunk, p_unit[r]);
  return kChunk;
}

template <int NR>
void qk_avx(const uint16_t* q, int64_t D, const ChunkKV& kv, float* s) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D / 2; ++j) {
    __m512bh kg[4];
    for (int g = 0; g < 4; ++g) kg[g] = (__m512bh)_mm512_loadu_si512(kv.k[g] + j * kv.kld[g]);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qb = bcast_pair(q + r * D + 2 * j);
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], kg[g], qb);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(s + r * kChunk + 16 * g, acc[r][g]);
}

template <int NR>
void pv_avx(const uint16_t* p, const ChunkKV& kv, int64_t D, int npairs, const float* alpha, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 x[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 4; ++h)
        x[r][h] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * h), _mm512_set1_ps(alpha[r]));
    // the chunk's 16-token groups, each walking one pointer: v_at's lookup per pair left GCC short of
    // registers (3 of the 24 accumulators spilled), though where measured that loop ran as fast
    for (int g = 0; g < 4 && 8 * g < npairs; ++g) {
      const uint16_t* vp = kv.v[g] + 2 * d0;  // token pair i of the group: dims d0 .. d0 + 63 at vp + 2 D i
      const uint16_t* pg = p + 16 * g;
      for (int i = 0; i < std::min(8, npairs - 8 * g); ++i) {
        __m512bh vv[4];
        for (int h = 0; h < 4; ++h) vv[h] = (__m512bh)_mm512_loadu_si512(vp + 2 * D * i + 32 * h);
        for (int r = 0; r < NR; ++r) {
          const __m512bh pr = bcast_pair(pg + r * kChunk + 2 * i);
          for (int h = 0; h < 4; ++h) x[r][h] = _mm512_dpbf16_ps(x[r][h], vv[h], pr);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 4; ++h) _mm512_storeu_ps(o + r * D + d0 + 16 * h, x[r][h]);
  }
}

// A SIMD path's micro-kernels for NR rows (QK, PV) with the vectorized softmax, as row_group takes them.
// A PV that takes the rows' probability units (pv_half) gets fp16 probabilities, the others bf16.
template <auto QK, auto PV>
struct SimdKernels {
  static constexpr bool kHalfP = std::is_invocable_v<decltype(PV), const uint16_t*, const float*, const ChunkKV&,
                                                     int64_t, int, const float*, float*>;
  static void qk(int, const uint16_t* q, int64_t D, const ChunkKV& kv, float* s) { QK(q, D, kv, s); }
  static constexpr auto softmax = softmax_group<kHalfP>;
  static void pv(int, const uint16_t* p, const float* p_unit, const ChunkKV& kv, int64_t D, int npairs,
                 const float* alpha, float* o) {
    if constexpr (kHalfP) PV(p, p_unit, kv, D, npairs, alpha, o);
    else PV(p, kv, D, npairs, alpha, o);
  }
};

template <int NR>
using AvxKernels = SimdKernels<qk_avx<NR>, pv_avx<NR>>;

// The avx512_fp32 micro-kernels: the same K/V lines, each widened in registers to the fp32 values of
// its even and odd bf16 halves (bf16_widen.h), then two fp32 FMAs per row where vdpbf16ps takes one,
// odd half first: the bits of the vdpbf16ps path. q and p rows are widened once per call. Where
// vdpbf16ps issues at a quarter of the FMA rate (Intel cores without AMX exposed), this is the faster.

// n bf16 (a multiple of 16) at src -> fp32 at dst.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load_bf16x16(src + i));
}

// acc[r][h] += bf16 pair line h . (b[r ld], b[r ld + 1]) for NR rows and two lines, odd halves first.
template <int NR>
inline void fma_pairs(__m512 (&acc)[NR][2], const uint16_t* line0, const uint16_t* line1, const float* b, int64_t ld) {
  const __m512i lines[2] = {_mm512_loadu_si512(line0), _mm512_loadu_si512(line1)};
  for (int h = 0; h < 2; ++h) {
    const __m512 even = bf16_even(lines[h]), odd = bf16_odd(lines[h]);
    for (int r = 0; r < NR; ++r) {
      acc[r][h] = _mm512_fmadd_ps(odd, _mm512_set1_ps(b[r * ld + 1]), acc[r][h]);
      acc[r][h] = _mm512_fmadd_ps(even, _mm512_set1_ps(b[r * ld]), acc[r][h]);
    }
  }
}

// Both kernels pass over two 16-wide columns at a time (NR x 2 accumulators): with all four, the
// accumulators and the row broadcasts would not fit the 32 registers together.
template <int NR>
void qk_fp32(const uint16_t* q, int64_t D, const ChunkKV& kv, float* s) {
  alignas(64) float qf[NR * 256];
  for (int r = 0; r < NR; ++r) widen_bf16(q + r * D, qf + r * D, D);
  for (int g0 = 0; g0 < 4; g0 += 2) {
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D / 2; ++j)
      fma_pairs<NR>(acc, kv.k[g0] + j * kv.kld[g0], kv.k[g0 + 1] + j * kv.kld[g0 + 1], qf + 2 * j, D);
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(s + r * kChunk + 16 * (g0 + h), acc[r][h]);
  }
}

template <int NR>
void pv_fp32(const uint16_t* p, const ChunkKV& kv, int64_t D, int npairs, const float* alpha, float* o) {
  alignas(64) float pf[NR * kChunk];
  for (int r = 0; r < NR; ++r) widen_bf16(p + r * kChunk, pf + r * kChunk, kChunk);
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m512 x[NR][2];
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h)
        x[r][h] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * h), _mm512_set1_ps(alpha[r]));
    for (int g = 0; g < 4 && 8 * g < npairs; ++g) {  // the chunk's 16-token groups
      const uint16_t* vp = kv.v[g] + 2 * d0;          // token pair i of the group: dims d0 .. d0 + 31 at vp + 2 D i
      const float* pg = pf + 16 * g;
      for (int i = 0; i < std::min(8, npairs - 8 * g); ++i)
        fma_pairs<NR>(x, vp + 2 * D * i, vp + 2 * D * i + 32, pg + 2 * i, kChunk);
    }
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(o + r * D + d0 + 16 * h, x[r][h]);
  }
}

template <int NR>
using Fp32Kernels = SimdKernels<qk_fp32<NR>, pv_fp32<NR>>;

}  // namespace
}  // namespace pyengine
#endif  // AVX512-BF16
