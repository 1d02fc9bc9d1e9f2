// The prefill kernel's chunks: what its micro-kernels (portable ones in attention/prefill.cpp,
// vdpbf16ps and fp32-widening in prefill_avx512.h, fp16 in prefill_fp16.h, AMX tiles in prefill_amx.h)
// and the driver that runs them (attention/prefill.cpp, run_item) share.
//
// Layouts (uint16_t elements: bf16, or fp16 where the avx512_fp16 path staged them):
//   chunk K  4 groups of 16 tokens, group g [D/2][16][2]: dims pair j of token u at
//            k[g][j * kld[g] + 2 u] (kld 32 in a packed run, 2 BS read in place from a bf16 cache)
//   chunk V  4 groups of 8 token pairs, group g [8][D][2]: token pair i, dim d at v[g][2 D i + 2 d]
//   q        a row group's rows [nr][D] bf16          s  scores [nr][kChunk] fp32
//   p        probabilities [nr][kChunk] bf16 (fp16)  o  accumulators [nr][D] fp32
// No ISA guard: every build. Like the kernels' headers, for prefill.cpp alone (its anonymous namespace).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pyengine {
namespace {

constexpr int kChunk = 64;              // kv tokens per online-softmax step: 4 groups of 16
constexpr int kRows = 6;                // q rows per micro-kernel pass (6 x 4 accumulators)
constexpr int kAmxRows = 16;            // q rows per AMX pass (a tile's rows)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

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

}  // namespace
}  // namespace pyengine
