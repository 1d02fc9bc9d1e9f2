// The decode kernel's chunk steps (stage_q, qk_group, softmax_row, pv_group; attention.cpp's
// run_item_dot drives them) for CPUs with AVX2 and FMA but no AVX512-BF16/VNNI: AMD Zen 2 and 3,
// Intel cores before Sapphire Rapids. Same cache layouts (kv_layout.h) and chunks (decode_tiles.h)
// as the AVX-512 kernels, in 256-bit vectors: a half line is 32 bytes, 8 tokens of one K dims group
// (QK: a token per lane) or 8 dims of one V token group (PV: a dim per lane), L values per 32-bit lane.
//
// Operands by cache dtype (the weight of token t is its probability times its V scale):
//   bf16  a half line widens to L = 2 fp32 vectors, one per value of its lanes (the low value shifted
//         up, the high one masked); fp32 FMAs against q in fp32 (QK) or the fp32 weights (PV).
//   fp8   the same with L = 4: a code moved to its lane's top byte, shifted right by 4 (arithmetic),
//         masked, and given the exponent's high bits 112 is the fp32 of its value times 2^-8
//         (kFp8Unit), exact for normal codes; a half line with subnormal codes (zero among them)
//         fixes those lanes on a slower branch.
//   int8  integer products (vpmaddwd: two int16 products per int32 lane): the codes widen to int16
//         (unpack, shift), q is rounded per row to 15-bit codes (scale absmax / 32767), the weights per
//         row and chunk to 15-bit codes (scale max / 32767). A horizontal add (vphaddd) of the two
//         accumulators puts the sums back in token (QK) or dim (PV) order. No overflow: 64 products
//         per lane and chunk of at most 2^15 * 2^7.
// Each row's sums go through a register per row (and, for QK, per parity of the dims group), so
// the FMA latency of one row hides behind the others'.
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "decode_tiles.h"
#include "prefill_attention.h"
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"

namespace pyengine::decode {

struct Avx2 {};  // the kernels' tag (attention.cpp's AVX-512 ones take Avx512)

constexpr float kCode15 = 32767.0f;

// Half h of a chunk's tiles (tokens 8 h .. 8 h + 7: tile h / 2, its first or second 8): the address of
// its K in dims group 0, and of its K or V scales.
template <bool SPLIT>
inline const char* k_half(const ChunkPtrs& c, int h) {
  if constexpr (SPLIT) return h % 2 ? c.k1[h / 2] : c.k0[h / 2];
  else return c.k0[h / 2] + 32 * (h % 2);
}
template <bool SPLIT>
inline const float* scales_half(const float* const* s0, const float* const* s1, int h) {
  if constexpr (SPLIT) return h % 2 ? s1[h / 2] : s0[h / 2];
  else return s0[h / 2] + 8 * (h % 2);
}

inline __m256i load256(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Four int16 at p, in every 64-bit lane.
inline __m256i bcast64(const char* p) {
  int64_t w;
  std::memcpy(&w, p, 8);
  return _mm256_set1_epi64x(w);
}

// All-ones in lane i where first + i lies in [lo, hi).
inline __m256 lanes_in(int first, int lo, int hi) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_castsi256_ps(
      _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), idx), _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), idx)));
}

// The lanes of fp8 codes in v (as widen_fp8 made them) whose code in `sub` is subnormal: the lane's
// exponent 112 stood for the implicit 1 a subnormal lacks, and its exponent is 1 - 7, not 0 - 7, so
// the value times 2^-8 is (v - sign * 2^-15) * 2.
inline void fix_fp8_subnormals(__m256i sub, __m256* v) {
  const __m256 lead = _mm256_set1_ps(0x1p-15f), sign = _mm256_set1_ps(-0.0f), two = _mm256_set1_ps(2.0f);
  for (int k = 0; k < 4; ++k) {
    const __m256 lanes = _mm256_castsi256_ps(_mm256_srai_epi32(_mm256_slli_epi32(sub, 24 - 8 * k), 24));
    const __m256 fixed = _mm256_mul_ps(_mm256_sub_ps(v[k], _mm256_or_ps(_mm256_and_ps(v[k], sign), lead)), two);
    v[k] = _mm256_blendv_ps(v[k], fixed, lanes);
  }
}

// A half line as L fp32 vectors, v[k] holding value k of each lane: bf16 exactly, fp8 times kFp8Unit.
template <Operands O>
inline void widen(__m256i x, __m256* v) {
  if constexpr (O == Operands::kBf16) {
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  } else {
    const __m256i keep = _mm256_set1_epi32(static_cast<int32_t>(0x87f00000u)), exponent = _mm256_set1_epi32(112 << 23);
    for (int k = 0; k < 4; ++k) {
      const __m256i top = _mm256_slli_epi32(x, 24 - 8 * k);  // code k on bits 31..24
      v[k] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_srai_epi32(top, 4), keep), exponent));
    }
    const __m256i sub = _mm256_cmpeq_epi8(_mm256_and_si256(x, _mm256_set1_epi8(0x78)), _mm256_setzero_si256());
    if (__builtin_expect(!_mm256_testz_si256(sub, sub), 0)) fix_fp8_subnormals(sub, v);
  }
}

// A half line of int8 codes as int16: lo holds lanes 0, 1, 4, 5 and hi lanes 2, 3, 6, 7, each lane's
// four codes in order. vphaddd of two such accumulators restores the lanes' order.
inline void widen_int8(__m256i x, __m256i& lo, __m256i& hi) {
  lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(x, x), 8);
  hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(x, x), 8);
}

inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// One bf16 q row of D values -> its operands at dst: fp32, or for an int8 cache 15-bit int16 codes
// (returns their scale, 0 for a zero row). *sum is unused (the AVX-512 int8 kernel's).
template <Operands O>
inline float stage_q(Avx2, const uint16_t* q, int64_t D, char* dst, int32_t* sum) {
  *sum = 0;
  if constexpr (O == Operands::kInt8) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t d = 0; d < D; d += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load_bf16x8(q + d), abs));
    const float m = hmax256(amax);
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? kCode15 / m : 0.0f);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16x8(q + d), inv));  // nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * d),
                       _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
    }
    return m / kCode15;
  } else {
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(reinterpret_cast<float*>(dst) + d, load_bf16x8(q + d));
    return 1.0f;
  }
}

// QK of NR rows over the chunk, 8 tokens at a time: sc[r * kChunk + t] = q_r . k_t * scale (log2
// units). q: the rows' operands (q_bytes apart); qs: the rows' q scales (int8 cache).
template <Operands O, int NC32, int NR, bool SPLIT>
inline void qk_group(Avx2, const ChunkPtrs& c, const ChunkPtrs& next, int64_t line_stride, const char* q,
                     int64_t q_bytes, const float* qs, const int32_t*, float* sc, float scale) {
  constexpr int L = lane_of(O), kLines = 32 * NC32 / L;
  const int nhalves = (c.n + 7) / 8;
  for (int h = 0; h < nhalves; ++h) {
    const char* k = k_half<SPLIT>(c, h);
    const char* kn = k_half<SPLIT>(next, h);
    // the next chunk's K, each 64-byte line once: a line holds two halves, or (SPLIT) two dims groups
    auto prefetch = [&](int j) {
      if (SPLIT ? j % 2 == 0 : h % 2 == 0) _mm_prefetch(kn + j * line_stride, kPrefetchLevel);
    };
    __m256 s = _mm256_set1_ps(is_fp8(O) ? scale / kFp8Unit : scale);
    if constexpr (O != Operands::kBf16) s = _mm256_mul_ps(s, _mm256_loadu_ps(scales_half<SPLIT>(c.ks0, c.ks1, h)));
    if constexpr (O == Operands::kInt8) {
      __m256i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int j = 0; j < kLines; ++j) {
        prefetch(j);
        __m256i a, b;
        widen_int8(load256(k + j * line_stride), a, b);
        for (int r = 0; r < NR; ++r) {
          const __m256i qv = bcast64(q + r * q_bytes + 8 * j);
          lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(a, qv));
          hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(b, qv));
        }
      }
      for (int r = 0; r < NR; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[r], hi[r]));
        _mm256_storeu_ps(sc + r * kChunk + 8 * h, _mm256_mul_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(qs[r]))));
      }
    } else {
      __m256 acc[NR][2];
      for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int j = 0; j < kLines; ++j) {
        prefetch(j);
        __m256 v[L];
        widen<O>(load256(k + j * line_stride), v);
        for (int r = 0; r < NR; ++r) {
          const float* qr = reinterpret_cast<const float*>(q + r * q_bytes) + L * j;
          __m256 t = _mm256_mul_ps(v[0], _mm256_broadcast_ss(qr));
          for (int i = 1; i < L; ++i) t = _mm256_fmadd_ps(v[i], _mm256_broadcast_ss(qr + i), t);
          acc[r][j % 2] = _mm256_add_ps(acc[r][j % 2], t);
        }
      }
      for (int r = 0; r < NR; ++r)
        _mm256_storeu_ps(sc + r * kChunk + 8 * h, _mm256_mul_ps(_mm256_add_ps(acc[r][0], acc[r][1]), s));
    }
  }
}

// 2^x for x <= 0, as exp2_weights (attention.cpp) computes it: a degree-4 polynomial of 2^f on
// [-0.5, 0.5], exact at 0, relative error 2.8e-6.
inline __m256 exp2_weights(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.00958278402686119f), f, _mm256_set1_ps(0.055906277149915695f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24024099111557007f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931242346763611f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return times_pow2_256(p, n);
}

// Online-softmax update of one row with the scores sc[lo, nv) (lo > 0: before its window): writes
// PV's weights to pw[0, round_up(n, 8) tokens) (zeros outside [lo, nv)): fp32 (times the V scales
// for fp8), or 15-bit codes of scale *wscale (int8); updates m and l; returns alpha for acc. The
// running max lags the scores by up to kMaxSlack, as in the AVX-512 kernel.
template <Operands O, bool SPLIT>
inline float softmax_row(Avx2, const float* sc, int lo, int nv, int n, const ChunkPtrs& c, char* pw, float& m,
                         float& l, float& wscale) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kVecs = kChunk / 8;
  wscale = 0.0f;
  if (nv <= lo) {
    std::memset(pw, 0, kWeightStride);
    return 1.0f;
  }
  const int nvec = (nv + 7) / 8, nout = (n + 7) / 8;  // vectors with the row's scores, with the chunk's tokens
  __m256 x[kVecs], keep[kVecs];
  const __m256 limit = _mm256_set1_ps(m + kMaxSlack);
  int over = 0;
  for (int g = 0; g < nvec; ++g) {
    keep[g] = lanes_in(8 * g, lo, nv);
    x[g] = _mm256_loadu_ps(sc + 8 * g);
    over |= _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(x[g], limit, _CMP_NLE_UQ), keep[g]));  // NaN is over
  }
  float m_new = m;
  if (over || m == kNegInf) {
    __m256 vmax = _mm256_set1_ps(kNegInf);
    for (int g = 0; g < nvec; ++g) vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x[g], keep[g]));
    m_new = std::max(m, hmax256(vmax));
  }
  const float alpha = m_new == m ? 1.0f : std::exp2(m - m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps(), wmax = _mm256_setzero_ps(), w[kVecs];
  for (int g = 0; g < nout; ++g) {
    if (g >= nvec) {
      w[g] = _mm256_setzero_ps();
    } else {
      const __m256 p = _mm256_and_ps(exp2_weights(_mm256_sub_ps(x[g], vm)), keep[g]);
      vsum = _mm256_add_ps(vsum, p);
      w[g] = p;
      // scales past the chunk's end may be anything: the mask after the product zeroes NaN too
      if constexpr (O != Operands::kBf16)
        w[g] = _mm256_and_ps(_mm256_mul_ps(p, _mm256_loadu_ps(scales_half<SPLIT>(c.vs0, c.vs1, g))), keep[g]);
      if constexpr (is_fp8(O)) w[g] = _mm256_mul_ps(w[g], _mm256_set1_ps(1.0f / kFp8Unit));
      if constexpr (O == Operands::kInt8) wmax = _mm256_max_ps(wmax, w[g]);
    }
    if constexpr (O != Operands::kInt8) _mm256_storeu_ps(reinterpret_cast<float*>(pw) + 8 * g, w[g]);
  }
  if constexpr (O == Operands::kInt8) {
    const float mx = hmax256(wmax);
    const __m256 inv = _mm256_set1_ps(mx > 0.0f ? kCode15 / mx : 0.0f);
    for (int g = 0; g < nout; ++g) {
      const __m256i code = _mm256_cvtps_epi32(_mm256_mul_ps(w[g], inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pw + 16 * g),
                       _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1)));
    }
    wscale = mx / kCode15;
  }
  l = l * alpha + hsum256(vsum);
  m = m_new;
  return alpha;
}

// acc_r = acc_r * alpha_r + sum_t w_rt V_t (times wscale_r for int8) for NR rows, DB dims at a time
// (16: two half lines; 8 for int8, whose two accumulators a dim needs would not fit 16 registers at 4
// rows). pw: the rows' weights, kWeightStride bytes apart.
template <Operands O, int NC32, int NR, bool SPLIT>
inline void pv_group(Avx2, const ChunkPtrs& c, const ChunkPtrs& next, const char* pw, const float* alpha,
                     const float* wscale, float* acc, int maxnv) {
  constexpr int64_t D = 32 * NC32, group_bytes = D * 4;
  constexpr int L = lane_of(O), NH = O == Operands::kInt8 ? 1 : 2, DB = 8 * NH;
  constexpr int64_t es = O == Operands::kBf16 ? 2 : 1;
  const int ngroups = (maxnv + L - 1) / L;
  auto prefetch = [&](int64_t d0, int p) {  // the next chunk's V group p, during the first pass
    if (d0 > 0) return;
    const char* nvg = v_group<O, SPLIT>(next, p, group_bytes);
    for (int64_t b = 0; b < group_bytes; b += 64) _mm_prefetch(nvg + b, kPrefetchLevel);
  };
  // the tokens of a part group past the chunk's end may be any slot: zero them (0 * NaN is NaN)
  const int full = O == Operands::kInt8 ? ngroups : std::min(ngroups, c.n / L);
  const __m256i tail = _mm256_set1_epi32(static_cast<int32_t>((1u << ((c.n % L) * es * 8)) - 1));
  for (int64_t d0 = 0; d0 < D; d0 += DB) {
    if constexpr (O == Operands::kInt8) {
      __m256i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int p = 0; p < ngroups; ++p) {  // integer products: a zero weight zeroes whatever a slot holds
        prefetch(d0, p);
        __m256i a, b;
        widen_int8(load256(v_group<O, SPLIT>(c, p, group_bytes) + d0 * 4), a, b);
        for (int r = 0; r < NR; ++r) {
          const __m256i wv = bcast64(pw + r * kWeightStride + 8 * p);
          lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(a, wv));
          hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(b, wv));
        }
      }
      for (int r = 0; r < NR; ++r) {
        float* o = acc + r * D + d0;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[r], hi[r])),
                                            _mm256_set1_ps(wscale[r]),
                                            _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(alpha[r]))));
      }
    } else {
      __m256 x[NR][NH];
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < NH; ++i)
          x[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * i), _mm256_set1_ps(alpha[r]));
      for (int p = 0; p < ngroups; ++p) {
        prefetch(d0, p);
        const char* vg = v_group<O, SPLIT>(c, p, group_bytes) + d0 * L * es;
        for (int i = 0; i < NH; ++i) {
          __m256i raw = load256(vg + 32 * i);
          if (p >= full) raw = _mm256_and_si256(raw, tail);
          __m256 v[L];
          widen<O>(raw, v);
          for (int r = 0; r < NR; ++r) {
            const float* w = reinterpret_cast<const float*>(pw + r * kWeightStride) + L * p;
            __m256 t = _mm256_mul_ps(v[0], _mm256_broadcast_ss(w));
            for (int k = 1; k < L; ++k) t = _mm256_fmadd_ps(v[k], _mm256_broadcast_ss(w + k), t);
            x[r][i] = _mm256_add_ps(x[r][i], t);
          }
        }
      }
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < NH; ++i) _mm256_storeu_ps(acc + r * D + d0 + 8 * i, x[r][i]);
    }
  }
}

}  // namespace pyengine::decode
#endif
