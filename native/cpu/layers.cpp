// Per-token layer kernels: rms_norm, add_rms_norm, rotary_embedding (neox), hadamard_heads,
// silu_and_mul.
//
// Layouts (row-major, element strides):
//   rms_norm / add_rms_norm: x, residual, out [rows, dim] contiguous; weight [dim].
//   rotary_embedding: q rows of num_q_heads*head_dim, k rows of num_kv_heads*head_dim, each head's
//     head_dim values contiguous, heads contiguous within a row, rows q_row_stride / k_row_stride
//     apart (so q and k may be column slices of a fused qkv output); positions [T] int64;
//     cos_sin_cache [max_position, head_dim] fp32 = [cos | sin] halves.
//   hadamard_heads: x rows of heads*head_dim (heads contiguous within a row, rows row_stride apart),
//     each head's vector replaced in place by its normalised Walsh-Hadamard transform over blocks of
//     n = the largest power of two dividing head_dim (all of it for 64, 128, 256).
//   silu_and_mul: x [rows, 2*inter] -> out [rows, inter].
// Element types: fp32, bf16, fp16 activations (weight: the activation type or fp32); all
// arithmetic in fp32, one rounding on store. The residual stream may be fp32 under bf16/fp16
// activations (a model's residual, kept unrounded): rms_norm's x (then out is the activation type)
// and add_rms_norm's residual.
// Parallel shape: rows (silu_and_mul: rows x 2048-column tiles) split into chunks on the
// ThreadPool, only when rows*row_work >= kMinParallelWork elements; smaller calls (a decode
// step's single row) run inline on the caller and never wake a worker.
// SIMD: AVX-512 (16 lanes), else AVX2+FMA+F16C (8 lanes), else scalar; chosen at build time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyengine/bf16_widen.h"
#include "pyengine/dtype.h"
#include "pyengine/parallel.h"
#include "pyengine/vec_exp.h"
#include "pyengine/vec_reduce.h"

// GCC 12 flags its own AVX-512 intrinsics (_mm512_undefined_*) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace pyengine::cpu {
namespace {

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return bf16_to_float(v.bits); }
inline float to_float(fp16 v) { return fp16_to_float(v.bits); }
inline void store_float(float* p, float v) { *p = v; }
inline void store_float(bf16* p, float v) { p->bits = float_to_bf16(v); }
inline void store_float(fp16* p, float v) { p->bits = float_to_fp16(v); }

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vfloat = __m512;
inline vfloat vset(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const bf16* p) { return load_bf16x16(&p->bits); }
inline vfloat vload(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline void vstore(bf16* p, vfloat v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else  // round to nearest even; NaN stays a quiet NaN
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}
inline void vstore(fp16* p, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vfms(vfloat a, vfloat b, vfloat c) { return _mm512_fmsub_ps(a, b, c); }  // a*b - c
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline vfloat vexp(vfloat x) { return exp512(x); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t kLanes = 8;
using vfloat = __m256;
inline vfloat vset(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vfloat vload(const fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline void vstore(bf16* p, vfloat v) {  // round to nearest even; NaN stays a quiet NaN
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void vstore(fp16* p, vfloat v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vfms(vfloat a, vfloat b, vfloat c) { return _mm256_fmsub_ps(a, b, c); }
inline float vsum(vfloat v) { return hsum256(v); }
inline vfloat vexp(vfloat x) { return exp256(x); }
#else
constexpr int64_t kLanes = 1;
using vfloat = float;
inline vfloat vset(float x) { return x; }
template <class T> inline vfloat vload(const T* p) { return to_float(*p); }
template <class T> inline void vstore(T* p, vfloat v) { store_float(p, v); }
inline vfloat vadd(vfloat a, vfloat b) { return a + b; }
inline vfloat vsub(vfloat a, vfloat b) { return a - b; }
inline vfloat vmul(vfloat a, vfloat b) { return a * b; }
inline vfloat vdiv(vfloat a, vfloat b) { return a / b; }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return a * b + c; }
inline vfloat vfms(vfloat a, vfloat b, vfloat c) { return a * b - c; }
inline float vsum(vfloat v) { return v; }
inline vfloat vexp(vfloat x) { return std::exp(x); }
#endif

// Elements of work below which a call stays on the calling thread (a few microseconds).
constexpr int64_t kMinParallelWork = 32768;

// fn(begin, end) over [0, units), split across the pool when units*unit_work is large enough.
template <class F>
void for_units(int64_t units, int64_t unit_work, F&& fn) {
  ThreadPool& pool = ThreadPool::instance();
  const int64_t threads = pool.num_threads();
  if (threads == 1 || units < 2 || units * unit_work < kMinParallelWork) {
    fn(int64_t{0}, units);
    return;
  }
  const int64_t per = (units + threads * 4 - 1) / (threads * 4);
  const int64_t chunks = (units + per - 1) / per;
  pool.parallel_for(chunks, [&](int64_t c) { fn(c * per, std::min(units, (c + 1) * per)); });
}

template <class X, class W, class O>
void rms_norm_impl(const X* x, const W* w, O* out, int64_t rows, int64_t dim, float eps) {
  for_units(rows, dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const X* xr = x + r * dim;
      O* orow = out + r * dim;
      vfloat acc = vset(0.0f);
      int64_t i = 0;
      for (; i + kLanes <= dim; i += kLanes) {
        const vfloat v = vload(xr + i);
        acc = vfma(v, v, acc);
      }
      float ss = vsum(acc);
      for (int64_t j = i; j < dim; ++j) ss += to_float(xr[j]) * to_float(xr[j]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
      const vfloat vinv = vset(inv);
      for (i = 0; i + kLanes <= dim; i += kLanes) vstore(orow + i, vmul(vmul(vload(xr + i), vinv), vload(w + i)));
      for (; i < dim; ++i) store_float(orow + i, to_float(xr[i]) * inv * to_float(w[i]));
    }
  });
}

// residual += x (rounded to R); x = rms_norm(residual) * w, normalizing the stored residual.
template <class T, class R, class W>
void add_rms_norm_impl(T* x, R* residual, const W* w, int64_t rows, int64_t dim, float eps) {
  for_units(rows, 2 * dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * dim;
      R* rr = residual + r * dim;
      vfloat acc = vset(0.0f);
      int64_t i = 0;
      for (; i + kLanes <= dim; i += kLanes) {
        vstore(rr + i, vadd(vload(xr + i), vload(rr + i)));
        const vfloat v = vload(rr + i);
        acc = vfma(v, v, acc);
      }
      float ss = vsum(acc);
      for (int64_t j = i; j < dim; ++j) {
        store_float(rr + j, to_float(xr[j]) + to_float(rr[j]));
        ss += to_float(rr[j]) * to_float(rr[j]);
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
      const vfloat vinv = vset(inv);
      for (i = 0; i + kLanes <= dim; i += kLanes) vstore(xr + i, vmul(vmul(vload(rr + i), vinv), vload(w + i)));
      for (; i < dim; ++i) store_float(xr + i, to_float(rr[i]) * inv * to_float(w[i]));
    }
  });
}

template <class T>
inline void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const vfloat x1 = vload(x + i), x2 = vload(x + half + i), c = vload(cos + i), s = vload(sin + i);
    vstore(x + i, vfms(x1, c, vmul(x2, s)));
    vstore(x + half + i, vfma(x2, c, vmul(x1, s)));
  }
  for (; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
    store_float(x + i, x1 * cos[i] - x2 * sin[i]);
    store_float(x + half + i, x2 * cos[i] + x1 * sin[i]);
  }
}

template <class T>
void rotary_impl(const int64_t* positions, T* q, T* k, const float* cache, int64_t tokens, int64_t q_heads,
                 int64_t kv_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride) {
  const int64_t half = head_dim / 2;
  for_units(tokens, (q_heads + kv_heads) * head_dim, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cos = cache + positions[t] * head_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + t * q_stride + h * head_dim, cos, sin, half);
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head(k + t * k_stride + h * head_dim, cos, sin, half);
    }
  });
}

#if defined(__AVX512F__)
// a with lanes i and i ^ L combined as fwht's butterfly: a_i + a_(i^L) where bit L of i is clear
// (`upper` has the lanes where it is set), a_(i^L) - a_i where it is set.
inline __m512 butterfly(__m512 a, __m512 partner, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(a, partner), upper, partner, a);
}

// fwht's passes of lane distance 1, 2, 4, 8 within one register of 16 floats.
inline __m512 fwht16(__m512 a) {
  a = butterfly(a, _mm512_permute_ps(a, 0xB1), 0xAAAA);
  a = butterfly(a, _mm512_permute_ps(a, 0x4E), 0xCCCC);
  a = butterfly(a, _mm512_shuffle_f32x4(a, a, 0xB1), 0xF0F0);
  return butterfly(a, _mm512_shuffle_f32x4(a, a, 0x4E), 0xFF00);
}
#endif

// In place: v[0, n) = H_n v, H_n the Sylvester Hadamard matrix (entry (i, j) is (-1)^popcount(i & j));
// n a power of two. log2(n) butterfly passes of exact sums and differences (the SIMD passes compute
// the same sums in the same order: the same bits).
void fwht(float* v, int64_t n) {
  int64_t len = 1;
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(v + i, fwht16(_mm512_loadu_ps(v + i)));
    len = 16;
  }
#endif
  for (; len < n; len <<= 1) {
    for (int64_t i = 0; i < n; i += 2 * len) {
      int64_t j = i;
      if (len % kLanes == 0) {
        for (; j < i + len; j += kLanes) {
          const vfloat a = vload(v + j), b = vload(v + j + len);
          vstore(v + j, vadd(a, b));
          vstore(v + j + len, vsub(a, b));
        }
      }
      for (; j < i + len; ++j) {
        const float a = v[j], b = v[j + len];
        v[j] = a + b;
        v[j + len] = a - b;
      }
    }
  }
}

// Each head of x: its blocks of n (the largest power of two dividing head_dim) times H_n / sqrt(n).
template <class T>
void hadamard_impl(T* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride) {
  const int64_t n = head_dim & -head_dim;
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for_units(tokens, heads * head_dim, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(head_dim);
    float* v = buf.data();
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        T* head = x + t * row_stride + h * head_dim;
        int64_t i = 0;
        for (; i + kLanes <= head_dim; i += kLanes) vstore(v + i, vload(head + i));
        for (; i < head_dim; ++i) v[i] = to_float(head[i]);
        for (int64_t b = 0; b < head_dim; b += n) fwht(v + b, n);
        for (i = 0; i + kLanes <= head_dim; i += kLanes) vstore(head + i, vmul(vload(v + i), vset(norm)));
        for (; i < head_dim; ++i) store_float(head + i, v[i] * norm);
      }
    }
  });
}

template <class T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t inter) {
  constexpr int64_t kTile = 2048;  // columns per work unit, so one long row can still split
  const int64_t tiles = (inter + kTile - 1) / kTile;
  for_units(rows * tiles, std::min(inter, kTile), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = u / tiles, c0 = (u % tiles) * kTile, c1 = std::min(inter, c0 + kTile);
      const T* a = x + r * 2 * inter;
      const T* b = a + inter;
      T* o = out + r * inter;
      int64_t i = c0;
      for (; i + kLanes <= c1; i += kLanes) {
        const vfloat av = vload(a + i);
        const vfloat silu = vdiv(av, vadd(vset(1.0f), vexp(vsub(vset(0.0f), av))));
        vstore(o + i, vmul(silu, vload(b + i)));
      }
      for (; i < c1; ++i) {
        const float av = to_float(a[i]);
        store_float(o + i, av / (1.0f + std::exp(-av)) * to_float(b[i]));
      }
    }
  });
}

[[noreturn]] void bad_dtype(const char* op, int code) {
  throw std::invalid_argument(std::string(op) + ": unsupported dtype code " + std::to_string(code));
}

// Calls fn(T{}) with the element tag type of an activation dtype code.
template <class F>
void dispatch_act(const char* op, int code, F&& fn) {
  switch (static_cast<DType>(code)) {
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(bf16{});
    case DType::kFloat16: return fn(fp16{});
    default: bad_dtype(op, code);
  }
}

// Calls fn(T{}) where `code` is the activation's (`act_code`, tag type T), fn(float{}) where it is fp32:
// weights and the residual stream are either.
template <class T, class F>
void dispatch_act_or_float(const char* op, int code, int act_code, F&& fn) {
  if (code == act_code) return fn(T{});
  if (static_cast<DType>(code) == DType::kFloat32) return fn(float{});
  bad_dtype(op, code);
}

template <class T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

}  // namespace

void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows, int64_t dim, double eps, int dtype,
              int weight_dtype, int out_dtype) {
  dispatch_act("rms_norm", out_dtype, [&](auto o) {
    using O = decltype(o);
    dispatch_act_or_float<O>("rms_norm", dtype, out_dtype, [&](auto xt) {
      dispatch_act_or_float<O>("rms_norm", weight_dtype, out_dtype, [&](auto w) {
        using X = decltype(xt);
        using W = decltype(w);
        rms_norm_impl(ptr<const X>(x), ptr<const W>(weight), ptr<O>(out), rows, dim, static_cast<float>(eps));
      });
    });
  });
}

void add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t dim, double eps,
                  int dtype, int weight_dtype, int residual_dtype) {
  dispatch_act("add_rms_norm", dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_act_or_float<T>("add_rms_norm", residual_dtype, dtype, [&](auto r) {
      dispatch_act_or_float<T>("add_rms_norm", weight_dtype, dtype, [&](auto w) {
        using R = decltype(r);
        using W = decltype(w);
        add_rms_norm_impl(ptr<T>(x), ptr<R>(residual), ptr<const W>(weight), rows, dim, static_cast<float>(eps));
      });
    });
  });
}

void rotary_embedding(uintptr_t positions, uintptr_t q, uintptr_t k, uintptr_t cos_sin_cache, int64_t tokens,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_row_stride,
                      int64_t k_row_stride, int64_t max_position, int dtype) {
  const int64_t* pos = ptr<const int64_t>(positions);
  for (int64_t t = 0; t < tokens; ++t) {
    if (pos[t] < 0 || pos[t] >= max_position)
      throw std::invalid_argument("rotary_embedding: positions[" + std::to_string(t) + "] = " +
                                  std::to_string(pos[t]) + " is outside the cos_sin_cache range [0, " +
                                  std::to_string(max_position) + ")");
  }
  dispatch_act("rotary_embedding", dtype, [&](auto t) {
    using T = decltype(t);
    rotary_impl(pos, ptr<T>(q), ptr<T>(k), ptr<const float>(cos_sin_cache), tokens, q_heads, kv_heads, head_dim,
                q_row_stride, k_row_stride);
  });
}

void hadamard_heads(uintptr_t x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride, int dtype) {
  if (head_dim <= 0) throw std::invalid_argument("hadamard_heads: head_dim must be positive");
  dispatch_act("hadamard_heads", dtype, [&](auto t) {
    using T = decltype(t);
    hadamard_impl(ptr<T>(x), tokens, heads, head_dim, row_stride);
  });
}

void silu_and_mul(uintptr_t x, uintptr_t out, int64_t rows, int64_t inter, int dtype) {
  dispatch_act("silu_and_mul", dtype, [&](auto t) {
    using T = decltype(t);
    silu_and_mul_impl(ptr<const T>(x), ptr<T>(out), rows, inter);
  });
}

}  // namespace pyengine::cpu
