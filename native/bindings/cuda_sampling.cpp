// Bindings of the CUDA sampler and penalties (native/cuda/sampling.cu): the names and argument
// lists of native/bindings/cpu_sampling.cpp (the Philox known-answer helpers stay CPU-only: the
// CUDA kernels include the same header); `stream` is the cudaStream_t to launch on.
#include "../cuda/ops.cuh"
#include "registry.h"

namespace py = pybind11;

namespace {
void register_sampling(py::module_& m) {
  namespace pc = pyengine::cuda;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("sample", &pc::sample, py::arg("logits"), py::arg("batch"), py::arg("vocab"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("seeds"), py::arg("steps"),
        py::arg("token_ids"), py::arg("logprobs"), py::arg("num_top"), py::arg("top_ids"), py::arg("top_logprobs"),
        py::arg("bitmask"), py::arg("stream"), nogil,
        "Per-row temperature/top-k/top-p/min-p sampling keyed by (seed, step), optionally under a token bitmask; see sampling.cu.");
  m.def("apply_penalties", &pc::apply_penalties, py::arg("logits"), py::arg("batch"), py::arg("vocab"),
        py::arg("prompt_ids"), py::arg("num_prompt_ids"), py::arg("prompt_offsets"), py::arg("output_ids"),
        py::arg("num_output_ids"), py::arg("output_offsets"), py::arg("presence"), py::arg("frequency"),
        py::arg("repetition"), py::arg("stream"), nogil,
        "In-place vLLM-style repetition/frequency/presence penalties over CSR token lists.");
}
}  // namespace

PYENGINE_REGISTER_OPS(register_sampling);
