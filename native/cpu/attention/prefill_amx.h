// The AMX pipeline of the prefill kernel (attention/prefill.cpp's run_item pushes its row groups):
// QK and PV as bf16 tile products on 16 q rows at a time, the softmax (prefill_avx512.h's) between them.
//
// Reads: q rows [16][D] bf16 (a Q tile: 16 rows x 32 dims, rows 2 D bytes apart); the chunk's K groups
// as they lie (prefill_chunks.h: a K tile is 16 dims pairs x 16 tokens x 2, rows 2 kld bytes apart);
// V as two 32-token blocks [16 pairs][D][2] (v_blocks: in place where a block's groups are contiguous,
// else copied into Scratch::vblocks); scores S [16][kChunk] fp32 and probabilities P [16][kChunk] bf16,
// two of each in Scratch::s and Scratch::p. Writes S, P and the accumulators O [16][D] fp32.
// Builds for AMX-TILE, AMX-BF16 and AVX512-BF16 (pyengine/amx.h defines PYENGINE_AMX):
// #if defined(PYENGINE_AMX).
#pragma once
#include "pyengine/amx.h"
#if defined(PYENGINE_AMX)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "prefill_avx512.h"
#include "prefill_chunks.h"

namespace pyengine {
namespace {

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

}  // namespace
}  // namespace pyengine
#endif  // PYENGINE_AMX
