// Quantized linear layers at many rows (M >= strip rows, bf16 activations): the weight is dequantized a
// strip at a time into bf16, in exactly the packed layout linear/bf16.cpp's kernel reads (16-output tiles of
// k pairs: quant_lines.h), and that kernel (AMX tiles, else AVX-512) runs its tile loop over all M rows of
// the strip.
//
// Why: the int8 kernels (linear/quant.cpp) scale every 32-value group's int32 sums through the vector units,
// which bounds them at many rows (about half the bf16 AMX GEMM's rate on the same shapes). Here the
// dequantization is paid once per strip per call, shared by all M rows, and the weight is still read at
// its quantized size. A strip is a few tiles x all of K, about kStripBytes of bf16: it stays in L2
// while the rows stream past. Up to kFusedRows rows on AMX (a decode step of a few streams), each group
// goes through L1 instead: dequantized and multiplied at once (quant_fused_amx.h), with the same bits,
// the bits `--weights dequantize` gives (quant_lines.h says why).
#include <algorithm>
#include <atomic>
#include <vector>

#include "linear.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/parallel.h"
#include "quant_fused_amx.h"
#include "quant_lines.h"
#include "quant_rows.h"
#include "quant_tiles.h"

namespace pyengine::cpu {
namespace {

using ggml::kBlock;
using ggml::kTileRows;

// From this many rows, where linear_bf16 runs on AMX tiles: from 7-8 rows the fused path (quant_fused_amx.h) beat the
// int8 kernels (their AMX path from 8 rows included) on a 2-core AMX host, 4-, 5-, 6- and 8-bit types alike
// (docs/performance.md, "quantized weights by strips"). Without AMX the default is 0 (never): linear_bf16's
// vdpbf16ps kernel does half the products per instruction of the int8 kernels' vpdpbusd, and there the
// strips lose at every M; on AVX512-FP16 builds its kernel is avx512_fp32 (bf16 widened to fp32 FMAs), and
// they still lose (bench/engine/bench_quant_steps.py).
constexpr int64_t kAmxStripRows = 8;
constexpr int64_t kStripBytes = 256 * 1024;  // bf16 per strip: a share of L2 beside x's rows and the output

std::atomic<int64_t> g_strip_rows{linear_path(kBlock) == "amx" ? kAmxStripRows : 0};

#if defined(PYENGINE_QLINEAR_STRIPS)
// Tiles [begin, end) of a type-T weight (KB groups a row) -> bf16 lines at `out` ([tile, K / 2, 16, 2]).
template <int T>
void dequantize_strip(const uint8_t* w, int64_t KB, int64_t begin, int64_t end, uint16_t* out) {
  const int64_t stride = tile_stride(layout(T), KB);
  for (int64_t tile = begin; tile < end; ++tile)
    for (int64_t b = 0; b < KB; ++b, out += kBlock / 2 * 32) dequantize_group<T>(w + tile * stride, b, out);
}

// One strip: tiles [begin, end) of the segment whose first output column is col.
struct Strip {
  int type;
  const uint8_t* w;
  int64_t begin, end, col, rows;  // rows: the segment's
};

#endif

}  // namespace

void set_qlinear_strip_rows(int64_t rows) { g_strip_rows.store(std::max<int64_t>(rows, 0)); }

int64_t qlinear_strip_rows() { return g_strip_rows.load(); }

bool qlinear_strips(const uint16_t* x, const int64_t* seg, const float* bias, void* out, int64_t M, int64_t N,
                    int64_t K, bool out_f32) {
#if defined(PYENGINE_QLINEAR_STRIPS)
  const int64_t min_rows = g_strip_rows.load();
  if (min_rows == 0 || M < min_rows || !linear_bf16_simd(K)) return false;
  const int64_t KB = K / kBlock, tile_bytes = K * kTileRows * 2;
  auto& pool = ThreadPool::instance();
  // Strips of at most about kStripBytes, a multiple of the thread count where the segment has the tiles
  // for it: equal shares (at 3 strips for 2 threads, one thread idled a third of the time). A strip is
  // whole tile pairs, the AMX kernel's blocks, so its output rows leave as full 64-byte lines.
  std::vector<Strip> strips;
  const int64_t threads = pool.num_threads();
  for (int64_t s = 0, col = 0; s < seg[0]; col += seg[2 + 3 * s], ++s) {
    const int64_t rows = seg[2 + 3 * s], tiles = (rows + kTileRows - 1) / kTileRows;
    const int64_t rounds = (tiles * tile_bytes + kStripBytes * threads - 1) / (kStripBytes * threads);
    const int64_t n = std::min((tiles + 1) / 2, rounds * threads);
    for (int64_t i = 0; i < n; ++i) {
      const TileRange r = tile_pair_range(tiles, i, n);
      strips.push_back({static_cast<int>(seg[1 + 3 * s]), reinterpret_cast<const uint8_t*>(seg[3 + 3 * s]), r.begin,
                        r.end, col, rows});
    }
  }
#if defined(PYENGINE_QLINEAR_FUSED)
  if (M <= kFusedRows && linear_path(K) == "amx") {  // linear_bf16 would run on AMX tiles here
#if defined(PYENGINE_QLINEAR_ROW_TABLES)
    static thread_local std::vector<uint32_t> packed;  // x as the row-table kernels' B tiles
    bool tables = false;
    for (int64_t s = 0; s < seg[0]; ++s)
      dispatch(static_cast<int>(seg[1 + 3 * s]), [&](auto t) { tables |= row_tables<decltype(t)::value>(); });
    if (tables) {
      packed.resize(static_cast<size_t>((M + 15) / 16 * 16 * K / 2));
      pack_x_pairs(x, M, K, packed.data());
    }
    const uint32_t* xp = packed.data();
#endif
    pool.parallel_for(static_cast<int64_t>(strips.size()), [&](int64_t i) {
      const Strip& s = strips[i];
      dispatch(s.type, [&](auto t) {
        constexpr int T = decltype(t)::value;
#if defined(PYENGINE_QLINEAR_ROW_TABLES)
        if constexpr (row_tables<T>()) {
          fused_rows_range<T>(xp, M, K, s.w, s.begin, s.end, s.col, s.rows, bias, out, N, out_f32);
          return;
        }
#endif
        fused_range<T>(x, M, K, s.w, s.begin, s.end, s.col, s.rows, bias, out, N, out_f32);
      });
    });
    return true;
  }
#endif
  const Bf16Rows xr(x, M, K);
  pool.parallel_for(static_cast<int64_t>(strips.size()), [&](int64_t i) {
    const Strip& s = strips[i];
    struct alignas(64) Line {
      uint16_t v[32];
    };
    static thread_local std::vector<Line> buffer;
    buffer.resize(static_cast<size_t>((s.end - s.begin) * K / 2));
    uint16_t* const w = buffer.front().v;
    dispatch(s.type, [&](auto t) { dequantize_strip<decltype(t)::value>(s.w, KB, s.begin, s.end, w); });
    const int64_t n0 = s.col + s.begin * kTileRows;
    xr.run(w, bias ? bias + n0 : nullptr, static_cast<char*>(out) + n0 * (out_f32 ? 4 : 2),
           std::min(s.rows, s.end * kTileRows) - s.begin * kTileRows, N, out_f32);
  });
  return true;
#else
  (void)x, (void)seg, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)out_f32;
  return false;
#endif
}

}  // namespace pyengine::cpu
