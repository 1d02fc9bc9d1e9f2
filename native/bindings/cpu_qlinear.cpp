// pybind11 binding of the CPU kernels on GGUF-quantized weights (native/cpu/linear/quant.cpp).
// Pointers are tensor.data_ptr() values; dtype codes follow pyengine/ops/_common.py DTYPE_CODES; `type`
// is the GGML type id (ggml_blocks.h); the trailing `stream` is ignored on the CPU.
#include <cstdint>

#include "pyengine/cpu_ops.h"
#include "registry.h"

namespace py = pybind11;

namespace {

void register_qlinear_ops(py::module_& m) {
  namespace c = pyengine::cpu;
  m.def("qpacked_bytes", &c::qpacked_bytes, py::arg("type"), py::arg("N"), py::arg("K"),
        "Bytes of the tiled copy of an [N, K] weight of GGML type `type`.");
  m.def("qpack", &c::qpack, py::arg("type"), py::arg("src"), py::arg("N"), py::arg("K"), py::arg("dst"),
        py::call_guard<py::gil_scoped_release>(),
        "GGUF blocks [N, K/32 blocks] -> the tiled layout (ggml_blocks.h) at dst (qpacked_bytes bytes).");
  m.def(
      "qlinear",
      [](uintptr_t x, int x_dtype, uintptr_t segments, uintptr_t bias, uintptr_t out, int64_t M, int64_t N, int64_t K,
         int out_dtype, uintptr_t) { c::qlinear(x, x_dtype, segments, bias, out, M, N, K, out_dtype); },
      py::arg("x"), py::arg("x_dtype"), py::arg("segments"), py::arg("bias"), py::arg("out"),
      py::arg("M"), py::arg("N"), py::arg("K"), py::arg("out_dtype"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>(),
      "out[M, N] = x[M, K] @ W^T + bias; x bf16/fp32, W row ranges of tiled quantized weights (segments: int64\n"
      "[1 + 3 n] = n, (GGML type, rows, address) each), bias fp32 [N] or 0, out bf16/fp32.");
  m.def(
      "qembedding",
      [](uintptr_t ids, int64_t T, uintptr_t packed, int type, int64_t N, int64_t K, uintptr_t out, int out_dtype,
         uintptr_t) { c::qembedding(ids, T, packed, type, N, K, out, out_dtype); },
      py::arg("ids"), py::arg("T"), py::arg("packed"), py::arg("type"), py::arg("N"), py::arg("K"), py::arg("out"),
      py::arg("out_dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
      "out[T, K] = rows ids (int64) of a tiled quantized [N, K] weight, dequantized to bf16/fp32.");
  m.def("set_qlinear_isa", &c::set_qlinear_isa, py::arg("name"),
        "Run the quantized kernels on one SIMD path of this build (qlinear_isas), for tests of each path.");
  m.def("qlinear_isa", &c::qlinear_isa, "The SIMD path the quantized kernels run on now.");
  m.def("qlinear_isas", &c::qlinear_isas, "The SIMD paths of this build, comma-separated, best last.");
  m.def("set_qlinear_strip_rows", &c::set_qlinear_strip_rows, py::arg("rows"),
        "From this many rows of bf16 x (0: never), qlinear runs linear_bf16's kernel on the weight dequantized\n"
        "a strip at a time (where linear_path is not portable), else its int8 kernels. Default: 8 where\n"
        "linear_path is amx, else 0 (the int8 kernels measured faster than the strips on vdpbf16ps at every M).");
  m.def("qlinear_strip_rows", &c::qlinear_strip_rows, "The row count set by set_qlinear_strip_rows.");
  m.def("qlinear_path", &c::qlinear_path, py::arg("M"), py::arg("K"),
        "The kernel qlinear runs for M rows of bf16 x on a weight of K columns: strips, or the\n"
        "int8 kernels' SIMD path (qlinear_isa).");
}

}  // namespace

PYENGINE_REGISTER_OPS(register_qlinear_ops);
