// Bindings of the CUDA layer kernels (native/cuda/layers.cu): the names and
// argument lists of native/bindings/cpu_layers.cpp, whose trailing `stream`
// is here the cudaStream_t the kernels are launched on.
#include "../cuda/ops.cuh"
#include "registry.h"

namespace py = pybind11;

namespace {
void register_layers(py::module_& m) {
  namespace pc = pyengine::cuda;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &pc::rms_norm, py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("rows"), py::arg("dim"),
        py::arg("eps"), py::arg("dtype"), py::arg("weight_dtype"), py::arg("out_dtype"), py::arg("stream"), nogil,
        "out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x, out [rows, dim] contiguous (out may be x); "
        "an fp32 x may be normed into a bf16/fp16 out.");
  m.def("add_rms_norm", &pc::add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("rows"),
        py::arg("dim"), py::arg("eps"), py::arg("dtype"), py::arg("weight_dtype"), py::arg("residual_dtype"),
        py::arg("stream"), nogil,
        "In place: residual += x; x = rms_norm(residual) * weight (residual x's dtype or fp32).");
  m.def("rotary_embedding", &pc::rotary_embedding, py::arg("positions"), py::arg("q"), py::arg("k"),
        py::arg("cos_sin_cache"), py::arg("tokens"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"),
        py::arg("q_row_stride"), py::arg("k_row_stride"), py::arg("max_position"), py::arg("dtype"),
        py::arg("stream"), nogil,
        "In-place neox rotary embedding of q and k rows (row strides in elements); tokens whose position is "
        "outside [0, max_position) are left unchanged.");
  m.def("silu_and_mul", &pc::silu_and_mul, py::arg("x"), py::arg("out"), py::arg("rows"), py::arg("inter"),
        py::arg("dtype"), py::arg("stream"), nogil,
        "out[r] = silu(x[r, :inter]) * x[r, inter:]; x [rows, 2*inter], out [rows, inter].");
}
}  // namespace

PYENGINE_REGISTER_OPS(register_layers);
