// paged_attention (CPU): causal attention of a whole mixed step (prompt chunks and single-token
// decodes together) over a paged KV cache.
//
// Layouts (element strides, row-major):
//   q        [T, H, D]   token stride q_stride, heads and D contiguous      out [T, H, D] contiguous
//   k/v cache [NB, KVH, BS, D]   k/v scales [NB, KVH, BS] fp32 (fp8/int8 caches: value = q * scale)
//   block_tables [S, MB] int32, seq_lens [S] int32, query_start_loc [S+1] int32
// Query token j of sequence s (q_len = qsl[s+1] - qsl[s]) sits at position seq_len - q_len + j and
// sees cache positions <= its own. q head hq reads kv head hq / G (G = H / KVH).
//
// Parallel shape: work items (sequence, kv head, query tile, kv split) over the thread pool, heaviest
// first. A query tile is QT = max(1, 16 / G) query tokens x the G q heads of one kv head (<= 16 rows
// unless G > 16), so each K/V row is loaded and dequantized once per tile into an fp32 scratch chunk
// (L1-sized) and reused by every row. When (sequences x kv heads x tiles) is too few to feed the pool
// (decode at small batch, long context) the kv range is split flash-decoding style and the partial
// (max, sum, acc) triples are merged afterwards. Online softmax in base 2 (q is pre-scaled by
// scale * log2 e); the score matrix is never materialised beyond one chunk of one row. fp32 throughout.
//
// Paths (chosen at compile time by the -march of the build, PYENGINE_CPU_ARCH):
//   bf16 q with a bf16/fp8/int8 cache, head_dim 64/128, AVX512_BF16: run_item_bf16 (vdpbf16ps, no fp32
//     scratch; see its comment). This is the decode hot path of bf16 models.
//   everything else (fp32/fp16, other head dims, no AVX512_BF16): run_item, which dequantizes each K/V
//     chunk once into fp32 scratch; AVX-512 intrinsics under __AVX512F__, otherwise portable loops in
//     16-lane strips that GCC vectorizes for AVX2 (-march=x86-64-v3) and leaves scalar elsewhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyengine/dtype.h"
#include "pyengine/kv_quant.h"
#include "pyengine/parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
// GCC 12 flags the _mm512_undefined_*() placeholders inside its own intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif









namespace pyengine {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMinSplitTokens = 256;

struct Args {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  const float* ks;
  const float* vs;
  const int32_t* bt;
  const int32_t* seq_lens;
  const int32_t* qsl;
  int64_t T, H, KVH, D, q_stride, NB, BS, S, MB;
  float scale;
  DType qdt, cdt;
  int64_t G, Dp, chunk, QT;  // derived
};

struct Item {
  int32_t seq, kvh, tok0, tok1;  // query tokens [tok0, tok1) of the sequence
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
  // bf16 path: q rows, widened K codes, token-pair-interleaved V, bf16 probabilities, K/V row
  // pointers and per-token scales of the chunk
  std::vector<uint16_t> qb, kq, vi, pb;
  std::vector<const uint16_t*> kp;
  std::vector<const char*> vp;
  std::vector<float> ksc, vsc;
  std::vector<int64_t> pf;  // cache rows of the next chunk (prefetch)
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
// Inner loops. convert_rows: n cache rows (D elements each, contiguous) -> fp32 rows of Dp
// (zero padded), times a per-row scale when QUANT. qk: scores of one q row against nv rows.
// softmax_pv: online-softmax update of one row (m, l, acc) with nv scores and V rows.
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)

template <DType CD>
inline __m512 load16(const void* p, __mmask16 m) {
  if constexpr (CD == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (CD == DType::kBFloat16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else if constexpr (CD == DType::kFloat16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else if constexpr (CD == DType::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  } else {  // fp8 e4m3: same bit arithmetic as fp8e4m3_to_float
    const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
    const __m512i em = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512 normal =
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0.001953125f));
    const __m512 mag = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(em, _mm512_set1_epi32(8)), sub, normal);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
  }
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

template <DType CD, bool QUANT>
void convert_rows(const void* src, const float* scales, int64_t n, int64_t D, int64_t Dp, float* dst) {
  const size_t es = elem_size(CD);
  for (int64_t t = 0; t < n; ++t) {
    const char* row = static_cast<const char*>(src) + t * D * es;
    float* d = dst + t * Dp;
    const __m512 s = _mm512_set1_ps(QUANT ? scales[t] : 1.0f);
    for (int64_t c = 0; c < Dp; c += 16) {
      const int64_t left = D - c;
      __m512 x = left > 0 ? load16<CD>(row + c * es, tail_mask(left)) : _mm512_setzero_ps();
      if constexpr (QUANT) x = _mm512_mul_ps(x, s);
      _mm512_storeu_ps(d + c, x);
    }
  }
}

// Sums of each of 16 vectors, as one vector (lane i = sum of v[i]): a transpose-and-add tree.
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
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

// 2^x for x <= 0 (clamped at -127): 2^round(x) * poly(frac), Taylor degree 6 on [-0.5, 0.5].
inline __m512 exp2_ps(__m512 x) {
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

template <int NC>
void softmax_pv(float* sc, int64_t nv, const float* V, int64_t Dp, float& m, float& l, float* acc) {
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t t0 = 0; t0 < nv; t0 += 16)
    vmax = _mm512_mask_max_ps(vmax, tail_mask(nv - t0), vmax, _mm512_loadu_ps(sc + t0));
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float alpha = std::exp2(m - m_new);  // 0 on the first chunk (m = -inf)
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < nv; t0 += 16) {
    const __m512 p = _mm512_maskz_mov_ps(tail_mask(nv - t0), exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + t0), vm)));
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

#else  // portable: 16-lane strips the compiler can vectorize

template <DType CD, bool QUANT>
void convert_rows(const void* src, const float* scales, int64_t n, int64_t D, int64_t Dp, float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    const float s = QUANT ? scales[t] : 1.0f;
    float* d = dst + t * Dp;
    for (int64_t i = 0; i < D; ++i) d[i] = elem_to_float(src, t * D + i, CD) * s;
    for (int64_t i = D; i < Dp; ++i) d[i] = 0.0f;
  }
}

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

  const float qscale = a.scale * kLog2e;
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
  const int32_t* table = a.bt + it.seq * a.MB;
  const int64_t kv_end = std::min<int64_t>(it.kv_hi, first_pos + it.tok1);  // causal end of the tile
  for (int64_t c0 = it.kv_lo; c0 < kv_end; c0 += a.chunk) {
    const int64_t n = std::min(a.chunk, kv_end - c0);
    for (int64_t p = c0; p < c0 + n;) {  // dequantize the chunk, one block run at a time
      const int64_t blk = table[p / a.BS], off = p % a.BS, run = std::min(a.BS - off, c0 + n - p);
      const int64_t slab = (blk * a.KVH + it.kvh) * a.BS + off;
      const float* ksc = kQuant ? a.ks + slab : nullptr;
      const float* vsc = kQuant ? a.vs + slab : nullptr;
      convert_rows<CD, kQuant>(static_cast<const char*>(a.k) + slab * D * es, ksc, run, D, Dp,
                               ws.kf.data() + (p - c0) * Dp);
      convert_rows<CD, kQuant>(static_cast<const char*>(a.v) + slab * D * es, vsc, run, D, Dp,
                               ws.vf.data() + (p - c0) * Dp);
      p += run;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + it.tok0 + r / G;
      const int64_t nv = std::min(n, pos + 1 - c0);
      if (nv <= 0) continue;
      qk<NC>(ws.qf.data() + r * Dp, ws.kf.data(), Dp, nv, ws.sc.data());
      softmax_pv<NC>(ws.sc.data(), nv, ws.vf.data(), Dp, ws.m[r], ws.l[r], ws.acc.data() + r * Dp);
    }
  }

  for (int64_t r = 0; r < rows; ++r)
    finish_row(a, it, parts, q_start + it.tok0 + r / G, it.kvh * G + r % G, ws.acc.data() + r * Dp, ws.m[r], ws.l[r]);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// bf16 q over a bf16, fp8 or int8 cache (head_dim = 32 * NC32). QK uses vdpbf16ps on K rows (read
// straight from a bf16 cache; fp8/int8 codes are first widened to bf16, which is exact) and scales
// the scores afterwards (softmax scale, and the per-token K scale). PV interleaves the V rows of a
// token pair once per chunk, (V[t][d], V[t+1][d]), and accumulates dpbf16(pair, (p_t, p_t+1)) with
// p (times the per-token V scale) rounded to bf16, as flash attention does on GPUs; for a bf16 cache
// the softmax sum uses the same rounded p. The accumulators then hold d in unpack order: vector k,
// lane i is d = (k / 2) * 32 + (i / 4) * 8 + (k % 2) * 4 + i % 4, restored when the row finishes.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kBf16Chunk = 64;

// 32 cache elements -> 32 bf16 (exact for every fp8 e4m3 and int8 code).
template <DType CD>
inline __m512i load32_bf16(const void* p) {
  if constexpr (CD == DType::kBFloat16) {
    return _mm512_loadu_si512(p);
  } else if constexpr (CD == DType::kFloat8E4M3) {
    alignas(64) static const uint16_t kSub[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};  // m * 2^-9
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    const __m512i em = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
    const __m512i sub = _mm512_permutexvar_epi16(em, _mm512_load_si512(kSub));
    const __mmask32 is_normal = _mm512_cmpge_epu16_mask(em, _mm512_set1_epi16(8));
    return _mm512_or_si512(_mm512_mask_blend_epi16(is_normal, sub, normal), sign);
  } else {  // int8
    const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

template <DType CD, int NC32>
void run_item_bf16(const Args& a, const Item& it, Partials& parts, Workspace& ws) {
  constexpr bool kQuant = CD != DType::kBFloat16;
  constexpr int NV = 2 * NC32;  // fp32 accumulator vectors per row
  constexpr int64_t D = 32 * NC32;
  constexpr int64_t es = kQuant ? 1 : 2;
  const int64_t G = a.G;
  const int64_t q_start = a.qsl[it.seq], q_len = a.qsl[it.seq + 1] - q_start;
  const int64_t first_pos = a.seq_lens[it.seq] - q_len;
  const int64_t rows = (it.tok1 - it.tok0) * G;
  if (static_cast<int64_t>(ws.acc.size()) < rows * D) ws.acc.resize(rows * D);
  if (static_cast<int64_t>(ws.m.size()) < rows) ws.m.resize(rows), ws.l.resize(rows);
  if (static_cast<int64_t>(ws.qb.size()) < rows * D) ws.qb.resize(rows * D);
  if (static_cast<int64_t>(ws.vi.size()) < kBf16Chunk * D) {  // zero-filled: lanes past n stay finite
    ws.vi.resize(kBf16Chunk * D), ws.kq.resize(kBf16Chunk * D);
    ws.pb.resize(kBf16Chunk), ws.sc.resize(kBf16Chunk), ws.kp.resize(kBf16Chunk), ws.vp.resize(kBf16Chunk);
    ws.ksc.resize(kBf16Chunk), ws.vsc.resize(kBf16Chunk), ws.pf.resize(kBf16Chunk);
  }

  // Raw pointers: through the vectors of a thread_local workspace GCC reloads them (and the TLS
  // address) after every store, which serializes the loads of the hot loops.
  const uint16_t** kp = ws.kp.data();
  const char** vp = ws.vp.data();
  uint16_t* kq = ws.kq.data();
  __m512i* vi = reinterpret_cast<__m512i*>(ws.vi.data());
  float* ksc = ws.ksc.data();
  float* vsc = ws.vsc.data();
  int64_t* pf = ws.pf.data();
  const uint16_t* qb = ws.qb.data();
  float* acc_all = ws.acc.data();
  float* m_all = ws.m.data();
  float* l_all = ws.l.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + it.tok0 + r / G, head = it.kvh * G + r % G;
    std::memcpy(ws.qb.data() + r * D, static_cast<const uint16_t*>(a.q) + tok * a.q_stride + head * D, D * 2);
    std::fill(ws.acc.data() + r * D, ws.acc.data() + (r + 1) * D, 0.0f);
    ws.m[r] = kNegInf;
    ws.l[r] = 0.0f;
  }
  const __m512 qscale = _mm512_set1_ps(a.scale * kLog2e);
  const char* kc = static_cast<const char*>(a.k);
  const char* vc = static_cast<const char*>(a.v);
  const int32_t* table = a.bt + it.seq * a.MB;
  const int64_t kv_end = std::min<int64_t>(it.kv_hi, first_pos + it.tok1);
  float* sc = ws.sc.data();
  uint16_t* pb = ws.pb.data();
  // Calls fn(t, cache row index, run) for each block run of the chunk [c, min(c + chunk, kv_end)).
  auto for_runs = [&](int64_t c, auto&& fn) {
    const int64_t end = std::min(kv_end, c + kBf16Chunk);
    for (int64_t p = c; p < end;) {
      const int64_t off = p % a.BS, run = std::min(a.BS - off, end - p);
      fn(p - c, (static_cast<int64_t>(table[p / a.BS]) * a.KVH + it.kvh) * a.BS + off, run);
      p += run;
    }
  };
  for (int64_t c0 = it.kv_lo; c0 < kv_end; c0 += kBf16Chunk) {
    const int64_t n = std::min(kBf16Chunk, kv_end - c0);
    for_runs(c0, [&](int64_t t, int64_t row, int64_t run) {
      for (int64_t i = 0; i < run; ++i) {
        vp[t + i] = vc + (row + i) * D * es;
        if constexpr (kQuant) {
          ksc[t + i] = a.ks[row + i];
          vsc[t + i] = a.vs[row + i];
          uint16_t* dst = kq + (t + i) * D;
          for (int c = 0; c < NC32; ++c)
            _mm512_storeu_si512(dst + c * 32, load32_bf16<CD>(kc + (row + i) * D + c * 32));
          kp[t + i] = dst;
        } else {
          kp[t + i] = reinterpret_cast<const uint16_t*>(kc + (row + i) * D * es);
        }
      }
    });
    for (int64_t t = n; t < (n + 15) / 16 * 16; ++t) kp[t] = kp[0];  // lanes past n: any valid row
    const int64_t nnext = std::min(kBf16Chunk, kv_end - c0 - kBf16Chunk);
    if (nnext > 0)
      for_runs(c0 + kBf16Chunk, [&](int64_t t, int64_t row, int64_t run) {
        for (int64_t i = 0; i < run; ++i) pf[t + i] = row + i;
      });
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {  // interleave V rows of token pairs
      // and prefetch the next chunk's rows: blocks are scattered, so the hardware prefetcher stops at
      // every block edge; spread over this loop, the prefetches overlap this chunk's work
      for (int64_t t = 2 * j; t < std::min(2 * j + 2, nnext); ++t)
        for (int64_t b = 0; b < D * es; b += 64)
          _mm_prefetch(kc + pf[t] * D * es + b, _MM_HINT_T0), _mm_prefetch(vc + pf[t] * D * es + b, _MM_HINT_T0);
      __m512i* dst = vi + j * NV;
      const char* v0 = vp[2 * j];
      const char* v1 = 2 * j + 1 < n ? vp[2 * j + 1] : nullptr;
      for (int c = 0; c < NC32; ++c) {
        const __m512i x = load32_bf16<CD>(v0 + c * 32 * es);
        const __m512i y = v1 ? load32_bf16<CD>(v1 + c * 32 * es) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * c, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(dst + 2 * c + 1, _mm512_unpackhi_epi16(x, y));
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t nv = std::min(n, first_pos + it.tok0 + r / G + 1 - c0);
      if (nv <= 0) continue;
      __m512bh qv[NC32];
      for (int c = 0; c < NC32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + r * D + c * 32);
      __m512 vmax = _mm512_set1_ps(kNegInf);
      for (int64_t t0 = 0; t0 < nv; t0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
          __m512 s = _mm512_setzero_ps();
          for (int c = 0; c < NC32; ++c) s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(kp[t0 + i] + c * 32));
          acc[i] = s;
        }
        __m512 s = _mm512_mul_ps(hsum16(acc), qscale);
        if constexpr (kQuant) s = _mm512_mul_ps(s, _mm512_loadu_ps(ksc + t0));
        _mm512_storeu_ps(sc + t0, s);
        vmax = _mm512_mask_max_ps(vmax, tail_mask(nv - t0), vmax, s);
      }
      float& m = m_all[r];
      float& l = l_all[r];
      const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
      const float alpha = std::exp2(m - m_new);
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < nv; t0 += 16) {
        const __m512 p = _mm512_maskz_mov_ps(tail_mask(nv - t0), exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + t0), vm)));
        if constexpr (kQuant) {
          const __m256bh ph = _mm512_cvtneps_pbh(_mm512_mul_ps(p, _mm512_loadu_ps(vsc + t0)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t0), (__m256i)ph);
          vsum = _mm512_add_ps(vsum, p);
        } else {
          const __m256bh ph = _mm512_cvtneps_pbh(p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t0), (__m256i)ph);
          vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(ph));
        }
      }
      l = l * alpha + _mm512_reduce_add_ps(vsum);
      m = m_new;
      float* accr = acc_all + r * D;
      const __m512 va = _mm512_set1_ps(alpha);
      __m512 x[NV], y[NV];
      for (int k = 0; k < NV; ++k) x[k] = _mm512_mul_ps(_mm512_loadu_ps(accr + k * 16), va), y[k] = _mm512_setzero_ps();
      const int64_t npairs = (nv + 1) / 2;
      int64_t j = 0;
      for (; j + 1 < npairs; j += 2) {
        int32_t w0, w1;
        std::memcpy(&w0, pb + 2 * j, 4);
        std::memcpy(&w1, pb + 2 * j + 2, 4);
        const __m512bh p0 = (__m512bh)_mm512_set1_epi32(w0), p1 = (__m512bh)_mm512_set1_epi32(w1);
        for (int k = 0; k < NV; ++k) {
          x[k] = _mm512_dpbf16_ps(x[k], (__m512bh)_mm512_loadu_si512(vi + j * NV + k), p0);
          y[k] = _mm512_dpbf16_ps(y[k], (__m512bh)_mm512_loadu_si512(vi + (j + 1) * NV + k), p1);
        }
      }
      if (j < npairs) {  // p of a token past nv is 0, so a half-used last pair adds nothing extra
        int32_t w0;
        std::memcpy(&w0, pb + 2 * j, 4);
        const __m512bh p0 = (__m512bh)_mm512_set1_epi32(w0);
        for (int k = 0; k < NV; ++k) x[k] = _mm512_dpbf16_ps(x[k], (__m512bh)_mm512_loadu_si512(vi + j * NV + k), p0);
      }
      for (int k = 0; k < NV; ++k) _mm512_storeu_ps(accr + k * 16, _mm512_add_ps(x[k], y[k]));
    }
  }

  float nat[D];
  for (int64_t r = 0; r < rows; ++r) {
    const float* accr = ws.acc.data() + r * D;
    for (int k = 0; k < NV; ++k)
      for (int i = 0; i < 16; ++i) nat[(k / 2) * 32 + (i / 4) * 8 + (k % 2) * 4 + i % 4] = accr[k * 16 + i];
    finish_row(a, it, parts, q_start + it.tok0 + r / G, it.kvh * G + r % G, nat, ws.m[r], ws.l[r]);
  }
}

template <DType CD, int NC32>
void run_all_bf16(const Args& a, const std::vector<Item>& items, Partials& parts) {
  ThreadPool::instance().parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Workspace ws;
    run_item_bf16<CD, NC32>(a, items[i], parts, ws);
  });
}

template <DType CD>
bool bf16_head_dim(const Args& a, const std::vector<Item>& items, Partials& parts) {
  if (a.D == 64) run_all_bf16<CD, 2>(a, items, parts);
  else if (a.D == 128) run_all_bf16<CD, 4>(a, items, parts);
  else return false;
  return true;
}

bool try_bf16_path(const Args& a, const std::vector<Item>& items, Partials& parts) {
  if (a.qdt != DType::kBFloat16) return false;
  switch (a.cdt) {
    case DType::kBFloat16: return bf16_head_dim<DType::kBFloat16>(a, items, parts);
    case DType::kFloat8E4M3: return bf16_head_dim<DType::kFloat8E4M3>(a, items, parts);
    case DType::kInt8: return bf16_head_dim<DType::kInt8>(a, items, parts);
    default: return false;
  }
}
#else
bool try_bf16_path(const Args&, const std::vector<Item>&, Partials&) { return false; }
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
    run_item<CD, NC>(a, items[i], parts, ws);
  });
}

template <DType CD>
void dispatch_head_dim(const Args& a, const std::vector<Item>& items, Partials& parts) {
  if (a.D == 64) run_all<CD, 4>(a, items, parts);
  else if (a.D == 128) run_all<CD, 8>(a, items, parts);
  else run_all<CD, 0>(a, items, parts);
}

void check_args(const Args& a, int64_t max_seq_len) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("paged_attention: " + msg); };
  if (a.KVH <= 0 || a.H % a.KVH != 0)
    fail("num_heads (" + std::to_string(a.H) + ") must be a multiple of num_kv_heads (" + std::to_string(a.KVH) + ")");
  if (a.D <= 0 || a.D > kMaxHeadDim) fail("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "]");
  if (a.BS <= 0) fail("block_size must be positive");
  const bool quant = a.cdt == DType::kFloat8E4M3 || a.cdt == DType::kInt8;
  if (!quant && a.cdt != a.qdt) fail("the cache dtype must match q's dtype (or be fp8/int8)");
  if (quant && (a.ks == nullptr || a.vs == nullptr)) fail("fp8/int8 caches need k_scales and v_scales");
  if (a.qdt != DType::kFloat32 && a.qdt != DType::kBFloat16 && a.qdt != DType::kFloat16)
    fail("q must be fp32, bf16 or fp16");
  if (a.qsl[0] != 0 || a.qsl[a.S] != a.T)
    fail("query_start_loc must start at 0 and end at num_tokens (" + std::to_string(a.T) + "), got " +
         std::to_string(a.qsl[0]) + " .. " + std::to_string(a.qsl[a.S]));
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t q_len = a.qsl[s + 1] - a.qsl[s], len = a.seq_lens[s];
    const std::string who = "sequence " + std::to_string(s) + ": ";
    if (q_len < 0) fail(who + "query_start_loc must be non-decreasing");
    if (len < q_len) fail(who + "seq_len " + std::to_string(len) + " < its query length " + std::to_string(q_len));
    if (len > a.MB * a.BS || len > max_seq_len)
      fail(who + "seq_len " + std::to_string(len) + " exceeds the block table capacity (" +
           std::to_string(a.MB * a.BS) + ") or max_seq_len (" + std::to_string(max_seq_len) + ")");
    for (int64_t b = 0; b < (len + a.BS - 1) / a.BS; ++b) {
      const int64_t blk = a.bt[s * a.MB + b];
      if (blk < 0 || blk >= a.NB)
        fail(who + "block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " + std::to_string(blk) +
             " is outside [0, " + std::to_string(a.NB) + ")");
    }
  }
}

}  // namespace

void paged_attention_cpu(void* out, const void* q, const void* k_cache, const void* v_cache, const float* k_scales,
                         const float* v_scales, const int32_t* block_tables, const int32_t* seq_lens,
                         const int32_t* query_start_loc, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t q_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                         int64_t max_blocks_per_seq, int64_t max_seq_len, float scale, DType q_dtype,
                         DType cache_dtype) {
  Args a{out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc,
         num_tokens, num_heads, num_kv_heads, head_dim, q_stride, num_blocks, block_size, num_seqs,
         max_blocks_per_seq, scale, q_dtype, cache_dtype, 0, 0, 0, 0};
  check_args(a, max_seq_len);
  a.G = a.H / a.KVH;
  a.Dp = (a.D + 63) / 64 * 64;
  a.chunk = std::max<int64_t>(a.BS, 4096 / a.Dp / a.BS * a.BS);
  a.QT = std::max<int64_t>(1, 16 / a.G);

  // Split the kv range only when (sequences x kv heads x tiles) cannot feed the pool.
  const int64_t nthreads = ThreadPool::instance().num_threads();
  int64_t base_items = 0, total_work = 0;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t tiles = (a.qsl[s + 1] - a.qsl[s] + a.QT - 1) / a.QT;
    base_items += a.KVH * tiles;
    total_work += a.KVH * tiles * seq_lens[s];
  }
  int64_t split_tokens = std::numeric_limits<int32_t>::max();
  if (nthreads > 1 && base_items < 4 * nthreads) {
    const int64_t want = std::max(kMinSplitTokens, (total_work + 8 * nthreads - 1) / (8 * nthreads));
    split_tokens = (want + a.chunk - 1) / a.chunk * a.chunk;
  }

  std::vector<Item> items;
  items.reserve(base_items);
  Partials parts;
  for (int32_t s = 0; s < a.S; ++s) {
    const int32_t q_len = a.qsl[s + 1] - a.qsl[s], len = seq_lens[s];
    const int32_t nsplit = std::max<int64_t>(1, (len + split_tokens - 1) / split_tokens);
    parts.nsplit = std::max<int64_t>(parts.nsplit, nsplit);
    for (int32_t h = 0; h < a.KVH; ++h)
      for (int32_t t0 = 0; t0 < q_len; t0 += a.QT)
        for (int32_t j = 0; j < nsplit; ++j) {
          const int32_t t1 = std::min<int32_t>(q_len, t0 + a.QT);
          const int32_t lo = j * split_tokens, hi = std::min<int64_t>(len, (int64_t)(j + 1) * split_tokens);
          const int64_t end = std::min<int64_t>(hi, len - q_len + t1);
          items.push_back({s, h, t0, t1, lo, hi, j, nsplit, std::max<int64_t>(0, end - lo) * (t1 - t0)});
        }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.work > y.work; });
  if (parts.nsplit > 1) {
    parts.ml.assign(a.T * a.H * parts.nsplit * 2, 0.0f);
    parts.acc.assign(a.T * a.H * parts.nsplit * a.Dp, 0.0f);
  }

  if (!try_bf16_path(a, items, parts)) switch (cache_dtype) {
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

}  // namespace pyengine
