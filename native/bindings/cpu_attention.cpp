// pybind11 bindings of the attention-side CPU ops. The CUDA module registers the same names with
// the same argument lists (pointers are tensor.data_ptr() values; dtype codes follow DType in
// pyengine/dtype.h; strides are in elements; `stream` is the CUDA stream handle, ignored on CPU):
//
//   paged_attention(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens,
//                   query_start_loc, num_tokens, num_heads, num_kv_heads, head_dim, q_token_stride,
//                   num_blocks, block_size, num_seqs, max_blocks_per_seq, max_seq_len, scale,
//                   q_dtype, cache_dtype, stream, window=0, softcap=0.0) -> None
//     out [T, H, D] contiguous, q [T, H, D] with token stride q_token_stride; caches
//     [num_blocks, KVH, block_size, D]; k_scales/v_scales [num_blocks, KVH, block_size] fp32 or 0
//     (required for fp8/int8 caches); block_tables [num_seqs, max_blocks_per_seq] int32; seq_lens
//     [num_seqs] int32; query_start_loc [num_seqs + 1] int32; max_seq_len: an upper bound on
//     seq_lens; window > 0: each query sees only the last `window` positions up to its own;
//     softcap > 0: scores s -> softcap * tanh(s / softcap). Bad index values raise ValueError (CPU).
//
//   reshape_and_cache(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, num_tokens,
//                     num_kv_heads, head_dim, key_token_stride, value_token_stride, num_blocks,
//                     block_size, src_dtype, cache_dtype, stream, query=0, query_token_stride=0,
//                     num_heads=0) -> None
//     key/value [T, KVH, D] with the given token strides; slot_mapping [T] int64 (-1 = skip);
//     k_scales/v_scales as above (0 for unquantized caches); query [T, num_heads, D] (src dtype) or 0:
//     the step's q, for which fp8 and int8 caches round K (native/cpu/kv_cache.cpp).
//
//   set_prefill_attention_path(name) -> None; prefill_attention_path() -> str   (CPU only)
//     The prefill kernel's path for prompts (>= 16 query tokens of a bf16 step; native/cpu/
//     attention/prefill.cpp): "amx", "avx512_bf16", "portable" or "paged" (none: prompts run on the
//     decode kernel, the best an AVX2 build without AVX512-BF16 has). set caps it (tests run each path;
//     default "amx": the best the build and machine have); get names the one that runs. fp32 steps over
//     an fp32 cache: prefill_attention_path("float32") is "avx2_fp32" (native/cpu/attention/prefill_fp32.cpp) on
//     AVX2 + FMA builds, or "paged" (capped so, or no AVX2).
//   set_decode_attention_path(name) -> None; decode_attention_path() -> str   (CPU only)
//     The decode kernel's path (the other sequences of a step; native/cpu/attention/paged.cpp):
//     "avx512_fp16" (fp8 caches in fp16 FMAs; otherwise as avx512_bf16), "avx512_bf16", "avx2" (bf16,
//     fp8, int8 and fp32 caches read in place with AVX2 FMAs / vpmaddwd) or "fp32", capped the same way
//     (default "avx512_fp16": the best the build has).
//
//   read_bandwidth(ptr, nbytes, stream) -> int       (CPU only: benchmark probe)
//     Reads nbytes (a multiple of 64) once with the thread pool; returns a checksum.
//   read_tiles(ptr, tile_bytes, tiles, ntiles) -> int   (CPU only: benchmark probe)
//     Reads the tiles ptr + tiles[i] * tile_bytes (tiles: int64 indices, tile_bytes a multiple of 64) in
//     the list's order, as a paged kernel reads its blocks, the list split over the thread pool in
//     runs; returns the sum of their 64-bit words.
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "pyengine/cpu_ops.h"
#include "pyengine/dtype.h"
#include "pyengine/parallel.h"
#include "registry.h"

#if defined(__AVX512F__)
#include <immintrin.h>
// GCC 12 flags the _mm512_undefined_*() placeholders inside its own intrinsics as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace py = pybind11;

namespace pyengine {

namespace {

DType to_dtype(int code) {
  if (code < 0 || code > static_cast<int>(DType::kInt8)) throw std::invalid_argument("unknown dtype code");
  return static_cast<DType>(code);
}

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// The sum of the 64-bit words of lines [l0, l1) (64 bytes each) at base: a plain read, two loads in flight.
uint64_t sum_lines(const char* base, int64_t l0, int64_t l1) {
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0;
  int64_t l = l0;
  for (; l + 1 < l1; l += 2) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(base + l * 64));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(base + (l + 1) * 64));
  }
  if (l < l1) a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(base + l * 64));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
#else
  const uint64_t* w = reinterpret_cast<const uint64_t*>(base);
  uint64_t acc[8] = {};
  for (int64_t l = l0; l < l1; ++l)
    for (int i = 0; i < 8; ++i) acc[i] += w[l * 8 + i];
  uint64_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += acc[i];
  return sum;
#endif
}

// n items split over the thread pool in runs; item_sum(i) for each; the sum of all.
template <class ItemSum>
uint64_t sum_over_threads(int64_t n, ItemSum item_sum) {
  auto& pool = ThreadPool::instance();
  const int64_t nparts = pool.num_threads();
  std::vector<uint64_t> sums(nparts * 8, 0);  // one cache line per part
  pool.parallel_for(nparts, [&](int64_t part) {
    for (int64_t i = n * part / nparts; i < n * (part + 1) / nparts; ++i) sums[part * 8] += item_sum(i);
  });
  uint64_t total = 0;
  for (int64_t part = 0; part < nparts; ++part) total += sums[part * 8];
  return total;
}

uint64_t read_bandwidth(uintptr_t p, int64_t nbytes, uintptr_t /*stream*/) {
  if (nbytes % 64 != 0) throw std::invalid_argument("read_bandwidth: nbytes must be a multiple of 64");
  const int64_t nparts = ThreadPool::instance().num_threads(), nlines = nbytes / 64;
  return sum_over_threads(nparts, [&](int64_t part) {
    return sum_lines(ptr<const char>(p), nlines * part / nparts, nlines * (part + 1) / nparts);
  });
}

uint64_t read_tiles(uintptr_t p, int64_t tile_bytes, uintptr_t tiles, int64_t ntiles) {
  if (tile_bytes <= 0 || tile_bytes % 64 != 0)
    throw std::invalid_argument("read_tiles: tile_bytes must be a positive multiple of 64");
  const int64_t* index = ptr<const int64_t>(tiles);
  return sum_over_threads(ntiles, [&](int64_t i) {
    return sum_lines(ptr<const char>(p) + index[i] * tile_bytes, 0, tile_bytes / 64);
  });
}

void register_attention_ops(py::module_& m) {
  m.def(
      "paged_attention",
      [](uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales, uintptr_t v_scales,
         uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc, int64_t num_tokens, int64_t num_heads,
         int64_t num_kv_heads, int64_t head_dim, int64_t q_token_stride, int64_t num_blocks, int64_t block_size,
         int64_t num_seqs, int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype,
         int cache_dtype, uintptr_t /*stream*/, int64_t window, double softcap) {
        attention_step_cpu(ptr<void>(out), ptr<const void>(q), ptr<const void>(k_cache), ptr<const void>(v_cache),
                           ptr<const float>(k_scales), ptr<const float>(v_scales), ptr<const int32_t>(block_tables),
                           ptr<const int32_t>(seq_lens), ptr<const int32_t>(query_start_loc), num_tokens, num_heads,
                           num_kv_heads, head_dim, q_token_stride, num_blocks, block_size, num_seqs,
                           max_blocks_per_seq, max_seq_len, static_cast<float>(scale), to_dtype(q_dtype),
                           to_dtype(cache_dtype), window, static_cast<float>(softcap));
      },
      py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scales"), py::arg("v_scales"),
      py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("num_tokens"),
      py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("q_token_stride"),
      py::arg("num_blocks"), py::arg("block_size"), py::arg("num_seqs"), py::arg("max_blocks_per_seq"),
      py::arg("max_seq_len"), py::arg("scale"), py::arg("q_dtype"), py::arg("cache_dtype"), py::arg("stream"),
      py::arg("window") = 0, py::arg("softcap") = 0.0, py::call_guard<py::gil_scoped_release>(),
      "Causal paged attention over a mixed step (see native/cpu/attention/step.cpp).");
  m.def(
      "reshape_and_cache",
      [](uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
         uintptr_t v_scales, uintptr_t slot_mapping, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
         int64_t key_token_stride, int64_t value_token_stride, int64_t num_blocks, int64_t block_size, int src_dtype,
         int cache_dtype, uintptr_t /*stream*/, uintptr_t query, int64_t query_token_stride, int64_t num_heads) {
        reshape_and_cache_cpu(ptr<const void>(key), ptr<const void>(value), ptr<void>(k_cache), ptr<void>(v_cache),
                              ptr<float>(k_scales), ptr<float>(v_scales), ptr<const int64_t>(slot_mapping),
                              num_tokens, num_kv_heads, head_dim, key_token_stride, value_token_stride, num_blocks,
                              block_size, to_dtype(src_dtype), to_dtype(cache_dtype), ptr<const void>(query),
                              query_token_stride, num_heads);
      },
      py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scales"),
      py::arg("v_scales"), py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("num_kv_heads"),
      py::arg("head_dim"), py::arg("key_token_stride"), py::arg("value_token_stride"), py::arg("num_blocks"),
      py::arg("block_size"), py::arg("src_dtype"), py::arg("cache_dtype"), py::arg("stream"), py::arg("query") = 0,
      py::arg("query_token_stride") = 0, py::arg("num_heads") = 0, py::call_guard<py::gil_scoped_release>(),
      "Write K/V rows into the paged cache at slot_mapping.");
  m.def("set_prefill_attention_path", &set_prefill_attention_path, py::arg("name"),
        "Cap the prefill attention kernel's path: amx (default: the best available), avx512_fp32, avx512_bf16, portable, paged.");
  m.def("prefill_attention_path", &prefill_attention_path, py::arg("q_dtype") = "bfloat16",
        "The prefill attention kernel's path in use for prompts with q of q_dtype (bfloat16 or float32).");
  m.def("set_decode_attention_path", &set_decode_attention_path, py::arg("name"),
        "Cap the decode attention kernel's path: avx512_fp16 (default: the best available), avx512_bf16, avx2 or fp32.");
  m.def("decode_attention_path", &decode_attention_path, "The decode attention kernel's path for bf16 q.");
  m.def("read_bandwidth", &read_bandwidth, py::arg("ptr"), py::arg("nbytes"), py::arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "Benchmark probe: read nbytes once with the thread pool, return a checksum.");
  m.def("read_tiles", &read_tiles, py::arg("ptr"), py::arg("tile_bytes"), py::arg("tiles"), py::arg("ntiles"),
        py::call_guard<py::gil_scoped_release>(),
        "Benchmark probe: read the tiles ptr + tiles[i] * tile_bytes in order with the thread pool, return their "
        "sum.");
}

}  // namespace

PYENGINE_REGISTER_OPS(register_attention_ops);

}  // namespace pyengine
