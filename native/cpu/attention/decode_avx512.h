// The AVX-512 decode kernel's chunk steps (stage_q, qk_group, softmax_row, pv_group; paged.cpp's
// run_item_dot drives them), for builds with AVX512-BF16 and AVX512-VNNI. Their AVX2 twins are in
// decode_avx2.h; the chunks they read are decode_tiles.h's.
//
// bf16 q over a bf16, fp8 or int8 cache, head_dim D = 32 * NC32 (64 or 128), with dot products
// straight on the CPU cache layouts (kv_layout.h), where they need no shuffles. A line is one
// 64-byte vector: 16 tokens of one dims group (K) or 16 dims of one token group (V), L values per
// 32-bit lane (L = 2 for bf16, 4 for fp8/int8):
//   K tile [D/L][BS][L]: QK is acc = sum_j dot(acc, K line j, broadcast(q dims group j)), the 16
//     tokens' scores in the lanes.
//   V tile [BS/L][D][L]: PV is acc_d = sum_p dot(acc_d, V line p, broadcast(weights of token group
//     p)), the dims in the lanes.
// Operands by cache dtype (the weight of token t is its probability times its V scale):
//   bf16  bf16 x bf16 -> fp32 (vdpbf16ps); q as is, weights rounded to bf16 (as flash attention
//         does on GPUs), and the softmax sum uses the same rounded values.
//   fp8   each lane's even bytes (b0, b2) and odd bytes (b1, b3) widen to one bf16 pair each with
//         two or three shifts and logic ops (exact, times 2^-8 that the scales take back), then two
//         vdpbf16ps per line against q (or the weights) stored with each group's values in the
//         order 0, 2, 1, 3. On AVX512-FP16 CPUs they widen to fp16 instead (two ops, subnormals
//         included) and the products are fp16 FMAs: twice vdpbf16ps's rate, where fp8 decode was
//         bound on vdpbf16ps (docs/performance.md, "fp8 decode on fp16 FMAs"). q and the weights are scaled by powers of two so the short fp16 sums (up to 64
//         products per lane half and tile or chunk) cannot overflow or sink into subnormals; the
//         epilogues add each lane's two halves in fp32. Top-1 agreement with a bf16 cache through
//         this kernel is the same for both (test_kv_accuracy).
//   int8  u8 x s8 -> int32 (vpdpbusd, four products per lane). QK takes the codes offset by 128
//         (k ^ 0x80 = k + 128 as u8) against q rounded per row to codes c of 15 bits (scale
//         absmax / 16255, once per item) held as two int8 halves c = 128 h + l: two instructions
//         per line and row, and 128 sum(c) off each score. PV takes the weights rounded to u8 per
//         row and chunk (scale max / 255) against the codes: one instruction per line and row.
//         (q as one int8 code, one instruction per line, cost top-1 agreement; u8 weights cost
//         none, though their error on sharp synthetic scores is ~1e-2: docs/performance.md,
//         "int8 decode operands".)
// The rows of an item (query tokens x the G q heads of its kv head) go through in groups of up to
// 4 that share every K/V load. Tokens go in chunks of 64 (4 tiles of 16 tokens; with block size 8
// a tile spans two blocks) per online-softmax update.
//
// Operands names those choices; the decode path (set_decode_attention_path) picks fp8's.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "decode_tiles.h"
#include "pyengine/dtype.h"
#include "pyengine/simd.h"
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"

namespace pyengine::decode {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr float kQ16 = 16255.0f, kU8Max = 255.0f;
struct Avx512 {};  // the kernels' tag (the AVX2 ones take decode::Avx2)

// Bytes of a row's q operands (bf16, fp8's bf16 reordered, or int8's two halves), and of its PV
// weights over a chunk (bf16 or u8).
constexpr int64_t q_row_bytes(Avx512, Operands, int64_t D) { return 2 * D; }
constexpr int64_t weight_row_bytes(Avx512, Operands) { return kChunk * 2; }

// Bytes of q (or of the weights) per line's dot product.
constexpr int operand_bytes(Operands O) { return is_fp8(O) ? 8 : 4; }

// fp8 codes widen to bf16 or fp16 as their values times 2^-8 (exactly: e4m3's exponent lands in the low
// bits of the wider one's); the scales take the 2^8 back. (The AVX2 kernels place them in fp32 instead:
// attention/decode_avx2.h's kFp8QLift.)
constexpr float kFp8Unit = 1.0f / 256.0f;

// fp8 e4m3 codes (s eeee mmm) in the high byte of each 16-bit word -> bf16 of their values times 2^-8
// (kFp8Unit), exact for normal codes: an arithmetic shift right by 4 puts e.m on bits 10..4 and
// copies of the sign on 15..11; clearing bits 14..11 (and 3..0) and setting the exponent's high bits
// to 112 (e + 112: bias 7 -> 127, less 8) is one ternary-logic op. The scales take the 2^8 back
// (exact: a power of two).
inline __m512i fp8_high_to_bf16(__m512i y) {
  return _mm512_ternarylogic_epi32(_mm512_srai_epi16(y, 4), _mm512_set1_epi16(static_cast<int16_t>(0x87f0)),
                                   _mm512_set1_epi16(112 << 7), 0xea);  // (a & b) | c
}

// Subnormal codes (e = 0, zero among them; rare in a scaled row) in the high bytes of y, the words
// in `sub`: from a table indexed by the code rotated left by 2 (bits 1..0 the sign, 4..2 the mantissa).
inline __m512i fp8_fix_subnormals(__m512i r, __m512i y, __mmask32 sub) {
  alignas(64) static const uint16_t kSub[32] = {  // m * 2^-17 at index m << 2, its negative at (m << 2) | 3
      0, 0, 0, 0x8000, 0x3700, 0, 0, 0xb700, 0x3780, 0, 0, 0xb780, 0x37c0, 0, 0, 0xb7c0,
      0x3800, 0, 0, 0xb800, 0x3820, 0, 0, 0xb820, 0x3840, 0, 0, 0xb840, 0x3860, 0, 0, 0xb860};
  const __m512i x = _mm512_srai_epi16(y, 8);  // the code, sign-extended
  const __m512i index = _mm512_or_si512(_mm512_slli_epi16(x, 2), _mm512_srli_epi16(x, 14));
  return _mm512_mask_permutexvar_epi16(r, sub, index, _mm512_load_si512(kSub));
}

// A line of 64 fp8 codes -> its even bytes (b0, b2 of each lane) and odd bytes (b1, b3) as bf16 pairs.
inline void fp8_line_to_bf16(__m512i x, __m512i& even, __m512i& odd) {
  const __m512i hi_even = _mm512_slli_epi16(x, 8);
  even = fp8_high_to_bf16(hi_even);
  odd = fp8_high_to_bf16(x);
  const __mmask64 sub = _mm512_testn_epi8_mask(x, _mm512_set1_epi8(0x78));
  if (__builtin_expect(sub == 0, 1)) return;
  even = fp8_fix_subnormals(even, hi_even, static_cast<__mmask32>(_pext_u64(sub, 0x5555555555555555ull)));
  odd = fp8_fix_subnormals(odd, x, static_cast<__mmask32>(_pext_u64(sub, 0xaaaaaaaaaaaaaaaaull)));
}

#if defined(__AVX512FP16__)
// fp8 codes widen to fp16 exactly, subnormals and zero too: e4m3's exponent field lands in fp16's
// low four exponent bits, so every value is its code's times 2^-8 (kFp8Unit), as for bf16.
// A line of 64 fp8 codes -> its even bytes (b0, b2 of each lane) and odd bytes (b1, b3) as fp16 pairs:
// a code in a word's high byte shifted right by one (arithmetic: the sign stays on bit 15) has e.m
// on bits 13..7; clearing bit 14 and bits 6..0 leaves the fp16 of its value times 2^-8.
inline void fp8_line_to_half(__m512i x, __m512i& even, __m512i& odd) {
  const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(0xbf80));
  even = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(x, 8), 1), mask);
  odd = _mm512_and_si512(_mm512_srai_epi16(x, 1), mask);
}
#endif

// One line: 64 bytes at p, or with SPLIT (block size 8: 8 tokens per block) 32 at p and 32 at p1.
template <bool SPLIT>
inline __m512i load_line(const char* p, const char* p1 = nullptr) {
  if constexpr (SPLIT)
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
  else
    return _mm512_loadu_si512(p);
}

// The accumulator of the dot products: fp32, int32 for int8, fp16 pairs for fp8 on AVX512-FP16.
template <Operands O>
struct DotAccOf {
  using type = __m512;
};
template <>
struct DotAccOf<Operands::kInt8> {
  using type = __m512i;
};
#if defined(__AVX512FP16__)
template <>
struct DotAccOf<Operands::kFp8Half> {
  using type = __m512h;
};
#endif
template <Operands O>
using DotAcc = typename DotAccOf<O>::type;

template <Operands O>
inline DotAcc<O> dot_zero() {
  if constexpr (O == Operands::kInt8) return _mm512_setzero_si512();
#if defined(__AVX512FP16__)
  else if constexpr (O == Operands::kFp8Half) return _mm512_setzero_ph();
#endif
  else return _mm512_setzero_ps();
}

// acc + the sums of four u8 x s8 products per 32-bit lane (vpdpbusd). Not _mm512_dpbusd_epi32: GCC 12
// gave the accumulators of QK's and PV's loops a fresh register for each product through it, two
// vmovdqa32 around every vpdpbusd (QK's loop: 24 moves beside 12 products). As inline asm, and with
// the tile masks free of branches (low_bits), each product accumulates in place; either alone left the
// moves.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, u8, s8);
#endif
}

inline __m512i bcast32(const char* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return _mm512_set1_epi32(w);
}

// A line ready for its dot products: bf16 as it is; fp8 as its even and odd bf16 pairs; int8 K as
// u8 (offset by 128), int8 V as s8 codes.
struct Line {
  __m512i a, b;
};
template <Operands O, bool K>
inline Line prepare_line(__m512i raw) {
  Line l{raw, raw};
  if constexpr (O == Operands::kFp8Bf16) fp8_line_to_bf16(raw, l.a, l.b);
#if defined(__AVX512FP16__)
  else if constexpr (O == Operands::kFp8Half) fp8_line_to_half(raw, l.a, l.b);
#endif
  else if constexpr (O == Operands::kInt8 && K) l.a = _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));
  return l;
}

// acc += the line's products with the operand at p (operand_bytes(O): q's dims group, or the
// weights of a token group).
template <Operands O, bool K>
inline DotAcc<O> line_dot(DotAcc<O> acc, const Line& l, const char* p) {
  if constexpr (O == Operands::kInt8) {
    return K ? dpbusd(acc, l.a, bcast32(p)) : dpbusd(acc, bcast32(p), l.a);
  } else if constexpr (O == Operands::kFp8Bf16) {
    return _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc, (__m512bh)l.a, (__m512bh)bcast32(p)), (__m512bh)l.b,
                            (__m512bh)bcast32(p + 4));
#if defined(__AVX512FP16__)
  } else if constexpr (O == Operands::kFp8Half) {
    return _mm512_fmadd_ph(_mm512_castsi512_ph(l.b), _mm512_castsi512_ph(bcast32(p + 4)),
                           _mm512_fmadd_ph(_mm512_castsi512_ph(l.a), _mm512_castsi512_ph(bcast32(p)), acc));
#endif
  } else {
    return _mm512_dpbf16_ps(acc, (__m512bh)l.a, (__m512bh)bcast32(p));
  }
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 bf16 in groups of four reordered 0, 2, 1, 3 (the fp8 operands' order: even bytes, then odd).
inline __m256i fp8_operand_order(__m256i x) {
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6,
                                         7, 8, 9, 12, 13, 10, 11, 14, 15);
  return _mm256_shuffle_epi8(x, order);
}

// One bf16 q row of D values (try_dot_path sends only bf16 q here) -> the cache dtype's q operand at
// dst: bf16 as is, fp8 reordered, int8 codes (returns the scale, 0 for a zero row, and their sum in *sum).
template <Operands O>
inline float stage_q(Avx512, const void* qrow, DType, int64_t D, char* dst, int32_t* sum) {
  const uint16_t* q = static_cast<const uint16_t*>(qrow);
  if constexpr (O == Operands::kInt8) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(q + d)));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? kQ16 / m : 0.0f);
    __m512i s = _mm512_setzero_si512();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(q + d), inv));  // nearest even
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(64)), 7);  // round(c / 128)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtsepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + D + d),
                       _mm512_cvtsepi32_epi8(_mm512_sub_epi32(c, _mm512_slli_epi32(h, 7))));
      s = _mm512_add_epi32(s, c);
    }
    *sum = _mm512_reduce_add_epi32(s);
    return m / kQ16;
  } else if constexpr (O == Operands::kFp8Half) {
#if defined(__AVX512FP16__)
    // fp16 q times 2^e, e making the row's absmax at most 2^8: a score's 64 products then sum to
    // at most 2^8 * 1.875 * 64 < 65504 (codes are at most 1.875 as fp16). Returns 2^-e.
    __m512 amax = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(q + d)));
    const Pow2 p = pow2_to(_mm512_reduce_max_ps(amax), 7.0f);
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i x = _mm256_castph_si256(_mm512_cvtxps_ph(_mm512_mul_ps(load_bf16x16(q + d), p.up)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * d), fp8_operand_order(x));
    }
    return p.down;
#endif
  } else {
    for (int64_t d = 0; d < D; d += 16) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
      if constexpr (O == Operands::kFp8Bf16) x = fp8_operand_order(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * d), x);
    }
    return 1.0f;
  }
}

// The scales of tile i's tokens; zero past the chunk's end (slots there may hold anything).
template <bool SPLIT>
inline __m512 tile_scales(const float* const* s0, const float* const* s1, int i, uint64_t chunk_valid) {
  const __mmask16 valid = static_cast<__mmask16>(chunk_valid >> (16 * i));
  if constexpr (SPLIT)
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_maskz_loadu_ps(static_cast<__mmask8>(valid), s0[i])),
                              _mm256_maskz_loadu_ps(static_cast<__mmask8>(valid >> 8), s1[i]), 1);
  else
    return _mm512_maskz_loadu_ps(valid, s0[i]);
}

// QK of NR rows over the chunk's tiles, 4 tiles (NR x 4 accumulators) at a time:
// sc[r * kChunk + t] = q_r . k_t * scale (log2 units). q: the rows' operands (q_bytes apart);
// qs, qsum: the rows' q scales and code sums (int8 cache).
template <Operands O, int NC32, int NR, bool SPLIT>
inline void qk_group(Avx512, const ChunkPtrs& c, const ChunkPtrs& next, int64_t line_stride, const char* q,
                     int64_t q_bytes, const float* qs, const int32_t* qsum, float* sc, float scale) {
  constexpr int kLines = 32 * NC32 / lane_of(O);
  const int ntiles = (c.n + 15) / 16;
  const uint64_t valid = low_bits(c.n);  // the chunk's tokens
  constexpr int kT = O == Operands::kInt8 ? 2 : 4;
  for (int i0 = 0; i0 < ntiles; i0 += kT) {
    DotAcc<O> acc[NR][kT], accl[NR][kT];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kT; ++i) acc[r][i] = accl[r][i] = dot_zero<O>();
    for (int j = 0; j < kLines; ++j) {
      // the next chunk's K, each 64-byte line once: with SPLIT (block size 8) a K line is 32 bytes,
      // so every other one
      if (!SPLIT || j % 2 == 0)
        for (int i = i0; i < i0 + kT; ++i) {
          prefetch<kPrefetchLevel>(next.k0[i] + j * line_stride);
          if constexpr (SPLIT) prefetch<kPrefetchLevel>(next.k1[i] + j * line_stride);
        }
      for (int i = 0; i < kT; ++i) {  // tiles past the chunk's end read valid lines; their scores go unstored
        const Line k = prepare_line<O, true>(
            load_line<SPLIT>(c.k0[i0 + i] + j * line_stride, SPLIT ? c.k1[i0 + i] + j * line_stride : nullptr));
        for (int r = 0; r < NR; ++r) {
          acc[r][i] = line_dot<O, true>(acc[r][i], k, q + r * q_bytes + j * operand_bytes(O));
          if constexpr (O == Operands::kInt8)
            accl[r][i] = line_dot<O, true>(accl[r][i], k, q + r * q_bytes + 32 * NC32 + j * operand_bytes(O));
        }
      }
    }
    for (int i = 0; i < kT && i0 + i < ntiles; ++i) {
      __m512 s = _mm512_set1_ps(is_fp8(O) ? scale / kFp8Unit : scale);
      if constexpr (has_scales(O)) s = _mm512_mul_ps(s, tile_scales<SPLIT>(c.ks0, c.ks1, i0 + i, valid));
      for (int r = 0; r < NR; ++r) {
        __m512 dot;
        if constexpr (O == Operands::kInt8) {  // sum (k + 128) q = q.k + 128 sum(q)
          acc[r][i] = _mm512_add_epi32(_mm512_slli_epi32(acc[r][i], 7), accl[r][i]);
          dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][i], _mm512_set1_epi32(128 * qsum[r])));
          dot = _mm512_mul_ps(dot, _mm512_set1_ps(qs[r]));
        } else if constexpr (O == Operands::kFp8Half) {
#if defined(__AVX512FP16__)
          dot = _mm512_mul_ps(half_pairs_to_ps(acc[r][i]), _mm512_set1_ps(qs[r]));
#endif
        } else {
          dot = acc[r][i];
        }
        _mm512_storeu_ps(sc + r * kChunk + 16 * (i0 + i), _mm512_mul_ps(dot, s));
      }
    }
  }
}

// 2^x for x <= 0 as the weights need it (kExp2Weights, vec_exp.h): two fewer FMAs per 16 scores than
// exp2_512's degree-6 Taylor polynomial, in a softmax that takes a fifth of decode's time.
inline __m512 exp2_weights(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Weights[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Weights[i]));
  return _mm512_scalef_ps(p, n);
}

// Online-softmax update of one row with the scores sc[lo, nv) (lo > 0: before its window): writes
// the weights as PV's operands to pw[0, round_up(n, 16) tokens) (zeros outside [lo, nv)): bf16,
// bf16 in fp8's operand order, or u8 codes of scale *wscale (int8); updates m and l; returns alpha
// for acc. The running max lags the scores by up to kMaxSlack (attention/prefill.h): while it does
// not move, alpha is exactly 1 and the row needs no horizontal max, which at decode's 3 rows x 64
// tokens per chunk was a large part of the softmax's time.
template <Operands O, bool SPLIT>
inline float softmax_row(Avx512, const float* sc, int lo, int nv, int n, const ChunkPtrs& c, char* pw, float& m,
                         float& l, float& wscale) {
  wscale = 0.0f;
  if (nv <= lo) {
    std::memset(pw, 0, kChunk * 2);
    return 1.0f;
  }
  __m512 x[kTiles];
  __mmask16 keep[kTiles];
  const uint64_t valid = low_bits(n), span = low_bits(nv) & ~low_bits(lo);  // the chunk's tokens, the row's
  const __m512 limit = _mm512_set1_ps(m + kMaxSlack);
  __mmask16 over = 0;
  for (int g = 0; g < kTiles; ++g) {
    keep[g] = static_cast<__mmask16>(span >> (16 * g));
    x[g] = _mm512_loadu_ps(sc + 16 * g);
    over |= _mm512_mask_cmp_ps_mask(keep[g], x[g], limit, _CMP_NLE_UQ);  // NaN counts as over
  }
  float m_new = m;
  if (over || m == kNegInf) {
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (int g = 0; g < kTiles; ++g) vmax = _mm512_mask_max_ps(vmax, keep[g], vmax, x[g]);
    m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  }
  const float alpha = m_new == m ? 1.0f : std::exp2(m - m_new);
  const __m512 vm = _mm512_set1_ps(m_new);
  // int8: the weights' max; fp8 on fp16: their sum
  __m512 vsum = _mm512_setzero_ps(), wmax = _mm512_setzero_ps(), wsum = _mm512_setzero_ps(), w[kTiles];
  for (int g = 0; g < kTiles && 16 * g < n; ++g) {
    const __m512 p = _mm512_maskz_mov_ps(keep[g], exp2_weights(_mm512_sub_ps(x[g], vm)));
    __m256i* dst = reinterpret_cast<__m256i*>(pw + 32 * g);
    if constexpr (O == Operands::kInt8) {  // the fp32 weights, rounded once their max is known
      w[g] = _mm512_mul_ps(p, tile_scales<SPLIT>(c.vs0, c.vs1, g, valid));
      wmax = _mm512_max_ps(wmax, w[g]);
      vsum = _mm512_add_ps(vsum, p);
    } else if constexpr (O == Operands::kFp8Half) {  // stored once their sum is known
      w[g] = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_set1_ps(1.0f / kFp8Unit)), tile_scales<SPLIT>(c.vs0, c.vs1, g, valid));
      wsum = _mm512_add_ps(wsum, w[g]);
      vsum = _mm512_add_ps(vsum, p);
    } else if constexpr (O == Operands::kFp8Bf16) {
      const __m512 vs = tile_scales<SPLIT>(c.vs0, c.vs1, g, valid);
      const __m512 wt = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_set1_ps(1.0f / kFp8Unit)), vs);
      _mm256_storeu_si256(dst, fp8_operand_order((__m256i)_mm512_cvtneps_pbh(wt)));
      vsum = _mm512_add_ps(vsum, p);
    } else {
      const __m256bh ph = _mm512_cvtneps_pbh(p);
      _mm256_storeu_si256(dst, (__m256i)ph);
      vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(ph));
    }
  }
  if constexpr (O == Operands::kInt8) {
    const float mx = _mm512_reduce_max_ps(wmax);
    const __m512 inv = _mm512_set1_ps(mx > 0.0f ? kU8Max / mx : 0.0f);
    for (int g = 0; g < kTiles && 16 * g < n; ++g)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pw + 16 * g),
                       _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w[g], inv))));
    wscale = mx / kU8Max;
  }
#if defined(__AVX512FP16__)
  if constexpr (O == Operands::kFp8Half) {
    // fp16 weights times 2^e, e making their sum at most 2^14: with codes at most 1.875 as fp16, a
    // dim's sum over the chunk stays below 65504. wscale = 2^-e.
    const Pow2 p = pow2_to(_mm512_reduce_add_ps(wsum), 13.0f);
    for (int g = 0; g < kTiles && 16 * g < n; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + 32 * g),
                          fp8_operand_order(_mm256_castph_si256(_mm512_cvtxps_ph(_mm512_mul_ps(w[g], p.up)))));
    wscale = p.down;
  }
#endif
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  m = m_new;
  return alpha;
}

// acc_r = acc_r * alpha_r + sum_t w_rt V_t (times wscale_r for int8) for NR rows, 64 dims (4
// vectors) at a time. pw: the rows' weights, weight_row_bytes apart.
template <Operands O, int NC32, int NR, bool SPLIT>
inline void pv_group(Avx512, const ChunkPtrs& c, const ChunkPtrs& next, const char* pw, const float* alpha,
                     const float* wscale, float* acc, int maxnv) {
  constexpr int64_t D = 32 * NC32, group_bytes = D * 4;
  constexpr int L = lane_of(O);
  constexpr int64_t es = elem_bytes(O);
  const int ngroups = (maxnv + L - 1) / L;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    DotAcc<O> x[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) {
        if constexpr (O == Operands::kInt8 || O == Operands::kFp8Half)
          x[r][k] = dot_zero<O>();  // folded into acc at the end
        else x[r][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + 16 * k), _mm512_set1_ps(alpha[r]));
      }
    // token group p of the chunk; keep: the bytes of its lanes that hold tokens of the chunk
    auto group = [&](int p, __mmask64 keep) {
      if (d0 == 0) {  // the next chunk's V group p
        const char* nv = v_group<O, SPLIT>(next, p, group_bytes);
        for (int64_t b = 0; b < group_bytes; b += 64) prefetch<kPrefetchLevel>(nv + b);
      }
      const char* w = pw + p * operand_bytes(O);
      for (int k = 0; k < 4; ++k) {
        __m512i raw = _mm512_loadu_si512(v_group<O, SPLIT>(c, p, group_bytes) + (d0 + 16 * k) * 4);
        if (keep != ~0ull) raw = _mm512_maskz_mov_epi8(keep, raw);
        const Line v = prepare_line<O, false>(raw);
        for (int r = 0; r < NR; ++r) x[r][k] = line_dot<O, false>(x[r][k], v, w + r * weight_row_bytes(Avx512{}, O));
      }
    };
    if constexpr (O == Operands::kInt8) {  // integer products: a zero weight zeroes whatever a slot holds
      for (int p = 0; p < ngroups; ++p) group(p, ~0ull);
    } else {
      const int full = std::min(ngroups, c.n / L);
      for (int p = 0; p < full; ++p) group(p, ~0ull);
      // the tokens of a part group past the chunk's end may be any slot: zero them (0 * NaN is NaN)
      if (full < ngroups) group(full, 0x1111111111111111ull * ((1ull << ((c.n % L) * es)) - 1));
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) {
        float* o = acc + r * D + d0 + 16 * k;
        if constexpr (O == Operands::kInt8)
          _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(x[r][k]), _mm512_set1_ps(wscale[r]),
                                              _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha[r]))));
#if defined(__AVX512FP16__)
        else if constexpr (O == Operands::kFp8Half)
          _mm512_storeu_ps(o, _mm512_fmadd_ps(half_pairs_to_ps(x[r][k]), _mm512_set1_ps(wscale[r]),
                                              _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha[r]))));
#endif
        else
          _mm512_storeu_ps(o, x[r][k]);
      }
  }
}


}  // namespace pyengine::decode
#endif  // AVX512-BF16 and VNNI
