// Paged KV cache: reshape_and_cache (write + optional fp8/int8 quantization)
// and paged_attention (variable-length causal GQA attention over the cache).
//
// Layouts:
//   key/value      [T, KVH, D]   token rows key/value_token_stride elements apart, heads D apart
//   k/v cache      [num_blocks, KVH, block_size, D]  element type = q dtype, fp8 e4m3 or int8
//   k/v scales     [num_blocks, KVH, block_size] fp32  (quantized caches only)
//   slot_mapping   [T] int64  block_id * block_size + offset, -1 = skip
//   q, out         [T, H, D]  q token rows q_token_stride apart; out contiguous
//   block_tables   [S, max_blocks] int32; seq_lens [S] int32; query_start_loc [S+1] int32
//
// Quantization (per token, per kv head; the functions of kv_quant.h, shared
// with the CPU): scale = absmax / qmax (qmax 448 for e4m3, 127 for int8);
// stored = encode(x / scale) (round to nearest even, saturating; a row of
// zeros stores scale 0 and zeros); dequantized value = stored * scale.
// Index values are trusted up to bounds: a slot outside [0, num_blocks *
// block_size) is skipped, a key whose block id is outside [0, num_blocks) is
// masked out (the GPU cannot raise without a host sync).
//
// Launch shapes:
//   reshape_and_cache  grid.x = T; 4 warps, each warp one (kv head, K or V) row at a time.
//   paged_attention    grid = (T, H); 8 warps. Warp w takes keys 4w..4w+3, then 4w+32..,
//                      of the query's causal range; lane i holds dims i, i+32, ... (D <= 256)
//                      of q, and of its running output; each warp keeps an online
//                      softmax (max, sum); the warps are merged through shared memory.
#include <cuda_fp8.h>

#include "common.cuh"
#include "ops.cuh"
#include "pyengine/kv_quant.h"

namespace pyengine {
namespace cuda {
namespace {

using fp8 = __nv_fp8_e4m3;

// Cache element codec: C == T stores the value as is; fp8/int8 use the shared
// encoders of kv_quant.h (bit-identical to the CPU) and CUDA's fp8 decoder.
template <typename C>
struct Codec {
  static constexpr bool kQuant = false;
  __device__ static C encode(float v, float /*scale*/) { return from_float<C>(v); }
  __device__ static float decode(C c) { return to_float(c); }
};
template <>
struct Codec<fp8> {
  static constexpr bool kQuant = true;
  static constexpr float kQmax = kFp8E4M3Max;
  __device__ static fp8 encode(float v, float scale) {
    fp8 r;
    r.__x = float_to_fp8e4m3(kv_scaled(v, scale));
    return r;
  }
  __device__ static float decode(fp8 c) { return static_cast<float>(c); }
};
template <>
struct Codec<int8_t> {
  static constexpr bool kQuant = true;
  static constexpr float kQmax = kInt8Max;
  __device__ static int8_t encode(float v, float scale) { return float_to_int8(kv_scaled(v, scale)); }
  __device__ static float decode(int8_t c) { return int8_to_float(c); }
};

constexpr int kCacheWarps = 4;

template <typename T, typename C>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value, C* __restrict__ kc,
                                         C* __restrict__ vc, float* __restrict__ ks, float* __restrict__ vs,
                                         const int64_t* __restrict__ slot_mapping, int KVH, int D, int BS,
                                         int64_t key_stride, int64_t value_stride, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;
  const int64_t blk = slot / BS, off = slot % BS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int task = warp; task < 2 * KVH; task += kCacheWarps) {
    const int g = task >> 1;
    const bool is_v = task & 1;
    const T* src = (is_v ? value + t * value_stride : key + t * key_stride) + static_cast<int64_t>(g) * D;
    const int64_t row = (blk * KVH + g) * BS + off;  // index into [num_blocks, KVH, BS]
    C* dst = (is_v ? vc : kc) + row * D;
    float scale = 1.f;
    if constexpr (Codec<C>::kQuant) {
      float amax = 0.f;
      for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
      scale = kv_scale(warp_max(amax), Codec<C>::kQmax);
      if (lane == 0) (is_v ? vs : ks)[row] = scale;
    }
    for (int d = lane; d < D; d += 32) dst[d] = Codec<C>::encode(to_float(src[d]), scale);
  }
}

constexpr int kAttnWarps = 8;
constexpr int kKeysPerIter = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

template <typename T, typename C>
__global__ void __launch_bounds__(kAttnWarps * 32)
    paged_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ kc,
                           const C* __restrict__ vc, const float* __restrict__ ks, const float* __restrict__ vs,
                           const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                           const int* __restrict__ qsl, int S, int H, int KVH, int D, int BS, int max_blocks,
                           int num_blocks, int64_t q_stride, float scale) {
  __shared__ float sm_m[kAttnWarps], sm_l[kAttnWarps], sm_acc[kAttnWarps][kMaxHeadDim];
  const int t = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  // Sequence of token t: the last s with qsl[s] <= t.
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int s = lo;
  const int q_len = qsl[s + 1] - qsl[s], seq_len = seq_lens[s];
  // Token j of the chunk sits at position seq_len - q_len + j and sees keys [0, pos].
  const int n_keys = max(0, min(min(seq_len, max_blocks * BS), seq_len - q_len + (t - qsl[s]) + 1));
  const int g = h / (H / KVH);
  const int* bt = block_tables + static_cast<int64_t>(s) * max_blocks;

  float qv[kPerLane], acc[kPerLane];
  const T* qrow = q + t * q_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < D ? to_float(qrow[d]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  // Each warp takes kKeysPerIter consecutive keys per iteration: their loads are independent,
  // so they are in flight together. Everything below is uniform across the warp.
  for (int base = warp * kKeysPerIter; base < n_keys; base += kAttnWarps * kKeysPerIter) {
    int64_t rows[kKeysPerIter];
    bool valid[kKeysPerIter];
#pragma unroll
    for (int j = 0; j < kKeysPerIter; ++j) {
      const int key = base + j;
      const int blk = key < n_keys ? bt[key / BS] : -1;
      valid[j] = blk >= 0 && blk < num_blocks;  // out-of-range block ids are masked out
      rows[j] = valid[j] ? (static_cast<int64_t>(blk) * KVH + g) * BS + key % BS : 0;
    }
    float dots[kKeysPerIter];
#pragma unroll
    for (int j = 0; j < kKeysPerIter; ++j) {
      const C* kp = kc + rows[j] * D;
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        if (valid[j] && d < D) dot += qv[i] * Codec<C>::decode(kp[d]);
      }
      dots[j] = dot;
    }
    float m_new = m;
#pragma unroll
    for (int j = 0; j < kKeysPerIter; ++j) {
      dots[j] = warp_sum(dots[j]);
      if constexpr (Codec<C>::kQuant) {
        if (valid[j]) dots[j] *= ks[rows[j]];
      }
      if (!valid[j]) dots[j] = -INFINITY;
      m_new = fmaxf(m_new, dots[j]);
    }
    if (m_new == -INFINITY) continue;  // no valid key in this group
    const float corr = expf(m - m_new);  // 0 while m is still -inf
    float pv[kKeysPerIter];
    l *= corr;
#pragma unroll
    for (int j = 0; j < kKeysPerIter; ++j) {
      const float p = valid[j] ? expf(dots[j] - m_new) : 0.f;
      l += p;
      pv[j] = p;
      if constexpr (Codec<C>::kQuant) {
        if (valid[j]) pv[j] *= vs[rows[j]];
      }
    }
    m = m_new;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d >= D) continue;
      float a = acc[i] * corr;
#pragma unroll
      for (int j = 0; j < kKeysPerIter; ++j)
        if (valid[j]) a += pv[j] * Codec<C>::decode(vc[rows[j] * D + d]);
      acc[i] = a;
    }
  }

#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < D) sm_acc[warp][d] = acc[i];
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
  __syncthreads();
  float gm = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) gm = fmaxf(gm, sm_m[w]);
  float wgt[kAttnWarps], denom = 0.f;
  for (int w = 0; w < kAttnWarps; ++w) {
    wgt[w] = sm_l[w] > 0.f ? expf(sm_m[w] - gm) : 0.f;  // warps that saw no key weigh 0
    denom += sm_l[w] * wgt[w];
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  T* orow = out + (static_cast<int64_t>(t) * H + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) o += sm_acc[w][d] * wgt[w];
    orow[d] = from_float<T>(o * inv);
  }
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Runs the body with `cache_t` bound to the cache element type: scalar_t when
// the cache has the activations' dtype, else fp8 e4m3 or int8.
#define DISPATCH_CACHE(cache_dtype, act_dtype, op, ...)                                                      \
  do {                                                                                            \
    const int cd_ = (cache_dtype);                                                                \
    if (cd_ == static_cast<int>(DType::kFloat8E4M3)) {                                            \
      using cache_t = fp8;                                                                        \
      __VA_ARGS__;                                                                                \
    } else if (cd_ == static_cast<int>(DType::kInt8)) {                                           \
      using cache_t = int8_t;                                                                     \
      __VA_ARGS__;                                                                                \
    } else if (cd_ == (act_dtype)) {                                                              \
      using cache_t = scalar_t;                                                                   \
      __VA_ARGS__;                                                                                \
    } else {                                                                                      \
      throw std::invalid_argument(std::string("pyengine._cuda.") + op +                           \
                                  ": cache dtype code " + std::to_string(cd_) +                   \
                                  " must equal the activations' or be fp8 e4m3/int8");            \
    }                                                                                             \
  } while (0)

}  // namespace

void reshape_and_cache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                       uintptr_t v_scales, uintptr_t slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t head_dim, int64_t key_token_stride, int64_t value_token_stride, int64_t num_blocks,
                       int64_t block_size, int src_dtype, int cache_dtype, uintptr_t stream) {
  const char* op = "reshape_and_cache";
  const bool quant = cache_dtype == static_cast<int>(DType::kFloat8E4M3) || cache_dtype == static_cast<int>(DType::kInt8);
  if (quant && (k_scales == 0 || v_scales == 0))
    throw std::invalid_argument("pyengine._cuda.reshape_and_cache: fp8/int8 caches need k_scales and v_scales");
  if (num_tokens == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(k_cache), op);
  PYENGINE_DISPATCH_FLOAT(src_dtype, op, {
    DISPATCH_CACHE(cache_dtype, src_dtype, op, {
      reshape_and_cache_kernel<scalar_t, cache_t><<<num_tokens, kCacheWarps * 32, 0, as_stream(stream)>>>(
          ptr<const scalar_t>(key), ptr<const scalar_t>(value), ptr<cache_t>(k_cache), ptr<cache_t>(v_cache),
          ptr<float>(k_scales), ptr<float>(v_scales), ptr<const int64_t>(slot_mapping), num_kv_heads, head_dim,
          block_size, key_token_stride, value_token_stride, num_blocks * block_size);
    });
  });
  check_launch(op);
}

void paged_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                     uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                     int64_t max_blocks_per_seq, int64_t /*max_seq_len*/, double scale, int q_dtype, int cache_dtype,
                     uintptr_t stream) {
  const char* op = "paged_attention";
  auto fail = [](const char* what) { throw std::invalid_argument(std::string("pyengine._cuda.paged_attention: ") + what); };
  if (head_dim <= 0 || head_dim > kMaxHeadDim) fail("head_dim must be in [1, 256]");
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) fail("num_heads must be a multiple of num_kv_heads");
  if (num_heads > 65535) fail("num_heads must be <= 65535");
  if (block_size <= 0) fail("block_size must be positive");
  const bool quant = cache_dtype == static_cast<int>(DType::kFloat8E4M3) || cache_dtype == static_cast<int>(DType::kInt8);
  if (quant && (k_scales == 0 || v_scales == 0)) fail("fp8/int8 caches need k_scales and v_scales");
  if (num_tokens == 0 || num_seqs == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(q), op);
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(num_heads));
  PYENGINE_DISPATCH_FLOAT(q_dtype, op, {
    DISPATCH_CACHE(cache_dtype, q_dtype, op, {
      paged_attention_kernel<scalar_t, cache_t><<<grid, kAttnWarps * 32, 0, as_stream(stream)>>>(
          ptr<scalar_t>(out), ptr<const scalar_t>(q), ptr<const cache_t>(k_cache), ptr<const cache_t>(v_cache),
          ptr<const float>(k_scales), ptr<const float>(v_scales), ptr<const int>(block_tables),
          ptr<const int>(seq_lens), ptr<const int>(query_start_loc), num_seqs, num_heads, num_kv_heads, head_dim,
          block_size, max_blocks_per_seq, num_blocks, q_token_stride, static_cast<float>(scale));
    });
  });
  check_launch(op);
}

}  // namespace cuda
}  // namespace pyengine
