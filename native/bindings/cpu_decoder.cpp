// pybind11 binding of the CPU decoder-layer loop (native/cpu/decoder.cpp). CPU only: the CUDA path
// runs the model op by op.
#include <cstdint>

#include "pyengine/cpu_ops.h"
#include "registry.h"

namespace py = pybind11;

namespace {

void register_decoder_ops(py::module_& m) {
  m.def(
      "decoder_layers",
      [](uintptr_t residual, uintptr_t x, uintptr_t qkv, uintptr_t attn, uintptr_t gate_up, uintptr_t act,
         uintptr_t layer_table, int64_t num_layers, uintptr_t positions, uintptr_t cos_sin_cache, int64_t max_position,
         uintptr_t slot_mapping, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc, int64_t T,
         int64_t hidden, int64_t H, int64_t KVH, int64_t D, int64_t inter, int64_t num_blocks, int64_t block_size,
         int64_t num_seqs, int64_t max_blocks, int64_t max_seq_len, double eps, double scale, int norm_dtype,
         int cache_dtype, int64_t window, uintptr_t final_norm, uintptr_t stop_flag) {
        return pyengine::cpu::decoder_layers(
            residual, x, qkv, attn, gate_up, act, reinterpret_cast<const int64_t*>(layer_table), num_layers, positions,
            cos_sin_cache, max_position, slot_mapping, block_tables, seq_lens, query_start_loc, T, hidden, H, KVH, D,
            inter, num_blocks, block_size, num_seqs, max_blocks, max_seq_len, eps, scale, norm_dtype, cache_dtype,
            window, final_norm, stop_flag);
      },
      py::call_guard<py::gil_scoped_release>(),
      "All decoder layers of a Llama-family model for one step of T tokens (native/cpu/decoder.cpp says "
      "what each argument is; window: every layer's attention window, 0 for none; final_norm: the model's final "
      "norm weight, applied after the last layer, or 0; stop_flag: the address of an int32 read before each "
      "layer, or 0); bf16 activations, an fp32 residual stream, packed bf16 or quantized weights. Returns False "
      "if the flag stopped it (the step half done), else True.");
}

}  // namespace

PYENGINE_REGISTER_OPS(register_decoder_ops);
