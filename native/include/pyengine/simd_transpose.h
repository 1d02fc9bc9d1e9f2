// Register transposes of 16 x 16 32-bit words (AVX-512F), for kernels that turn rows of k pairs or of
// tokens into the column-major runs their dot products read: linear/bf16.cpp packs x so, and kv_cache.cpp writes
// a block's 16 tokens into a K tile's dims-pair lines.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pyengine {

// In place: r[i] (16 32-bit words) becomes (r[0][i], ..., r[15][i]).
inline void transpose16x16_epi32(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i+1 interleaved, words 0-1 and 2-3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], lane l: word 4l + e of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // word 4l + e of all rows: lane l of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xee);
    t[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    t[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

}  // namespace pyengine

#endif
