// RMSNorm, fused residual-add + RMSNorm, SiLU-and-mul, neox rotary embedding.
//
// Layouts (row-major; T tokens; same as native/cpu/layers.cpp):
//   rms_norm      x [T, D], weight [D] (out's dtype or fp32), out [T, D] (x's dtype, or any where x
//                 is fp32: a model's fp32 residual stream normed into bf16/fp16 activations)
//   add_rms_norm  x, residual [T, D] in place (residual x's dtype or fp32); weight x's dtype or fp32
//   silu_and_mul  x [T, 2I] -> out [T, I]
//   rotary        q [T, H, D], k [T, KVH, D] in place (token rows q_stride /
//                 k_stride elements apart, heads contiguous), cos_sin
//                 [max_pos, D] fp32 with cos in [:, :D/2] and sin in [:, D/2:]
// Launch: grid.x = T (one block per token), 256 threads striding over the
// row. All arithmetic in fp32, one rounding on store.
#include "common.cuh"
#include "ops.cuh"

namespace pyengine {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename X, typename W, typename T>
__global__ void rms_norm_kernel(const X* x, const W* __restrict__ w, T* out, int D,
                                float eps) {
  __shared__ float scratch[32];
  const X* row = x + static_cast<int64_t>(blockIdx.x) * D;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = to_float(row[i]);
    ss += v * v;
  }
  const float inv = 1.f / sqrtf(block_sum(ss, scratch) / D + eps);  // IEEE, as on the CPU
  T* o = out + static_cast<int64_t>(blockIdx.x) * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = from_float<T>(to_float(row[i]) * inv * to_float(w[i]));
}

template <typename T, typename R, typename W>
__global__ void add_rms_norm_kernel(T* __restrict__ x, R* __restrict__ residual, const W* __restrict__ w, int D,
                                    float eps) {
  __shared__ float scratch[32];
  T* xr = x + static_cast<int64_t>(blockIdx.x) * D;
  R* rr = residual + static_cast<int64_t>(blockIdx.x) * D;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const R r = from_float<R>(to_float(rr[i]) + to_float(xr[i]));  // residual keeps its dtype
    rr[i] = r;
    const float v = to_float(r);
    ss += v * v;
  }
  const float inv = 1.f / sqrtf(block_sum(ss, scratch) / D + eps);  // IEEE, as on the CPU
  // Each thread re-reads only the residual elements it wrote itself.
  for (int i = threadIdx.x; i < D; i += blockDim.x) xr[i] = from_float<T>(to_float(rr[i]) * inv * to_float(w[i]));
}

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int I) {
  const T* row = x + static_cast<int64_t>(blockIdx.x) * 2 * I;
  T* o = out + static_cast<int64_t>(blockIdx.x) * I;
  for (int i = threadIdx.x; i < I; i += blockDim.x) {
    const float g = to_float(row[i]), u = to_float(row[I + i]);
    o[i] = from_float<T>(g / (1.f + expf(-g)) * u);
  }
}

// Thread j of token t handles rotation pair (j % half) of head (j / half),
// heads of q first, then of k.
template <typename T>
__global__ void rotary_kernel(const int64_t* __restrict__ positions, T* __restrict__ q, T* __restrict__ k,
                              const float* __restrict__ cos_sin, int H, int KVH, int D, int64_t q_stride,
                              int64_t k_stride, int64_t max_position) {
  const int half = D / 2;
  const int64_t t = blockIdx.x, pos = positions[t];
  if (pos < 0 || pos >= max_position) return;
  const float* cs = cos_sin + pos * D;
  for (int j = threadIdx.x; j < (H + KVH) * half; j += blockDim.x) {
    const int head = j / half, i = j % half;
    T* p = head < H ? q + t * q_stride + static_cast<int64_t>(head) * D
                    : k + t * k_stride + static_cast<int64_t>(head - H) * D;
    const float c = cs[i], s = cs[half + i];
    const float x1 = to_float(p[i]), x2 = to_float(p[half + i]);
    p[i] = from_float<T>(x1 * c - x2 * s);
    p[half + i] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Runs the body with `name` = scalar_t or float: weights and the residual stream are the activation
// type or fp32.
#define DISPATCH_ACT_OR_FLOAT(code, act_dtype, name, op, ...)                  \
  do {                                                                         \
    if ((code) == (act_dtype)) {                                               \
      using name = scalar_t;                                                   \
      __VA_ARGS__;                                                             \
    } else if (static_cast<DType>(code) == DType::kFloat32) {                  \
      using name = float;                                                      \
      __VA_ARGS__;                                                             \
    } else {                                                                   \
      bad_dtype(op, code);                                                     \
    }                                                                          \
  } while (0)

}  // namespace

void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows, int64_t dim, double eps, int dtype,
              int weight_dtype, int out_dtype, uintptr_t stream) {
  if (rows == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(x), "rms_norm");
  PYENGINE_DISPATCH_FLOAT(out_dtype, "rms_norm", {
    DISPATCH_ACT_OR_FLOAT(dtype, out_dtype, x_t, "rms_norm", {
      DISPATCH_ACT_OR_FLOAT(weight_dtype, out_dtype, weight_t, "rms_norm", {
        rms_norm_kernel<x_t, weight_t, scalar_t><<<rows, kThreads, 0, as_stream(stream)>>>(
            ptr<const x_t>(x), ptr<const weight_t>(weight), ptr<scalar_t>(out), dim, static_cast<float>(eps));
      });
    });
  });
  check_launch("rms_norm");
}

void add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t dim, double eps,
                  int dtype, int weight_dtype, int residual_dtype, uintptr_t stream) {
  if (rows == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(x), "add_rms_norm");
  PYENGINE_DISPATCH_FLOAT(dtype, "add_rms_norm", {
    DISPATCH_ACT_OR_FLOAT(residual_dtype, dtype, residual_t, "add_rms_norm", {
      DISPATCH_ACT_OR_FLOAT(weight_dtype, dtype, weight_t, "add_rms_norm", {
        add_rms_norm_kernel<scalar_t, residual_t, weight_t><<<rows, kThreads, 0, as_stream(stream)>>>(
            ptr<scalar_t>(x), ptr<residual_t>(residual), ptr<const weight_t>(weight), dim, static_cast<float>(eps));
      });
    });
  });
  check_launch("add_rms_norm");
}

void rotary_embedding(uintptr_t positions, uintptr_t q, uintptr_t k, uintptr_t cos_sin_cache, int64_t tokens,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_row_stride,
                      int64_t k_row_stride, int64_t max_position, int dtype, uintptr_t stream) {
  if (tokens == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(q), "rotary_embedding");
  PYENGINE_DISPATCH_FLOAT(dtype, "rotary_embedding", {
    rotary_kernel<scalar_t><<<tokens, kThreads, 0, as_stream(stream)>>>(
        ptr<const int64_t>(positions), ptr<scalar_t>(q), ptr<scalar_t>(k), ptr<const float>(cos_sin_cache), q_heads,
        kv_heads, head_dim, q_row_stride, k_row_stride, max_position);
  });
  check_launch("rotary_embedding");
}

void silu_and_mul(uintptr_t x, uintptr_t out, int64_t rows, int64_t inter, int dtype, uintptr_t stream) {
  if (rows == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(x), "silu_and_mul");
  PYENGINE_DISPATCH_FLOAT(dtype, "silu_and_mul", {
    silu_and_mul_kernel<scalar_t><<<rows, kThreads, 0, as_stream(stream)>>>(ptr<const scalar_t>(x),
                                                                            ptr<scalar_t>(out), inter);
  });
  check_launch("silu_and_mul");
}

}  // namespace cuda
}  // namespace pyengine
