// paged_attention (CPU): causal attention of a whole mixed step (prompt chunks and single-token
// decodes together) over a paged KV cache.
//
// Layouts (element strides, row-major):
//   q        [T, H, D]   token stride q_stride, heads and D contiguous      out [T, H, D] contiguous
//   k cache  [NB, KVH, D/L, BS, L]  v cache [NB, KVH, BS/L, D, L]  (the CPU cache layout, kv_layout.h:
//            one (block, kv head) tile holds K as groups of L dims of each token, V as groups of L
//            tokens of each dim; L = 4 for fp8/int8 caches, 2 otherwise; D and BS multiples of L)
//   k/v scales [NB, KVH, BS] fp32 (fp8/int8 caches: value = code * scale)
//   block_tables [S, MB] int32, seq_lens [S] int32, query_start_loc [S+1] int32
// Query token j of sequence s (q_len = qsl[s+1] - qsl[s]) sits at position seq_len - q_len + j and
// sees cache positions <= its own. q head hq reads kv head hq / G (G = H / KVH).
// Options (0 = off): window > 0 limits that to the `window` positions ending at its own (Mistral,
// Gemma sliding-window layers); softcap > 0 maps each score s (scale included) to
// softcap * tanh(s / softcap) before the softmax (Gemma 2; the run_item path only).
//
// Parallel shape: work items (sequence, kv heads, query tile, kv split) over the thread pool, heaviest
// first. An item spans as many adjacent kv heads as still leave 2 items per thread, none over half a
// thread's share of the work (their tiles are adjacent in a block: longer runs of memory for the
// prefetchers). A query tile is QT = max(1, 16 / G) query tokens x the G q heads of one kv head (<= 16
// rows unless G > 16), so each K/V row is loaded and dequantized once per tile into an fp32 scratch
// chunk (L1-sized) and reused by every row. When (sequences x kv heads x tiles) is too few to feed the
// pool (decode at small batch, long context) the kv range is split flash-decoding style, each part an
// item over as many kv heads as divide KVH, and the partial (max, sum, acc) triples are merged
// afterwards. Online softmax in base 2 (q is pre-scaled by scale * log2 e); the score matrix is never
// materialised beyond one chunk of one row. fp32 throughout.
//
// Paths (chosen at compile time by the -march of the build, PYENGINE_CPU_ARCH):
//   a bf16/fp8/int8 cache, head_dim 64/128, block size 8 or a multiple of 16: run_item_dot, dot
//     products straight from the cache tiles, chunk by chunk (attention/decode_tiles.h). With AVX512_BF16 and
//     AVX512_VNNI (bf16 q) its kernels are vdpbf16ps, or vpdpbusd for int8 (see their comment); with
//     AVX2 and FMA but no AVX-512 (bf16 or fp32 q), fp32 FMAs on the widened values, or vpmaddwd for
//     int8 (attention/decode_avx2.h). This is the hot path of bf16 models, and on AVX2 CPUs of fp32 ones with a
//     quantized cache.
//   everything else (fp32/fp16 caches, fp16 q, other head dims, no AVX2): run_item, which dequantizes each K/V
//     chunk once into fp32 scratch; AVX-512 intrinsics under __AVX512F__, AVX2 + FMA ones (8-float
//     vectors, the same loops) under __AVX2__, otherwise portable loops in 16-lane strips. On an AVX2
//     host (AMD Zen 3) the AVX2 loops took a 2,000-token fp32 prefill from 114 to 168 tok/s: the
//     portable ones called libm's exp2f per score and left qk unvectorized.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/half_pairs.h"
#include "pyengine/kv_layout.h"
#include "pyengine/kv_quant.h"
#include "decode_avx2.h"
#include "decode_tiles.h"
#include "prefill.h"
#include "pyengine/parallel.h"
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
// GCC 12 flags the _mm512_undefined_*() placeholders inside its own intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pyengine {
namespace {
#if defined(__AVX2__)
using namespace decode;
#endif

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMinSplitTokens = 256;
constexpr int32_t kMaxItemHeads = 8;  // kv heads one decode work item may span

// The decode paths a build has, best first; set_decode_attention_path caps which one runs (tests:
// an AVX-512 CPU runs the AVX2 and fp32 paths too, and one without AVX512-FP16 computes fp8 caches in
// bf16, which this host would otherwise never test). kAvx512Fp16 differs only for fp8 caches.
enum class DecodePath { kAvx512Fp16, kAvx512Bf16, kAvx2, kFp32 };
std::atomic<DecodePath> g_decode_cap{DecodePath::kAvx512Fp16};

// One step's arguments (AttentionStep, attention/prefill.h) and what the decode kernel derives from them.
struct Args : AttentionStep {
  int64_t G, Dp, chunk, QT;
};

struct Item {
  int32_t seq, kvh, nkvh;        // kv heads [kvh, kvh + nkvh)
  int32_t tok0, tok1;            // query tokens [tok0, tok1) of the sequence
  int32_t kv_lo, kv_hi;          // cache positions [kv_lo, kv_hi)
  int32_t split, nsplit;         // split index and count (nsplit > 1: write partials)
  int64_t work;
};

// Partial results of split items: per (token, q head, split) the running max, sum and accumulator.
struct Partials {
  int64_t nsplit = 1;
  std::vector<float> ml, acc;
};

struct Workspace {
  std::vector<float> qf, acc, m, l, kf, vf, sc;
  std::vector<uint16_t> qb, pb;  // dot path: the q rows' operands, the weights' operands
  std::vector<float> qs;         // dot path, int8 cache: the q rows' scales and code sums
  std::vector<int32_t> qsum;
  std::vector<int64_t> row_end;  // dot path: each row's causal end (cache positions it sees: < row_end)
  void fit(int64_t rows, int64_t Dp, int64_t chunk) {
    const int64_t chunk16 = (chunk + 15) / 16 * 16;
    if (static_cast<int64_t>(qf.size()) < rows * Dp) qf.resize(rows * Dp), acc.resize(rows * Dp);
    if (static_cast<int64_t>(m.size()) < rows) m.resize(rows), l.resize(rows);
    if (static_cast<int64_t>(kf.size()) < chunk16 * Dp) kf.resize(chunk16 * Dp), vf.resize(chunk16 * Dp);
    if (static_cast<int64_t>(sc.size()) < chunk16) sc.resize(chunk16);
  }
};

float elem_to_float(const void* base, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat8E4M3: return fp8e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kInt8: return int8_to_float(static_cast<const int8_t*>(base)[i]);
  }
  return 0.0f;
}

void store_float(void* base, int64_t i, DType t, float x) {
  if (t == DType::kFloat32) static_cast<float*>(base)[i] = x;
  else if (t == DType::kBFloat16) static_cast<uint16_t*>(base)[i] = float_to_bf16(x);
  else static_cast<uint16_t*>(base)[i] = float_to_fp16(x);
}

constexpr size_t elem_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kBFloat16 || t == DType::kFloat16) ? 2 : 1;
}

// ---------------------------------------------------------------------------------------------
// Cache tiles -> fp32 rows (the generic path). A tile is one (block, kv head): K [D/L][BS][L],
// V [BS/L][D][L] (kv_layout.h). Tokens [off, off + n) of the tile become n rows of Dp floats (zero
// padded), times the per-token scale when QUANT.
// ---------------------------------------------------------------------------------------------
template <DType CD>
inline float cache_elem(const void* base, int64_t i) {
  if constexpr (CD == DType::kFloat32) return static_cast<const float*>(base)[i];
  else if constexpr (CD == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  else if constexpr (CD == DType::kFloat16) return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  else if constexpr (CD == DType::kFloat8E4M3) return fp8e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
  else return int8_to_float(static_cast<const int8_t*>(base)[i]);
}

template <DType CD, bool QUANT>
void convert_k_tile(const void* tile, const float* scales, int64_t off, int64_t n, int64_t BS, int64_t D, int64_t Dp,
                    float* dst) {
  constexpr int64_t L = kv_lane(elem_size(CD));
  for (int64_t t = 0; t < n; ++t) {
    const float s = QUANT ? scales[t] : 1.0f;
    for (int64_t d = 0; d < D; ++d) dst[t * Dp + d] = cache_elem<CD>(tile, kv_k_offset(off + t, d, BS, L)) * s;
    std::fill(dst + t * Dp + D, dst + (t + 1) * Dp, 0.0f);
  }
}

template <DType CD, bool QUANT>
void convert_v_tile(const void* tile, const float* scales, int64_t off, int64_t n, int64_t D, int64_t Dp, float* dst) {
  constexpr int64_t L = kv_lane(elem_size(CD));
  for (int64_t t = 0; t < n; ++t) {
    const float s = QUANT ? scales[t] : 1.0f;
    float* d = dst + t * Dp;
    // the token's dims lie L elements apart from its first: a constant stride the compiler vectorizes
    // (the offset computed per element was 70% of a decode item's time on an AVX2 host)
    const char* src = static_cast<const char*>(tile) + kv_v_offset(off + t, 0, D, L) * elem_size(CD);
    for (int64_t i = 0; i < D; ++i) d[i] = cache_elem<CD>(src, i * L) * s;
    std::fill(d + D, d + Dp, 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// Inner loops. qk: scores of one q row against nv fp32 K rows.
// softmax_pv: online-softmax update of one row (m, l, acc) with nv scores and V rows.
// ---------------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------------
// One work item: a query tile of one kv head over cache positions [kv_lo, min(kv_hi, causal end)).
// ---------------------------------------------------------------------------------------------

// Writes a finished row (acc in natural order): the output row, or the item's split partial.
void finish_row(const Args& a, const Item& it, Partials& parts, int64_t tok, int64_t head, const float* acc, float m,
                float l) {
  if (it.nsplit > 1) {
    const int64_t idx = (tok * a.H + head) * parts.nsplit + it.split;
    parts.ml[idx * 2] = m;
    parts.ml[idx * 2 + 1] = l;
    std::copy(acc, acc + a.D, parts.acc.data() + idx * a.Dp);
  } else {
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < a.D; ++d) store_float(a.out, (tok * a.H + head) * a.D + d, a.qdt, acc[d] * inv);
  }
}
template <DType CD, int NC>
void run_item(const Args& a, const Item& it, Partials& parts, Workspace& ws) {
  constexpr bool kQuant = CD == DType::kFloat8E4M3 || CD == DType::kInt8;
  const int64_t G = a.G, Dp = a.Dp, D = a.D;
  const int64_t q_start = a.qsl[it.seq], q_len = a.qsl[it.seq + 1] - q_start;
  const int64_t seq_len = a.seq_lens[it.seq];
  const int64_t first_pos = seq_len - q_len;  // position of query token 0
  const int64_t ntok = it.tok1 - it.tok0, rows = ntok * G;
  ws.fit(rows, Dp, a.chunk);

  // with a softcap, scores are capped in natural units and converted to log2 units after
  const float qscale = a.softcap > 0.0f ? a.scale : a.scale * kLog2e;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + it.tok0 + r / G, head = it.kvh * G + r % G;
    const void* qrow = static_cast<const char*>(a.q) + (tok * a.q_stride + head * D) * elem_size(a.qdt);
    float* qf = ws.qf.data() + r * Dp;
    for (int64_t d = 0; d < D; ++d) qf[d] = elem_to_float(qrow, d, a.qdt) * qscale;
    std::fill(qf + D, qf + Dp, 0.0f);
    std::fill(ws.acc.data() + r * Dp, ws.acc.data() + (r + 1) * Dp, 0.0f);
    ws.m[r] = kNegInf;
    ws.l[r] = 0.0f;
  }

  const size_t es = elem_size(CD);
  const int32_t* table = a.block_tables + it.seq * a.MB;
  const int64_t kv_end = std::min<int64_t>(it.kv_hi, first_pos + it.tok1);  // causal end of the tile
  // the window's start for the tile's first token: nothing before it is read
  const int64_t kv_start = a.window > 0 ? std::max<int64_t>(it.kv_lo, first_pos + it.tok0 + 1 - a.window) : it.kv_lo;
  for (int64_t c0 = kv_start; c0 < kv_end; c0 += a.chunk) {
    const int64_t n = std::min(a.chunk, kv_end - c0);
    for (int64_t p = c0; p < c0 + n;) {  // dequantize the chunk, one block run at a time
      const int64_t blk = table[p / a.BS], off = p % a.BS, run = std::min(a.BS - off, c0 + n - p);
      const int64_t slab = (blk * a.KVH + it.kvh) * a.BS + off;
      const float* ksc = kQuant ? a.ks + slab : nullptr;
      const float* vsc = kQuant ? a.vs + slab : nullptr;
      const int64_t tile = (slab - off) * D * es;
      convert_k_tile<CD, kQuant>(static_cast<const char*>(a.k) + tile, ksc, off, run, a.BS, D, Dp,
                                 ws.kf.data() + (p - c0) * Dp);
      convert_v_tile<CD, kQuant>(static_cast<const char*>(a.v) + tile, vsc, off, run, D, Dp,
                                 ws.vf.data() + (p - c0) * Dp);
      p += run;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + it.tok0 + r / G;
      const int64_t nv = std::min(n, pos + 1 - c0);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos + 1 - a.window - c0) : 0;  // window start
      if (nv <= lo) continue;
      float* sc = ws.sc.data();
      qk<NC>(ws.qf.data() + r * Dp, ws.kf.data() + lo * Dp, Dp, nv - lo, sc);
      if (a.softcap > 0.0f)
        for (int64_t i = 0; i < nv - lo; ++i) sc[i] = a.softcap * std::tanh(sc[i] / a.softcap) * kLog2e;
      softmax_pv<NC>(sc, nv - lo, ws.vf.data() + lo * Dp, Dp, ws.m[r], ws.l[r], ws.acc.data() + r * Dp);
    }
  }

  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, parts, q_start + it.tok0 + r / G, it.kvh * G + r % G, ws.acc.data() + r * Dp, ws.m[r], ws.l[r]);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
// ---------------------------------------------------------------------------------------------
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
//         bound on vdpbf16ps (2 threads, cold, the paths alternating: batch 16 x 4096 2590 ->
//         1955 us, 54% -> 72% of the time to read the cache; 32 x 2048 2358 -> 1918 us, 60% ->
//         73%). q and the weights are scaled by powers of two so the short fp16 sums (up to 64
//         products per lane half and tile or chunk) cannot overflow or sink into subnormals; the
//         epilogues add each lane's two halves in fp32. Top-1 agreement with a bf16 cache through
//         this kernel (default model, 2,047 teacher-forced tokens) is the same for both: 98.19%.
//   int8  u8 x s8 -> int32 (vpdpbusd, four products per lane). QK takes the codes offset by 128
//         (k ^ 0x80 = k + 128 as u8) against q rounded per row to codes c of 15 bits (scale
//         absmax / 16255, once per item) held as two int8 halves c = 128 h + l: two instructions
//         per line and row, and 128 sum(c) off each score. PV takes the weights rounded to u8 per
//         row and chunk (scale max / 255) against the codes: one instruction per line and row.
//         (q as one int8 code, one instruction per line, cost 0.5% of the default model's top-1
//         agreement through this kernel, 98.97% -> 98.49%; the halves give 99.07%. u8 weights
//         cost nothing there, though their error on sharp synthetic scores is ~1e-2.)
// The rows of an item (query tokens x the G q heads of its kv head) go through in groups of up to
// 4 that share every K/V load. Tokens go in chunks of 64 (4 tiles of 16 tokens; with block size 8
// a tile spans two blocks) per online-softmax update.
//
// Operands names those choices; the decode path (set_decode_attention_path) picks fp8's.
// ---------------------------------------------------------------------------------------------
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

#endif  // AVX512-BF16 and VNNI

#if defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------------------------------------
// The driver of the dot-product kernels (Isa: Avx512 above, or decode::Avx2): an item's chunks in
// order, each chunk's tiles prefetched one chunk ahead, its rows in groups that share every load.
// ---------------------------------------------------------------------------------------------
// Chunks between the one computed and the one prefetched: 2 measured no faster for int8/fp8 and
// 1.2-1.5x slower for bf16 (2 threads, batch 8 x 2048, cold; AVX-512).
constexpr int kAhead = 1;

// The cache positions [kv_lo, kv_end) an item reads (its causal end, within its split).
inline int64_t item_kv_end(const Args& a, const Item& it) {
  const int64_t q_len = a.qsl[it.seq + 1] - a.qsl[it.seq];
  return std::min<int64_t>(it.kv_hi, a.seq_lens[it.seq] - q_len + it.tok1);
}

// The pointers of item `it`'s chunk at c0 (< kv_end; a multiple of 16, so a tile's tokens are one
// run of slots in a block, or with block size 8 (SPLIT) two whole blocks).
template <Operands O, int NC32, bool SPLIT>
void fill_chunk(const Args& a, const Item& it, int64_t c0, int64_t kv_end, ChunkPtrs& c) {
  constexpr int64_t D = 32 * NC32;
  constexpr int64_t es = elem_bytes(O);
  const int64_t tile_bytes = a.BS * D * es;
  const int32_t* table = a.block_tables + it.seq * a.MB;
  c.n = static_cast<int>(std::min<int64_t>(kChunk, kv_end - c0));
  // the half-tile (8 tokens with SPLIT, else 16) at position pos: its K (dims group 0) and V
  // addresses (lane_bytes per token in a K line, D * lane_bytes per V token group), scales
  auto half = [&](int64_t pos, const char*& k, const char*& v, const float*& ks, const float*& vs) {
    const int64_t off = pos % a.BS, tile = static_cast<int64_t>(table[pos / a.BS]) * a.KVH + it.kvh;
    k = static_cast<const char*>(a.k) + tile * tile_bytes + off * lane_bytes(O);
    v = static_cast<const char*>(a.v) + tile * tile_bytes + off * D * es;
    if constexpr (has_scales(O)) ks = a.ks + tile * a.BS + off, vs = a.vs + tile * a.BS + off;
    else ks = vs = nullptr;
  };
  const int ntiles = (c.n + 15) / 16;
  for (int i = 0; i < kTiles; ++i) {
    if (i < ntiles) {
      half(c0 + 16 * i, c.k0[i], c.v0[i], c.ks0[i], c.vs0[i]);
      if (SPLIT && 16 * i + 8 < c.n) half(c0 + 16 * i + 8, c.k1[i], c.v1[i], c.ks1[i], c.vs1[i]);
      else c.k1[i] = c.k0[i], c.v1[i] = c.v0[i], c.ks1[i] = c.ks0[i], c.vs1[i] = c.vs0[i];
    } else {  // past the chunk's end: any valid address (meets zero probabilities and masked scale loads)
      c.k0[i] = c.k1[i] = c.k0[0], c.v0[i] = c.v1[i] = c.v0[0];
      c.ks0[i] = c.ks1[i] = c.ks0[0], c.vs0[i] = c.vs1[i] = c.vs0[0];
    }
  }
}

// Chunk c's pointers moved to kv head `h` heads further: a block's kv heads are adjacent tiles.
inline ChunkPtrs head_shifted(const ChunkPtrs& c, int64_t h, int64_t tile_bytes, int64_t BS) {
  ChunkPtrs s = c;
  for (int i = 0; i < kTiles; ++i) {
    s.k0[i] += h * tile_bytes, s.k1[i] += h * tile_bytes, s.v0[i] += h * tile_bytes, s.v1[i] += h * tile_bytes;
    if (c.ks0[i]) s.ks0[i] += h * BS, s.ks1[i] += h * BS, s.vs0[i] += h * BS, s.vs1[i] += h * BS;
  }
  return s;
}

template <class Isa, Operands O, int NC32, bool SPLIT>
void run_item_dot(const Args& a, const Item& it, const Item* next_item, Partials& parts, Workspace& ws) {
  constexpr int64_t D = 32 * NC32;
  constexpr int64_t es = elem_bytes(O);
  const int64_t G = a.G, nh = it.nkvh, tile_bytes = a.BS * D * es;
  const int64_t q_start = a.qsl[it.seq], q_len = a.qsl[it.seq + 1] - q_start;
  const int64_t first_pos = a.seq_lens[it.seq] - q_len;
  // rows: per kv head (head-major), the query tokens x its G q heads
  const int64_t head_rows = (it.tok1 - it.tok0) * G, rows = nh * head_rows;
  auto row_token = [&](int64_t r) { return q_start + it.tok0 + r % head_rows / G; };
  auto row_head = [&](int64_t r) { return (it.kvh + r / head_rows) * G + r % G; };
  const int64_t q_bytes = q_row_bytes(Isa{}, O, D), w_bytes = weight_row_bytes(Isa{}, O);
  if (static_cast<int64_t>(ws.acc.size()) < rows * D) ws.acc.resize(rows * D);
  if (static_cast<int64_t>(ws.qb.size()) < rows * q_bytes / 2) ws.qb.resize(rows * q_bytes / 2);
  if (static_cast<int64_t>(ws.m.size()) < rows) ws.m.resize(rows), ws.l.resize(rows);
  if (static_cast<int64_t>(ws.pb.size()) < kGroup * w_bytes / 2) ws.pb.resize(kGroup * w_bytes / 2);
  if (static_cast<int64_t>(ws.qs.size()) < rows) ws.qs.resize(rows), ws.qsum.resize(rows), ws.row_end.resize(rows);
  char* qbuf = reinterpret_cast<char*>(ws.qb.data());
  for (int64_t r = 0; r < rows; ++r) {
    const char* qrow = static_cast<const char*>(a.q) + (row_token(r) * a.q_stride + row_head(r) * D) * elem_size(a.qdt);
    ws.qs[r] = stage_q<O>(Isa{}, qrow, a.qdt, D, qbuf + r * q_bytes, ws.qsum.data() + r);
    std::fill(ws.acc.data() + r * D, ws.acc.data() + (r + 1) * D, 0.0f);
    ws.m[r] = kNegInf;
    ws.l[r] = 0.0f;
    ws.row_end[r] = first_pos + (row_token(r) - q_start) + 1;
  }
  const float qscale = a.scale * kLog2e;
  const int64_t line_stride = a.BS * lane_bytes(O);  // bytes between a token's K dims groups
  const int64_t kv_end = item_kv_end(a, it);
  // with a window, from the 16-token tile holding the first row's window start (tiles stay aligned)
  const int64_t kv_start =
      a.window > 0 ? std::max<int64_t>(it.kv_lo, (first_pos + it.tok0 + 1 - a.window) / 16 * 16) : it.kv_lo;
  // Chunk ci's pointers sit in ring[ci % kRing] from kAhead + 1 chunks before it is computed, one
  // entry per kv head of the item: the lines of chunk ci + kAhead are prefetched (to kPrefetchLevel)
  // while ci computes (tiles are scattered, so the hardware prefetcher stops at every tile edge).
  // Past the item's last chunk come the next item's first ones (with many short sequences, a cold
  // first chunk per item was a third of the reads); with no next item, a chunk the ring already
  // holds (the prefetches then hit).
  const int64_t nchunks = std::max<int64_t>(0, (kv_end - kv_start + kChunk - 1) / kChunk);
  const int64_t next_end = next_item ? item_kv_end(a, *next_item) : 0;
  constexpr int kRing = kAhead + 2;
  ChunkPtrs ring[kRing][kMaxItemHeads];
  auto fill = [&](int64_t ci) {
    ChunkPtrs* c = ring[ci % kRing];
    const int64_t next_pos = next_item ? next_item->kv_lo + (ci - nchunks) * kChunk : 0;
    if (ci < nchunks) fill_chunk<O, NC32, SPLIT>(a, it, kv_start + ci * kChunk, kv_end, c[0]);
    else if (next_item && next_pos < next_end) fill_chunk<O, NC32, SPLIT>(a, *next_item, next_pos, next_end, c[0]);
    else c[0] = ring[0][0];
    for (int64_t h = 1; h < nh; ++h) c[h] = head_shifted(c[0], h, tile_bytes, a.BS);
    if constexpr (has_scales(O))
      for (int64_t h = 0; h < nh; ++h) prefetch_scales<SPLIT>(c[h]);
  };
  // Row groups of up to kGroup rows of one kv head share each K/V load. Each group's QK runs one
  // chunk ahead of its softmax and PV (scores double-buffered), so the softmax's chain of dependent
  // reductions overlaps the next chunk's dot products instead of stalling between QK and PV.
  const int head_groups = static_cast<int>((head_rows + kGroup - 1) / kGroup);
  const int ngroups = static_cast<int>(nh) * head_groups;
  const int64_t sc_size = int64_t{2} * ngroups * kGroup * kChunk;
  if (static_cast<int64_t>(ws.sc.size()) < sc_size) ws.sc.resize(sc_size);
  auto scores = [&](int g, int64_t ci) { return ws.sc.data() + ((ci & 1) * ngroups + g) * kGroup * kChunk; };
  // group g: kv head g / head_groups of the item, its first row r0 and row count
  auto for_group = [&](int g, auto&& body) {
    const int64_t h = head_groups == 1 ? g : g / head_groups;  // (decode: one group per head, no division)
    const int64_t first = int64_t{g - h * head_groups} * kGroup, r0 = h * head_rows + first;
    switch (std::min<int64_t>(kGroup, head_rows - first)) {
      case 1: body(std::integral_constant<int, 1>(), h, r0); break;
      case 2: body(std::integral_constant<int, 2>(), h, r0); break;
      case 3: body(std::integral_constant<int, 3>(), h, r0); break;
      default: body(std::integral_constant<int, 4>(), h, r0); break;
    }
  };
  auto qk = [&](int g, int64_t ci) {
    for_group(g, [&](auto nr, int64_t h, int64_t r0) {
      qk_group<O, NC32, decltype(nr)::value, SPLIT>(Isa{}, ring[ci % kRing][h], ring[(ci + kAhead) % kRing][h],
                                                     line_stride, qbuf + r0 * q_bytes, q_bytes, ws.qs.data() + r0,
                                                     ws.qsum.data() + r0, scores(g, ci), qscale);
    });
  };
  if (nchunks > 0) {
    for (int64_t ci = 0; ci <= kAhead; ++ci) fill(ci);
    for (int g = 0; g < ngroups; ++g) qk(g, 0);
  }
  for (int64_t ci = 0; ci < nchunks; ++ci) {
    fill(ci + kAhead + 1);
    const int64_t c0 = kv_start + ci * kChunk;
    for (int g = 0; g < ngroups; ++g)
      for_group(g, [&](auto nr, int64_t h, int64_t r0) {
        constexpr int NR = decltype(nr)::value;
        const ChunkPtrs& c = ring[ci % kRing][h];
        int lo[NR], nv[NR];
        for (int r = 0; r < NR; ++r) {
          const int64_t end = ws.row_end[r0 + r] - c0;  // the row's causal end in the chunk
          nv[r] = static_cast<int>(std::clamp<int64_t>(end, 0, c.n));
          lo[r] = a.window > 0 ? static_cast<int>(std::clamp<int64_t>(end - a.window, 0, c.n)) : 0;
        }
        const float* sc = scores(g, ci);
        char* pw = reinterpret_cast<char*>(ws.pb.data());
        float alpha[NR], wscale[NR];
        int maxnv = 0;
        for (int r = 0; r < NR; ++r) {
          alpha[r] = softmax_row<O, SPLIT>(Isa{}, sc + r * kChunk, lo[r], nv[r], c.n, c, pw + r * w_bytes,
                                            ws.m[r0 + r], ws.l[r0 + r], wscale[r]);
          maxnv = std::max(maxnv, nv[r]);
        }
        if (ci + 1 < nchunks) qk(g, ci + 1);
        pv_group<O, NC32, NR, SPLIT>(Isa{}, c, ring[(ci + kAhead) % kRing][h], pw, alpha, wscale,
                                      ws.acc.data() + r0 * D, maxnv);
      });
  }
  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, parts, row_token(r), row_head(r), ws.acc.data() + r * D, ws.m[r], ws.l[r]);
}

// Items go to the threads in runs of consecutive ones (so each knows the next item, to prefetch
// its first chunk), small enough runs to keep the threads balanced.
template <class Isa, Operands O, int NC32>
void run_all_dot(const Args& a, const std::vector<Item>& items, Partials& parts) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t run = std::max<int64_t>(1, n / (8 * ThreadPool::instance().num_threads()));
  ThreadPool::instance().parallel_for((n + run - 1) / run, [&](int64_t r) {
    thread_local Workspace ws;
    for (int64_t i = r * run; i < std::min(n, (r + 1) * run); ++i) {
      const Item* next = i + 1 < std::min(n, (r + 1) * run) ? &items[i + 1] : nullptr;
      if (a.BS == 8) run_item_dot<Isa, O, NC32, true>(a, items[i], next, parts, ws);
      else run_item_dot<Isa, O, NC32, false>(a, items[i], next, parts, ws);
    }
  });
}

template <class Isa, Operands O>
bool dot_head_dim(const Args& a, const std::vector<Item>& items, Partials& parts) {
  if (a.D == 64) run_all_dot<Isa, O, 2>(a, items, parts);
  else if (a.D == 128) run_all_dot<Isa, O, 4>(a, items, parts);
  else return false;
  return true;
}

// The dot-product kernels, where the build, the cap, q's dtype, the block size and the options allow.
bool try_dot_path(const Args& a, const std::vector<Item>& items, Partials& parts) {
  const DecodePath cap = g_decode_cap.load();
  if (cap == DecodePath::kFp32) return false;
  if (a.BS != 8 && a.BS % 16 != 0) return false;  // tiles of 16 tokens
  if (a.softcap > 0.0f) return false;  // run_item has the cap
  if (a.qdt != DType::kBFloat16 && a.qdt != DType::kFloat32) return false;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  if (cap != DecodePath::kAvx2 && a.qdt == DType::kBFloat16) switch (a.cdt) {
      case DType::kBFloat16: return dot_head_dim<Avx512, Operands::kBf16>(a, items, parts);
      case DType::kFloat8E4M3:
#if defined(__AVX512FP16__)
        if (cap == DecodePath::kAvx512Fp16) return dot_head_dim<Avx512, Operands::kFp8Half>(a, items, parts);
#endif
        return dot_head_dim<Avx512, Operands::kFp8Bf16>(a, items, parts);
      case DType::kInt8: return dot_head_dim<Avx512, Operands::kInt8>(a, items, parts);
      default: return false;
    }
#endif
#if defined(__AVX512F__)
  // An AVX-512 build runs the AVX2 kernels only when capped to them: what the AVX-512 ones do not take
  // (fp32 q; CPUs without AVX512-BF16) keeps run_item's 16-lane loops, as the AVX2 kernels were
  // measured only against run_item's AVX2 loops, on an AVX2 CPU.
  if (cap != DecodePath::kAvx2) return false;
#endif
  switch (a.cdt) {
    case DType::kBFloat16: return dot_head_dim<decode::Avx2, Operands::kBf16>(a, items, parts);
    case DType::kFloat8E4M3: return dot_head_dim<decode::Avx2, Operands::kFp8Fp32>(a, items, parts);
    case DType::kInt8: return dot_head_dim<decode::Avx2, Operands::kInt8>(a, items, parts);
    case DType::kFloat32: return dot_head_dim<decode::Avx2, Operands::kFp32>(a, items, parts);
    default: return false;
  }
}
#else
bool try_dot_path(const Args&, const std::vector<Item>&, Partials&) { return false; }
#endif

// Merge the split partials of one (token, q head) into the output row.
void merge_partials(const Args& a, const Partials& parts, int64_t tok, int64_t head, int64_t nsplit, float* tmp) {
  const int64_t base = (tok * a.H + head) * parts.nsplit;
  float M = kNegInf;
  for (int64_t j = 0; j < nsplit; ++j) M = std::max(M, parts.ml[(base + j) * 2]);
  float L = 0.0f;
  std::fill(tmp, tmp + a.D, 0.0f);
  for (int64_t j = 0; j < nsplit; ++j) {
    const float l = parts.ml[(base + j) * 2 + 1];
    if (l == 0.0f) continue;
    const float w = std::exp2(parts.ml[(base + j) * 2] - M);
    L += l * w;
    const float* acc = parts.acc.data() + (base + j) * a.Dp;
    for (int64_t d = 0; d < a.D; ++d) tmp[d] += w * acc[d];
  }
  const float inv = 1.0f / L;
  for (int64_t d = 0; d < a.D; ++d) store_float(a.out, (tok * a.H + head) * a.D + d, a.qdt, tmp[d] * inv);
}

template <DType CD, int NC>
void run_all(const Args& a, const std::vector<Item>& items, Partials& parts) {
  ThreadPool::instance().parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Workspace ws;
    for (int32_t h = 0; h < items[i].nkvh; ++h) {
      Item one = items[i];
      one.kvh += h, one.nkvh = 1;
      run_item<CD, NC>(a, one, parts, ws);
    }
  });
}

template <DType CD>
void dispatch_head_dim(const Args& a, const std::vector<Item>& items, Partials& parts) {
  if (a.D == 64) run_all<CD, 4>(a, items, parts);
  else if (a.D == 128) run_all<CD, 8>(a, items, parts);
  else run_all<CD, 0>(a, items, parts);
}

}  // namespace

void paged_attention_cpu(void* out, const void* q, const void* k_cache, const void* v_cache, const float* k_scales,
                         const float* v_scales, const int32_t* block_tables, const int32_t* seq_lens,
                         const int32_t* query_start_loc, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t q_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                         int64_t max_blocks_per_seq, int64_t max_seq_len, float scale, DType q_dtype,
                         DType cache_dtype, int64_t window, float softcap) {
  Args a{{out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc, num_tokens,
          num_heads, num_kv_heads, head_dim, q_stride, num_blocks, block_size, num_seqs, max_blocks_per_seq,
          max_seq_len, scale, q_dtype, cache_dtype, window, softcap},
         0, 0, 0, 0};
  check_attention_step(a);
  a.G = a.H / a.KVH;
  a.Dp = (a.D + 63) / 64 * 64;
  a.chunk = std::max<int64_t>(a.BS, 4096 / a.Dp / a.BS * a.BS);
  a.QT = std::max<int64_t>(1, 16 / a.G);

  const int64_t nthreads = ThreadPool::instance().num_threads();
  int64_t base_items = 0, total_work = 0, max_len = 0;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t tiles = (a.qsl[s + 1] - a.qsl[s] + a.QT - 1) / a.QT;
    base_items += a.KVH * tiles;
    total_work += a.KVH * tiles * seq_lens[s];
    max_len = std::max<int64_t>(max_len, seq_lens[s]);
  }
  // kv heads per item (a divisor of KVH, at most kMaxItemHeads): as many as leave 2 items per thread
  // with none over half a thread's share of the work (a ragged batch keeps its long sequence's heads
  // apart), or, where the kv range is split, as many as divide KVH. A block's kv heads are adjacent
  // tiles, so an item over several reads longer runs of memory (3 heads at the default model's shape:
  // 6 KB of K and of V per block instead of 2 KB; int8 and fp8, 3 KB instead of 1). A split item then
  // spans nkvh times fewer tokens: as many items as with one head each.
  // The kv range is split only when (sequences x kv heads x tiles) cannot feed the pool.
  const bool split = nthreads > 1 && base_items < 4 * nthreads;
  int32_t nkvh = 1;
  for (int32_t n = static_cast<int32_t>(std::min<int64_t>(a.KVH, kMaxItemHeads)); n > 1; --n)
    if (a.KVH % n == 0 &&
        (split || (base_items / n >= 2 * nthreads && n * max_len * 2 * nthreads <= total_work))) {
      nkvh = n;
      break;
    }
  int64_t split_tokens = std::numeric_limits<int32_t>::max();
  if (split) {
    const int64_t want = std::max(kMinSplitTokens, (total_work + 8 * nthreads * nkvh - 1) / (8 * nthreads * nkvh));
    split_tokens = (want + 63) / 64 * 64;  // whole 64-token chunks of the dot path
  }

  std::vector<Item> items;
  items.reserve(base_items);
  Partials parts;
  for (int32_t s = 0; s < a.S; ++s) {
    const int32_t q_len = a.qsl[s + 1] - a.qsl[s], len = seq_lens[s];
    const int32_t nsplit = std::max<int64_t>(1, (len + split_tokens - 1) / split_tokens);
    parts.nsplit = std::max<int64_t>(parts.nsplit, nsplit);
    for (int32_t h = 0; h < a.KVH; h += nkvh)
      for (int32_t t0 = 0; t0 < q_len; t0 += a.QT)
        for (int32_t j = 0; j < nsplit; ++j) {
          const int32_t t1 = std::min<int32_t>(q_len, t0 + a.QT);
          const int32_t lo = j * split_tokens, hi = std::min<int64_t>(len, (int64_t)(j + 1) * split_tokens);
          const int64_t end = std::min<int64_t>(hi, len - q_len + t1);
          items.push_back({s, h, nkvh, t0, t1, lo, hi, j, nsplit, std::max<int64_t>(0, end - lo) * (t1 - t0)});
        }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.work > y.work; });
  if (parts.nsplit > 1) {
    parts.ml.assign(a.T * a.H * parts.nsplit * 2, 0.0f);
    parts.acc.assign(a.T * a.H * parts.nsplit * a.Dp, 0.0f);
  }

  if (!try_dot_path(a, items, parts)) switch (cache_dtype) {
    case DType::kFloat32: dispatch_head_dim<DType::kFloat32>(a, items, parts); break;
    case DType::kBFloat16: dispatch_head_dim<DType::kBFloat16>(a, items, parts); break;
    case DType::kFloat16: dispatch_head_dim<DType::kFloat16>(a, items, parts); break;
    case DType::kFloat8E4M3: dispatch_head_dim<DType::kFloat8E4M3>(a, items, parts); break;
    case DType::kInt8: dispatch_head_dim<DType::kInt8>(a, items, parts); break;
  }

  if (parts.nsplit > 1) {
    ThreadPool::instance().parallel_for(a.S, [&](int64_t s) {
      const int64_t nsplit = (seq_lens[s] + split_tokens - 1) / split_tokens;
      std::vector<float> tmp(a.D);
      for (int64_t tok = a.qsl[s]; tok < a.qsl[s + 1]; ++tok)
        for (int64_t head = 0; head < a.H; ++head) {
          if (nsplit > 1) merge_partials(a, parts, tok, head, nsplit, tmp.data());
        }
    });
  }
}

void set_decode_attention_path(const std::string& name) {
  if (name == "avx512_fp16") g_decode_cap.store(DecodePath::kAvx512Fp16);
  else if (name == "avx512_bf16") g_decode_cap.store(DecodePath::kAvx512Bf16);
  else if (name == "avx2") g_decode_cap.store(DecodePath::kAvx2);
  else if (name == "fp32") g_decode_cap.store(DecodePath::kFp32);
  else throw std::invalid_argument("decode attention path must be avx512_fp16, avx512_bf16, avx2 or fp32, got " + name);
}

std::string decode_attention_path() {
  const DecodePath cap = g_decode_cap.load();
  if (cap == DecodePath::kFp32) return "fp32";
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#if defined(__AVX512FP16__)
  if (cap == DecodePath::kAvx512Fp16) return "avx512_fp16";
#endif
  if (cap != DecodePath::kAvx2) return "avx512_bf16";
#endif
#if defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "fp32";
#endif
}

}  // namespace pyengine
