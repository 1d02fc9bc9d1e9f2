// prefill_attention (CPU): causal attention of prompt chunks (sequences with many query tokens) over
// the paged KV cache, flash-attention style, built to run at the bf16 dot-product rate of the GEMMs.
//
// Two phases per batch of (sequence, kv head) pairs:
//  1. Pack. Each pair's cache positions [lo, len) (lo = 0, or the earliest window start, rounded down
//     to a chunk) are gathered from the scattered block tiles into one contiguous bf16 run:
//       K [n/16][D/2][16][2]  16-token groups; a group's dims pair j is one 64-byte vector (16 tokens)
//       V [n/2][D][2]         token pair (2p, 2p+1) at dims d..d+15 is one 64-byte vector
//       ks, vs [n] fp32       per-token scales (fp8/int8 caches), 1 for bf16
//     n rounded up to a whole chunk with zeros (never NaN: 0 * NaN would leak into the output).
//     fp8/int8 codes become bf16 exactly (256-entry table); the scales stay fp32 and are applied to
//     the scores (K) and to the probabilities before their bf16 rounding (V), as the decode kernel does.
//     Packing once per pair costs one read of the K/V; every query block of the pair then reads the
//     packed copy (any block size, any cache dtype, no per-block pointer chasing in the hot loops).
//  2. Attend. Work items are (pair, block of about kItemRows / G query tokens), heaviest first. An
//     item's rows (query tokens x the G q heads of its kv head) walk the kv range in chunks of kChunk
//     tokens; per chunk, groups of kRows rows do
//       QK  s[r][t] = q_r . k_t            kRows x 4 accumulators, vdpbf16ps(K group vector, q pair)
//       online softmax in fp32 (scale, optional softcap, causal/window masks, running max and sum)
//       PV  o_r = o_r * alpha_r + sum_t p_rt v_t   kRows x 4 accumulators per 64 dims,
//                                                  vdpbf16ps(V pair vector, p pair)
//     so each loaded K/V vector feeds kRows dot products and the chunk (8-16 KB) stays in L1 while
//     all the item's rows pass over it. Probabilities are rounded to bf16 for PV (as flash attention
//     on GPUs does); scores, sums and accumulators are fp32.
// Without AVX512_BF16 (or after set_prefill_attention_portable(true)) plain loops over the same
// packed layout do the same arithmetic in fp32 (the compiler vectorizes them for AVX2).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "prefill_attention.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/kv_quant.h"
#include "pyengine/parallel.h"
#include "pyengine/vec_exp.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
// GCC 12 flags the _mm512_undefined_*() placeholders inside its own intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pyengine {
namespace {

constexpr int kChunk = 64;              // kv tokens per online-softmax step: 4 groups of 16
constexpr int kRows = 6;                // q rows per micro-kernel pass (6 x 4 accumulators)
constexpr int64_t kItemRows = 96;       // q rows (query tokens x G heads) per work item
constexpr int64_t kPackTokens = 1024;   // positions per packing task
constexpr int64_t kPackBudget = 64 << 20;  // bytes of packed K/V per batch of pairs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::atomic<bool> g_portable{false};

// One (sequence, kv head)'s packed K/V: positions [lo, lo + n), n a multiple of kChunk.
struct Packed {
  int32_t seq, kvh;
  int64_t lo, n;
  uint16_t* k;
  uint16_t* v;
  float* ks;
  float* vs;
};

struct Item {
  int32_t pair, tok0, tok1;  // query tokens [tok0, tok1) of the pair's sequence
  int64_t work;
};

// Per-thread scratch of an item: its q rows (bf16), accumulators, running max/sum, one row group's
// scores and bf16 probabilities.
struct Scratch {
  std::vector<uint16_t> q, p;
  std::vector<float> o, m, l, s;
  void fit(int64_t rows, int64_t D) {
    if (static_cast<int64_t>(q.size()) < rows * D) q.resize(rows * D), o.resize(rows * D);
    if (static_cast<int64_t>(m.size()) < rows) m.resize(rows), l.resize(rows);
    s.resize(kRows * kChunk);
    p.resize(kRows * kChunk);
  }
};

// ---------------------------------------------------------------------------------------------
// Packing.
// ---------------------------------------------------------------------------------------------

// bf16 bits of every fp8 e4m3 / int8 code (both convert exactly: <= 4 / 7 significant bits).
template <DType CD>
const std::array<uint16_t, 256>& code_table() {
  static const std::array<uint16_t, 256> table = [] {
    std::array<uint16_t, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const float f = CD == DType::kFloat8E4M3 ? fp8e4m3_to_float(static_cast<uint8_t>(c))
                                              : int8_to_float(static_cast<int8_t>(static_cast<uint8_t>(c)));
      t[c] = static_cast<uint16_t>(kvq_bits(f) >> 16);
    }
    return t;
  }();
  return table;
}

// Positions [lo + t0, lo + t1) of pair P (t0, t1 even) into its packed run.
template <DType CD>
void pack_range(const AttentionStep& a, const Packed& P, int64_t t0, int64_t t1) {
  constexpr bool kQuant = CD != DType::kBFloat16;
  const auto* table = kQuant ? code_table<CD>().data() : nullptr;
  auto bits = [table](const void* base, int64_t i) -> uint16_t {
    if constexpr (kQuant) return table[static_cast<const uint8_t*>(base)[i]];
    else return static_cast<const uint16_t*>(base)[i];
  };
  const int64_t D = a.D, half = D / 2, len = a.seq_lens[P.seq];
  const size_t es = kQuant ? 1 : 2;
  const int32_t* blocks = a.block_tables + P.seq * a.MB;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t pos = P.lo + t;
    uint16_t* kd = P.k + (t / 16 * half * 16 + t % 16) * 2;  // dims pair j at kd[32 j], kd[32 j + 1]
    uint16_t* vd = P.v + t / 2 * 2 * D + t % 2;              // dim d at vd[2 d]
    if (pos >= len) {
      for (int64_t j = 0; j < half; ++j) kd[32 * j] = kd[32 * j + 1] = 0;
      for (int64_t d = 0; d < D; ++d) vd[2 * d] = 0;
      P.ks[t] = P.vs[t] = 0.0f;
      continue;
    }
    const int64_t tile = static_cast<int64_t>(blocks[pos / a.BS]) * a.KVH + P.kvh, off = pos % a.BS;
    const char* kt = static_cast<const char*>(a.k) + tile * a.BS * D * es;  // [D/2][BS][2]
    const char* vt = static_cast<const char*>(a.v) + tile * a.BS * D * es;  // [BS/2][D][2]
    for (int64_t j = 0; j < half; ++j) {
      kd[32 * j] = bits(kt, (j * a.BS + off) * 2);
      kd[32 * j + 1] = bits(kt, (j * a.BS + off) * 2 + 1);
    }
    const int64_t v0 = off / 2 * D * 2 + off % 2;
    for (int64_t d = 0; d < D; ++d) vd[2 * d] = bits(vt, v0 + 2 * d);
    P.ks[t] = kQuant ? a.ks[tile * a.BS + off] : 1.0f;
    P.vs[t] = kQuant ? a.vs[tile * a.BS + off] : 1.0f;
  }
}

void pack(const AttentionStep& a, const Packed& P, int64_t t0, int64_t t1) {
  switch (a.cdt) {
    case DType::kFloat8E4M3: pack_range<DType::kFloat8E4M3>(a, P, t0, t1); break;
    case DType::kInt8: pack_range<DType::kInt8>(a, P, t0, t1); break;
    default: pack_range<DType::kBFloat16>(a, P, t0, t1); break;
  }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels over one chunk: k points at the chunk's packed K (4 groups), v at its packed V
// (kChunk / 2 pairs), q at nr rows of D bf16, s / p at nr rows of kChunk scores / probabilities.
// ---------------------------------------------------------------------------------------------

// The softmax of one row's chunk: scores s (raw dot products) of the visible tokens [lo, hi) are
// scaled (and capped), the running max m and sum l updated; p gets bf16(prob * vs) (zero outside
// [lo, hi)); returns alpha = exp(m_old - m_new), the factor for the row's accumulator.
struct RowSoftmax {
  float scale, softcap;
  const float* ks;
  const float* vs;
};

float softmax_row_portable(const RowSoftmax& c, const float* s, int lo, int hi, float& m, float& l, uint16_t* p) {
  float x[kChunk];
  float mx = kNegInf;
  for (int t = lo; t < hi; ++t) {
    float v = s[t] * c.scale * c.ks[t];
    if (c.softcap > 0.0f) v = c.softcap * std::tanh(v / c.softcap);
    x[t] = v;
    mx = std::max(mx, v);
  }
  const float m_new = std::max(m, mx), alpha = std::exp(m - m_new);
  float sum = 0.0f;
  for (int t = 0; t < kChunk; ++t) {
    const float e = t >= lo && t < hi ? std::exp(x[t] - m_new) : 0.0f;
    sum += e;
    p[t] = float_to_bf16(e * c.vs[t]);
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

void qk_portable(int nr, const uint16_t* q, int64_t D, const uint16_t* k, float* s) {
  const int64_t half = D / 2;
  for (int r = 0; r < nr; ++r) {
    float acc[kChunk] = {};
    for (int64_t j = 0; j < half; ++j) {
      const float q0 = bf16_to_float(q[r * D + 2 * j]), q1 = bf16_to_float(q[r * D + 2 * j + 1]);
      for (int t = 0; t < kChunk; ++t) {
        const uint16_t* kp = k + (t / 16 * half * 16 + j * 16 + t % 16) * 2;
        acc[t] += q0 * bf16_to_float(kp[0]) + q1 * bf16_to_float(kp[1]);
      }
    }
    std::copy(acc, acc + kChunk, s + r * kChunk);
  }
}

void pv_portable(int nr, const uint16_t* p, const uint16_t* v, int64_t D, int npairs, const float* alpha, float* o) {
  for (int r = 0; r < nr; ++r) {
    float* orow = o + r * D;
    for (int64_t d = 0; d < D; ++d) orow[d] *= alpha[r];
    for (int pp = 0; pp < npairs; ++pp) {
      const float p0 = bf16_to_float(p[r * kChunk + 2 * pp]), p1 = bf16_to_float(p[r * kChunk + 2 * pp + 1]);
      const uint16_t* vp = v + pp * 2 * D;
      for (int64_t d = 0; d < D; ++d) orow[d] += p0 * bf16_to_float(vp[2 * d]) + p1 * bf16_to_float(vp[2 * d + 1]);
    }
  }
}

#if defined(__AVX512BF16__)

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

float softmax_row_avx(const RowSoftmax& c, const float* s, int lo, int hi, float& m, float& l, uint16_t* p) {
  __m512 x[4];
  __mmask16 keep[4];
  __m512 vmax = _mm512_set1_ps(kNegInf);
  const __m512 scale = _mm512_set1_ps(c.scale);
  for (int g = 0; g < 4; ++g) {
    keep[g] = tail_mask(hi - 16 * g) & static_cast<__mmask16>(~tail_mask(lo - 16 * g));
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(s + 16 * g), scale), _mm512_loadu_ps(c.ks + 16 * g));
    if (c.softcap > 0.0f) {
      const __m512 cap = _mm512_set1_ps(c.softcap);
      v = _mm512_mul_ps(cap, tanh512(_mm512_div_ps(v, cap)));
    }
    x[g] = v;
    vmax = _mm512_mask_max_ps(vmax, keep[g], vmax, v);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax)), alpha = std::exp(m - m_new);
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int g = 0; g < 4; ++g) {
    const __m512 e = _mm512_maskz_mov_ps(keep[g], exp512(_mm512_sub_ps(x[g], vm)));
    sum = _mm512_add_ps(sum, e);
    const __m256bh pb = _mm512_cvtneps_pbh(_mm512_mul_ps(e, _mm512_loadu_ps(c.vs + 16 * g)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * g), (__m256i)pb);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

template <int NR>
void qk_avx(const uint16_t* q, int64_t D, const uint16_t* k, float* s) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  const int64_t half = D / 2, group = 16 * D;
  for (int64_t j = 0; j < half; ++j) {
    __m512bh kv[4];
    for (int g = 0; g < 4; ++g) kv[g] = (__m512bh)_mm512_loadu_si512(k + g * group + 32 * j);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qb = bcast_pair(q + r * D + 2 * j);
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], kv[g], qb);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(s + r * kChunk + 16 * g, acc[r][g]);
}

template <int NR>
void pv_avx(const uint16_t* p, const uint16_t* v, int64_t D, int npairs, const float* alpha, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 x[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i)
        x[r][i] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * i), _mm512_set1_ps(alpha[r]));
    for (int pp = 0; pp < npairs; ++pp) {
      const uint16_t* vp = v + pp * 2 * D + 2 * d0;
      __m512bh vv[4];
      for (int i = 0; i < 4; ++i) vv[i] = (__m512bh)_mm512_loadu_si512(vp + 32 * i);
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = bcast_pair(p + r * kChunk + 2 * pp);
        for (int i = 0; i < 4; ++i) x[r][i] = _mm512_dpbf16_ps(x[r][i], vv[i], pr);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + r * D + d0 + 16 * i, x[r][i]);
  }
}

template <int NR>
void row_group_avx(const RowSoftmax& c, const uint16_t* q, int64_t D, const uint16_t* k, const uint16_t* v,
                   const int* lo, const int* hi, float* m, float* l, float* o, Scratch& w) {
  qk_avx<NR>(q, D, k, w.s.data());
  float alpha[NR];
  int maxhi = 0;
  for (int r = 0; r < NR; ++r) {
    uint16_t* p = w.p.data() + r * kChunk;
    if (lo[r] < hi[r]) {
      alpha[r] = softmax_row_avx(c, w.s.data() + r * kChunk, lo[r], hi[r], m[r], l[r], p);
      maxhi = std::max(maxhi, hi[r]);
    } else {
      alpha[r] = 1.0f;
      std::memset(p, 0, kChunk * 2);
    }
  }
  pv_avx<NR>(w.p.data(), v, D, (maxhi + 1) / 2, alpha, o);
}

#endif

void row_group_portable(int nr, const RowSoftmax& c, const uint16_t* q, int64_t D, const uint16_t* k,
                        const uint16_t* v, const int* lo, const int* hi, float* m, float* l, float* o, Scratch& w) {
  qk_portable(nr, q, D, k, w.s.data());
  float alpha[kRows];
  int maxhi = 0;
  for (int r = 0; r < nr; ++r) {
    uint16_t* p = w.p.data() + r * kChunk;
    if (lo[r] < hi[r]) {
      alpha[r] = softmax_row_portable(c, w.s.data() + r * kChunk, lo[r], hi[r], m[r], l[r], p);
      maxhi = std::max(maxhi, hi[r]);
    } else {
      alpha[r] = 1.0f;
      std::memset(p, 0, kChunk * 2);
    }
  }
  pv_portable(nr, w.p.data(), v, D, (maxhi + 1) / 2, alpha, o);
}

// nr (<= kRows) rows of one chunk.
void row_group(bool portable, int nr, const RowSoftmax& c, const uint16_t* q, int64_t D, const uint16_t* k,
               const uint16_t* v, const int* lo, const int* hi, float* m, float* l, float* o, Scratch& w) {
#if defined(__AVX512BF16__)
  if (!portable) {
    switch (nr) {
      case 1: return row_group_avx<1>(c, q, D, k, v, lo, hi, m, l, o, w);
      case 2: return row_group_avx<2>(c, q, D, k, v, lo, hi, m, l, o, w);
      case 3: return row_group_avx<3>(c, q, D, k, v, lo, hi, m, l, o, w);
      case 4: return row_group_avx<4>(c, q, D, k, v, lo, hi, m, l, o, w);
      case 5: return row_group_avx<5>(c, q, D, k, v, lo, hi, m, l, o, w);
      default: return row_group_avx<6>(c, q, D, k, v, lo, hi, m, l, o, w);
    }
  }
#endif
  row_group_portable(nr, c, q, D, k, v, lo, hi, m, l, o, w);
}

// ---------------------------------------------------------------------------------------------
// One work item: query tokens [tok0, tok1) of pair P, all their visible positions.
// ---------------------------------------------------------------------------------------------
void run_item(const AttentionStep& a, const Packed& P, int64_t tok0, int64_t tok1, bool portable, Scratch& w) {
  const int64_t G = a.H / a.KVH, D = a.D, rows = (tok1 - tok0) * G;
  const int64_t q_start = a.qsl[P.seq], first = a.seq_lens[P.seq] - (a.qsl[P.seq + 1] - q_start);
  w.fit(rows, D);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + tok0 + r / G, head = P.kvh * G + r % G;
    std::memcpy(w.q.data() + r * D, static_cast<const uint16_t*>(a.q) + tok * a.q_stride + head * D, D * 2);
    std::fill(w.o.data() + r * D, w.o.data() + (r + 1) * D, 0.0f);
    w.m[r] = kNegInf;
    w.l[r] = 0.0f;
  }
  const int64_t pos0 = first + tok0, pos_end = first + tok1;  // the item's positions [pos0, pos_end)
  const int64_t kv_lo = a.window > 0 ? std::max<int64_t>(0, pos0 + 1 - a.window) : 0;
  for (int64_t c0 = kv_lo / kChunk * kChunk; c0 < pos_end; c0 += kChunk) {
    const int64_t t = c0 - P.lo;  // the chunk in the packed run
    const RowSoftmax sm{a.scale, a.softcap, P.ks + t, P.vs + t};
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      int lo[kRows], hi[kRows];
      bool any = false;
      for (int r = 0; r < nr; ++r) {
        const int64_t end = first + tok0 + (r0 + r) / G + 1 - c0;  // the row's causal end in the chunk
        hi[r] = static_cast<int>(std::clamp<int64_t>(end, 0, kChunk));
        lo[r] = a.window > 0 ? static_cast<int>(std::clamp<int64_t>(end - a.window, 0, kChunk)) : 0;
        any |= lo[r] < hi[r];
      }
      if (!any) continue;
      row_group(portable, nr, sm, w.q.data() + r0 * D, D, P.k + t * D, P.v + t * D, lo, hi, w.m.data() + r0,
                w.l.data() + r0, w.o.data() + r0 * D, w);
    }
  }
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + tok0 + r / G, head = P.kvh * G + r % G;
    const float inv = 1.0f / w.l[r];
    for (int64_t d = 0; d < D; ++d) out[(tok * a.H + head) * D + d] = float_to_bf16(w.o[r * D + d] * inv);
  }
}

// Packs the pairs [p0, p1) into buf, then runs all their items.
void run_batch(const AttentionStep& a, std::vector<Packed>& pairs, int64_t p0, int64_t p1, bool portable) {
  static thread_local std::vector<uint16_t> kv;
  static thread_local std::vector<float> scales;
  int64_t tokens = 0;
  for (int64_t i = p0; i < p1; ++i) tokens += pairs[i].n;
  kv.resize(tokens * a.D * 2 + 32);
  scales.resize(tokens * 2);
  uint16_t* base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(kv.data()) + 63) & ~uintptr_t{63});
  int64_t off = 0;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (pair, first position) of each packing task
  for (int64_t i = p0; i < p1; ++i) {
    Packed& P = pairs[i];
    P.k = base + off * a.D * 2;
    P.v = P.k + P.n * a.D;
    P.ks = scales.data() + off * 2;
    P.vs = P.ks + P.n;
    off += P.n;
    for (int64_t t = 0; t < P.n; t += kPackTokens) tasks.emplace_back(i, t);
  }
  auto& pool = ThreadPool::instance();
  pool.parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Packed& P = pairs[tasks[i].first];
    pack(a, P, tasks[i].second, std::min(P.n, tasks[i].second + kPackTokens));
  });

  const int64_t G = a.H / a.KVH, item_tokens = std::max<int64_t>(1, kItemRows / G);
  std::vector<Item> items;
  for (int64_t i = p0; i < p1; ++i) {
    const Packed& P = pairs[i];
    const int64_t q_len = a.qsl[P.seq + 1] - a.qsl[P.seq], first = a.seq_lens[P.seq] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += item_tokens) {
      const int64_t t1 = std::min(q_len, t0 + item_tokens);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first + t0 + 1 - a.window) : 0;
      items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(t0), static_cast<int32_t>(t1),
                       (first + t1 - lo) * (t1 - t0)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.work > y.work; });
  pool.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch w;
    run_item(a, pairs[items[i].pair], items[i].tok0, items[i].tok1, portable, w);
  });
}

}  // namespace

bool prefill_attention_supports(const AttentionStep& a) {
  const bool cache_ok = a.cdt == DType::kBFloat16 || a.cdt == DType::kFloat8E4M3 || a.cdt == DType::kInt8;
  return a.qdt == DType::kBFloat16 && cache_ok && a.D % 64 == 0 && a.D <= 256;
}

void prefill_attention_cpu(const AttentionStep& a, const int32_t* seqs, int64_t nseqs) {
#if defined(__AVX512BF16__)
  const bool portable = g_portable.load();
#else
  const bool portable = true;
#endif
  std::vector<Packed> pairs;
  for (int64_t i = 0; i < nseqs; ++i) {
    const int32_t s = seqs[i];
    const int64_t len = a.seq_lens[s], first = len - (a.qsl[s + 1] - a.qsl[s]);
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first + 1 - a.window) / kChunk * kChunk : 0;
    const int64_t n = (len - lo + kChunk - 1) / kChunk * kChunk;
    for (int32_t h = 0; h < a.KVH; ++h) pairs.push_back({s, h, lo, n, nullptr, nullptr, nullptr, nullptr});
  }
  // batches of pairs whose packed K/V fit the budget (at least one pair each)
  const int64_t pair_bytes_per_token = a.D * 4 + 8;
  for (int64_t p0 = 0, p1; p0 < static_cast<int64_t>(pairs.size()); p0 = p1) {
    int64_t bytes = pairs[p0].n * pair_bytes_per_token;
    for (p1 = p0 + 1; p1 < static_cast<int64_t>(pairs.size()); ++p1) {
      bytes += pairs[p1].n * pair_bytes_per_token;
      if (bytes > kPackBudget) break;
    }
    run_batch(a, pairs, p0, p1, portable);
  }
}

void set_prefill_attention_portable(bool portable) { g_portable.store(portable); }

}  // namespace pyengine
