// reshape_and_cache (CPU): write this step's K/V rows into the paged KV cache.
//
// Layouts (element strides, all row-major):
//   key, value      [T, KVH, D]; token stride key_stride / value_stride, heads and D contiguous
//                   (so a column slice of a fused QKV projection works without a copy)
//   k_cache [NB, KVH, D/2, BS, 2], v_cache [NB, KVH, BS/2, D, 2]: the CPU cache layout. Per (block,
//                   kv head) tile, K holds pairs of dims of each token ([D/2][BS][2]) and V pairs of
//                   tokens of each dim ([BS/2][D][2]): the operand layouts of vdpbf16ps for QK
//                   (tokens in lanes) and PV (dims in lanes), so attention reads them without shuffles.
//   k_scales, v_scales [NB, KVH, BS] fp32 (fp8/int8 caches only)
//   slot_mapping    [T] int64, slot = block * BS + offset; -1 = skip the token
// Source dtype fp32/bf16/fp16; the cache has the same dtype (plain copy) or fp8 e4m3 / int8
// (quantized per (token, kv head) row, see kv_quant.h).
// Parallel shape: tokens in contiguous ranges over the thread pool; every (token, kv head) row is
// independent. Slots are validated up front so a bad slot raises before anything is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyengine/dtype.h"
#include "pyengine/kv_quant.h"
#include "pyengine/parallel.h"

namespace pyengine {
namespace {

size_t elem_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kFloat8E4M3:
    case DType::kInt8: return 1;
  }
  return 0;
}

void row_to_float(const void* src, DType t, int64_t n, float* dst) {
  if (t == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (t == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(s[i]);
  }
}

// Quantizes one row of n values into dst, returning its scale.
float quantize_row(const float* x, int64_t n, DType cache, void* dst) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const bool fp8 = cache == DType::kFloat8E4M3;
  const float scale = kv_scale(absmax, fp8 ? kFp8E4M3Max : kInt8Max);
  if (fp8) {
    uint8_t* d = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_fp8e4m3(kv_scaled(x[i], scale));
  } else {
    int8_t* d = static_cast<int8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_int8(kv_scaled(x[i], scale));
  }
  return scale;
}

// One token's row of D elements (es bytes each) into its tile at token offset `off`.
void scatter_k(const char* row, char* tile, int64_t off, int64_t BS, int64_t D, size_t es) {
  for (int64_t j = 0; j < D / 2; ++j) std::memcpy(tile + (j * BS + off) * 2 * es, row + 2 * j * es, 2 * es);
}

void scatter_v(const char* row, char* tile, int64_t off, int64_t D, size_t es) {
  char* dst = tile + ((off / 2) * D * 2 + off % 2) * es;
  for (int64_t d = 0; d < D; ++d) std::memcpy(dst + 2 * d * es, row + d * es, es);
}

}  // namespace

void reshape_and_cache_cpu(const void* key, const void* value, void* k_cache, void* v_cache, float* k_scales,
                           float* v_scales, const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                           int64_t head_dim, int64_t key_stride, int64_t value_stride, int64_t num_blocks,
                           int64_t block_size, DType src_dtype, DType cache_dtype) {
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < -1 || slot >= num_slots)
      throw std::invalid_argument("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot) +
                                  " is outside [-1, " + std::to_string(num_slots) +
                                  ") (num_blocks * block_size; -1 = skip)");
  }
  const bool quant = cache_dtype == DType::kFloat8E4M3 || cache_dtype == DType::kInt8;
  if (!quant && cache_dtype != src_dtype) throw std::invalid_argument("cache dtype must match key/value dtype");
  if (quant && (k_scales == nullptr || v_scales == nullptr))
    throw std::invalid_argument("fp8/int8 caches need k_scales and v_scales");
  if (block_size % 2 || head_dim % 2)
    throw std::invalid_argument("block_size and head_dim must be even (the CPU cache layout)");
  const size_t src_es = elem_size(src_dtype), cache_es = elem_size(cache_dtype);
  const size_t tile_bytes = block_size * head_dim * cache_es;

  auto& pool = ThreadPool::instance();
  const int64_t nchunks = std::min<int64_t>(num_tokens, pool.num_threads() * 4);
  pool.parallel_for(nchunks, [&](int64_t c) {
    const int64_t t0 = num_tokens * c / nchunks, t1 = num_tokens * (c + 1) / nchunks;
    std::vector<float> row(quant ? head_dim : 0);
    std::vector<char> codes(quant ? head_dim : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t tile = blk * num_kv_heads + h, row_idx = tile * block_size + off;
        const char* ks = static_cast<const char*>(key) + (t * key_stride + h * head_dim) * src_es;
        const char* vs = static_cast<const char*>(value) + (t * value_stride + h * head_dim) * src_es;
        char* kd = static_cast<char*>(k_cache) + tile * tile_bytes;
        char* vd = static_cast<char*>(v_cache) + tile * tile_bytes;
        if (!quant) {
          scatter_k(ks, kd, off, block_size, head_dim, cache_es);
          scatter_v(vs, vd, off, head_dim, cache_es);
          continue;
        }
        row_to_float(ks, src_dtype, head_dim, row.data());
        k_scales[row_idx] = quantize_row(row.data(), head_dim, cache_dtype, codes.data());
        scatter_k(codes.data(), kd, off, block_size, head_dim, 1);
        row_to_float(vs, src_dtype, head_dim, row.data());
        v_scales[row_idx] = quantize_row(row.data(), head_dim, cache_dtype, codes.data());
        scatter_v(codes.data(), vd, off, head_dim, 1);
      }
    }
  });
}

}  // namespace pyengine
