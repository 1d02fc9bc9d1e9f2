// Bindings of the CUDA paged-KV kernels (native/cuda/attention.cu): the names
// and argument lists of native/bindings/cpu_attention.cpp (the CPU-only
// read_bandwidth probe excepted) and the CUDA-only prefill_attention; `stream` is the cudaStream_t to launch on.
#include "../cuda/ops.cuh"
#include "registry.h"

namespace py = pybind11;

namespace {
void register_attention(py::module_& m) {
  namespace pc = pyengine::cuda;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &pc::paged_attention, py::arg("out"), py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scales"), py::arg("v_scales"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("num_tokens"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("q_token_stride"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("num_seqs"), py::arg("max_blocks_per_seq"), py::arg("max_seq_len"), py::arg("scale"),
        py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("stream"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        nogil,
        "Causal paged attention over a mixed step (layouts: native/cuda/attention.cu).");
  m.def("prefill_attention", &pc::prefill_attention, py::arg("out"), py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scales"), py::arg("v_scales"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("num_tokens"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("q_token_stride"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("num_seqs"), py::arg("max_blocks_per_seq"), py::arg("max_seq_len"), py::arg("scale"),
        py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("stream"), py::arg("window"), py::arg("softcap"),
        py::arg("max_query_len"), nogil,
        "paged_attention for steps with prompt chunks: FlashAttention-2 on tensor cores where it applies "
        "(native/cuda/prefill_attention.cu), else paged_attention.");
  m.def("reshape_and_cache", &pc::reshape_and_cache, py::arg("key"), py::arg("value"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scales"), py::arg("v_scales"), py::arg("slot_mapping"), py::arg("num_tokens"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("key_token_stride"), py::arg("value_token_stride"),
        py::arg("num_blocks"), py::arg("block_size"), py::arg("src_dtype"), py::arg("cache_dtype"),
        py::arg("stream"), py::arg("query") = 0, py::arg("query_token_stride") = 0, py::arg("num_heads") = 0, nogil,
        "Write K/V rows into the paged cache at slot_mapping (fp8/int8: quantize; fp8 K rounded for query).");
}
}  // namespace

PYENGINE_REGISTER_OPS(register_attention);
