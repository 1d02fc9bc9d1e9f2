// Device helpers shared by the CUDA kernels (included only from .cu files).
//
// - Element access: every kernel computes in fp32 and loads/stores its
//   element type through to_float/from_float (fp32, bf16, fp16).
// - Reductions: warp_* via shuffles; block_sum over up to 32 warps through a
//   32-element shared scratch (every thread of the block must call it).
// - Host side: DISPATCH_FLOAT picks the element type from a DType code;
//   check_launch turns a failed launch into std::runtime_error (RuntimeError
//   in Python); DeviceGuard runs the launch on the device owning a pointer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "pyengine/dtype.h"

namespace pyengine {
namespace cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T>  // float, double, integers
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; the result is returned to every thread.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch /* [32] shared */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : T(0);
  return warp_sum(v);
}

inline void check_launch(const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("pyengine._cuda.") + op + ": " + cudaGetErrorString(err));
}

inline void check_call(cudaError_t err, const char* op) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("pyengine._cuda.") + op + ": " + cudaGetErrorString(err));
}

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Makes the device that owns `ptr` current for the scope (torch tensors may
// live on a device other than this host thread's current one). A pointer the
// runtime cannot classify leaves the current device alone (the error is
// cleared so that check_launch does not report it).
class DeviceGuard {
 public:
  DeviceGuard(const void* ptr, const char* op) {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return;
    check_call(cudaGetDevice(&prev_), op);
    if (attr.device != prev_) {
      check_call(cudaSetDevice(attr.device), op);
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

[[noreturn]] inline void bad_dtype(const char* op, int code) {
  throw std::invalid_argument(std::string("pyengine._cuda.") + op + ": unsupported dtype code " + std::to_string(code));
}

}  // namespace cuda
}  // namespace pyengine

// Runs the body with `scalar_t` bound to the element type of DType `code`
// (fp32, bf16 or fp16).
#define PYENGINE_DISPATCH_FLOAT(code, op, ...)                     \
  switch (static_cast<::pyengine::DType>(code)) {                  \
    case ::pyengine::DType::kFloat32: {                            \
      using scalar_t = float;                                      \
      __VA_ARGS__;                                                 \
    } break;                                                       \
    case ::pyengine::DType::kBFloat16: {                           \
      using scalar_t = __nv_bfloat16;                              \
      __VA_ARGS__;                                                 \
    } break;                                                       \
    case ::pyengine::DType::kFloat16: {                            \
      using scalar_t = __half;                                     \
      __VA_ARGS__;                                                 \
    } break;                                                       \
    default:                                                       \
      ::pyengine::cuda::bad_dtype(op, code);                       \
  }
