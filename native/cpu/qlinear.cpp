// Linear layers on GGUF-quantized weights (Q8_0, Q4_0, Q4_1): out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// The weight stays quantized, repacked once at load into 16-row tiles (ggml_blocks.h), so decode
// streams 4.5-8.5 bits per weight instead of bf16's 16. Activations are quantized per 32-value
// block to int8 in two rows, the value and its residual (quantize_row), each with an fp32 scale
// dx = amax / 127 (round to nearest even) and its block sum s for the zero-point term. Per (row,
// tile, block): 8 int8 dot products of 64 bytes (Q8_0: 8 lines; 4-bit: 4 lines x low/high nibbles),
// accumulated in fp32 across blocks:
//   acc[m][j] += dx[m, b] * (d[j, b] * dot[m][j] + c[j, b] * s[m, b])
// and the two rows' results are summed (+ bias) into the output.
// SIMD: AVX512-VNNI vpdpbusd (16 rows of a tile in the lanes of one zmm, 4 activation bytes
// broadcast); a portable loop over the same layout otherwise (and when tests ask for it).
// Parallel shape as linear.cpp: tiles split into one contiguous range per thread; within a range,
// groups of NT tiles x chunks of MR rows (MR * NT <= 8 pairs of accumulators); big M in row panels
// so the quantized activations stay in L2 while the weights stream.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/dtype.h"
#include "pyengine/ggml_blocks.h"
#include "pyengine/parallel.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PYENGINE_QLINEAR_VNNI 1
// GCC 12 warns inside its own _mm512_cvtph_ps (an undefined pass-through operand): a false positive
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pyengine::cpu {
namespace {

using ggml::kBlock;
using ggml::kTileRows;

constexpr int64_t kMaxRows = 8;                   // rows of x per pass over a tile group
constexpr int64_t kMinParallelBytes = 32 * 1024;  // below this weight size the caller runs alone
constexpr int64_t kPanelMinRows = 64;
constexpr int64_t kPanelBytes = 256 * 1024;       // quantized x per panel

std::atomic<bool> g_portable{false};

struct QArgs {
  const int8_t* xq;    // [M, K]
  const float* dx;     // [M, KB]
  const float* sx;     // [M, KB]: dx * sum(xq)
  const uint8_t* w;    // tiles
  float* out;          // [M, N]
  int64_t M, N, K, KB;
};

// Unsigned stored value of row j, k-in-block kk, and the record's c term, for the portable paths.
template <int T>
inline int record_value(const uint8_t* rec, int64_t j, int64_t kk) {
  if constexpr (T == ggml::kQ8_0) {
    return rec[64 * (kk / 4) + 4 * j + kk % 4];
  } else {
    const int64_t line = kk / 8, r = kk % 8;
    const uint8_t byte = rec[64 * line + 4 * j + r % 4];
    return r < 4 ? byte & 0x0F : byte >> 4;
  }
}

template <int T>
inline float record_c(const uint8_t* rec, int64_t j) {
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec + ggml::record_quant_bytes(T));
  if constexpr (T == ggml::kQ4_1) return fp16_to_float(scales[kTileRows + j]);
  return (T == ggml::kQ8_0 ? -128.0f : -8.0f) * fp16_to_float(scales[j]);
}

template <int T>
void tile_group_portable(const QArgs& a, int64_t t0, int nt) {
  constexpr int64_t rb = ggml::record_bytes(T), qb = ggml::record_quant_bytes(T);
  for (int64_t tile = t0; tile < t0 + nt; ++tile) {
    const uint8_t* w = a.w + tile * a.KB * rb;
    const int64_t n0 = tile * kTileRows, valid = std::min(kTileRows, a.N - n0);
    for (int64_t m = 0; m < a.M; ++m) {
      for (int64_t j = 0; j < valid; ++j) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.KB; ++b) {
          const uint8_t* rec = w + b * rb;
          const int8_t* xq = a.xq + m * a.K + b * kBlock;
          int32_t dot = 0;
          for (int64_t kk = 0; kk < kBlock; ++kk) dot += record_value<T>(rec, j, kk) * xq[kk];
          const float d = fp16_to_float(reinterpret_cast<const uint16_t*>(rec + qb)[j]);
          acc += a.dx[m * a.KB + b] * (d * static_cast<float>(dot)) + record_c<T>(rec, j) * a.sx[m * a.KB + b];
        }
        a.out[m * a.N + n0 + j] = acc;
      }
    }
  }
}

#if defined(PYENGINE_QLINEAR_VNNI)

// Rows [r0, r0 + MR) x tiles [t0, t0 + NT).
template <int T, int MR, int NT>
void tile_block(const QArgs& a, int64_t r0, int64_t t0) {
  constexpr int64_t rb = ggml::record_bytes(T), qb = ggml::record_quant_bytes(T);
  constexpr int lines = T == ggml::kQ8_0 ? 8 : 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const int64_t tile_stride = a.KB * rb;
  const uint8_t* w = a.w + t0 * tile_stride;
  for (int64_t b = 0; b < a.KB; ++b, w += rb) {
    __m512i dot[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) dot[m][t] = _mm512_setzero_si512();
    // activation words (4 bytes) of this block, per row
    const int32_t* xw[MR];
    for (int m = 0; m < MR; ++m) xw[m] = reinterpret_cast<const int32_t*>(a.xq + (r0 + m) * a.K + b * kBlock);
    for (int i = 0; i < lines; ++i) {
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* line = w + t * tile_stride + 64 * i;
        _mm_prefetch(reinterpret_cast<const char*>(line + 8 * rb), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(line);
        if constexpr (T == ggml::kQ8_0) {
          lo[t] = raw;
        } else {
          lo[t] = _mm512_and_si512(raw, low4);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
      }
      for (int m = 0; m < MR; ++m) {
        if constexpr (T == ggml::kQ8_0) {
          const __m512i xv = _mm512_set1_epi32(xw[m][i]);
          for (int t = 0; t < NT; ++t) dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], lo[t], xv);
        } else {
          const __m512i xl = _mm512_set1_epi32(xw[m][2 * i]), xh = _mm512_set1_epi32(xw[m][2 * i + 1]);
          for (int t = 0; t < NT; ++t) {
            dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], lo[t], xl);
            dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], hi[t], xh);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* scales = w + t * tile_stride + qb;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      __m512 c;
      if constexpr (T == ggml::kQ4_1) c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
      else c = _mm512_mul_ps(d, _mm512_set1_ps(T == ggml::kQ8_0 ? -128.0f : -8.0f));
      for (int m = 0; m < MR; ++m) {
        const int64_t xb = (r0 + m) * a.KB + b;
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[xb]));
        acc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][t]), ds, acc[m][t]);
        acc[m][t] = _mm512_fmadd_ps(c, _mm512_set1_ps(a.sx[xb]), acc[m][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (t0 + t) * kTileRows;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kTileRows, a.N - n0)) - 1u);
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(a.out + (r0 + m) * a.N + n0, mask, acc[m][t]);
  }
}

using BlockFn = void (*)(const QArgs&, int64_t, int64_t);

template <int T, int MR>
constexpr BlockFn block_fn(int nt) {
  return nt == 4 ? &tile_block<T, MR, 4> : nt == 2 ? &tile_block<T, MR, 2> : &tile_block<T, MR, 1>;
}

template <int T, int... MRs>
BlockFn pick(int64_t rows, int nt, std::integer_sequence<int, MRs...>) {
  static constexpr BlockFn table[][3] = {{block_fn<T, MRs + 1>(1), block_fn<T, MRs + 1>(2), block_fn<T, MRs + 1>(4)}...};
  return table[rows - 1][nt == 4 ? 2 : nt - 1];
}

template <int T>
void tile_group_vnni(const QArgs& a, int64_t t0, int nt) {
  for (int64_t r0 = 0; r0 < a.M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, a.M - r0);
    pick<T>(rows, nt, std::make_integer_sequence<int, kMaxRows>{})(a, r0, t0);
  }
}

#endif

inline int tiles_per_group(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

template <int T>
void tile_range(const QArgs& a, int64_t begin, int64_t end, bool portable) {
  const int group = tiles_per_group(std::min(a.M, kMaxRows));
  int64_t t = begin;
  for (int nt = group; nt >= 1; nt /= 2) {
    for (; t + nt <= end; t += nt) {
#if defined(PYENGINE_QLINEAR_VNNI)
      if (!portable) {
        tile_group_vnni<T>(a, t, nt);
        continue;
      }
#endif
      tile_group_portable<T>(a, t, nt);
    }
  }
}

// One row of x (bf16 or fp32) -> two rows of int8 blocks, their scales and scaled sums: the value
// (x ~ d1 q1) and its residual (x - d1 q1 ~ d2 q2, d2 ~ d1 / 254), so x ~ d1 q1 + d2 q2 to about 15 bits.
// One int8 level alone (as llama.cpp's q8 activations) cost 2.4% top-1 agreement on the default model
// against fp32 (97.6%, tests/test_quant_model.py); the residual row reuses every weight line the first
// row loads, so decode (bound by the weight stream) barely pays for it.
template <class Load>
void quantize_row(Load load, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t KB = K / kBlock;
  for (int64_t b = 0; b < KB; ++b) {
    float v[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) v[i] = load(b * kBlock + i);
    for (int level = 0; level < 2; ++level) {
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = xq + level * K + b * kBlock;
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * id));
        q[i] = static_cast<int8_t>(qi);
        sum += qi;
        v[i] -= d * static_cast<float>(qi);  // the residual, for level 1
      }
      dx[level * KB + b] = d;
      sx[level * KB + b] = d * static_cast<float>(sum);
    }
  }
}

void check_type(int type, const char* who) {
  if (!ggml::supported(type))
    throw std::invalid_argument(std::string(who) + ": GGML type " + std::to_string(type) +
                                " has no native kernel (supported: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
}

template <class F>
void dispatch(int type, F&& f) {
  switch (type) {
    case ggml::kQ8_0: f(std::integral_constant<int, ggml::kQ8_0>{}); break;
    case ggml::kQ4_0: f(std::integral_constant<int, ggml::kQ4_0>{}); break;
    default: f(std::integral_constant<int, ggml::kQ4_1>{}); break;
  }
}

}  // namespace

void set_qlinear_portable(bool portable) { g_portable.store(portable); }

const char* qlinear_isa() {
#if defined(PYENGINE_QLINEAR_VNNI)
  return "avx512_vnni";
#else
  return "scalar";
#endif
}

int64_t qpacked_bytes(int type, int64_t N, int64_t K) {
  check_type(type, "qpack");
  return (N + kTileRows - 1) / kTileRows * (K / kBlock) * ggml::record_bytes(type);
}

void qpack(int type, uintptr_t src, int64_t N, int64_t K, uintptr_t dst) {
  check_type(type, "qpack");
  if (N <= 0 || K <= 0 || K % kBlock) throw std::invalid_argument("qpack: need N > 0 and K a positive multiple of 32");
  const int64_t KB = K / kBlock, bb = ggml::block_bytes(type), rb = ggml::record_bytes(type);
  const int64_t qb = ggml::record_quant_bytes(type), tiles = (N + kTileRows - 1) / kTileRows;
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src);
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  std::memset(out, 0, static_cast<size_t>(tiles * KB * rb));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t tile = n / kTileRows, j = n % kTileRows;
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* blk = in + (n * KB + b) * bb;
      uint8_t* rec = out + (tile * KB + b) * rb;
      uint16_t* scales = reinterpret_cast<uint16_t*>(rec + qb);
      std::memcpy(&scales[j], blk, 2);
      if (type == ggml::kQ8_0) {
        for (int64_t k = 0; k < kBlock; ++k)
          rec[64 * (k / 4) + 4 * j + k % 4] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + k]) + 128);
        continue;
      }
      if (type == ggml::kQ4_1) std::memcpy(&scales[kTileRows + j], blk + 2, 2);
      const uint8_t* qs = blk + (type == ggml::kQ4_1 ? 4 : 2);
      auto value = [&](int64_t k) { return k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4; };
      for (int64_t line = 0; line < 4; ++line)
        for (int64_t t = 0; t < 4; ++t)
          rec[64 * line + 4 * j + t] = static_cast<uint8_t>(value(8 * line + t) | value(8 * line + 4 + t) << 4);
    }
  }
}

void qlinear(uintptr_t x, int x_dtype, uintptr_t packed, int type, uintptr_t bias, uintptr_t out, int64_t M,
             int64_t N, int64_t K, int out_dtype) {
  check_type(type, "qlinear");
  if (M < 0 || N <= 0 || K <= 0 || K % kBlock) throw std::invalid_argument("qlinear: need M >= 0, N > 0, K % 32 == 0");
  const int f32 = static_cast<int>(DType::kFloat32), bf16 = static_cast<int>(DType::kBFloat16);
  if ((out_dtype != f32 && out_dtype != bf16) || (x_dtype != f32 && x_dtype != bf16))
    throw std::invalid_argument("qlinear: x and out dtypes must be fp32 or bf16");
  if (M == 0) return;
  // The kernel runs on 2M int8 rows (each row of x, then its residual: quantize_row) into fp32 partial
  // results, and the two partials of a row are summed (+ bias) at the end.
  const int64_t KB = K / kBlock, M2 = 2 * M;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> scales, partial;
  xq.resize(static_cast<size_t>(M2 * K));
  scales.resize(static_cast<size_t>(2 * M2 * KB));
  partial.resize(static_cast<size_t>(M2 * N));
  int8_t* const xqb = xq.data();
  float* const dx = scales.data();
  float* const sx = dx + M2 * KB;
  float* const part = partial.data();
  auto& pool = ThreadPool::instance();
  const int64_t parts = M > kPanelMinRows ? pool.num_threads() : 1;
  pool.parallel_for(parts, [&](int64_t c) {
    for (int64_t r = M * c / parts; r < M * (c + 1) / parts; ++r) {
      int8_t* q = xqb + 2 * r * K;
      if (x_dtype == f32) {
        const float* row = reinterpret_cast<const float*>(x) + r * K;
        quantize_row([&](int64_t i) { return row[i]; }, K, q, dx + 2 * r * KB, sx + 2 * r * KB);
      } else {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x) + r * K;
        quantize_row([&](int64_t i) { return bf16_to_float(row[i]); }, K, q, dx + 2 * r * KB, sx + 2 * r * KB);
      }
    }
  });
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t bytes = tiles * KB * ggml::record_bytes(type);
  const int64_t chunks = bytes < kMinParallelBytes ? 1 : std::min<int64_t>(tiles, pool.num_threads());
  const bool portable = g_portable.load();
  const int64_t panel = M2 > kPanelMinRows ? std::max<int64_t>(kMaxRows, kPanelBytes / K / kMaxRows * kMaxRows) : M2;
  for (int64_t p0 = 0; p0 < M2; p0 += panel) {
    const QArgs a{xqb + p0 * K, dx + p0 * KB, sx + p0 * KB, reinterpret_cast<const uint8_t*>(packed), part + p0 * N,
                  std::min(panel, M2 - p0), N, K, KB};
    dispatch(type, [&](auto t) {
      pool.parallel_for(chunks, [&](int64_t c) {
        tile_range<decltype(t)::value>(a, tiles * c / chunks, tiles * (c + 1) / chunks, portable);
      });
    });
  }
  const float* b = reinterpret_cast<const float*>(bias);
  pool.parallel_for(parts, [&](int64_t c) {
  for (int64_t r = M * c / parts; r < M * (c + 1) / parts; ++r) {
    const float* hi = part + 2 * r * N;
    const float* lo = hi + N;
    if (out_dtype == f32) {
      float* o = reinterpret_cast<float*>(out) + r * N;
      for (int64_t n = 0; n < N; ++n) o[n] = hi[n] + lo[n] + (b ? b[n] : 0.0f);
    } else {
      uint16_t* o = reinterpret_cast<uint16_t*>(out) + r * N;
      for (int64_t n = 0; n < N; ++n) o[n] = float_to_bf16(hi[n] + lo[n] + (b ? b[n] : 0.0f));
    }
  }
  });
}

void qembedding(uintptr_t ids, int64_t T, uintptr_t packed, int type, int64_t N, int64_t K, uintptr_t out,
                int out_dtype) {
  check_type(type, "qembedding");
  const int64_t* tok = reinterpret_cast<const int64_t*>(ids);
  for (int64_t r = 0; r < T; ++r)
    if (tok[r] < 0 || tok[r] >= N) throw std::out_of_range("qembedding: token id " + std::to_string(tok[r]) +
                                                           " outside [0, " + std::to_string(N) + ")");
  const int64_t KB = K / kBlock;
  const bool f32 = out_dtype == static_cast<int>(DType::kFloat32);
  dispatch(type, [&](auto tc) {
    constexpr int Ty = decltype(tc)::value;
    constexpr int64_t rb = ggml::record_bytes(Ty), qb = ggml::record_quant_bytes(Ty);
    ThreadPool::instance().parallel_for(T, [&](int64_t r) {
      const int64_t n = tok[r], j = n % kTileRows;
      const uint8_t* w = reinterpret_cast<const uint8_t*>(packed) + n / kTileRows * KB * rb;
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* rec = w + b * rb;
        const float d = fp16_to_float(reinterpret_cast<const uint16_t*>(rec + qb)[j]), c = record_c<Ty>(rec, j);
        for (int64_t kk = 0; kk < kBlock; ++kk) {
          // the dequantized value as GGUF defines it: d * q (+ m), with q the signed value for Q8_0/Q4_0
          const int u = record_value<Ty>(rec, j, kk);
          const float v = Ty == ggml::kQ4_1 ? d * static_cast<float>(u) + c
                          : d * static_cast<float>(u - (Ty == ggml::kQ8_0 ? 128 : 8));
          const int64_t off = r * K + b * kBlock + kk;
          if (f32) reinterpret_cast<float*>(out)[off] = v;
          else reinterpret_cast<uint16_t*>(out)[off] = float_to_bf16(v);
        }
      }
    });
  });
}

}  // namespace pyengine::cpu
