// linear/bf16.cpp's bf16 kernel for callers that write its packed weight tiles themselves: linear/quant_strips.cpp
// dequantizes a quantized weight into them a strip of tiles at a time, and runs the kernel on each strip.
#pragma once

#include <cstdint>

namespace pyengine::cpu {

// Whether linear_bf16 runs a SIMD kernel (AMX or AVX512-BF16) for a weight of K columns.
bool linear_bf16_simd(int64_t K);

// Part i of n of `tiles` output tiles, cut at tile pairs (the AMX kernel's blocks, whose rows leave as
// whole 64-byte lines): tiles [begin, end), n <= (tiles + 1) / 2.
struct TileRange {
  int64_t begin, end;
};
inline TileRange tile_pair_range(int64_t tiles, int64_t i, int64_t n) {
  const int64_t pairs = (tiles + 1) / 2, end = 2 * (pairs * (i + 1) / n);
  return {2 * (pairs * i / n), end < tiles ? end : tiles};
}

// x [M, K] bf16 made ready once for the kernel linear_bf16 runs at this K (AMX: the last partial 16 rows
// copied zero-padded; AVX-512: packed in k pairs, linear/bf16.cpp's header), in buffers of the constructing
// thread; then run() computes any block of output columns, from any thread. One at a time per
// constructing thread: the next one reuses the buffers.
class Bf16Rows {
 public:
  Bf16Rows(const uint16_t* x, int64_t M, int64_t K);

  // out[M, N] (rows ldo elements apart; fp32 or bf16) = x @ W^T (+ bias [N] fp32, or null), on the
  // calling thread, for W's packed tiles `w` (linear/bf16.cpp's layout, 64-byte aligned).
  void run(const uint16_t* w, const float* bias, void* out, int64_t N, int64_t ldo, bool out_f32) const;

 private:
  const uint16_t* x_;
  const uint16_t* tail_ = nullptr;  // AMX: rows [M / 16 * 16, M) zero-padded to 16, where M % 16 != 0
  const uint32_t* xp_ = nullptr;    // AVX-512 and portable paths: x packed in k pairs
  int64_t M_, K_;
  bool amx_ = false;
  bool wide_ = false;  // the avx512_fp32 kernel (x packed as fp32)
};

}  // namespace pyengine::cpu
