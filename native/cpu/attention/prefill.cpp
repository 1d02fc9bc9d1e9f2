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
//     on GPUs does); scores, sums and accumulators are fp32 (the avx512_fp16 path differs).
// Paths, best first (set_prefill_attention_path caps the choice, for tests):
//   amx          AMX tiles where the build (-march with AMX-TILE/BF16) and Linux (arch_prctl) allow:
//                the same chunk loop with groups of 16 rows, QK and PV as tile products overlapped
//                with the softmax on AVX-512 (AmxPipeline, prefill_amx.h); ~3x the vdpbf16ps path on
//                the same core.
//   avx512_fp16  the default without AMX on builds for AVX512-FP16 CPUs: QK and PV in fp16 FMAs (32 products each, at the fp32 FMA's issue rate) over
//                q staged once per item, K (less a mean key) and V once per item and chunk, as fp16
//                (HalfKernels, prefill_fp16.h), probabilities in fp16; QK stays on avx512_fp32's
//                kernel for quantized caches and soft-caps. Faster than avx512_fp32 at 512 to 8k tokens
//                (docs/performance.md, "prefill attention paths"); against the fp32 engine, the
//                default model's logprobs move about as far as avx512_fp32's (test_kv_accuracy).
//   avx512_fp32  the same chunk loop, each K/V line widened in registers to fp32 (its even and odd
//                halves) for two fp32 FMAs per row (Fp32Kernels, prefill_avx512.h): the bits of
//                avx512_bf16. On AVX512-FP16 CPUs vdpbf16ps issues at a quarter of the fp32 FMA rate,
//                so there this beats avx512_bf16 (docs/performance.md, "prefill attention paths").
//   avx512_bf16  the vdpbf16ps micro-kernels of step 2 (AvxKernels, prefill_avx512.h).
//   portable     plain loops over the same packed layout, same arithmetic in fp32 (every build).
// Files, one per ISA as the decode kernel's (paged.cpp, decode_*.h): this one holds the driver (packing,
// chunks, row groups, work items, path choice) and the portable kernels; prefill_chunks.h what the
// driver and every kernel share (ChunkKV, Scratch, RowSoftmax, softmax_rows); prefill_avx512.h the
// avx512_bf16 and avx512_fp32 kernels and their vectorized softmax; prefill_fp16.h the avx512_fp16
// kernels; prefill_amx.h the AMX pipeline. The headers are for this file alone: they define into its
// anonymous namespace.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "prefill.h"
#include "prefill_amx.h"
#include "prefill_avx512.h"
#include "prefill_chunks.h"
#include "prefill_fp16.h"
#include "pyengine/amx.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/kv_layout.h"
#include "pyengine/kv_quant.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"

#include "pyengine/simd.h"

namespace pyengine {
namespace {

constexpr int64_t kItemRows = 96;       // q rows (query tokens x G heads) per work item, at least
constexpr int64_t kAmxItemRows = 384;   // and at most, on the AMX path (item_tokens)
constexpr int64_t kItemsPerThread = 3;  // items a batch keeps per thread when it makes them larger
constexpr int64_t kPackTokens = 1024;   // positions per packing task
constexpr int64_t kPackBudget = 64 << 20;  // bytes of packed K/V per batch of pairs

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
// A pair's chunks (ChunkKV, prefill_chunks.h): from its packed run or the cache.
// ---------------------------------------------------------------------------------------------

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
// The portable micro-kernels, in every build (the layouts they read and write: prefill_chunks.h).
// The other paths' are in prefill_avx512.h (vdpbf16ps, fp32), prefill_fp16.h and prefill_amx.h.
// ---------------------------------------------------------------------------------------------

// A row's softmax (what it computes: RowSoftmax, prefill_chunks.h) in plain loops.
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
