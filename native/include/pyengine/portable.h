// PYENGINE_HD marks scalar helpers usable from host code and, under nvcc, device code.
#pragma once

#if defined(__CUDACC__)
#define PYENGINE_HD __host__ __device__ __forceinline__
#else
#define PYENGINE_HD inline
#endif
