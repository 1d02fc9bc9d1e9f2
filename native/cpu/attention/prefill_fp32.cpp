// prefill_fp32 (CPU, AVX2 + FMA): causal attention of prompt chunks with fp32 q over an fp32 KV cache,
// what an fp32 model runs (resolve_dtype's choice on CPUs without AVX512-BF16).
// Flash-attention style, as attention/prefill.cpp for bf16, in 256-bit fp32 FMAs that read the cache
// tiles in place (kv_layout.h with L = 2 values per lane pair):
//   K [D/2][BS][2]  dims pair j of consecutive tokens: a vector = 4 tokens x dims (2j, 2j + 1)
//   V [BS/2][D][2]  token pair i of consecutive dims:  a vector = 4 dims x tokens (2i, 2i + 1)
// Both products broadcast a pair of fp32 (vbroadcastsd) against such vectors, so each sum's two halves
// land in adjacent lanes:
//   QK  s[r][t] = q_r . k_t      kRows rows x 8 tokens: per dims pair, 2 K vectors x kRows q-pair
//                                broadcasts into 12 accumulators; a hadd + permute per 8 scores joins
//                                the halves
//   PV  o_r = o_r * alpha_r + sum_t p_rt v_t
//                                kRows rows x 8 dims: per token pair, 2 V vectors x kRows p-pair
//                                broadcasts; the halves (even and odd tokens) stay apart in o (2 D
//                                floats per row) until the item ends
// The softmax is online in fp32 (exact running max, exp2 to ~2e-7), probabilities stay fp32: the
// result differs from a plain fp32 softmax(QK^T)V only by summation order.
// Work items are (sequence, kv head, block of query tokens) of about kItemRows rows (query tokens x the
// G q heads of the kv head), heaviest first. An item walks its kv range in chunks of kChunk tokens, 4
// groups of 8; a group lies in one cache block when BS is a multiple of 8, else (and for the group
// holding the sequence's last position, zeros past it) it is gathered into the item's scratch. The
// chunk (16 KB of K and V at D = 64) stays in L1 while the item's rows pass over it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "prefill.h"
#include "pyengine/kv_layout.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "decode_avx2.h"  // lanes_in
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"
#endif

namespace pyengine {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int kChunk = 32;            // kv tokens per online-softmax step
constexpr int kGroups = kChunk / 8;   // 8-token groups per chunk (QK's unit)
constexpr int kPairs = kChunk / 2;    // token pairs per chunk (PV's unit)
constexpr int kRows = 6;              // q rows per micro-kernel pass (6 x 2 accumulators)
constexpr int64_t kItemRows = 96;     // q rows (query tokens x G heads) per work item, at least
constexpr int64_t kMaxD = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

// A chunk's K and V as the kernels read them: group g's dims pair j of its token u at
// k[g][j * kld[g] + 2 u] (and + 1); token pair i's dim d at v[i][2 d] (and + 1).
struct Chunk {
  const float* k[kGroups];
  int64_t kld[kGroups];
  const float* v[kPairs];
};

// Per-thread scratch of an item: q rows, accumulators (2 D per row: even and odd tokens' halves),
// running max (log2 units) and sum, each row's causal end, a row group's scores and probabilities,
// and the chunk's gathered groups (16 D floats each: K with kld 16, then V).
struct Scratch {
  std::vector<float> q, o, m, l, s, p, gathered;
  std::vector<int64_t> end;
  void fit(int64_t padded, int64_t D) {
    if (static_cast<int64_t>(q.size()) < padded * D) q.resize(padded * D), o.resize(2 * padded * D);
    if (static_cast<int64_t>(m.size()) < padded) m.resize(padded), l.resize(padded), end.resize(padded);
    s.resize(kRows * kChunk);
    p.resize(kRows * kChunk);
    gathered.resize(kGroups * 16 * D);
  }
};

struct Item {
  int32_t seq, kvh, tok0, tok1;  // query tokens [tok0, tok1) of the sequence
  int64_t work;
};

// Cache tile of (block of position pos, kv head) of a sequence, and pos's slot in it.
inline int64_t tile_of(const AttentionStep& a, int32_t seq, int32_t kvh, int64_t pos) {
  return static_cast<int64_t>(a.block_tables[seq * a.MB + pos / a.BS]) * a.KVH + kvh;
}

// The 8-token group at pos0 (a multiple of 8) copied into buf in the in-place layout (K lines of 16
// floats, then V's 4 token pairs), zeros at positions >= len.
void gather_group(const AttentionStep& a, int32_t seq, int32_t kvh, int64_t pos0, int64_t len, float* buf) {
  const int64_t D = a.D;
  float* k = buf;
  float* v = buf + 8 * D;
  const float* kc = static_cast<const float*>(a.k);
  const float* vc = static_cast<const float*>(a.v);
  for (int64_t u = 0; u < 8; ++u) {
    const int64_t pos = pos0 + u;
    const bool in = pos < len;
    const int64_t base = in ? tile_of(a, seq, kvh, pos) * a.BS * D : 0, off = pos % a.BS;
    for (int64_t d = 0; d < D; ++d) {
      k[(d / 2) * 16 + 2 * u + d % 2] = in ? kc[base + kv_k_offset(off, d, a.BS, 2)] : 0.0f;
      v[(u / 2) * 2 * D + 2 * d + u % 2] = in ? vc[base + kv_v_offset(off, d, D, 2)] : 0.0f;
    }
  }
}

// The chunk at c0 of (seq, kvh), its first ngroups groups (positions < len for all of them but the
// last, which may run past it).
Chunk chunk_at(const AttentionStep& a, int32_t seq, int32_t kvh, int64_t c0, int ngroups, int64_t len, float* gathered) {
  Chunk c{};
  const int64_t D = a.D;
  for (int g = 0; g < ngroups; ++g) {
    const int64_t pos0 = c0 + 8 * g;
    const float* k;
    const float* v;
    if (a.BS % 8 == 0 && pos0 + 8 <= len) {
      const int64_t at = tile_of(a, seq, kvh, pos0) * a.BS * D, off = pos0 % a.BS;
      k = static_cast<const float*>(a.k) + at + off * 2;
      v = static_cast<const float*>(a.v) + at + off * D;
      c.kld[g] = 2 * a.BS;
    } else {
      float* buf = gathered + g * 16 * D;
      gather_group(a, seq, kvh, pos0, len, buf);
      k = buf, v = buf + 8 * D;
      c.kld[g] = 16;
    }
    c.k[g] = k;
    for (int i = 0; i < 4; ++i) c.v[4 * g + i] = v + i * 2 * D;
  }
  return c;
}

// Asks for the cache lines of the groups [c0, c1) that lie in the cache (their blocks lie anywhere,
// so the hardware prefetcher cannot guess them). GCC had deleted these prefetches until prefetch.h;
// with them the kernel runs hardly faster: it is bound by its FMAs.
void prefetch_chunk(const AttentionStep& a, int32_t seq, int32_t kvh, int64_t c0, int64_t c1) {
  if (a.BS % 8) return;
  const int64_t D = a.D;
  for (int64_t pos0 = c0; pos0 + 8 <= c1; pos0 += 8) {
    const int64_t at = tile_of(a, seq, kvh, pos0) * a.BS * D, off = pos0 % a.BS;
    const float* k = static_cast<const float*>(a.k) + at + off * 2;
    const float* v = static_cast<const float*>(a.v) + at + off * D;
    for (int64_t j = 0; j < D / 2; ++j) prefetch<_MM_HINT_T0>(k + j * 2 * a.BS);
    for (int64_t i = 0; i < 8 * D; i += 16) prefetch<_MM_HINT_T0>(v + i);
  }
}

// s[r][8 g .. 8 g + 7] = q_r . k_t for the kRows rows (q rows D apart) and the first ngroups groups.
void qk(const float* q, int64_t D, const Chunk& c, int ngroups, float* s) {
  for (int g = 0; g < ngroups; ++g) {
    __m256 acc[kRows][2];
    for (auto& r : acc) r[0] = r[1] = _mm256_setzero_ps();
    const float* k = c.k[g];
    const int64_t ld = c.kld[g];
    for (int64_t j = 0; j < D / 2; ++j) {
      const __m256 k0 = _mm256_loadu_ps(k + j * ld), k1 = _mm256_loadu_ps(k + j * ld + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 qb = decode::bcast_pair(q + r * D + 2 * j);
        acc[r][0] = _mm256_fmadd_ps(k0, qb, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(k1, qb, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(s + r * kChunk + 8 * g, decode::join_pairs(acc[r][0], acc[r][1]));
  }
}

// One row's online softmax over the chunk: scores s of the visible tokens [lo, hi) in the log2 domain
// (scale2 = scale * log2 e), running max m and sum l updated, probabilities to p for the first nvec
// vectors (zero outside [lo, hi)). Returns alpha, the factor for the row's accumulator.
float softmax_row(const float* s, int lo, int hi, int nvec, float scale2, float& m, float& l, float* p) {
  if (hi <= lo) {
    std::memset(p, 0, nvec * 8 * sizeof(float));
    return 1.0f;
  }
  __m256 x[kGroups], keep[kGroups], vmax = _mm256_set1_ps(kNegInf);
  const __m256 vs = _mm256_set1_ps(scale2);
  for (int g = 0; g < nvec; ++g) {
    keep[g] = decode::lanes_in(8 * g, lo, hi);
    x[g] = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_mul_ps(_mm256_loadu_ps(s + 8 * g), vs), keep[g]);
    vmax = _mm256_max_ps(vmax, x[g]);
  }
  const float m_new = std::max(m, hmax256(vmax));
  const float alpha = std::exp2(m - m_new);  // m = -inf (the row's first chunk): 0
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int g = 0; g < nvec; ++g) {
    const __m256 e = _mm256_and_ps(exp2_256(_mm256_sub_ps(x[g], vm)), keep[g]);
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(p + 8 * g, e);
  }
  l = l * alpha + hsum256(sum);
  m = m_new;
  return alpha;
}

// o_r = o_r * alpha_r + sum over the chunk's first npairs token pairs of p_rt v_t, kRows rows (o rows
// 2 D apart, p rows kChunk apart), 8 dims (two vectors of o) at a time.
void pv(const float* p, const Chunk& c, int64_t D, int npairs, const float* alpha, float* o) {
  for (int64_t d0 = 0; d0 < 2 * D; d0 += 16) {
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * 2 * D + d0), a);
      acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * 2 * D + d0 + 8), a);
    }
    for (int i = 0; i < npairs; ++i) {
      const __m256 v0 = _mm256_loadu_ps(c.v[i] + d0), v1 = _mm256_loadu_ps(c.v[i] + d0 + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 pb = decode::bcast_pair(p + r * kChunk + 2 * i);
        acc[r][0] = _mm256_fmadd_ps(v0, pb, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(v1, pb, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(o + r * 2 * D + d0, acc[r][0]);
      _mm256_storeu_ps(o + r * 2 * D + d0 + 8, acc[r][1]);
    }
  }
}

// One work item: query tokens [tok0, tok1) of (seq, kvh), all their visible positions.
void run_item(const AttentionStep& a, const Item& it, Scratch& w) {
  const int64_t G = a.H / a.KVH, D = a.D, rows = (it.tok1 - it.tok0) * G;
  const int64_t q_start = a.qsl[it.seq], len = a.seq_lens[it.seq], first = len - (a.qsl[it.seq + 1] - q_start);
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;  // zero rows complete the last row group
  w.fit(padded, D);
  const float* qin = static_cast<const float*>(a.q);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t tok = q_start + it.tok0 + r / G, head = it.kvh * G + r % G;
    if (r < rows) std::memcpy(w.q.data() + r * D, qin + tok * a.q_stride + head * D, D * sizeof(float));
    else std::fill(w.q.data() + r * D, w.q.data() + (r + 1) * D, 0.0f);
    std::fill(w.o.data() + r * 2 * D, w.o.data() + (r + 1) * 2 * D, 0.0f);
    w.m[r] = kNegInf;
    w.l[r] = 0.0f;
    w.end[r] = r < rows ? first + it.tok0 + r / G + 1 : 0;  // the row's causal end (one past its position)
  }
  const int64_t pos0 = first + it.tok0, pos_end = first + it.tok1;  // the item's positions
  const int64_t kv_lo = a.window > 0 ? std::max<int64_t>(0, pos0 + 1 - a.window) : 0;
  const float scale2 = a.scale * kLog2e;
  for (int64_t c0 = kv_lo / kChunk * kChunk; c0 < pos_end; c0 += kChunk) {
    const int64_t c1 = std::min<int64_t>(c0 + kChunk, pos_end);  // no row sees past pos_end
    const Chunk c = chunk_at(a, it.seq, it.kvh, c0, static_cast<int>((c1 - c0 + 7) / 8), len, w.gathered.data());
    if (c1 < pos_end) prefetch_chunk(a, it.seq, it.kvh, c1, std::min<int64_t>(c1 + kChunk, len));
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      int lo[kRows], hi[kRows], maxhi = 0;
      for (int r = 0; r < kRows; ++r) {
        const int64_t end = w.end[r0 + r] - c0;  // the row's causal end in the chunk
        hi[r] = static_cast<int>(std::clamp<int64_t>(end, 0, kChunk));
        lo[r] = a.window > 0 ? static_cast<int>(std::clamp<int64_t>(end - a.window, 0, kChunk)) : 0;
        if (lo[r] < hi[r]) maxhi = std::max(maxhi, hi[r]);
      }
      if (maxhi == 0) continue;
      const int nvec = (maxhi + 7) / 8;
      qk(w.q.data() + r0 * D, D, c, nvec, w.s.data());
      float alpha[kRows];
      for (int r = 0; r < kRows; ++r)
        alpha[r] = softmax_row(w.s.data() + r * kChunk, lo[r], hi[r], nvec, scale2, w.m[r0 + r], w.l[r0 + r],
                               w.p.data() + r * kChunk);
      pv(w.p.data(), c, D, (maxhi + 1) / 2, alpha, w.o.data() + r0 * 2 * D);
    }
  }
  float* out = static_cast<float*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + it.tok0 + r / G, head = it.kvh * G + r % G;
    const float inv = 1.0f / w.l[r];
    const float* o = w.o.data() + r * 2 * D;
    for (int64_t d = 0; d < D; ++d) out[(tok * a.H + head) * D + d] = (o[2 * d] + o[2 * d + 1]) * inv;
  }
}

}  // namespace

bool prefill_fp32_supports(const AttentionStep& a) {
  return a.qdt == DType::kFloat32 && a.cdt == DType::kFloat32 && a.D % 8 == 0 && a.D <= kMaxD && a.softcap == 0.0f;
}

void prefill_fp32_cpu(const AttentionStep& a, const int32_t* seqs, int64_t nseqs) {
  const int64_t G = a.H / a.KVH, item_tokens = std::max<int64_t>(1, kItemRows / G);
  std::vector<Item> items;
  for (int64_t i = 0; i < nseqs; ++i) {
    const int32_t s = seqs[i];
    const int64_t q_len = a.qsl[s + 1] - a.qsl[s], first = a.seq_lens[s] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += item_tokens) {
      const int64_t t1 = std::min(q_len, t0 + item_tokens);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first + t0 + 1 - a.window) : 0;
      for (int32_t h = 0; h < a.KVH; ++h)
        items.push_back({s, h, static_cast<int32_t>(t0), static_cast<int32_t>(t1), (first + t1 - lo) * (t1 - t0)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.work > y.work; });
  ThreadPool::instance().parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch w;
    run_item(a, items[i], w);
  });
}

#else  // no AVX2 + FMA: fp32 prompts stay on paged_attention_cpu

bool prefill_fp32_supports(const AttentionStep&) { return false; }
void prefill_fp32_cpu(const AttentionStep&, const int32_t*, int64_t) {}

#endif

}  // namespace pyengine
