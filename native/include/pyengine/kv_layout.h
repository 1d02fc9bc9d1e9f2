// The CPU KV cache layout: where value (token, dim) of a (block, kv head) tile lies. kv_cache.cpp writes
// it; attention/paged.cpp and attention/prefill.cpp read it.
//
// A tile packs L values into each 32-bit lane, L = 4 for one-byte caches (fp8, int8) and 2 otherwise:
//   K [D/L][BS][L]  dims group j (dims L j .. L j + L - 1) of consecutive tokens: one token per lane
//   V [BS/L][D][L]  token group p (tokens L p .. L p + L - 1) of consecutive dims: one dim per lane
// These are the operand layouts of the dot-product instructions the decode kernel runs: vdpbf16ps
// (bf16 pairs), vpdpbusd (int8 quads), and fp8 quads whose even and odd bytes each widen to a bf16
// pair with shifts alone, so QK (tokens in the lanes) and PV (dims in the lanes) read the tiles
// with no shuffles. Both tile shapes need BS and D to be multiples of L.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyengine {

constexpr int64_t kv_lane(size_t elem_size) { return elem_size == 1 ? 4 : 2; }

// Element offsets inside a tile (block size BS, head dim D, lane L).
constexpr int64_t kv_k_offset(int64_t tok, int64_t d, int64_t BS, int64_t L) {
  return ((d / L) * BS + tok) * L + d % L;
}
constexpr int64_t kv_v_offset(int64_t tok, int64_t d, int64_t D, int64_t L) {
  return ((tok / L) * D + d) * L + tok % L;
}

}  // namespace pyengine
