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
//     vectors, the same loops) under __AVX2__, otherwise portable loops in 16-lane strips. The AVX2
//     loops exist because the portable ones called libm's exp2f per score and left qk unvectorized
//     (docs/performance.md, "AVX2 fallback loops").
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
#include "decode_avx512.h"
#include "decode_tiles.h"
#include "fp32_chunks.h"
#include "prefill.h"
#include "pyengine/parallel.h"
#include "pyengine/simd.h"


namespace pyengine {
namespace {
#if defined(__AVX2__)
using namespace decode;
#endif
using fp32_chunks::qk;
using fp32_chunks::softmax_pv;

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
    // (the offset computed per element was most of a decode item's time)
    const char* src = static_cast<const char*>(tile) + kv_v_offset(off + t, 0, D, L) * elem_size(CD);
    for (int64_t i = 0; i < D; ++i) d[i] = cache_elem<CD>(src, i * L) * s;
    std::fill(d + D, d + Dp, 0.0f);
  }
}


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


#if defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------------------------------------
// The driver of the dot-product kernels (Isa: Avx512 above, or decode::Avx2): an item's chunks in
// order, each chunk's tiles prefetched one chunk ahead, its rows in groups that share every load.
// ---------------------------------------------------------------------------------------------
// Chunks between the one computed and the one prefetched: 1; 2 measured no faster for int8/fp8 and
// slower for bf16 (docs/performance.md, "decode prefetch distance").
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
