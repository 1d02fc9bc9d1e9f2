// Quantized linear layers at many rows on AMX-INT8 tiles: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the
// tiled GGUF weights of linear/quant.cpp (ggml_blocks.h), with int8 arithmetic throughout: the weight is
// never widened to bf16 (linear/quant_strips.cpp does that), and each activation is one int8 code, not the
// int8 kernels' value and residual pair, so a row costs one tile product per group instead of two.
//
// Layouts:
//   x        [M, K] bf16 or fp32, row-major.
//   xq       [Mp / 16][KB][16][32] int8, Mp = M rounded up to 16 (zero rows pad it): per 32-value block b
//            of row m, q = nearbyint(v / dx) with dx = amax(|v|) / 127 (round to nearest even; an all-zero
//            block has dx = 0 and q = 0). One block of 16 rows is one A tile, 512 contiguous bytes.
//   dx, sx   [KB][Mp] fp32, block-major so one group's 16 row scales are one line: dx, and dx * sum(q) of
//            the block; sh [2 KB][Mp]: dx * sum(q) of each 16-value half (the offset terms of Q2_K).
//   W        the tiled records of ggml_blocks.h; per tile (16 output columns) its groups are unpacked once
//            per call into B rows (512 bytes a group: B row q = values 4q .. 4q + 3 of the 16 columns,
//            the tile layout tdpbssd / tdpbsud read), shared by all the row blocks of the call.
//   A tile   16 rows of xq x k bytes (rows 32 bytes apart) (k = 32, or 16 for the types with 16-value halves: Q6_K, Q2_K, Q3_K).
//   B tile   k / 4 rows x 64 bytes of the unpacked group.
//   C tile   16 x 16 int32: one group's dot products, stored and scaled by the vector units into fp32
//            accumulators, a zmm per row of x:  acc[m] += d[n] dx[m] C[m][n]  (+ c[n] s[m] for the types
//            with a minimum: Q4_1, Q5_1, Q4_K, Q5_K, Q2_K, whose values stay unsigned, tdpbsud).
//            The other types' values are made signed at unpacking (u minus its zero point: Q8_0's q,
//            Q4_0's q - 8, the IQ4 types' levels, ...), so their offset term vanishes (tdpbssd).
// Two tile sets alternate between groups: the next group's product is issued before this one is scaled.
// Threads split the output tiles into contiguous ranges; rows go in panels of kPanelRows so a panel's
// int8 activations stay in L2 while a tile's unpacked groups are reused across its row blocks.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "pyengine/bf16_widen.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/parallel.h"
#include "pyengine/prefetch.h"
#include "quant_tiles.h"

namespace pyengine::cpu {
namespace {

using ggml::kBlock;
using ggml::kTileRows;

constexpr int64_t kRows = 16;          // rows of x per A tile
constexpr int64_t kPanelRows = 256;    // rows of x per panel: 256 x K int8 stays in L2 for K up to ~8K
constexpr int64_t kGroupBytes = 512;   // one unpacked group: 8 B rows of 64 bytes

// Off unless set (qlinear_gemm_rows): one int8 code per activation agrees less often with the fp32
// reference than the bf16 strips or the int8 kernels' value-and-residual pair do, and where the strips
// run (AMX hosts) this GEMM is faster only at the fewest rows.
std::atomic<int64_t> g_gemm_rows{0};

#if defined(PYENGINE_QLINEAR_AMX)

// The zero point subtracted from a type's stored unsigned value to make it signed (0: the type keeps
// unsigned values and an offset term).
template <int T>
constexpr int zero_point() {
  if constexpr (!fixed_offset<T>()) return 0;
  else return static_cast<int>(-offset_ratio<T, false>());
}

// Activation buffers of one call, in the calling thread's storage.
struct Activations {
  const int8_t* xq;
  const float *dx, *sx, *sh;
  int64_t Mp, KB;
};

// Rows [r0, r1) of x -> xq, dx, sx, sh (the layouts at the top).
void quantize_rows(const void* x, bool f32, int64_t r0, int64_t r1, int8_t* xq, float* dx, float* sx, float* sh,
                   int64_t Mp, int64_t K) {
  const int64_t KB = K / kBlock;
  const __m512i qmax = _mm512_set1_epi32(127), qmin = _mm512_set1_epi32(-127);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < KB; ++b) {
      __m512 v[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t at = r * K + b * kBlock + 16 * h;
        v[h] = f32 ? _mm512_loadu_ps(static_cast<const float*>(x) + at)
                   : load_bf16x16(static_cast<const uint16_t*>(x) + at);
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i q =
            _mm512_max_epi32(qmin, _mm512_min_epi32(qmax, _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + ((r / kRows * KB + b) * kRows + r % kRows) * kBlock + 16 * h),
                         _mm512_cvtepi32_epi8(q));
        sum[h] = _mm512_reduce_add_epi32(q);
      }
      dx[b * Mp + r] = d;
      sx[b * Mp + r] = d * static_cast<float>(sum[0] + sum[1]);
      sh[2 * b * Mp + r] = d * static_cast<float>(sum[0]);
      sh[(2 * b + 1) * Mp + r] = d * static_cast<float>(sum[1]);
    }
  }
}

// C = A . B on tile set S (the tile numbers must be literals), left in the tile: its store (tile_store)
// comes after other work, as a store right after its product waits for it and holds up what follows.
template <int T, int S>
inline void tile_dot(const int8_t* a, const uint8_t* b) {
  constexpr bool Signed = zero_point<T>() != 0;
  if constexpr (S == 0) {
    _tile_loadd(0, a, kBlock);
    _tile_loadd(1, b, 64);
    _tile_zero(2);
    if constexpr (Signed) _tile_dpbssd(2, 0, 1);
    else _tile_dpbsud(2, 0, 1);
  } else {
    _tile_loadd(3, a, kBlock);
    _tile_loadd(4, b, 64);
    _tile_zero(5);
    if constexpr (Signed) _tile_dpbssd(5, 3, 4);
    else _tile_dpbsud(5, 3, 4);
  }
}

// C of tile set S -> c (16 x 16 int32).
template <int S>
inline void tile_store(int32_t* c) {
  if constexpr (S == 0) _tile_stored(2, c, 64);
  else _tile_stored(5, c, 64);
}

// The KB groups of one tile (its records at w) -> B rows at u (kGroupBytes a group), signed where the type
// has a zero point.
template <int T>
void unpack_tile(const uint8_t* w, int64_t KB, uint8_t* u) {
  constexpr Layout L = layout(T);
  const __m512i zero = _mm512_set1_epi8(static_cast<char>(zero_point<T>()));
  for (int64_t b = 0; b < KB; ++b, u += kGroupBytes) {
    const uint8_t* grp = w + b / L.groups() * L.record_bytes() + b % L.groups() * L.group_bytes();
    static_for<0, L.lines>([&](auto ic) {
      constexpr int i = decltype(ic)::value;
      __m512i lo, hi;
      vnni_line<T, i>(grp, lo, hi);
      if constexpr (L.lines == 8) {  // Q8_0: line i is B row i
        _mm512_store_si512(u + 64 * i, _mm512_sub_epi8(lo, zero));
      } else {  // line i's low values are B row 2i, its high values B row 2i + 1
        _mm512_store_si512(u + 128 * i, _mm512_sub_epi8(lo, zero));
        _mm512_store_si512(u + 128 * i + 64, _mm512_sub_epi8(hi, zero));
      }
    });
  }
}

// Rows [r0, r0 + 16) of the panel x one tile (n0: its first column; rec: its records; u: its unpacked
// groups) -> out (rows ldo apart), rows from M and columns from N left out (padding). `next`, `next_bytes`:
// the following tile's records, prefetched into L2 across the steps.
template <int T>
void row_block(const Activations& x, int64_t r0, int64_t n0, const uint8_t* rec, const uint8_t* u,
               const float* bias, void* out, int64_t M, int64_t N, int64_t ldo, bool out_f32, const uint8_t* next,
               int64_t next_bytes) {
  constexpr Layout L = layout(T);
  constexpr int k = kBlock / L.halves;
  constexpr bool offset = zero_point<T>() == 0;
  __m512 acc[kRows];
  static_for<0, kRows>([&](auto mc) { acc[decltype(mc)::value] = _mm512_setzero_ps(); });
  alignas(64) int32_t c[2][kRows * kTileRows];
  const int64_t steps = x.KB * L.halves;
  const int64_t lines_per_step = next ? (next_bytes / 64 + steps - 1) / steps : 0;
  // step j = (group b, half h): its product on tile set j % 2, issued a step ahead, its C stored once the
  // step before it has been scaled
  auto issue = [&](int64_t j) {
    const int64_t b = j / L.halves, h = j % L.halves;
    const int8_t* a = x.xq + (r0 / kRows * x.KB + b) * kRows * kBlock + h * k;
    const uint8_t* bw = u + b * kGroupBytes + h * (kGroupBytes / L.halves);
    if (j % 2 == 0) tile_dot<T, 0>(a, bw);
    else tile_dot<T, 1>(a, bw);
  };
  issue(0);
  for (int64_t j = 0; j < steps; ++j) {
    if (j % 2 == 0) tile_store<0>(c[0]);
    else tile_store<1>(c[1]);
    if (j + 1 < steps) issue(j + 1);
    for (int64_t l = j * lines_per_step; l < (j + 1) * lines_per_step && 64 * l < next_bytes; ++l)
      prefetch<_MM_HINT_T1>(next + 64 * l);
    const int64_t b = j / L.halves;
    const int h = static_cast<int>(j % L.halves);
    __m512 d, off;
    vec_scales<T, Zmm, false>(rec + b / L.groups() * L.record_bytes(), b % L.groups(), h, 0, d, off);
    const float* dx = x.dx + b * x.Mp + r0;
    const float* s = (L.halves == 1 ? x.sx + b * x.Mp : x.sh + (2 * b + h) * x.Mp) + r0;
    const int32_t* cj = c[j % 2];
    static_for<0, kRows>([&](auto mc) {
      constexpr int m = decltype(mc)::value;
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(cj + 16 * m));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[m])), acc[m]);
      if constexpr (offset) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(s[m]), acc[m]);
    });
  }
  const int64_t valid = std::min(kTileRows, N - n0);
  const __mmask16 cols = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(cols, bias + n0) : _mm512_setzero_ps();
  // constant indices into acc throughout (static_for), so it stays in registers: the tile intrinsics are
  // asm with a memory clobber, and an array indexed at run time would be reloaded and stored every step
  static_for<0, kRows>([&](auto mc) {
    constexpr int m = decltype(mc)::value;
    if (r0 + m >= M) return;
    const __m512 v = _mm512_add_ps(acc[m], bv);
    if (out_f32) {
      _mm512_mask_storeu_ps(static_cast<float*>(out) + (r0 + m) * ldo + n0, cols, v);
    } else {
      alignas(64) float f[kTileRows];
      _mm512_store_ps(f, v);
      uint16_t* o = static_cast<uint16_t*>(out) + (r0 + m) * ldo + n0;
      for (int64_t n = 0; n < valid; ++n) o[n] = float_to_bf16(f[n]);
    }
  });
}

// Tiles [begin, end) of one segment (type T, records at w, its columns from col), rows [p0, p1) of x.
template <int T>
void tile_range(const Activations& x, const uint8_t* w, int64_t begin, int64_t end, int64_t p0, int64_t p1,
                const float* bias, void* out, int64_t rows, int64_t col, int64_t N, bool out_f32) {
  constexpr Layout L = layout(T);
  const int64_t stride = tile_stride(L, x.KB);
  struct alignas(64) Group {
    uint8_t bytes[kGroupBytes];
  };
  static thread_local std::vector<Group> unpacked;
  unpacked.resize(static_cast<size_t>(x.KB));
  uint8_t* u = unpacked.front().bytes;
  configure_int8_tile_sets<T>();
  for (int64_t tile = begin; tile < end; ++tile) {
    const uint8_t* rec = w + tile * stride;
    unpack_tile<T>(rec, x.KB, u);
    const uint8_t* next = tile + 1 < end ? rec + stride : nullptr;
    for (int64_t r0 = p0; r0 < p1; r0 += kRows)
      row_block<T>(x, r0, col + tile * kTileRows, rec, u, bias, out, p1, col + rows, N, out_f32,
                   r0 == p0 ? next : nullptr, stride);
  }
  _tile_release();
}

#endif

}  // namespace

void set_qlinear_gemm_rows(int64_t rows) { g_gemm_rows.store(std::max<int64_t>(rows, 0)); }

int64_t qlinear_gemm_rows() { return g_gemm_rows.load(); }

bool qlinear_amx_gemm(const void* x, bool x_f32, const int64_t* seg, const float* bias, void* out, int64_t M,
                      int64_t N, int64_t K, bool out_f32) {
#if defined(PYENGINE_QLINEAR_AMX)
  const int64_t min_rows = g_gemm_rows.load();
  if (min_rows == 0 || M < min_rows || !amx_usable()) return false;
  const int64_t KB = K / kBlock, Mp = (M + kRows - 1) / kRows * kRows;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> scales;
  xq.resize(static_cast<size_t>(Mp * K));
  scales.resize(static_cast<size_t>(4 * Mp * KB));
  int8_t* const xqb = xq.data();  // the calling thread's buffers: pointers, for the helper threads
  float* const dx = scales.data();
  float* const sx = dx + Mp * KB;
  float* const sh = sx + Mp * KB;
  if (Mp > M) {  // zero padding rows: their products are computed and dropped
    std::memset(xqb + M * K, 0, static_cast<size_t>((Mp - M) * K));
    for (int64_t b = 0; b < KB; ++b)
      for (int64_t r = M; r < Mp; ++r) dx[b * Mp + r] = sx[b * Mp + r] = sh[2 * b * Mp + r] = sh[(2 * b + 1) * Mp + r] = 0.0f;
  }
  auto& pool = ThreadPool::instance();
  const int64_t threads = pool.num_threads(), parts = std::min<int64_t>(M, threads);
  pool.parallel_for(parts, [&](int64_t p) {
    quantize_rows(x, x_f32, M * p / parts, M * (p + 1) / parts, xqb, dx, sx, sh, Mp, K);
  });
  const Activations a{xqb, dx, sx, sh, Mp, KB};
  for (int64_t p0 = 0; p0 < Mp; p0 += kPanelRows) {
    const int64_t p1 = std::min(Mp, p0 + kPanelRows);
    for (int64_t s = 0, col = 0; s < seg[0]; col += seg[2 + 3 * s], ++s) {
      const int64_t rows = seg[2 + 3 * s], tiles = (rows + kTileRows - 1) / kTileRows;
      const uint8_t* w = reinterpret_cast<const uint8_t*>(seg[3 + 3 * s]);
      const int64_t chunks = std::min(tiles, threads);
      dispatch(static_cast<int>(seg[1 + 3 * s]), [&](auto t) {
        pool.parallel_for(chunks, [&](int64_t c) {
          tile_range<decltype(t)::value>(a, w, tiles * c / chunks, tiles * (c + 1) / chunks, p0, std::min(p1, M),
                                         bias, out, rows, col, N, out_f32);
        });
      });
    }
  }
  return true;
#else
  (void)x, (void)x_f32, (void)seg, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)out_f32;
  return false;
#endif
}

}  // namespace pyengine::cpu
