// pybind11 bindings of the CPU layer kernels (native/cpu/layers.cpp).
// Pointers are tensor.data_ptr() values; dtype codes follow pyengine/ops/_common.py DTYPE_CODES;
// the trailing `stream` is the CUDA stream handle, ignored on the CPU.
#include <cstdint>

#include "pyengine/cpu_ops.h"
#include "registry.h"

namespace py = pybind11;

namespace {

void register_layer_ops(py::module_& m) {
  using namespace pyengine::cpu;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def(
      "rms_norm",
      [](uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows, int64_t dim, double eps, int dtype,
         int weight_dtype, int out_dtype, uintptr_t) {
        rms_norm(x, weight, out, rows, dim, eps, dtype, weight_dtype, out_dtype);
      },
      py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("rows"), py::arg("dim"), py::arg("eps"),
      py::arg("dtype"), py::arg("weight_dtype"), py::arg("out_dtype"), py::arg("stream"), nogil,
      "out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x, out [rows, dim] contiguous (out may be x); "
      "an fp32 x may be normed into a bf16/fp16 out.");
  m.def(
      "add_rms_norm",
      [](uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t dim, double eps, int dtype,
         int weight_dtype, int residual_dtype, uintptr_t) {
        add_rms_norm(x, residual, weight, rows, dim, eps, dtype, weight_dtype, residual_dtype);
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("rows"), py::arg("dim"), py::arg("eps"),
      py::arg("dtype"), py::arg("weight_dtype"), py::arg("residual_dtype"), py::arg("stream"), nogil,
      "In place: residual += x; x = rms_norm(residual) * weight (residual x's dtype or fp32).");
  m.def(
      "rotary_embedding",
      [](uintptr_t positions, uintptr_t q, uintptr_t k, uintptr_t cache, int64_t tokens, int64_t q_heads,
         int64_t kv_heads, int64_t head_dim, int64_t q_row_stride, int64_t k_row_stride, int64_t max_position,
         int dtype, uintptr_t) {
        rotary_embedding(positions, q, k, cache, tokens, q_heads, kv_heads, head_dim, q_row_stride, k_row_stride,
                         max_position, dtype);
      },
      py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos_sin_cache"), py::arg("tokens"),
      py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("q_row_stride"),
      py::arg("k_row_stride"), py::arg("max_position"), py::arg("dtype"), py::arg("stream"), nogil,
      "In-place neox rotary embedding of q and k rows (row strides in elements).");
  m.def(
      "hadamard_heads",
      [](uintptr_t x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride, int dtype, uintptr_t) {
        hadamard_heads(x, tokens, heads, head_dim, row_stride, dtype);
      },
      py::arg("x"), py::arg("tokens"), py::arg("heads"), py::arg("head_dim"), py::arg("row_stride"),
      py::arg("dtype"), py::arg("stream"), nogil,
      "In place: each head of x's rows (row stride in elements) becomes its normalised Walsh-Hadamard transform.");
  m.def(
      "silu_and_mul",
      [](uintptr_t x, uintptr_t out, int64_t rows, int64_t inter, int dtype, uintptr_t) {
        silu_and_mul(x, out, rows, inter, dtype);
      },
      py::arg("x"), py::arg("out"), py::arg("rows"), py::arg("inter"), py::arg("dtype"), py::arg("stream"), nogil,
      "out[r] = silu(x[r, :inter]) * x[r, inter:]; x [rows, 2*inter], out [rows, inter].");
}

}  // namespace

PYENGINE_REGISTER_OPS(register_layer_ops);
