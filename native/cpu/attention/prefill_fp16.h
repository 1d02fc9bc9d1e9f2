// The avx512_fp16 micro-kernels of the prefill kernel (attention/prefill.cpp's row_group and run_item
// run them): QK and PV in fp16 FMAs over operands staged in fp16, probabilities from prefill_avx512.h's
// softmax in fp16.
//
// Reads: q staged once per item by q_to_half, per group of kRows rows dims pair j of row r at
// 2 (j kRows + r), fp16; the chunk staged by stage_half_chunk from prefill_chunks.h's bf16 layouts, K
// (less the item's mean key) with dims pair j of group g at k[0] + 32 (4 j + g) (one pointer for all
// 4 groups), V with token pair i at v[0] + 2 D i, [D][2] each, fp16 pairs; p [NR][kChunk] fp16 worth
// p_unit[r] per row. Writes s [NR][kChunk] fp32 (in units of the staged q and K) and o [NR][D] fp32.
// Builds for AVX512-FP16 (and AVX512-BF16, whose kernels QK falls back to):
// #if defined(__AVX512BF16__) && defined(__AVX512FP16__).
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512FP16__)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "prefill_avx512.h"
#include "prefill_chunks.h"
#include "pyengine/bf16_widen.h"
#include "pyengine/half_pairs.h"
#include "pyengine/simd.h"

namespace pyengine {
namespace {

// The avx512_fp16 micro-kernels: fp16 FMAs, 32 products per instruction where the fp32 kernels' FMAs
// do 16, over K, V and q staged as fp16 pairs in the packed layouts: K and V once per item and chunk
// (stage_half_chunk), q once per item (q_to_half); the softmax writes the probabilities in fp16
// (store_probabilities), which keeps 3 more bits of each than bf16. Every operand is scaled by a
// power of two (exact; bf16 values fit fp16's 11 bits unless they sink below its normal range, 2^-14,
// ~2^-19 of the largest) so that no fp16 sum can overflow (65504):
//   QK  the item's q and the chunk's K below 2^(tq+1) and 2^(tk+1) (half_tops): a lane sums at most
//       D/2 products, below 2^15 together. The softmax takes the units out with the scale it applies.
//   PV  V's largest |v| below 2^8, a row's probabilities' sum below 2^7: a lane sums 32 products
//       whose magnitudes add up to less than 2^15.
// A lane's fp16 sum rounds at each addition (~2^-11 of the partial sum), so the sums are kept short
// and small: QK adds kQkSpan dims pairs per sum (then fp32), over keys less the mean key of the item's
// last chunk (run_item: an offset common to the keys, as k biases give, would swell every partial
// sum); a row's PV sums last one chunk before they join its fp32 accumulator (llama.cpp's CPU flash
// attention keeps its whole V accumulator in fp16). The default model's logprobs against the fp32
// engine (test_kv_accuracy) move about as far as avx512_fp32's. QK sums of 32 pairs ran faster but
// moved the logprobs further and doubled the largest error on the random keys of
// test_prefill_attention (docs/performance.md, "prefill attention paths").

constexpr int64_t kQkSpan = 16;  // dims pairs per fp16 QK sum

// The binary exponents tq and tk that an item's q and a chunk's K are staged below (largest |x| in
// [2^t, 2^(t+1))): D/2 products each below 2^(tq+tk+2) add up to less than 2^15 (a bound for any span).
struct HalfTops {
  float q, k;
};
HalfTops half_tops(int64_t D) {
  int log2_terms = 0;
  while ((int64_t{1} << log2_terms) < D / 2) ++log2_terms;
  const int budget = 13 - log2_terms;
  return {static_cast<float>(budget - budget / 2), static_cast<float>(budget / 2)};
}

// fp32 values of the even and odd halves of 16 pairs -> the 16 pairs in fp16.
inline __m512i half_pairs(__m512 even, __m512 odd) {
  const __m256i e = _mm256_castph_si256(_mm512_cvtxps_ph(even)), o = _mm256_castph_si256(_mm512_cvtxps_ph(odd));
  return _mm512_or_si512(_mm512_cvtepu16_epi32(e), _mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16));
}

// The largest |x| of n bf16 vectors, each at src + i ld (n >= 1).
inline float max_abs_bf16(const uint16_t* src, int64_t ld, int64_t n) {
  const __m512i abs_bits = _mm512_set1_epi16(0x7fff);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; ++i)
    acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(src + i * ld), abs_bits));
  const __m512i m16 = _mm512_max_epu16(acc, _mm512_srli_epi32(acc, 16));  // each lane's larger half, low
  return _mm512_reduce_max_ps(bf16_even(m16));
}

// 4 groups of n lines of 32 bf16 (16 pairs; line i of group g at src[g] + i ld[g]) -> fp16 pairs at
// dst (line i of group g at dst + 32 (i line_step + g group_step)), less mu (line i's pairs less
// (mu[2i], mu[2i+1]); none where null), times the 2^e bringing max |x| + mu_max (the largest |x - mu|
// at most) into [2^top, 2^(top+1)); returns 2^-e.
float stage_half(const uint16_t* const (&src)[4], const int64_t (&ld)[4], int64_t n, const float* mu, float mu_max,
                 float top, uint16_t* dst, int64_t line_step, int64_t group_step) {
  float largest = 0.0f;
  for (int g = 0; g < 4; ++g) largest = std::max(largest, max_abs_bf16(src[g], ld[g], n));
  const Pow2 s = pow2_to(largest + mu_max, top);
  for (int64_t i = 0; i < n; ++i) {
    const __m512 mu_even = mu ? _mm512_set1_ps(mu[2 * i]) : _mm512_setzero_ps();
    const __m512 mu_odd = mu ? _mm512_set1_ps(mu[2 * i + 1]) : _mm512_setzero_ps();
    for (int g = 0; g < 4; ++g) {
      const __m512i x = _mm512_loadu_si512(src[g] + i * ld[g]);
      const __m512 even = _mm512_mul_ps(_mm512_sub_ps(bf16_even(x), mu_even), s.up);
      const __m512 odd = _mm512_mul_ps(_mm512_sub_ps(bf16_odd(x), mu_odd), s.up);
      _mm512_storeu_si512(dst + 32 * (i * line_step + g * group_step), half_pairs(even, odd));
    }
  }
  return s.down;
}

// The mean of a chunk's first n keys (zeros past them, as chunk_kv gives past a sequence's end), fp32
// per dim at mu (D); returns its largest |mu_d|.
float key_mean(const ChunkKV& kv, int64_t D, int64_t n, float* mu) {
  for (int64_t j = 0; j < D / 2; ++j) {  // line j of a group: dims 2j, 2j + 1 of its 16 tokens
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int g = 0; g < 4; ++g) {
      const __m512i x = _mm512_loadu_si512(kv.k[g] + j * kv.kld[g]);
      even = _mm512_add_ps(even, bf16_even(x)), odd = _mm512_add_ps(odd, bf16_odd(x));
    }
    mu[2 * j] = _mm512_reduce_add_ps(even) / static_cast<float>(n);
    mu[2 * j + 1] = _mm512_reduce_add_ps(odd) / static_cast<float>(n);
  }
  float largest = 0.0f;
  for (int64_t d = 0; d < D; ++d) largest = std::max(largest, std::fabs(mu[d]));
  return largest;
}

// The chunk's V and, with stage_k, its K less mu (null: none) -> fp16 at vdst and kdst (a 16-token group:
// D/2 lines of 32 values, K's a dims pair of its 16 tokens, V's 16 dims of a token pair), K below
// 2^(k_top+1), V below 2^8. V's groups follow each other (token pair i of the chunk at vdst + 2 D i);
// K's lines interleave (dims pair j of group g at kdst + 32 (4 j + g)), so qk_half walks one pointer.
ChunkKV stage_half_chunk(const ChunkKV& kv, int64_t D, bool stage_k, const float* mu, float mu_max, float k_top,
                         uint16_t* kdst, uint16_t* vdst) {
  static constexpr int64_t kLine[4] = {32, 32, 32, 32};
  const int64_t lines = D / 2;
  ChunkKV out = kv;
  out.v_unit = stage_half(kv.v, kLine, lines, nullptr, 0.0f, 7.0f, vdst, 1, lines);
  for (int g = 0; g < 4; ++g) out.v[g] = vdst + 32 * lines * g;
  if (stage_k) {
    out.k_half = true;
    out.k_unit = stage_half(kv.k, kv.kld, lines, mu, mu_max, k_top, kdst, 4, 1);
    for (int g = 0; g < 4; ++g) out.k[g] = kdst + 32 * g, out.kld[g] = 128;
  }
  return out;
}

// The item's q rows (bf16, D each, `rows` a multiple of kRows) -> fp16 in place, times the 2^e bringing
// the largest |q| into [2^top, 2^(top+1)), each group of kRows rows interleaved by dims pair (pair j of
// its row r at 2 (j kRows + r) from the group's start), so that qk_half's broadcasts walk one pointer;
// returns 2^-e.
float q_to_half(uint16_t* q, int64_t rows, int64_t D, float top) {
  const Pow2 s = pow2_to(max_abs_bf16(q, 32, rows * D / 32), top);
  uint32_t pairs[kRows * 128];  // a row group's fp16 pairs, row-major (D <= 256)
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    uint16_t* group = q + r0 * D;
    for (int64_t i = 0; i < kRows * D; i += 32) {
      const __m512i x = _mm512_loadu_si512(group + i);
      _mm512_storeu_si512(pairs + i / 2, half_pairs(_mm512_mul_ps(bf16_even(x), s.up), _mm512_mul_ps(bf16_odd(x), s.up)));
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < D / 2; ++j) std::memcpy(group + 2 * (j * kRows + r), pairs + r * D / 2 + j, 4);
  }
  return s.down;
}

// s[r][t] = q_r . k_t (in units of the staged q and K, keys less the item's mean key) over a staged
// chunk and row group (q_to_half's layout), all 4 groups at once (NR x 4 fp16-pair accumulators),
// kQkSpan dims pairs per fp16 sum.
template <int NR>
void qk_half(const uint16_t* q, int64_t D, const ChunkKV& kv, float* s) {
  for (int64_t j0 = 0; j0 < D / 2; j0 += kQkSpan) {
    __m512h acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ph();
    for (int64_t j = j0; j < std::min<int64_t>(D / 2, j0 + kQkSpan); ++j) {
      __m512h kg[4];
      for (int g = 0; g < 4; ++g) kg[g] = _mm512_castsi512_ph(_mm512_loadu_si512(kv.k[0] + 32 * (4 * j + g)));
      for (int r = 0; r < NR; ++r) {
        const __m512h qr = _mm512_castsi512_ph((__m512i)bcast_pair(q + 2 * (j * kRows + r)));
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_fmadd_ph(kg[g], qr, acc[r][g]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int g = 0; g < 4; ++g) {
        float* to = s + r * kChunk + 16 * g;
        const __m512 part = half_pairs_to_ps(acc[r][g]);
        _mm512_storeu_ps(to, j0 == 0 ? part : _mm512_add_ps(_mm512_loadu_ps(to), part));
      }
  }
}

// o_r = o_r * alpha_r + sum_t p_rt v_t over a staged chunk (stage_half_chunk), with row r's fp16
// probabilities worth p_unit[r] each, 64 dims (NR x 4 fp16-pair accumulators) at a time. Not inlined:
// GCC inlined it into run_item, where the kernel as a whole ran no faster.
template <int NR>
__attribute__((noinline)) void pv_half(const uint16_t* ph, const float* p_unit, const ChunkKV& kv, int64_t D, int npairs,
                                       const float* alpha, float* o) {
  float unit[NR];  // what a row's fp16 sums are worth
  for (int r = 0; r < NR; ++r) unit[r] = p_unit[r] * kv.v_unit;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512h x[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) x[r][i] = _mm512_setzero_ph();
    const uint16_t* vp = kv.v[0] + 2 * d0;  // staged: token pair pp at kv.v[0] + 2 D pp
    for (int pp = 0; pp < npairs; ++pp, vp += 2 * D) {
      __m512h vv[4];
      for (int i = 0; i < 4; ++i) vv[i] = _mm512_castsi512_ph(_mm512_loadu_si512(vp + 32 * i));
      for (int r = 0; r < NR; ++r) {
        const __m512h pr = _mm512_castsi512_ph((__m512i)bcast_pair(ph + r * kChunk + 2 * pp));
        for (int i = 0; i < 4; ++i) x[r][i] = _mm512_fmadd_ph(vv[i], pr, x[r][i]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) {
        float* to = o + r * D + d0 + 16 * i;
        _mm512_storeu_ps(to, _mm512_fmadd_ps(half_pairs_to_ps(x[r][i]), _mm512_set1_ps(unit[r]),
                                             _mm512_mul_ps(_mm512_loadu_ps(to), _mm512_set1_ps(alpha[r]))));
      }
  }
}

template <int NR>
using HalfKernels = SimdKernels<qk_half<NR>, pv_half<NR>>;
template <int NR>
using HalfPvKernels = SimdKernels<qk_fp32<NR>, pv_half<NR>>;  // K left in bf16 (see run_item)

}  // namespace
}  // namespace pyengine
#endif  // AVX512-BF16 and AVX512-FP16
