// prefill_attention (CPU): causal attention of prompt chunks (sequences with many query tokens) over
// the paged KV cache, flash-attention style, built to run at the bf16 dot-product rate of the GEMMs.
//
// Per batch of (sequence, kv head) pairs:
//  1. K/V in the packed layout (one 64-byte vector = 16 tokens of a dims pair, or 16 dims of a token pair):
//       K groups [D/2][16][2]  16-token groups; a group's dims pair j is one 64-byte vector
//       V [n/2][D][2]          token pair (2p, 2p+1) at dims d..d+15 is one 64-byte vector
//     A bf16 cache with blocks of 16 or 32 tokens already lies so (K [D/2][BS][2], V [BS/2][D][2]
//     per block and kv head): the kernels read it in place, block by block (no copy per step; the
//     group holding a sequence's last position is copied with zeros past the end, whose slots are
//     not the sequence's). Other caches (fp8/int8, blocks of 8 or 24) are packed first: each pair's
//     positions [lo, len) (lo = 0, or the earliest window start, rounded down to a chunk) gathered
//     into one contiguous bf16 run, with per-token fp32 scales ks, vs (1 for bf16), n rounded up to
//     a whole chunk with zeros (never NaN: 0 * NaN would leak into the output). fp8/int8 codes
//     become bf16 exactly (256-entry table); the scales are applied to the scores (K) and to the
//     probabilities before their bf16 rounding (V), as the decode kernel does.
//  2. Attend. Work items are (pair, block of about kItemRows / G query tokens), heaviest first. An
//     item's rows (query tokens x the G q heads of its kv head) walk the kv range in chunks of kChunk
//     tokens; per chunk, groups of kRows rows do
//       QK  s[r][t] = q_r . k_t            kRows x 4 accumulators, vdpbf16ps(K group vector, q pair)
//       online softmax in fp32 (scale, optional softcap, causal/window masks, running max and sum)
//       PV  o_r = o_r * alpha_r + sum_t p_rt v_t   kRows x 4 accumulators per 64 dims,
//                                                  vdpbf16ps(V pair vector, p pair)
//     so each loaded K/V vector feeds kRows dot products and the chunk (8-16 KB) stays in L1 while
//     all the item's rows pass over it. Probabilities are rounded to bf16 for PV (as flash attention
//     on GPUs does); scores, sums and accumulators are fp32 (the avx512_fp16 path below differs).
// Paths, best first (set_prefill_attention_path caps the choice, for tests):
//   amx          AMX tiles where the build (-march with AMX-TILE/BF16) and Linux (arch_prctl) allow:
//                the same chunk loop with groups of 16 rows, QK and PV as tile products overlapped
//                with the softmax on AVX-512 (AmxPipeline); ~3x the vdpbf16ps path on the same core.
//   avx512_fp16  the default without AMX on builds for AVX512-FP16 CPUs: QK and PV in fp16 FMAs (32 products each, at the fp32 FMA's issue rate) over
//                q staged once per item, K (less a mean key) and V once per item and chunk, as fp16
//                (HalfKernels), probabilities in fp16; QK stays on avx512_fp32's kernel for quantized
//                caches and soft-caps. Faster than avx512_fp32 at 512 to 8k tokens
//                (docs/performance.md, "prefill attention paths"); against the fp32 engine, the
//                default model's logprobs move about as far as avx512_fp32's (test_kv_accuracy).
//   avx512_fp32  the same chunk loop, each K/V line widened in registers to fp32 (its even and odd
//                halves) for two fp32 FMAs per row (Fp32Kernels): the bits of avx512_bf16. On
//                AVX512-FP16 CPUs vdpbf16ps issues at a quarter of the fp32 FMA rate, so there this
//                beats avx512_bf16 (docs/performance.md, "prefill attention paths").
//   avx512_bf16  the vdpbf16ps micro-kernels above.
//   portable     plain loops over the same packed layout, same arithmetic in fp32 (every build).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "prefill.h"
#include "pyengine/amx.h"
#include "pyengine/bf16_widen.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/half_pairs.h"
#include "pyengine/kv_layout.h"
#include "pyengine/kv_quant.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"
#include "pyengine/vec_exp.h"

#include "pyengine/simd.h"

namespace pyengine {
namespace {

constexpr int kChunk = 64;              // kv tokens per online-softmax step: 4 groups of 16
constexpr int kRows = 6;                // q rows per micro-kernel pass (6 x 4 accumulators)
constexpr int kAmxRows = 16;            // q rows per AMX pass (a tile's rows)
constexpr int64_t kItemRows = 96;       // q rows (query tokens x G heads) per work item, at least
constexpr int64_t kAmxItemRows = 384;   // and at most, on the AMX path (item_tokens)
constexpr int64_t kItemsPerThread = 3;  // items a batch keeps per thread when it makes them larger
constexpr int64_t kPackTokens = 1024;   // positions per packing task
constexpr int64_t kPackBudget = 64 << 20;  // bytes of packed K/V per batch of pairs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

// The kernels a build has, best first; set_prefill_attention_path caps which one runs (tests). kPaged:
// no kernel of this file; prompts run on paged_attention's (attention/paged.cpp).
enum class Path { kAmx, kAvx512Half, kAvx512Fp32, kAvx512Bf16, kPortable, kPaged };
std::atomic<Path> g_cap{Path::kAmx};

// One (sequence, kv head)'s packed K/V: positions [lo, lo + n), n a multiple of kChunk; k, v, ks, vs
// stay null where the pair reads the cache in place (reads_cache).
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

// Per-thread scratch of an item: its q rows (bf16; fp16 in q_to_half's layout on the avx512_fp16 path),
// accumulators, running max/sum, each row's causal end, scores and probabilities (bf16; fp16 on the
// avx512_fp16 path) of a row group (two of each for the AMX pipeline), a K/V group packed from the
// cache (the one holding a sequence's last position), the AMX path's V blocks and the avx512_fp16
// path's fp16 K and V chunk and the mean key its K is staged less (kmu).
struct Scratch {
  std::vector<uint16_t> q, p, edge, vblocks, khalf, vhalf;
  std::vector<float> o, m, l, s, kmu;
  std::vector<int64_t> end;
  // padded: the item's q rows rounded up to whole row groups of its path (the zero rows are computed too)
  void fit(int64_t padded, int64_t D) {
    if (static_cast<int64_t>(q.size()) < padded * D) q.resize(padded * D), o.resize(padded * D);
    if (static_cast<int64_t>(m.size()) < padded) m.resize(padded), l.resize(padded), end.resize(padded);
    s.resize(2 * kAmxRows * kChunk);
    p.resize(2 * kAmxRows * kChunk);
    edge.resize(32 * D);
    vblocks.resize(3 * kChunk * D);
    khalf.resize(kChunk * D);
    kmu.resize(D);
    vhalf.resize(kChunk * D);
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

#if defined(__AVX512BW__)
constexpr bool kHaveLut32 = true;
#else
constexpr bool kHaveLut32 = false;  // quantized groups go value by value
#endif

// 32 consecutive cache values at src -> 32 bf16 at dst: a copy (bf16), or, for fp8/int8 codes, four
// 64-entry lookups in code_table (vpermt2w) picked by each code's top two bits.
template <DType CD>
inline void copy32(uint16_t* dst, const char* src) {
  if constexpr (CD == DType::kBFloat16) {
    std::memcpy(dst, src, 64);
  } else {
#if defined(__AVX512BW__)
    const uint16_t* table = code_table<CD>().data();
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    __m512i part[4];
    for (int i = 0; i < 4; ++i)
      part[i] = _mm512_permutex2var_epi16(_mm512_loadu_si512(table + 64 * i), idx, _mm512_loadu_si512(table + 64 * i + 32));
    const __mmask32 b6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64));
    const __mmask32 b7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128));
    const __m512i lo = _mm512_mask_blend_epi16(b6, part[0], part[1]), hi = _mm512_mask_blend_epi16(b6, part[2], part[3]);
    _mm512_storeu_si512(dst, _mm512_mask_blend_epi16(b7, lo, hi));
#endif
  }
}

#if defined(__AVX512BW__)
// A line of 64 codes of a one-byte cache (four values per 32-bit lane, kv_layout.h: K 16 tokens of a
// dims group, V 16 dims of a token group) -> two runs of 32 bf16: each lane's first pair to `even`,
// its second to `odd` (K: dims pairs 2j and 2j + 1; V: token pairs 2p and 2p + 1).
template <DType CD>
inline void split_quads(uint16_t* even, uint16_t* odd, const char* src) {
  alignas(64) uint16_t tmp[64];
  copy32<CD>(tmp, src);
  copy32<CD>(tmp + 32, src + 32);
  const __m512i a = _mm512_load_si512(tmp), b = _mm512_load_si512(tmp + 32);
  const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  _mm512_storeu_si512(even, _mm512_permutex2var_epi32(a, first, b));
  _mm512_storeu_si512(odd, _mm512_permutex2var_epi32(a, _mm512_add_epi32(first, _mm512_set1_epi32(1)), b));
}
#endif

// Positions [lo + t0, lo + t1) of pair P (t0, t1 multiples of 16) into its packed run.
template <DType CD>
void pack_range(const AttentionStep& a, const Packed& P, int64_t t0, int64_t t1) {
  constexpr bool kQuant = CD != DType::kBFloat16;
  const auto* table = kQuant ? code_table<CD>().data() : nullptr;
  auto bits = [table](const void* base, int64_t i) -> uint16_t {
    if constexpr (kQuant) return table[static_cast<const uint8_t*>(base)[i]];
    else return static_cast<const uint16_t*>(base)[i];
  };
  const int64_t D = a.D, half = D / 2, len = a.seq_lens[P.seq];
  const size_t es = kQuant ? 1 : 2, tile_bytes = a.BS * D * es;
  const int64_t L = kv_lane(es);
  const int32_t* blocks = a.block_tables + P.seq * a.MB;
  for (int64_t g0 = t0; g0 < t1; g0 += 16) {
    const int64_t pos0 = P.lo + g0;
    uint16_t* kg = P.k + g0 * D;  // the group: dims pair j of token u at kg[32 j + 2 u]
    if (a.BS % 16 == 0 && pos0 + 16 <= len && (!kQuant || kHaveLut32)) {
      // a whole group inside one block: the block's K lines and V pairs as they lie, 32 values at a
      // time (bf16), or its K and V lines of quads split into pairs (fp8/int8)
      const int64_t tile = static_cast<int64_t>(blocks[pos0 / a.BS]) * a.KVH + P.kvh, off = pos0 % a.BS;
      const char* kt = static_cast<const char*>(a.k) + tile * tile_bytes;
      const char* vt = static_cast<const char*>(a.v) + tile * tile_bytes;
      if constexpr (kQuant) {
#if defined(__AVX512BW__)
        for (int64_t j = 0; j < D / 4; ++j) split_quads<CD>(kg + 64 * j, kg + 64 * j + 32, kt + (j * a.BS + off) * 4);
        for (int64_t p = 0; p < 4; ++p)
          for (int64_t d0 = 0; d0 < D; d0 += 16)
            split_quads<CD>(P.v + (g0 + 4 * p) * D + 2 * d0, P.v + (g0 + 4 * p + 2) * D + 2 * d0,
                            vt + ((off / 4 + p) * D + d0) * 4);
#endif
      } else {
        for (int64_t j = 0; j < half; ++j) copy32<CD>(kg + 32 * j, kt + (j * a.BS + off) * 4);
        for (int64_t i = 0; i < 16 * D; i += 32) copy32<CD>(P.v + g0 * D + i, vt + (off * D + i) * 2);
      }
      for (int64_t u = 0; u < 16; ++u) {
        P.ks[g0 + u] = kQuant ? a.ks[tile * a.BS + off + u] : 1.0f;
        P.vs[g0 + u] = kQuant ? a.vs[tile * a.BS + off + u] : 1.0f;
      }
      continue;
    }
    for (int64_t t = g0; t < g0 + 16; ++t) {
      const int64_t pos = P.lo + t;
      uint16_t* kd = kg + (t - g0) * 2;            // dims pair j at kd[32 j], kd[32 j + 1]
      uint16_t* vd = P.v + t / 2 * 2 * D + t % 2;  // dim d at vd[2 d]
      if (pos >= len) {
        for (int64_t j = 0; j < half; ++j) kd[32 * j] = kd[32 * j + 1] = 0;
        for (int64_t d = 0; d < D; ++d) vd[2 * d] = 0;
        P.ks[t] = P.vs[t] = 0.0f;
        continue;
      }
      const int64_t tile = static_cast<int64_t>(blocks[pos / a.BS]) * a.KVH + P.kvh, off = pos % a.BS;
      const char* kt = static_cast<const char*>(a.k) + tile * tile_bytes;  // [D/L][BS][L]
      const char* vt = static_cast<const char*>(a.v) + tile * tile_bytes;  // [BS/L][D][L]
      for (int64_t d = 0; d < D; ++d) kd[32 * (d / 2) + d % 2] = bits(kt, kv_k_offset(off, d, a.BS, L));
      for (int64_t d = 0; d < D; ++d) vd[2 * d] = bits(vt, kv_v_offset(off, d, D, L));
      P.ks[t] = kQuant ? a.ks[tile * a.BS + off] : 1.0f;
      P.vs[t] = kQuant ? a.vs[tile * a.BS + off] : 1.0f;
    }
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
// A chunk's K/V as the micro-kernels read them: 4 groups of 16 tokens, each in the packed layout
// (a packed run, or a bf16 cache block as it lies).
// ---------------------------------------------------------------------------------------------
struct ChunkKV {
  const uint16_t* k[4];  // group g: dims pair j of its token u at k[g][j * kld[g] + 2 u] (and + 1)
  int64_t kld[4];        // 32 in a packed run, 2 BS in a cache block ([D/2][BS][2])
  const uint16_t* v[4];  // group g: its token pair i (< 8) at dim d at v[g][2 D i + 2 d] (and + 1)
  bool k_half = false;   // avx512_fp16: k holds fp16 pairs (stage_half_chunk), each worth k_unit times
  float k_unit = 1.0f;   // its value (less the item's mean key), v too (v_unit)
  float v_unit = 1.0f;
};

// A zero K/V group (positions past a sequence's end), the widest head_dim.
alignas(64) const uint16_t kZeroGroup[16 * 256] = {};

// Whether the pairs' K/V are read straight from the cache: a bf16 cache whose blocks hold whole
// 16-token groups already lies in the packed layout, only the group stride differs.
bool reads_cache(const AttentionStep& a) { return a.cdt == DType::kBFloat16 && a.BS % 16 == 0; }

// The K (dims pair 0; rows 2 BS apart) and V (16 D contiguous) of the 16-token group at pos of pair P,
// in the cache.
std::pair<const uint16_t*, const uint16_t*> cache_group(const AttentionStep& a, const Packed& P, int64_t pos) {
  const int64_t tile = static_cast<int64_t>(a.block_tables[P.seq * a.MB + pos / a.BS]) * a.KVH + P.kvh;
  const int64_t at = tile * a.BS * a.D, off = pos % a.BS;
  return {static_cast<const uint16_t*>(a.k) + at + off * 2, static_cast<const uint16_t*>(a.v) + at + off * a.D};
}

// The chunk [c0, c0 + kChunk) of pair P: from its packed run, or (P.k null) from the cache, where
// groups past the sequence's end read zeros and the group holding its last position is packed into
// `edge` first (the slots past the end are not the sequence's: they may hold anything, even NaN).
ChunkKV chunk_kv(const AttentionStep& a, const Packed& P, int64_t c0, uint16_t* edge) {
  ChunkKV kv;
  const int64_t D = a.D, len = a.seq_lens[P.seq];
  for (int g = 0; g < 4; ++g) {
    const int64_t pos = c0 + 16 * g;
    kv.kld[g] = 32;
    if (P.k) {
      kv.k[g] = P.k + (pos - P.lo) * D, kv.v[g] = P.v + (pos - P.lo) * D;
    } else if (pos >= len) {
      kv.k[g] = kv.v[g] = kZeroGroup;
    } else if (pos + 16 > len) {
      float scales[32];
      const Packed one{P.seq, P.kvh, pos, 16, edge, edge + 16 * D, scales, scales + 16};
      pack(a, one, 0, 16);
      kv.k[g] = one.k, kv.v[g] = one.v;
    } else {
      std::tie(kv.k[g], kv.v[g]) = cache_group(a, P, pos);
      kv.kld[g] = 2 * a.BS;
    }
  }
  return kv;
}

// Asks for the cache lines of the chunk [c0, c0 + kChunk) of a pair that reads the cache: its blocks
// lie anywhere, so the hardware prefetcher cannot guess them.
void prefetch_chunk(const AttentionStep& a, const Packed& P, int64_t c0) {
  const int64_t len = a.seq_lens[P.seq], D = a.D;
  for (int64_t pos = c0; pos < std::min(len, c0 + kChunk); pos += 16) {
    const auto [k, v] = cache_group(a, P, pos);
    for (int64_t j = 0; j < D / 2; ++j) prefetch<_MM_HINT_T0>(k + j * 2 * a.BS);
    for (int64_t i = 0; i < 16 * D; i += 32) prefetch<_MM_HINT_T0>(v + i);
  }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels over one chunk: q at nr rows of D bf16, s / p at nr rows of kChunk scores /
// probabilities, o at nr rows of D fp32 accumulators.
// ---------------------------------------------------------------------------------------------

// The softmax of one row's chunk: scores s (raw dot products) of the visible tokens [lo, hi) are
// scaled (and capped), the running max m and sum l updated; p gets bf16(prob * vs) (zero outside
// [lo, hi)); returns alpha = exp(m_old - m_new), the factor for the row's accumulator.
struct RowSoftmax {
  float scale, softcap;
  const float* ks;  // the chunk's per-token scales, null for a bf16 cache
  const float* vs;
};

float softmax_row_portable(const RowSoftmax& c, const float* s, int lo, int hi, float& m, float& l, uint16_t* p, float&) {
  float x[kChunk];
  float mx = kNegInf;
  for (int t = lo; t < hi; ++t) {
    float v = s[t] * c.scale * (c.ks ? c.ks[t] : 1.0f);
    if (c.softcap > 0.0f) v = c.softcap * std::tanh(v / c.softcap);
    x[t] = v;
    mx = std::max(mx, v);
  }
  const float m_new = std::max(m, mx), alpha = std::exp(m - m_new);
  float sum = 0.0f;
  for (int t = 0; t < kChunk; ++t) {
    const float e = t >= lo && t < hi ? std::exp(x[t] - m_new) : 0.0f;
    sum += e;
    p[t] = float_to_bf16(c.vs ? e * c.vs[t] : e);
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// Dims pair j of chunk token t.
inline const uint16_t* k_at(const ChunkKV& kv, int t, int64_t j) { return kv.k[t / 16] + j * kv.kld[t / 16] + t % 16 * 2; }
// Token pair i of the chunk (tokens 2i, 2i + 1), dim 0.
inline const uint16_t* v_at(const ChunkKV& kv, int i, int64_t D) { return kv.v[i / 8] + i % 8 * 2 * D; }

void qk_portable(int nr, const uint16_t* q, int64_t D, const ChunkKV& kv, float* s) {
  for (int r = 0; r < nr; ++r) {
    float acc[kChunk] = {};
    for (int64_t j = 0; j < D / 2; ++j) {
      const float q0 = bf16_to_float(q[r * D + 2 * j]), q1 = bf16_to_float(q[r * D + 2 * j + 1]);
      for (int t = 0; t < kChunk; ++t) {
        const uint16_t* kp = k_at(kv, t, j);
        acc[t] += q0 * bf16_to_float(kp[0]) + q1 * bf16_to_float(kp[1]);
      }
    }
    std::copy(acc, acc + kChunk, s + r * kChunk);
  }
}

void pv_portable(int nr, const uint16_t* p, const ChunkKV& kv, int64_t D, int npairs, const float* alpha, float* o) {
  for (int r = 0; r < nr; ++r) {
    float* orow = o + r * D;
    for (int64_t d = 0; d < D; ++d) orow[d] *= alpha[r];
    for (int i = 0; i < npairs; ++i) {
      const float p0 = bf16_to_float(p[r * kChunk + 2 * i]), p1 = bf16_to_float(p[r * kChunk + 2 * i + 1]);
      const uint16_t* vp = v_at(kv, i, D);
      for (int64_t d = 0; d < D; ++d) orow[d] += p0 * bf16_to_float(vp[2 * d]) + p1 * bf16_to_float(vp[2 * d + 1]);
    }
  }
}

// The softmax of rows [0, nr) of a row group (probabilities p; alpha[r] for row r's accumulator);
// rows that see nothing of the chunk get zero probabilities. Returns the end of the last visible
// token over the rows (PV stops there). before_row(r) runs before row r (the AMX path issues its tile
// work there). p_unit[r]: what row r's probabilities are worth, where Softmax scales them (fp16).
template <auto Softmax, class BeforeRow>
int softmax_rows(int nr, const RowSoftmax& c, const float* s, const int* lo, const int* hi, float* m,
                 float* l, uint16_t* p, float* alpha, float* p_unit, BeforeRow before_row) {
  int maxhi = 0;
  for (int r = 0; r < nr; ++r) {
    before_row(r);
    if (lo[r] < hi[r]) {
      alpha[r] = Softmax(c, s + r * kChunk, lo[r], hi[r], m[r], l[r], p + r * kChunk, p_unit[r]);
      maxhi = std::max(maxhi, hi[r]);
    } else {
      alpha[r] = p_unit[r] = 1.0f;
      std::memset(p + r * kChunk, 0, kChunk * 2);
    }
  }
  return maxhi;
}

struct PortableKernels {
  static void qk(int nr, const uint16_t* q, int64_t D, const ChunkKV& kv, float* s) { qk_portable(nr, q, D, kv, s); }
  static int softmax(int nr, const RowSoftmax& c, const float* s, const int* lo, const int* hi, float* m, float* l,
                     uint16_t* p, float* alpha, float* p_unit) {
    return softmax_rows<softmax_row_portable>(nr, c, s, lo, hi, m, l, p, alpha, p_unit, [](int) {});
  }
  static void pv(int nr, const uint16_t* p, const float*, const ChunkKV& kv, int64_t D, int npairs, const float* alpha,
                 float* o) {
    pv_portable(nr, p, kv, D, npairs, alpha, o);
  }
};

// nr (<= kRows) rows of one chunk: QK, softmax, PV with one ISA's kernels.
template <class Kernels>
void row_group(int nr, const RowSoftmax& c, const uint16_t* q, int64_t D, const ChunkKV& kv, const int* lo,
               const int* hi, float* m, float* l, float* o, Scratch& w) {
  Kernels::qk(nr, q, D, kv, w.s.data());
  float alpha[kRows], p_unit[kRows];
  const int maxhi = Kernels::softmax(nr, c, w.s.data(), lo, hi, m, l, w.p.data(), alpha, p_unit);
  Kernels::pv(nr, w.p.data(), p_unit, kv, D, (maxhi + 1) / 2, alpha, o);
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

#if defined(__AVX512FP16__)
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
#endif

#endif

#if defined(PYENGINE_AMX)
// AMX: 16 q rows per pass, every tile 16 rows x 64 bytes: accumulators tmm0..3, A operands tmm4..5,
// B operands tmm6..7 (two of each, so a tile load need not wait for the product before it).
//   QK: S tiles tmm0..3 (16 rows x 16 tokens fp32, one per 16-token group) += Q tile (16 rows x 32
//       dims) . K tile (16 dims pairs x 16 tokens x 2: a group's pairs, as they lie)
//   PV: O tiles tmm0..3 (16 rows x 16 dims, a 64-dim slice) += P tile (16 rows x 32 tokens) . V tile
//       (16 token pairs x 16 dims x 2: a 32-token V block, as it lies where its two groups are
//       contiguous, else copied so; see v_blocks)
// The softmax runs on the AVX-512 units, row by row, as in the vdpbf16ps path, with other groups'
// tile products issued between its rows (AmxPipeline).

// The tile intrinsics take register numbers as literals (they are spliced into the asm), hence macros.
// tmm C += tmm A . (the tile at b, rows `stride` bytes apart), loaded into tmm B.
#define PYENGINE_TILE_PRODUCT(C, A, B, b, stride) \
  do {                                             \
    _tile_loadd(B, b, stride);                     \
    _tile_dpbf16ps(C, A, B);                       \
  } while (0)

// One row group's pass over one chunk.
struct RowGroup {
  RowSoftmax c;
  ChunkKV kv;
  const uint16_t* vb[2];  // v_blocks
  const uint16_t* q;
  float *m, *l, *o;
  int lo[kAmxRows], hi[kAmxRows];
};

// A PV to run: o[16 rows][D] += p[16 rows][32 * nblocks tokens] . v (nblocks <= 2).
struct Pv {
  const uint16_t* p = nullptr;
  const uint16_t* vb[2];
  float* o;
  int nblocks;
};

// tmm g += tmm A . (the tile at b), for an accumulator g in 0..3 (B operand tmm6 or tmm7).
#define PYENGINE_PRODUCT_INTO(g, A, b, stride)                   \
  switch (g) {                                                  \
    case 0: PYENGINE_TILE_PRODUCT(0, A, 6, b, stride); break;   \
    case 1: PYENGINE_TILE_PRODUCT(1, A, 7, b, stride); break;   \
    case 2: PYENGINE_TILE_PRODUCT(2, A, 6, b, stride); break;   \
    default: PYENGINE_TILE_PRODUCT(3, A, 7, b, stride); break;  \
  }

// The tile work of one pipeline step as single tile products, which the softmax runs between its
// rows (see AmxPipeline): one group's QK, S[16 rows][kChunk] = q . k (D / 32 x 4 products), then
// one PV (D / 64 x nblocks x 4 products), with the A operand loads, zeroing and stores around them.
class TileWork {
 public:
  TileWork(const RowGroup* qk, float* s, const Pv& pv, int64_t D)
      : qk_(qk), s_(s), pv_(pv), D_(D), nqk_(qk ? D / 32 * 4 : 0), npv_(pv.p ? D / 64 * pv.nblocks * 4 : 0) {}

  int size() const { return nqk_ + npv_; }
  void run_all() {
    for (int i = 0; i < size(); ++i) run(i);
  }

  void run(int i) {
    if (i < nqk_) return qk_product(i / 4, i % 4);
    i -= nqk_;
    const int g = i % 4, tb = pv_.nblocks == 2 ? i / 4 % 2 : 0;  // no division by a variable per product
    const int64_t d0 = (pv_.nblocks == 2 ? i / 8 : i / 4) * 64;
    float* o = pv_.o + d0;
    if (tb == 0 && g == 0) {
      _tile_loadd(0, o, D_ * 4);
      _tile_loadd(1, o + 16, D_ * 4);
      _tile_loadd(2, o + 32, D_ * 4);
      _tile_loadd(3, o + 48, D_ * 4);
    }
    const uint16_t* vt = pv_.vb[tb] + 2 * d0 + 32 * g;  // dims d0 + 16 g ..
    if (tb == 0) {
      if (g == 0) _tile_loadd(4, pv_.p, kChunk * 2);
      PYENGINE_PRODUCT_INTO(g, 4, vt, D_ * 4);
    } else {
      if (g == 0) _tile_loadd(5, pv_.p + 32, kChunk * 2);
      PYENGINE_PRODUCT_INTO(g, 5, vt, D_ * 4);
    }
    if (tb == pv_.nblocks - 1 && g == 3) {
      _tile_stored(0, o, D_ * 4);
      _tile_stored(1, o + 16, D_ * 4);
      _tile_stored(2, o + 32, D_ * 4);
      _tile_stored(3, o + 48, D_ * 4);
    }
  }

 private:
  // S += q[:, 32 kb, 32 kb + 32) . k of group g.
  void qk_product(int kb, int g) {
    if (kb == 0 && g == 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    const ChunkKV& kv = qk_->kv;
    const uint16_t* kt = kv.k[g] + kb * 16 * kv.kld[g];
    if (kb % 2 == 0) {
      if (g == 0) _tile_loadd(4, qk_->q + kb * 32, D_ * 2);
      PYENGINE_PRODUCT_INTO(g, 4, kt, kv.kld[g] * 2);
    } else {
      if (g == 0) _tile_loadd(5, qk_->q + kb * 32, D_ * 2);
      PYENGINE_PRODUCT_INTO(g, 5, kt, kv.kld[g] * 2);
    }
    if (kb == nqk_ / 4 - 1 && g == 3) {
      _tile_stored(0, s_, kChunk * 4);
      _tile_stored(1, s_ + 16, kChunk * 4);
      _tile_stored(2, s_ + 32, kChunk * 4);
      _tile_stored(3, s_ + 48, kChunk * 4);
    }
  }

  const RowGroup* qk_;
  float* s_;
  Pv pv_;
  int64_t D_;
  int nqk_, npv_;
};

// The chunk's two 32-token V blocks ([16 pairs][D][2], one tile row per pair): a block's groups as
// they lie where contiguous (a packed run, blocks of >= 32 tokens), else copied into buf (64 x D).
void v_blocks(const ChunkKV& kv, int64_t D, uint16_t* buf, const uint16_t* vb[2]) {
  for (int b = 0; b < 2; ++b) {
    if (kv.v[2 * b + 1] == kv.v[2 * b] + 16 * D) {
      vb[b] = kv.v[2 * b];
      continue;
    }
    uint16_t* dst = buf + b * 32 * D;
    std::memcpy(dst, kv.v[2 * b], 16 * D * 2);
    std::memcpy(dst + 16 * D, kv.v[2 * b + 1], 16 * D * 2);
    vb[b] = dst;
  }
}

// The AMX path's row groups in order, software-pipelined so that the tile unit works while the
// vector units run a softmax: push(k) runs group k - 1's softmax (its scores are in) and, spread
// between its rows, group k's QK and group k - 2's PV. Issued in one block, the tile work would hold
// the reorder buffer until it retires and the two would run one after the other. The scores and
// probabilities are double-buffered; the tile loads of a PV find its probabilities (vector stores,
// which tile loads do not forward from) in L1. The V blocks of a group's chunk must stay put until
// its PV: up to three chunks are in flight.
// The overlap measured small: all parts together take about the sum of each alone, and where the tile
// work sits among the rows changed nothing beyond noise except all after (slower). So each part's own
// cost counts in full (docs/performance.md, "AMX prefill pipeline").
class AmxPipeline {
 public:
  AmxPipeline(Scratch& w, int64_t D) : w_(w), D_(D) { configure_tiles(8); }
  ~AmxPipeline() {
    flush();
    _tile_release();
  }

  void push(const RowGroup& g) {
    step(&g);
    scored_ = g;
    ++k_;
  }

  void flush() {
    step(nullptr);  // the last softmax, the PV before it
    TileWork(nullptr, nullptr, pending_, D_).run_all();
    pending_.p = nullptr;
    k_ = 0;
  }

 private:
  float* scores(int64_t k) { return w_.s.data() + k % 2 * kAmxRows * kChunk; }

  // Group k - 1's softmax with g's QK (if any) and the pending PV interleaved; then k - 1's PV pends.
  void step(const RowGroup* g) {
    TileWork work(g, scores(k_), pending_, D_);
    pending_.p = nullptr;
    int next = 0;  // tile steps run so far: step i before row i * kAmxRows / size
    auto before_row = [&](int r) {
      while (next < work.size() && next * kAmxRows <= r * work.size()) work.run(next++);
    };
    if (k_ == 0) {
      while (next < work.size()) work.run(next++);
      return;
    }
    const RowGroup& sg = scored_;
    uint16_t* p = w_.p.data() + k_ % 2 * kAmxRows * kChunk;
    float alpha[kAmxRows], p_unit[kAmxRows];
    const int maxhi = softmax_rows<softmax_row_avx<false>>(kAmxRows, sg.c, scores(k_ - 1), sg.lo, sg.hi, sg.m, sg.l, p,
                                                           alpha, p_unit, before_row);
    while (next < work.size()) work.run(next++);
    for (int r = 0; r < kAmxRows; ++r) {  // after the PV above: it may add to the same rows
      if (alpha[r] == 1.0f) continue;
      const __m512 va = _mm512_set1_ps(alpha[r]);
      for (int64_t d = 0; d < D_; d += 16)
        _mm512_storeu_ps(sg.o + r * D_ + d, _mm512_mul_ps(_mm512_loadu_ps(sg.o + r * D_ + d), va));
    }
    pending_ = {p, {sg.vb[0], sg.vb[1]}, sg.o, (maxhi + 31) / 32};  // 32-token blocks holding a probability
  }

  Scratch& w_;
  const int64_t D_;
  int64_t k_ = 0;  // groups pushed
  RowGroup scored_;
  Pv pending_;
};
#endif

#if defined(__AVX512BF16__)
// row_group with Kernels<nr>: the micro-kernels are unrolled over the rows.
template <template <int> class Kernels>
void row_group_of(int nr, const RowSoftmax& c, const uint16_t* q, int64_t D, const ChunkKV& kv, const int* lo,
                  const int* hi, float* m, float* l, float* o, Scratch& w) {
  switch (nr) {
    case 1: return row_group<Kernels<1>>(nr, c, q, D, kv, lo, hi, m, l, o, w);
    case 2: return row_group<Kernels<2>>(nr, c, q, D, kv, lo, hi, m, l, o, w);
    case 3: return row_group<Kernels<3>>(nr, c, q, D, kv, lo, hi, m, l, o, w);
    case 4: return row_group<Kernels<4>>(nr, c, q, D, kv, lo, hi, m, l, o, w);
    case 5: return row_group<Kernels<5>>(nr, c, q, D, kv, lo, hi, m, l, o, w);
    default: return row_group<Kernels<6>>(nr, c, q, D, kv, lo, hi, m, l, o, w);
  }
}
#endif

// nr (<= kRows) rows of one chunk, on the fp16, fp32, vdpbf16ps or portable path.
void row_group(Path path, int nr, const RowSoftmax& c, const uint16_t* q, int64_t D, const ChunkKV& kv, const int* lo,
               const int* hi, float* m, float* l, float* o, Scratch& w) {
#if defined(__AVX512FP16__)
  if (path == Path::kAvx512Half && kv.k_half) return row_group_of<HalfKernels>(nr, c, q, D, kv, lo, hi, m, l, o, w);
  if (path == Path::kAvx512Half) return row_group_of<HalfPvKernels>(nr, c, q, D, kv, lo, hi, m, l, o, w);
#endif
#if defined(__AVX512BF16__)
  if (path == Path::kAvx512Fp32) return row_group_of<Fp32Kernels>(nr, c, q, D, kv, lo, hi, m, l, o, w);
  if (path == Path::kAvx512Bf16) return row_group_of<AvxKernels>(nr, c, q, D, kv, lo, hi, m, l, o, w);
#endif
  row_group<PortableKernels>(nr, c, q, D, kv, lo, hi, m, l, o, w);
}

// ---------------------------------------------------------------------------------------------
// One work item: query tokens [tok0, tok1) of pair P, all their visible positions.
// ---------------------------------------------------------------------------------------------
void run_item(const AttentionStep& a, const Packed& P, int64_t tok0, int64_t tok1, Path path, Scratch& w) {
  const int64_t G = a.H / a.KVH, D = a.D, rows = (tok1 - tok0) * G;
  const int64_t q_start = a.qsl[P.seq], first = a.seq_lens[P.seq] - (a.qsl[P.seq + 1] - q_start);
  const int group = path == Path::kAmx ? kAmxRows : kRows;
  const int64_t padded = (rows + group - 1) / group * group;  // zero rows complete the last row group
  w.fit(padded, D);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t tok = q_start + tok0 + r / G, head = P.kvh * G + r % G;
    if (r < rows) std::memcpy(w.q.data() + r * D, static_cast<const uint16_t*>(a.q) + tok * a.q_stride + head * D, D * 2);
    else std::fill(w.q.data() + r * D, w.q.data() + (r + 1) * D, uint16_t{0});
    std::fill(w.o.data() + r * D, w.o.data() + (r + 1) * D, 0.0f);
    w.l[r] = 0.0f;
    w.m[r] = kNegInf;
    w.end[r] = first + tok0 + r / G + 1;  // the row's causal end (one past its position)
  }
#if defined(PYENGINE_AMX)
  std::optional<AmxPipeline> amx;
  if (path == Path::kAmx) amx.emplace(w, D);
#endif
  const int64_t pos0 = first + tok0, pos_end = first + tok1;  // the item's positions [pos0, pos_end)
  const int64_t kv_lo = a.window > 0 ? std::max<int64_t>(0, pos0 + 1 - a.window) : 0;
  const bool quant = a.cdt != DType::kBFloat16;
  float q_unit = 1.0f;  // what a staged q value is worth (avx512_fp16)
#if defined(__AVX512FP16__)
  const HalfTops tops = half_tops(D);
  // QK in fp16 on keys less the mean key of the item's last chunk, so that a large offset common to
  // the keys (k biases) does not swell the fp16 sums: each row's scores all move by q . k_mean, which
  // its softmax cancels. Not where per-token K scales (quantized caches) or a soft-cap would not
  // cancel it: QK stays on the fp32 kernel there.
  const bool half_qk = path == Path::kAvx512Half && !quant && a.softcap == 0.0f;
  float k_mean_max = 0.0f;
  if (half_qk) {
    q_unit = q_to_half(w.q.data(), padded, D, tops.q);
    const int64_t c_last = (pos_end - 1) / kChunk * kChunk, len = a.seq_lens[P.seq];
    k_mean_max =
        key_mean(chunk_kv(a, P, c_last, w.edge.data()), D, std::min<int64_t>(kChunk, len - c_last), w.kmu.data());
  }
#endif
  [[maybe_unused]] int64_t chunks = 0;
  for (int64_t c0 = kv_lo / kChunk * kChunk; c0 < pos_end; c0 += kChunk) {
    ChunkKV kv = chunk_kv(a, P, c0, w.edge.data());  // only the item's last chunk may use the edge buffer
    if (!P.k) prefetch_chunk(a, P, c0 + kChunk);
#if defined(PYENGINE_AMX)
    const uint16_t* vb[2] = {};
    if (amx) v_blocks(kv, D, w.vblocks.data() + ++chunks % 3 * kChunk * D, vb);  // see AmxPipeline
#endif
#if defined(__AVX512FP16__)
    if (path == Path::kAvx512Half)
      kv = stage_half_chunk(kv, D, half_qk, w.kmu.data(), k_mean_max, tops.k, w.khalf.data(), w.vhalf.data());
#endif
    const int64_t t = c0 - P.lo;  // the chunk in the packed run
    const float score_unit = q_unit * kv.k_unit;  // the scores' units: the softmax takes them out with its scale
    const RowSoftmax sm{a.scale * score_unit, a.softcap, quant ? P.ks + t : nullptr, quant ? P.vs + t : nullptr};
    for (int64_t r0 = 0; r0 < rows; r0 += group) {
      const int nr = static_cast<int>(std::min<int64_t>(group, rows - r0));
      int lo[kAmxRows] = {}, hi[kAmxRows] = {};  // padding rows see nothing
      bool any = false;
      for (int r = 0; r < nr; ++r) {
        const int64_t end = w.end[r0 + r] - c0;  // the row's causal end in the chunk
        hi[r] = static_cast<int>(std::clamp<int64_t>(end, 0, kChunk));
        lo[r] = a.window > 0 ? static_cast<int>(std::clamp<int64_t>(end - a.window, 0, kChunk)) : 0;
        any |= lo[r] < hi[r];
      }
      if (!any) continue;
      float *m = w.m.data() + r0, *l = w.l.data() + r0, *o = w.o.data() + r0 * D;
#if defined(PYENGINE_AMX)
      if (amx) {
        RowGroup g{sm, kv, {vb[0], vb[1]}, w.q.data() + r0 * D, m, l, o, {}, {}};
        std::copy(lo, lo + kAmxRows, g.lo);
        std::copy(hi, hi + kAmxRows, g.hi);
        amx->push(g);
        continue;
      }
#endif
      row_group(path, nr, sm, w.q.data() + r0 * D, D, kv, lo, hi, m, l, o, w);
    }
  }
#if defined(PYENGINE_AMX)
  amx.reset();  // the last groups' softmax and PV
#endif
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + tok0 + r / G, head = P.kvh * G + r % G;
    const float inv = 1.0f / w.l[r];
    for (int64_t d = 0; d < D; ++d) out[(tok * a.H + head) * D + d] = float_to_bf16(w.o[r * D + d] * inv);
  }
}

// Query tokens per work item. Every item reads its pair's K/V chunk by chunk and the chunk serves all
// its rows, so larger items read K/V less often. On the AMX path, where tile loads and not the products
// bound the kernel, up to 384 rows instead of 96 are faster (docs/performance.md, "AMX prefill item
// size"). Items
// grow only while the batch keeps kItemsPerThread per thread, so a 64-token chunk still makes six items
// for two threads. The vdpbf16ps path keeps 96 (not measured larger).
int64_t choose_item_tokens(const AttentionStep& a, const std::vector<Packed>& pairs, int64_t p0, int64_t p1, Path path,
                           int64_t threads) {
  const int64_t G = a.H / a.KVH, base = std::max<int64_t>(1, kItemRows / G);
  if (path != Path::kAmx) return base;
  auto count = [&](int64_t tokens) {
    int64_t n = 0;
    for (int64_t i = p0; i < p1; ++i) n += (a.qsl[pairs[i].seq + 1] - a.qsl[pairs[i].seq] + tokens - 1) / tokens;
    return n;
  };
  int64_t tokens = std::max<int64_t>(base, kAmxItemRows / G);
  while (tokens > base && count(tokens) < threads * kItemsPerThread) tokens = std::max(base, tokens / 2);
  return tokens;
}

// Packs the pairs [p0, p1) (unless they read the cache directly), then runs all their items.
void run_batch(const AttentionStep& a, std::vector<Packed>& pairs, int64_t p0, int64_t p1, Path path) {
  auto& pool = ThreadPool::instance();
  if (!reads_cache(a)) {
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
    pool.parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
      const Packed& P = pairs[tasks[i].first];
      pack(a, P, tasks[i].second, std::min(P.n, tasks[i].second + kPackTokens));
    });
  }

  const int64_t item_tokens = choose_item_tokens(a, pairs, p0, p1, path, pool.num_threads());
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
    run_item(a, pairs[items[i].pair], items[i].tok0, items[i].tok1, path, w);
  });
}

// The best path this build and machine have, at most g_cap.
// Without AVX512-BF16, an AVX2 build runs prompts faster on paged_attention's AVX2 loops (fp32 rows
// converted once per chunk) than on this file's portable ones (docs/performance.md, "AVX2 fallback
// loops"). The portable path stays for builds without AVX2
// (and for tests, capped to it).
Path best_path() {
  const Path cap = g_cap.load();
  if (cap == Path::kPaged) return Path::kPaged;
#if defined(PYENGINE_AMX)
  if (cap == Path::kAmx && amx_usable()) return Path::kAmx;
#endif
#if defined(__AVX512FP16__)
  if (cap == Path::kAmx || cap == Path::kAvx512Half) return Path::kAvx512Half;
#endif
#if defined(__AVX512BF16__)
  if (cap == Path::kAvx512Fp32) return Path::kAvx512Fp32;
  if (cap != Path::kPortable) return Path::kAvx512Bf16;
#elif defined(__AVX2__) && defined(__FMA__)
  if (cap != Path::kPortable) return Path::kPaged;
#endif
  return Path::kPortable;
}

}  // namespace

bool prefill_attention_supports(const AttentionStep& a) {
  if (a.qdt == DType::kFloat32) return prefill_fp32_supports(a) && g_cap.load() != Path::kPaged;
  const bool cache_ok = a.cdt == DType::kBFloat16 || a.cdt == DType::kFloat8E4M3 || a.cdt == DType::kInt8;
  return a.qdt == DType::kBFloat16 && cache_ok && a.D % 64 == 0 && a.D <= 256 && best_path() != Path::kPaged;
}

void prefill_attention_cpu(const AttentionStep& a, const int32_t* seqs, int64_t nseqs) {
  if (a.qdt == DType::kFloat32) return prefill_fp32_cpu(a, seqs, nseqs);
  const Path path = best_path();
  std::vector<Packed> pairs;
  for (int64_t i = 0; i < nseqs; ++i) {
    const int32_t s = seqs[i];
    const int64_t len = a.seq_lens[s], first = len - (a.qsl[s + 1] - a.qsl[s]);
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first + 1 - a.window) / kChunk * kChunk : 0;
    const int64_t n = (len - lo + kChunk - 1) / kChunk * kChunk;
    for (int32_t h = 0; h < a.KVH; ++h) pairs.push_back({s, h, lo, n, nullptr, nullptr, nullptr, nullptr});
  }
  // batches of pairs whose packed K/V fit the budget (at least one pair each; one batch when nothing is packed)
  const int64_t pair_bytes_per_token = reads_cache(a) ? 0 : a.D * 4 + 8;
  for (int64_t p0 = 0, p1; p0 < static_cast<int64_t>(pairs.size()); p0 = p1) {
    int64_t bytes = pairs[p0].n * pair_bytes_per_token;
    for (p1 = p0 + 1; p1 < static_cast<int64_t>(pairs.size()); ++p1) {
      bytes += pairs[p1].n * pair_bytes_per_token;
      if (bytes > kPackBudget) break;
    }
    run_batch(a, pairs, p0, p1, path);
  }
}

void set_prefill_attention_path(const std::string& name) {
  if (name == "amx") g_cap.store(Path::kAmx);
  else if (name == "avx512_fp16") g_cap.store(Path::kAvx512Half);
  else if (name == "avx512_fp32") g_cap.store(Path::kAvx512Fp32);
  else if (name == "avx512_bf16") g_cap.store(Path::kAvx512Bf16);
  else if (name == "portable") g_cap.store(Path::kPortable);
  else if (name == "paged") g_cap.store(Path::kPaged);
  else throw std::invalid_argument(
      "prefill attention path must be amx, avx512_fp16, avx512_fp32, avx512_bf16, portable or paged, got " + name);
}

std::string prefill_attention_path(const std::string& q_dtype) {
  if (q_dtype == "float32") {
#if defined(__AVX2__) && defined(__FMA__)
    if (g_cap.load() != Path::kPaged) return "avx2_fp32";  // attention/prefill_fp32.cpp
#endif
    return "paged";
  }
  if (q_dtype != "bfloat16") throw std::invalid_argument("q_dtype must be bfloat16 or float32, got " + q_dtype);
  switch (best_path()) {
    case Path::kAmx: return "amx";
    case Path::kAvx512Half: return "avx512_fp16";
    case Path::kAvx512Fp32: return "avx512_fp32";
    case Path::kAvx512Bf16: return "avx512_bf16";
    case Path::kPaged: return "paged";
    default: return "portable";
  }
}

}  // namespace pyengine
