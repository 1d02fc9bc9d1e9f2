// pybind11 bindings of the CPU linear kernels: bf16 (native/cpu/linear/bf16.cpp) and fp32 (native/cpu/linear/fp32.cpp).
// Pointers are tensor.data_ptr() values; the out dtype code follows pyengine/ops/_common.py DTYPE_CODES;
// the trailing `stream` is the CUDA stream handle, ignored on the CPU.
#include <cstdint>
#include <string>

#include "pyengine/cpu_ops.h"
#include "registry.h"

namespace py = pybind11;

namespace {

void register_linear_ops(py::module_& m) {
  m.def(
      "linear_bf16",
      [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out, int64_t M, int64_t N, int64_t K,
         int out_dtype, uintptr_t) { pyengine::cpu::linear_bf16(x, packed, bias, out, M, N, K, out_dtype); },
      py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::arg("out_dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "out[M, N] = x[M, K] @ W^T + bias; x bf16, W packed [ceil(N/16), ceil(K/2), 16, 2] bf16 (64-byte "
      "aligned), bias fp32 [N] or 0, out bf16 or fp32.");
  m.def(
      "linear_fp32",
      [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out, int64_t M, int64_t N, int64_t K) {
        pyengine::cpu::linear_fp32(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(packed),
                                   reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(out), M, N, K);
      },
      py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out"), py::arg("M"), py::arg("N"), py::arg("K"),
      py::call_guard<py::gil_scoped_release>(),
      "out[M, N] = x[M, K] @ W^T + bias, all fp32; W packed [ceil(N/16), K, 16] (64-byte aligned), bias [N] or 0. "
      "Only where linear_fp32_available().");
  m.def("linear_fp32_available", &pyengine::cpu::linear_fp32_available,
        "Whether this build has linear_fp32's kernel (AVX2 and FMA).");
  m.def("set_linear_path", &pyengine::cpu::set_linear_path, py::arg("name"),
        "amx (default: AMX tiles where the build and CPU have them, for K % 32 == 0, else the better "
        "AVX-512 kernel for this build), avx512_fp32 (bf16 weights widened to fp32 FMAs) or avx512_bf16 "
        "(vdpbf16ps), each for every M (tests compare them).");
  m.def("linear_path", &pyengine::cpu::linear_path, py::arg("K"),
        "The kernel linear_bf16 runs for a weight of K columns, at every M: amx, avx512_fp32, avx512_bf16 or "
        "portable.");
}

}  // namespace

PYENGINE_REGISTER_OPS(register_linear_ops);
