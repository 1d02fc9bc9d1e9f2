// Bindings of the CUDA layer kernels (native/cuda/layers.cu): the names and
// argument lists of native/bindings/cpu_layers.cpp, whose trailing `stream`
// is here the cudaStream_t the kernels are launched on.
#include "../cuda/ops.cuh"
#include "registry.h"

namespace py = pybind11;

namespace {
void register_layers(py::module_& m) {
  using G = py::call_guard<py::gil_scoped_release>;
  namespace pc = pyengine::cuda;
  m.def("rms_norm", &pc::rms_norm, G(), "out = x * rsqrt(mean(x^2) + eps) * weight, rows of x [rows, dim].");
  m.def("add_rms_norm", &pc::add_rms_norm, G(), "In place: residual += x; x = rms_norm(residual) * weight.");
  m.def("rotary_embedding", &pc::rotary_embedding, G(), "In-place neox rotary embedding of q and k by position.");
  m.def("silu_and_mul", &pc::silu_and_mul, G(), "out = silu(x[:, :inter]) * x[:, inter:].");
}
}  // namespace

PYENGINE_REGISTER_OPS(register_layers);
