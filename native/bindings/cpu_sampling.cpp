// pybind11 bindings of the CPU sampler (native/cpu/sampling.cpp) and of the Philox generator the
// CPU and CUDA samplers share (native/include/pyengine/philox.h). Pointers are tensor.data_ptr()
// values (0 = output not requested); the trailing `stream` is ignored on the CPU.
#include <pybind11/stl.h>

#include <array>
#include <cstdint>

#include "pyengine/philox.h"
#include "registry.h"

namespace py = pybind11;

namespace pyengine::cpu {
void sample(uintptr_t logits, int64_t B, int64_t V, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
            uintptr_t min_p, uintptr_t seeds, uintptr_t steps, uintptr_t token_ids, uintptr_t logprobs,
            int64_t num_top, uintptr_t top_ids, uintptr_t top_logprobs, uintptr_t bitmask);
void apply_penalties(uintptr_t logits, int64_t B, int64_t V, uintptr_t prompt_ids, int64_t num_prompt_ids,
                     uintptr_t prompt_offsets, uintptr_t output_ids, int64_t num_output_ids,
                     uintptr_t output_offsets, uintptr_t presence, uintptr_t frequency, uintptr_t repetition);
}  // namespace pyengine::cpu

namespace {

void register_sampling_ops(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def(
      "sample",
      [](uintptr_t logits, int64_t B, int64_t V, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
         uintptr_t min_p, uintptr_t seeds, uintptr_t steps, uintptr_t token_ids, uintptr_t logprobs,
         int64_t num_top, uintptr_t top_ids, uintptr_t top_logprobs, uintptr_t bitmask, uintptr_t) {
        pyengine::cpu::sample(logits, B, V, temperature, top_k, top_p, min_p, seeds, steps, token_ids, logprobs,
                              num_top, top_ids, top_logprobs, bitmask);
      },
      py::arg("logits"), py::arg("batch"), py::arg("vocab"), py::arg("temperature"), py::arg("top_k"),
      py::arg("top_p"), py::arg("min_p"), py::arg("seeds"), py::arg("steps"), py::arg("token_ids"),
      py::arg("logprobs"), py::arg("num_top"), py::arg("top_ids"), py::arg("top_logprobs"), py::arg("bitmask"),
      py::arg("stream"), nogil, "Per-row temperature/top-k/top-p/min-p sampling keyed by (seed, step), optionally under a token bitmask; see sampling.cpp.");
  m.def(
      "apply_penalties",
      [](uintptr_t logits, int64_t B, int64_t V, uintptr_t prompt_ids, int64_t num_prompt_ids,
         uintptr_t prompt_offsets, uintptr_t output_ids, int64_t num_output_ids, uintptr_t output_offsets,
         uintptr_t presence, uintptr_t frequency, uintptr_t repetition, uintptr_t) {
        pyengine::cpu::apply_penalties(logits, B, V, prompt_ids, num_prompt_ids, prompt_offsets, output_ids,
                                       num_output_ids, output_offsets, presence, frequency, repetition);
      },
      py::arg("logits"), py::arg("batch"), py::arg("vocab"), py::arg("prompt_ids"), py::arg("num_prompt_ids"),
      py::arg("prompt_offsets"), py::arg("output_ids"), py::arg("num_output_ids"), py::arg("output_offsets"),
      py::arg("presence"), py::arg("frequency"), py::arg("repetition"), py::arg("stream"), nogil,
      "In-place vLLM-style repetition/frequency/presence penalties over CSR token lists.");
  m.def(
      "philox4x32_10",
      [](std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
        const pyengine::Philox4x32Out r = pyengine::philox4x32_10(counter.data(), key.data());
        return std::array<uint32_t, 4>{r.v[0], r.v[1], r.v[2], r.v[3]};
      },
      py::arg("counter"), py::arg("key"), "Philox4x32-10 block (the sampler's RNG), for known-answer tests.");
  m.def("philox_uniform", &pyengine::philox_uniform, py::arg("seed"), py::arg("step"),
        "The sampler's uniform draw in [0, 1) for (seed, step).");
}

}  // namespace

PYENGINE_REGISTER_OPS(register_sampling_ops);
