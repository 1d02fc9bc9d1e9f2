// The decode kernel's chunk steps (stage_q, qk_group, softmax_row, pv_group; attention/paged.cpp's
// run_item_dot drives them) for CPUs with AVX2 and FMA but no AVX-512 (AVX-512 builds run them only when capped to "avx2", as the tests do). Same cache
// layouts (kv_layout.h) and chunks (attention/decode_tiles.h) as the AVX-512 kernels, in 256-bit vectors: a half
// line is 32 bytes, 8 tokens of one K dims group (QK: a token per lane) or 8 dims of one V token group
// (PV: a dim per lane), L values per 32-bit lane.
//
// Operands by cache dtype (the weight of token t is its probability times its V scale):
//   bf16  a half line widens to L = 2 fp32 vectors, one per value of its lanes (the low value shifted
//         up, the high one masked); fp32 FMAs against q in fp32 (QK) or the fp32 weights (PV).
//   fp8   (e4m3) L = 4, as bf16's but 4 fp32 vectors a half line: integer shifts and masks place each
//         code's sign, exponent and mantissa where fp32 has them (widen_fp8), its value times 2^-120,
//         exact for subnormal codes too; q and the weights are staged times powers of two that keep
//         the products normal (kFp8QLift, kFp8WLift).
//   fp32  (fp32 models keep an fp32 cache by default, and these CPUs run fp32 models by default.) A
//         lane is a pair of values (8 bytes): a K half line holds 4 tokens x 2 dims, a V one 4 dims x
//         2 tokens, the FMAs take q (QK) or the weights (PV) a pair at a time (vbroadcastsd), and
//         each dot product's two halves stay apart in the accumulators until one vhaddps and one
//         vpermpd join them, per 8 tokens (QK) or 8 dims (PV).
//   int8  integer products (vpmaddwd: two int16 products per int32 lane): the codes widen to int16
//         (unpack, shift), q is rounded per row to 15-bit codes (scale absmax / 32767), the weights per
//         row and chunk to 15-bit codes (scale max / 32767). A horizontal add (vphaddd) of the two
//         accumulators puts the sums back in token (QK) or dim (PV) order. No overflow: at most 64
//         products per lane (QK at D = 128), each at most 2^15 * 2^7.
// bf16 and fp8 go through dot_lanes: two half lines at a time share each broadcast of q (or of the
// weights), and each half line's products chain in a register of their own before they join the
// row's accumulator (q and the weights stored broadcast, one vfmadd with a memory operand per product,
// was bound on loads). int8 is bound on vpmaddwd. fp8 is placed in fp32 without a bias change, which beat
// widening through fp32's exponent with one (more shifts and masks, a branch for subnormal codes) and
// going through fp16 by F16C (bound on vcvtph2ps); its shifts are 16-bit ones where they can be (5 for
// 4 vectors, against 7 by 32-bit lanes). Ticks per score of each variant: docs/performance.md, "AVX2
// decode kernels" (bench/lab/decode_avx2_probe.cpp).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "decode_tiles.h"
#include "prefill.h"
#include "pyengine/dtype.h"
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"

namespace pyengine::decode {

struct Avx2 {};  // the kernels' tag (attention/paged.cpp's AVX-512 ones take Avx512)

constexpr float kCode15 = 32767.0f;
// fp8 codes placed in fp32's bit layout (widen_fp8) are their values times 2^-120. q is staged times
// 2^64 and the weights times 2^104 (*Lift), so QK's products are 2^-56 and PV's 2^-16 of the true ones
// (the epilogues multiply by *Rest): normal numbers, as FMAs on subnormals are slow on some CPUs, for
// |q| below 2^64 and V scales below 2^24 (no overflow).
constexpr float kFp8QLift = 0x1p64f, kFp8QRest = 0x1p56f, kFp8WLift = 0x1p104f, kFp8WRest = 0x1p16f;

// Bytes of a row's q operands (fp32, or int8's int16 codes) and of its PV weights over a chunk.
constexpr int64_t q_row_bytes(Avx2, Operands O, int64_t D) { return O == Operands::kInt8 ? 2 * D : 4 * D; }
constexpr int64_t weight_row_bytes(Avx2, Operands O) { return O == Operands::kInt8 ? kChunk * 2 : kChunk * 4; }

// Half h of a chunk's tiles (tokens 8 h .. 8 h + 7: tile h / 2, its first or second 8): the address of
// its K in dims group 0, and of its K or V scales.
template <Operands O, bool SPLIT>
inline const char* k_half(const ChunkPtrs& c, int h) {
  if constexpr (SPLIT) return h % 2 ? c.k1[h / 2] : c.k0[h / 2];
  else return c.k0[h / 2] + 8 * lane_bytes(O) * (h % 2);
}
template <bool SPLIT>
inline const float* scales_half(const float* const* s0, const float* const* s1, int h) {
  if constexpr (SPLIT) return h % 2 ? s1[h / 2] : s0[h / 2];
  else return s0[h / 2] + 8 * (h % 2);
}

inline __m256i load256(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The fp32 pair at p in every 64-bit lane.
inline __m256 bcast_pair(const void* p) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(static_cast<const double*>(p)));
}

// lo and hi hold two halves of 4 sums each, in lane pairs (lo: sums 0-3, hi: 4-7): the 8 sums in order
// (vhaddps leaves them 0, 1, 4, 5 | 2, 3, 6, 7).
inline __m256 join_pairs(__m256 lo, __m256 hi) {
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(lo, hi)), _MM_SHUFFLE(3, 1, 2, 0)));
}

// Four int16 at p, in every 64-bit lane.
inline __m256i bcast64(const char* p) {
  int64_t w;
  std::memcpy(&w, p, 8);
  return _mm256_set1_epi64x(w);
}

// All-ones in lane i where first + i lies in [lo, hi).
inline __m256 lanes_in(int first, int lo, int hi) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), idx);
  return _mm256_castsi256_ps(_mm256_andnot_si256(before, _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), idx)));
}

// A bf16 half line as 2 fp32 vectors, v[k] holding value k of each lane.
inline void widen_bf16(__m256i x, __m256* v) {
  v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  v[1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// An fp8 (e4m3) half line as 4 fp32 vectors, v[k] holding value k of each lane times 2^-120. A code at the
// top of a 16-bit lane (codes 1 and 3 are; 0 and 2 after a shift left by 8), shifted right by 4 with its
// sign, lies at bits 11..4 with its sign on 15..12; at the top of a 32-bit lane (1 and 0 after a shift left by
// 16), the mask leaves the sign at bit 31 and the exponent and mantissa at bits 26..20. That is the fp32
// whose exponent field is the code's (bias 127 for e4m3's 7: the 2^-120), subnormal codes as fp32
// subnormals of the same bits, zero as zero.
inline void widen_fp8(__m256i x, __m256* v) {
  const __m256i keep = _mm256_set1_epi32(static_cast<int32_t>(0x87f00000u));
  const __m256i odd = _mm256_srai_epi16(x, 4), even = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 4);
  v[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(even, 16), keep));
  v[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(odd, 16), keep));
  v[2] = _mm256_castsi256_ps(_mm256_and_si256(even, keep));
  v[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, keep));
}

// A bf16 or fp8 half line as fp32 vectors, v[k] holding value k of each lane.
template <Operands O>
inline void widen(__m256i x, __m256* v) {
  if constexpr (O == Operands::kBf16) widen_bf16(x, v);
  else widen_fp8(x, v);
}

// A half line of fp32 pairs (8 lanes of one K dims group or V token group: 4 tokens x 2 dims or 4 dims
// x 2 tokens): lo holds lanes 0-3, hi lanes 4-7. MASKED: anded with `tail` first.
template <bool MASKED>
inline void load_pairs(const char* p, __m256i tail, __m256& lo, __m256& hi) {
  __m256i a = load256(p), b = load256(p + 32);
  if constexpr (MASKED) a = _mm256_and_si256(a, tail), b = _mm256_and_si256(b, tail);
  lo = _mm256_castsi256_ps(a), hi = _mm256_castsi256_ps(b);
}

// A half line of int8 codes as int16: lo holds lanes 0, 1, 4, 5 and hi lanes 2, 3, 6, 7, each lane's
// four codes in order. vphaddd of two such accumulators restores the lanes' order.
inline void widen_int8(__m256i x, __m256i& lo, __m256i& hi) {
  lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(x, x), 8);
  hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(x, x), 8);
}

// q values d .. d + 7 of a bf16 or fp32 row, as fp32.
inline __m256 load_q8(const void* q, DType qdt, int64_t d) {
  if (qdt == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(q) + d);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(q) + d));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One q row of D values (bf16 or fp32) -> its operands at dst: fp32, or for an int8 cache 15-bit
// int16 codes (returns their scale, 0 for a zero row); fp8 times kFp8QLift. *sum is unused (the AVX-512
// int8 kernel's).
template <Operands O>
inline float stage_q(Avx2, const void* q, DType qdt, int64_t D, char* dst, int32_t* sum) {
  *sum = 0;
  if constexpr (O == Operands::kInt8) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t d = 0; d < D; d += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load_q8(q, qdt, d), abs));
    const float m = hmax256(amax);
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? kCode15 / m : 0.0f);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(load_q8(q, qdt, d), inv));  // nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * d),
                       _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
    }
    return m / kCode15;
  } else {
    for (int64_t d = 0; d < D; d += 8) {
      __m256 x = load_q8(q, qdt, d);
      if constexpr (is_fp8(O)) x = _mm256_mul_ps(x, _mm256_set1_ps(kFp8QLift));
      _mm256_storeu_ps(reinterpret_cast<float*>(dst) + d, x);
    }
    return 1.0f;
  }
}

// acc[i] += sum_k v[i][k] w[k] for two half lines i (QK: a K line's two halves of 8 tokens, w q's
// dims group; PV: 16 dims of a V token group, w the group's weights). Each w[k] is broadcast once for
// both, and each half line's products chain in one register before they join acc[i], so a row's FMA
// latency hides behind the other rows' (the accumulators of 4 rows x 2 halves x L values would not
// fit 16 registers).
template <int L>
inline void dot_lanes(const __m256 (*v)[L], const float* w, __m256* acc) {
  __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
  for (int k = 0; k < L; ++k) {
    const __m256 b = _mm256_broadcast_ss(w + k);
    t0 = k == 0 ? _mm256_mul_ps(v[0][0], b) : _mm256_fmadd_ps(v[0][k], b, t0);
    t1 = k == 0 ? _mm256_mul_ps(v[1][0], b) : _mm256_fmadd_ps(v[1][k], b, t1);
  }
  acc[0] = _mm256_add_ps(acc[0], t0);
  acc[1] = _mm256_add_ps(acc[1], t1);
}

// lo += a w and hi += b w: load_pairs' operands (a: lanes 0-3, b: 4-7) times w's pair (QK: q, PV: the
// weights) in every 64-bit lane.
inline void dot_pair(__m256 a, __m256 b, const char* w, __m256& lo, __m256& hi) {
  const __m256 wp = bcast_pair(w);
  lo = _mm256_fmadd_ps(a, wp, lo);
  hi = _mm256_fmadd_ps(b, wp, hi);
}

// QK of NR rows over the chunk: sc[r * kChunk + t] = q_r . k_t * scale (log2 units). q: the rows'
// operands (q_bytes apart); qs: the rows' q scales (int8 cache). bf16 and fp8 go a tile (16 tokens) at
// a time, sharing each broadcast of q between its halves; int8 and fp32 a half (8 tokens) at a time,
// whose two accumulators per row would not fit 16 registers for a tile at 4 rows.
template <Operands O, int NC32, int NR, bool SPLIT>
inline void qk_group(Avx2, const ChunkPtrs& c, const ChunkPtrs& next, int64_t line_stride, const char* q,
                     int64_t q_bytes, const float* qs, const int32_t*, float* sc, float scale) {
  constexpr int L = lane_of(O), kLines = 32 * NC32 / L;
  // the scale of half h's scores (log2 units; the K scales of its tokens for quantized caches)
  auto half_scale = [&](int h) {
    const __m256 s = _mm256_set1_ps(is_fp8(O) ? scale * kFp8QRest : scale);
    if constexpr (!has_scales(O)) return s;
    else return _mm256_mul_ps(s, _mm256_loadu_ps(scales_half<SPLIT>(c.ks0, c.ks1, h)));
  };
  // the next chunk's K of half h, each 64-byte line once: a line holds two halves, or (SPLIT) two dims groups
  auto prefetch_k = [&](int h, int j) {
    if (SPLIT ? j % 2 == 0 : h % 2 == 0) prefetch<kPrefetchLevel>(k_half<O, SPLIT>(next, h) + j * line_stride);
  };
  if constexpr (O == Operands::kFp32) {
    for (int h = 0; h < (c.n + 7) / 8; ++h) {
      const char* k = k_half<O, SPLIT>(c, h);
      __m256 lo[NR], hi[NR];  // tokens 0-3 and 4-7 of the half, a token's two dims in a lane pair
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
      for (int j = 0; j < kLines; ++j) {
        if constexpr (SPLIT)  // a half's dims pair is a whole line
          prefetch<kPrefetchLevel>(k_half<O, SPLIT>(next, h) + j * line_stride);
        else  // the tile's lines in address order (its halves interleave)
          prefetch<kPrefetchLevel>(next.k0[h / 2] + 64 * ((h % 2) * kLines + j));
        __m256 a, b;
        load_pairs<false>(k + j * line_stride, __m256i{}, a, b);
        for (int r = 0; r < NR; ++r) dot_pair(a, b, q + r * q_bytes + 8 * j, lo[r], hi[r]);
      }
      const __m256 s = half_scale(h);
      for (int r = 0; r < NR; ++r) _mm256_storeu_ps(sc + r * kChunk + 8 * h, _mm256_mul_ps(join_pairs(lo[r], hi[r]), s));
    }
  } else if constexpr (O == Operands::kInt8) {
    for (int h = 0; h < (c.n + 7) / 8; ++h) {
      const char* k = k_half<O, SPLIT>(c, h);
      __m256i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int j = 0; j < kLines; ++j) {
        prefetch_k(h, j);
        __m256i a, b;
        widen_int8(load256(k + j * line_stride), a, b);
        for (int r = 0; r < NR; ++r) {
          const __m256i qv = bcast64(q + r * q_bytes + 8 * j);
          lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(a, qv));
          hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(b, qv));
        }
      }
      const __m256 s = half_scale(h);
      for (int r = 0; r < NR; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[r], hi[r]));
        _mm256_storeu_ps(sc + r * kChunk + 8 * h, _mm256_mul_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(qs[r]))));
      }
    }
  } else {
    for (int i = 0; i < (c.n + 15) / 16; ++i) {  // a tile's second half past the chunk's end reads valid slots
      const char* k0 = k_half<O, SPLIT>(c, 2 * i);
      const char* k1 = k_half<O, SPLIT>(c, 2 * i + 1);
      __m256 acc[NR][2];
      for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int j = 0; j < kLines; ++j) {
        prefetch_k(2 * i, j);
        if constexpr (SPLIT) prefetch_k(2 * i + 1, j);
        __m256 v[2][L];
        widen<O>(load256(k0 + j * line_stride), v[0]);
        widen<O>(load256(k1 + j * line_stride), v[1]);
        for (int r = 0; r < NR; ++r) dot_lanes<L>(v, reinterpret_cast<const float*>(q + r * q_bytes) + L * j, acc[r]);
      }
      for (int hh = 0; hh < 2; ++hh) {
        const __m256 s = half_scale(2 * i + hh);
        for (int r = 0; r < NR; ++r) _mm256_storeu_ps(sc + r * kChunk + 16 * i + 8 * hh, _mm256_mul_ps(acc[r][hh], s));
      }
    }
  }
}

// 2^x for x <= 0 as the weights need it (kExp2Weights, vec_exp.h).
inline __m256 exp2_weights(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Weights[0]);
  for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Weights[i]));
  return times_pow2_256(p, n);
}

// softmax_row's steps; FULL: a whole chunk, every token the row's (lo 0, nv = n = kChunk), where no lane
// needs a mask: every chunk of a decode row but its last. Without the masks' compares and ands the
// kernel runs faster for all four caches (docs/performance.md, "AVX2 decode kernels").
template <Operands O, bool SPLIT, bool FULL>
inline float softmax_steps(const float* sc, int lo, int nv, int n, const ChunkPtrs& c, char* pw, float& m, float& l,
                           float& wscale) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kVecs = kChunk / 8;
  // vectors with the row's scores, with the chunk's tokens
  const int nvec = FULL ? kVecs : (nv + 7) / 8, nout = FULL ? kVecs : (n + 7) / 8;
  __m256 x[kVecs], keep[kVecs];
  const __m256 limit = _mm256_set1_ps(m + kMaxSlack);
  int over = 0;
  for (int g = 0; g < nvec; ++g) {
    x[g] = _mm256_loadu_ps(sc + 8 * g);
    const __m256 high = _mm256_cmp_ps(x[g], limit, _CMP_NLE_UQ);  // NaN is over
    if constexpr (FULL) {
      over |= _mm256_movemask_ps(high);
    } else {
      keep[g] = lanes_in(8 * g, lo, nv);
      over |= _mm256_movemask_ps(_mm256_and_ps(high, keep[g]));
    }
  }
  float m_new = m;
  if (over || m == kNegInf) {
    __m256 vmax = _mm256_set1_ps(kNegInf);
    for (int g = 0; g < nvec; ++g)
      vmax = _mm256_max_ps(vmax, FULL ? x[g] : _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x[g], keep[g]));
    m_new = std::max(m, hmax256(vmax));
  }
  const float alpha = m_new == m ? 1.0f : std::exp2(m - m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps(), wmax = _mm256_setzero_ps(), w[kVecs];
  for (int g = 0; g < nout; ++g) {
    if (g >= nvec) {
      w[g] = _mm256_setzero_ps();
    } else {
      __m256 p = exp2_weights(_mm256_sub_ps(x[g], vm));
      if constexpr (!FULL) p = _mm256_and_ps(p, keep[g]);
      vsum = _mm256_add_ps(vsum, p);
      w[g] = p;
      // scales past the chunk's end may be anything: the mask after the product zeroes NaN too
      if constexpr (has_scales(O)) {
        w[g] = _mm256_mul_ps(p, _mm256_loadu_ps(scales_half<SPLIT>(c.vs0, c.vs1, g)));
        if constexpr (!FULL) w[g] = _mm256_and_ps(w[g], keep[g]);
      }
      if constexpr (is_fp8(O)) w[g] = _mm256_mul_ps(w[g], _mm256_set1_ps(kFp8WLift));
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

// attention/paged.cpp's softmax_row in 8-lane vectors (the same lagging max): the weights of tokens
// [0, round_up(n, 8)) go to pw as fp32 (for fp8 times the V scales and kFp8WLift) or as 15-bit codes
// of scale *wscale (int8).
template <Operands O, bool SPLIT>
inline float softmax_row(Avx2, const float* sc, int lo, int nv, int n, const ChunkPtrs& c, char* pw, float& m,
                         float& l, float& wscale) {
  wscale = 0.0f;
  if (nv <= lo) {
    std::memset(pw, 0, weight_row_bytes(Avx2{}, O));
    return 1.0f;
  }
  if (lo == 0 && nv == kChunk && n == kChunk) return softmax_steps<O, SPLIT, true>(sc, lo, nv, n, c, pw, m, l, wscale);
  return softmax_steps<O, SPLIT, false>(sc, lo, nv, n, c, pw, m, l, wscale);
}

// acc_r = acc_r * alpha_r + sum_t w_rt V_t (times wscale_r for int8) for NR rows, in passes of DB
// dims (bf16, fp8: 16, two half lines; 8 for int8 and fp32, whose two accumulators a dim group needs
// would not fit 16 registers at 4 rows). pw: the rows' weights, weight_row_bytes apart. The group addresses are
// worked out once, and the loops carry no branch (the masked part group goes last), so the
// accumulators stay in registers. Each pass prefetches its share of the next chunk's V lines, spread
// over its groups (all of them in the first pass, where its loads queued behind them, was slower).
// Which share was chosen by measurement: bf16 and fp32 take the lines in address order, pass k the
// k-th run of them; 1-byte caches (groups of 4 tokens) line k * lines / passes of every group: int8
// (twice as many passes as a group has lines) each line twice, fp8 (as many) once. Either order for
// all four caches, or prefetching every line twice or every other one, was slower
// (docs/performance.md, "AVX2 decode kernels").
template <Operands O, int NC32, int NR, bool SPLIT>
inline void pv_group(Avx2, const ChunkPtrs& c, const ChunkPtrs& next, const char* pw, const float* alpha,
                     const float* wscale, float* acc, int maxnv) {
  constexpr int64_t D = 32 * NC32, group_bytes = D * lane_bytes(O), w_bytes = weight_row_bytes(Avx2{}, O);
  constexpr int L = lane_of(O), NH = O == Operands::kBf16 || is_fp8(O) ? 2 : 1, DB = 8 * NH;
  constexpr int64_t es = elem_bytes(O);
  const int ngroups = (maxnv + L - 1) / L;
  const char* gp[kChunk / 2];  // the chunk's V groups at dim 0 (at most 32: bf16's pairs)
  const char* gn[kChunk / 2];  // the next chunk's
  for (int p = 0; p < ngroups; ++p)
    gp[p] = v_group<O, SPLIT>(c, p, group_bytes), gn[p] = v_group<O, SPLIT>(next, p, group_bytes);
  // the tokens of a part group past the chunk's end may be any slot: zero them (0 * NaN is NaN)
  const int full = O == Operands::kInt8 ? ngroups : std::min(ngroups, c.n / L);
  const __m256i tail = O == Operands::kFp32  // fp32: each pair's first token
                           ? _mm256_set1_epi64x(0xffffffffLL)
                           : _mm256_set1_epi32(static_cast<int32_t>((1u << ((c.n % L) * es * 8)) - 1));
  // Unsigned and 64-bit indices: the extension builds with CPython's -fwrapv (signed overflow defined),
  // under which int index math keeps its sign extensions and its divisions by constants (call *
  // kGroupLines / kPasses is not call). Faster with the chunks in cache; from DRAM, within noise
  // (docs/performance.md, "AVX2 decode kernels").
  constexpr unsigned kPasses = D / DB, kGroupLines = group_bytes / 64;
  auto pass = [&](int64_t d0) {
    auto prefetch_v = [&](int64_t p) {
      if constexpr (es == 1) {
        prefetch<kPrefetchLevel>(gn[p] + d0 / DB * kGroupLines / kPasses * 64);
      } else {  // of the kPasses * ngroups calls, call k takes lines [k, k + 1) * kGroupLines / kPasses
        const unsigned call = static_cast<unsigned>(d0 / DB * ngroups + p);
        for (unsigned n = call * kGroupLines / kPasses; n < (call + 1) * kGroupLines / kPasses; ++n)
          prefetch<kPrefetchLevel>(gn[n / kGroupLines] + 64 * (n % kGroupLines));
      }
    };
    if constexpr (O == Operands::kFp32) {
      __m256 lo[NR], hi[NR];  // dims 0-3 and 4-7 of the pass, a dim's two tokens in a lane pair
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
      auto group = [&](int64_t p, auto masked) {
        prefetch_v(p);
        __m256 a, b;
        load_pairs<decltype(masked)::value>(gp[p] + d0 * lane_bytes(O), tail, a, b);
        for (int r = 0; r < NR; ++r) dot_pair(a, b, pw + r * w_bytes + 8 * p, lo[r], hi[r]);
      };
      for (int64_t p = 0; p < full; ++p) group(p, std::false_type{});
      if (full < ngroups) group(full, std::true_type{});
      for (int r = 0; r < NR; ++r) {
        float* o = acc + r * D + d0;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(alpha[r]), join_pairs(lo[r], hi[r])));
      }
    } else if constexpr (O == Operands::kInt8) {
      __m256i lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int64_t p = 0; p < ngroups; ++p) {  // integer products: a zero weight zeroes whatever a slot holds
        prefetch_v(p);
        __m256i a, b;
        widen_int8(load256(gp[p] + d0 * lane_bytes(O)), a, b);
        for (int r = 0; r < NR; ++r) {
          const __m256i wv = bcast64(pw + r * w_bytes + 8 * p);
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
    } else {  // bf16, fp8: whose products are kFp8WRest times too small, as acc is while in x
      constexpr float kIn = is_fp8(O) ? 1.0f / kFp8WRest : 1.0f, kOut = is_fp8(O) ? kFp8WRest : 1.0f;
      __m256 x[NR][NH];
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < NH; ++i)
          x[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * i), _mm256_set1_ps(alpha[r] * kIn));
      auto group = [&](int64_t p, auto masked) {
        prefetch_v(p);
        __m256 v[NH][L];
        for (int i = 0; i < NH; ++i) {
          __m256i raw = load256(gp[p] + d0 * lane_bytes(O) + 32 * i);
          if constexpr (decltype(masked)::value) raw = _mm256_and_si256(raw, tail);
          widen<O>(raw, v[i]);
        }
        for (int r = 0; r < NR; ++r)
          dot_lanes<L>(v, reinterpret_cast<const float*>(pw + r * w_bytes) + L * p, x[r]);
      };
      for (int64_t p = 0; p < full; ++p) group(p, std::false_type{});
      if (full < ngroups) group(full, std::true_type{});
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < NH; ++i) {
          __m256 out = x[r][i];
          if constexpr (kOut != 1.0f) out = _mm256_mul_ps(out, _mm256_set1_ps(kOut));
          _mm256_storeu_ps(acc + r * D + d0 + 8 * i, out);
        }
    }
  };
  for (int64_t d0 = 0; d0 < D; d0 += DB) pass(d0);
}

}  // namespace pyengine::decode
#endif
