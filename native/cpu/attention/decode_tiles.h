// The decode kernel's chunks of cache tiles: what its dot-product kernels (AVX-512 in attention/paged.cpp,
// AVX2 in attention/decode_avx2.h) and the driver that runs them (attention/paged.cpp, run_item_dot) share.
//
// A chunk is up to kChunk = 64 cache positions of one kv head: 4 tiles of 16 tokens, each one run of
// slots of one block, or with block size 8 ("SPLIT") two whole blocks. Per chunk the driver runs, for
// each group of up to kGroup rows (query tokens x the q heads of one kv head), QK into a row of
// scores, an online-softmax step that turns the scores into PV's weights, and PV. The kernels read
// the tiles in the CPU cache layout (kv_layout.h), L values per 32-bit lane.
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

#include "pyengine/prefetch.h"

namespace pyengine::decode {

// The operands of the dot products, by cache dtype (each kernel's header comment says how it computes them):
// bf16 codes as bf16; fp8 codes widened through bf16's bit layout, fp16's (AVX512-FP16) or, in the
// AVX2 kernels, placed straight into fp32's; int8 codes as integers; fp32 as they are (AVX2 only).
enum class Operands { kBf16, kFp8Bf16, kFp8Half, kFp8Fp32, kInt8, kFp32 };
constexpr bool is_fp8(Operands O) {
  return O == Operands::kFp8Bf16 || O == Operands::kFp8Half || O == Operands::kFp8Fp32;
}
// Quantized caches: an fp32 scale per (token, kv head) beside the codes.
constexpr bool has_scales(Operands O) { return O == Operands::kInt8 || is_fp8(O); }
// Values per lane of a tile (kv_lane), bytes per value, and bytes per lane: 4, but fp32's pairs take 8.
constexpr int lane_of(Operands O) { return O == Operands::kFp32 || O == Operands::kBf16 ? 2 : 4; }
constexpr int64_t elem_bytes(Operands O) { return O == Operands::kFp32 ? 4 : O == Operands::kBf16 ? 2 : 1; }
constexpr int64_t lane_bytes(Operands O) { return lane_of(O) * elem_bytes(O); }

// 64-token chunks: 128 is faster with the cache in L3 but slower from DRAM (the prefetch of the next
// chunk starts later and arrives in a longer burst); docs/performance.md, "decode chunk size".
constexpr int kChunk = 64, kTiles = kChunk / 16, kGroup = 4;

// The cache level the chunks' prefetches fill: L2 (T1), where L1's few fill buffers would cap the misses in
// flight, except on Zen 5 (told at compile time by AVX512-VP2INTERSECT in the -march without AMX or
// AVX512-FP16: Zen 4 and Intel's server cores lack it, Zen 5 has it), where T0 measured faster for all
// three caches. Every other host measured T1 faster. Figures per host: docs/performance.md, "decode
// prefetch level".
#if defined(__AVX512VP2INTERSECT__) && !defined(__AMX_TILE__) && !defined(__AVX512FP16__)
constexpr _mm_hint kPrefetchLevel = _MM_HINT_T0;
#else
constexpr _mm_hint kPrefetchLevel = _MM_HINT_T1;
#endif

// Where one chunk's data lives, per tile of 16 tokens: the K address of its first token in dims
// group 0, the V address of its first token group and its scales (quantized caches), each for the
// tile's first half and, with SPLIT (block size 8: a tile spans two blocks), its second half in *1;
// without SPLIT the 16 tokens are consecutive slots of one block and *1 is unused.
struct ChunkPtrs {
  const char *k0[kTiles], *k1[kTiles], *v0[kTiles], *v1[kTiles];
  const float *ks0[kTiles], *ks1[kTiles], *vs0[kTiles], *vs1[kTiles];
  int n;  // tokens in the chunk
};

// The V line address of the chunk's token group p (tokens L p .. L p + L - 1) at dim 0.
template <Operands O, bool SPLIT>
inline const char* v_group(const ChunkPtrs& c, int p, int64_t group_bytes) {
  constexpr int per_tile = 16 / lane_of(O), per_half = per_tile / 2;
  const int tile = p / per_tile, q = p % per_tile;
  if constexpr (SPLIT) return (q < per_half ? c.v0[tile] : c.v1[tile]) + (q % per_half) * group_bytes;
  else return c.v0[tile] + q * group_bytes;
}

// Bits [0, n) of a chunk's token mask, n in [0, 64]. A tile's mask is then a shift of its chunk's:
// tail_mask's branches per tile, in QK's epilogue, made GCC copy every QK accumulator to another
// register and back around each dot product.
inline uint64_t low_bits(int n) { return n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1; }

// The scale lines of a chunk (one line of 16 fp32 scales per tile for K and for V; with SPLIT, one
// per half): scattered like the tiles, so no hardware prefetcher fetches them, and without this QK's
// epilogue and the softmax wait on them from DRAM.
template <bool SPLIT>
inline void prefetch_scales(const ChunkPtrs& c) {
  for (int i = 0; i < kTiles; ++i) {
    prefetch<kPrefetchLevel>(c.ks0[i]);
    prefetch<kPrefetchLevel>(c.vs0[i]);
    if constexpr (SPLIT) prefetch<kPrefetchLevel>(c.ks1[i]), prefetch<kPrefetchLevel>(c.vs1[i]);
  }
}

}  // namespace pyengine::decode
#endif
