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
// with the CPU): int8 scale = absmax / 127, e4m3 the best of kFp8ScaleSteps candidates;
// stored = encode(x / scale) (round to nearest even, saturating; a row of
// zeros stores scale 0 and zeros); dequantized value = stored * scale. K rows
// written with the step's q may take a value's other neighbouring code instead
// (round_k_for_queries).
// Index values are trusted up to bounds: a slot outside [0, num_blocks *
// block_size) is skipped, a key whose block id is outside [0, num_blocks) is
// masked out (the GPU cannot raise without a host sync).
//
// Launch shapes:
//   reshape_and_cache  grid.x = T; 4 warps, each warp one (kv head, K or V) row at a time.
//   paged_attention    split-KV ("flash-decoding") kernel, used when head_dim * elem is a multiple
//                      of one vector load (16 B; 8 B for fp8/int8) with <= 32 loads per row:
//     grid = (T, KVH * ceil(G / GT), nsplit), 128 threads; G = H / KVH q heads per kv head, served
//       GT (1, 2, 4 or 8) at a time, so each K/V row is read once per GT heads.
//     Lanes per key LPK = pow2ceil(D / vec) (a "lane group"): lane i of a group holds q and the
//       output accumulator for dims [i*vec, (i+1)*vec) of all GT heads; each group takes KPI
//       consecutive keys per step (4; 2 when GT = 8), all loads issued before use, dots reduced
//       by xor shuffles inside the group; online softmax (base 2) per group; groups merged
//       through shared memory at the end.
//     Split z covers keys [z * split_len, (z + 1) * split_len) of the token's causal range (the
//       last split: up to its end). nsplit = 1: the kernel writes out. Otherwise it writes
//       per (token, q head, split) partials (max, sum, unnormalized acc[D]) to a workspace and
//       merge_splits_kernel (grid T * H, <= 128 threads) combines them.
//     Splits: from max_seq_len (the host cannot see seq_lens; shorter rows leave their last
//       splits empty), the nsplit minimizing waves(T * KVH * head chunks * nsplit over resident
//       CTAs = occupancy x SMs) x keys per split, each split >= 128 keys, nsplit <= 128,
//       split_len a multiple of the CTA's keys per step; more splits only for a > 3% gain.
//     Workspace: stream-ordered cudaMallocAsync/cudaFreeAsync on `stream` (safe with concurrent
//       streams and graph capture, where one cached buffer would race); the device's default pool
//       keeps freed memory (its release threshold is raised once), so repeat calls reuse it.
//   decodes_only (paged_attention_rows, for prefill_attention.cu): CTAs (and merges) of tokens whose
//     sequence has more than one query token return at once; the tensor-core kernel writes those rows.
//   generic fallback   (other head_dim / alignments) grid = (T, H); 8 warps. Warp w takes keys
//                      4w..4w+3, then 4w+32.., of the query's causal range; lane i holds dims
//                      i, i+32, ... (D <= 256) of q and of its running output; per-warp online
//                      softmax; the warps are merged through shared memory.
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

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
constexpr int kMaxFlips = 16;     // round_k_for_queries: as native/cpu/kv_cache.cpp
constexpr int kMaxGroup = 16;     // q heads per kv head it handles (larger groups round to nearest)
constexpr int kMaxRowSlots = 8;   // values per lane (head_dim <= 256)

// The bits of an fp8 or int8 code.
__device__ __forceinline__ uint8_t code_bits(fp8 c) { return c.__x; }
__device__ __forceinline__ uint8_t code_bits(int8_t c) { return static_cast<uint8_t>(c); }

// The value of code c (its bits) of an fp8 or int8 cache, before the row's scale.
template <typename C>
__device__ __forceinline__ float code_value(uint8_t c) {
  if constexpr (std::is_same_v<C, fp8>) return fp8e4m3_to_float(c);
  else return static_cast<float>(static_cast<int8_t>(c));
}

// native/cpu/kv_cache.cpp's round_k_for_queries for one warp's K row (values d = lane + 32 r) of an fp8 or
// int8 (C) cache: codes (their bits) start at round-to-nearest and move, best first and at most once
// each, to their other neighbouring code while J = sum_g (u_g . e)^2 + |e|^2 / D drops; u_g this
// token's q of head g, unit length. q: the group's G rows, D apart.
template <typename C, typename T>
__device__ void round_k_for_queries(const T* __restrict__ src, const T* __restrict__ q, int G, int D, float scale,
                                    uint8_t (&code)[kMaxRowSlots], int lane) {
  float inv[kMaxGroup], p[kMaxGroup], d[kMaxRowSlots], a[kMaxRowSlots];
  const float lambda = 1.f / D;
  for (int g = 0; g < G; ++g) {
    float n = 0.f;
    for (int i = lane; i < D; i += 32) n += to_float(q[g * D + i]) * to_float(q[g * D + i]);
    n = warp_sum(n);
    inv[g] = n > 0.f ? rsqrtf(n) : 0.f;
  }
#pragma unroll
  for (int r = 0; r < kMaxRowSlots; ++r) d[r] = 0.f, a[r] = 0.f;
  for (int g = 0; g < G; ++g) p[g] = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxRowSlots; ++r) {
    const int i = lane + 32 * r;
    if (i >= D) break;
    const float x = to_float(src[i]), v = code_value<C>(code[r]), y = kv_scaled(x, scale), e = v * scale - x;
    if constexpr (std::is_same_v<C, fp8>) {
      const float av = fabsf(v), ay = fabsf(y);
      const int m = code[r] & 0x7f;
      const int other = av < ay && m < 0x7e ? (code[r] & 0x80) | (m + 1) : av > ay ? (code[r] & 0x80) | (m - 1) : -1;
      d[r] = other < 0 ? 0.f : (fp8e4m3_to_float(static_cast<uint8_t>(other)) - v) * scale;
    } else {  // one level toward x, none past +-127
      d[r] = y > v && v < kInt8Max ? scale : y < v && v > -kInt8Max ? -scale : 0.f;
    }
    float uu = 0.f;
    for (int g = 0; g < G; ++g) {
      const float u = to_float(q[g * D + i]) * inv[g];
      p[g] += u * e;
      uu += u * u;
    }
    a[r] = d[r] * d[r] * (uu + lambda) + 2.f * lambda * e * d[r];
  }
  for (int g = 0; g < G; ++g) p[g] = warp_sum(p[g]);
  for (int flip = 0; flip < kMaxFlips; ++flip) {
    float best = 0.f;
    int best_i = -1;
#pragma unroll
    for (int r = 0; r < kMaxRowSlots; ++r) {
      const int i = lane + 32 * r;
      if (i >= D || d[r] == 0.f) continue;
      float dj = a[r];
      for (int g = 0; g < G; ++g) dj += p[g] * 2.f * d[r] * to_float(q[g * D + i]) * inv[g];
      if (dj < best) best = dj, best_i = i;
    }
    for (int o = 16; o > 0; o >>= 1) {  // the warp's least change, the lower index on ties
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (oi >= 0 && (best_i < 0 || ob < best || (ob == best && oi < best_i))) best = ob, best_i = oi;
    }
    if (best_i < 0) break;
    float moved = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxRowSlots; ++r) {
      if (lane + 32 * r != best_i) continue;
      if constexpr (std::is_same_v<C, fp8>) {  // sign and magnitude: away from zero when d has the code's sign
        const int m = code[r] & 0x7f;
        const bool up = (d[r] > 0.f) != ((code[r] & 0x80) != 0);
        code[r] = static_cast<uint8_t>((code[r] & 0x80) | (up ? m + 1 : m - 1));
      } else {  // two's complement
        code[r] = static_cast<uint8_t>(d[r] > 0.f ? code[r] + 1 : code[r] - 1);
      }
      moved = d[r];
      d[r] = 0.f;
    }
    moved = __shfl_sync(0xffffffffu, moved, best_i & 31);
    for (int g = 0; g < G; ++g) p[g] += to_float(q[g * D + best_i]) * inv[g] * moved;
  }
}

template <typename T, typename C>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value, C* __restrict__ kc,
                                         C* __restrict__ vc, float* __restrict__ ks, float* __restrict__ vs,
                                         const int64_t* __restrict__ slot_mapping, int KVH, int D, int BS,
                                         int64_t key_stride, int64_t value_stride, int64_t num_slots,
                                         const T* __restrict__ query, int64_t query_stride, int G) {
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
      amax = warp_max(amax);
      scale = kv_scale(amax, Codec<C>::kQmax);
      if constexpr (std::is_same_v<C, fp8>) {  // the candidate of least squared error (kv_quant.h)
        float best_err = INFINITY;
        for (int j = 0; j < kFp8ScaleSteps; ++j) {
          const float s = fp8_scale_candidate(amax, j);
          float err = 0.f;
          for (int d = lane; d < D; d += 32) err += fp8_sq_error(to_float(src[d]), s);
          err = warp_sum(err);  // the same total on every lane, so every lane picks the same scale
          if (err < best_err) scale = s, best_err = err;
        }
      }
      if (lane == 0) (is_v ? vs : ks)[row] = scale;
    }
    if constexpr (Codec<C>::kQuant) {
      if (!is_v && query != nullptr && G <= kMaxGroup && D <= 32 * kMaxRowSlots && scale > 0.f) {
        uint8_t code[kMaxRowSlots];  // the codes' bits
#pragma unroll
        for (int r = 0; r < kMaxRowSlots; ++r)
          code[r] = lane + 32 * r < D ? code_bits(Codec<C>::encode(to_float(src[lane + 32 * r]), scale)) : 0;
        round_k_for_queries<C>(src, query + t * query_stride + static_cast<int64_t>(g) * G * D, G, D, scale, code,
                               lane);
#pragma unroll
        for (int r = 0; r < kMaxRowSlots; ++r)
          if (lane + 32 * r < D) std::memcpy(&dst[lane + 32 * r], &code[r], 1);
        continue;
      }
    }
    for (int d = lane; d < D; d += 32) dst[d] = Codec<C>::encode(to_float(src[d]), scale);
  }
}

// Sequence of query token t (the last s with qsl[s] <= t) and how many keys it sees: token j of a
// chunk of q_len sits at position seq_len - q_len + j and sees keys [0, pos] (at most `cap`).
struct TokenRange {
  int seq, n_keys, q_len;
};
__device__ __forceinline__ TokenRange token_range(const int* qsl, const int* seq_lens, int S, int t, int cap) {
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int q_len = qsl[lo + 1] - qsl[lo], seq_len = seq_lens[lo];
  return {lo, max(0, min(min(seq_len, cap), seq_len - q_len + (t - qsl[lo]) + 1)), q_len};
}

constexpr int kSplitThreads = 128;
constexpr int kMinSplitKeys = 128;  // smallest split worth a partial (D floats per head) round trip
constexpr int kMaxSplits = 128;

// One vector load of cache elements: 8 of a 1- or 2-byte type (8 or 16 bytes), 4 fp32 (16 bytes).
template <typename C>
constexpr int kVec = sizeof(C) == 4 ? 4 : 8;
template <typename C>
using VecRaw = std::conditional_t<sizeof(C) == 1, uint2, uint4>;

template <typename C>
__device__ __forceinline__ void decode_vec(const VecRaw<C>& raw, float (&f)[kVec<C>]) {
  const C* c = reinterpret_cast<const C*>(&raw);
#pragma unroll
  for (int e = 0; e < kVec<C>; ++e) f[e] = Codec<C>::decode(c[e]);
}

// Grid (T, KVH * head chunks, nsplit): one CTA = one query token, up to G q heads of one kv head,
// one key split. Scores are kept in base 2 (q is pre-scaled by scale * log2(e)).
// KPI: keys per lane group per step: 4 (159 registers, 3 CTAs/SM); 8 (202 registers, 2 CTAs/SM) was
// slower (docs/performance.md, GPU). The min-blocks bound of 1 lets ptxas use the
// registers it needs: without it some instantiations were capped at 128 and spilled.
template <typename T, typename C, int G>
__global__ void __launch_bounds__(kSplitThreads, 1)
    split_attention_kernel(T* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
                           const T* __restrict__ q, const C* __restrict__ kc, const C* __restrict__ vc,
                           const float* __restrict__ ks, const float* __restrict__ vs,
                           const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                           const int* __restrict__ qsl, int S, int H, int KVH, int D, int BS, int max_blocks,
                           int num_blocks, int64_t q_stride, float scale_log2, int lpk, int split_len,
                           bool decodes_only) {
  constexpr int E = kVec<C>, KPI = G >= 8 ? 2 : 4;
  __shared__ float sm_m[kSplitThreads][G], sm_l[kSplitThreads][G], sm_acc[kSplitThreads * E * G];
  __shared__ float sm_max[G], sm_den[G];
  const int t = blockIdx.x, split = blockIdx.z, nsplit = gridDim.z;
  const int group = H / KVH, chunks = (group + G - 1) / G;
  const int g = blockIdx.y / chunks, h0 = g * group + (blockIdx.y % chunks) * G;
  const int nh = min(G, (g + 1) * group - h0);
  const TokenRange tr = token_range(qsl, seq_lens, S, t, max_blocks * BS);
  if (decodes_only && tr.q_len > 1) return;  // uniform over the CTA; prefill_attention.cu has these rows
  const int k0 = split * split_len, k1 = split == nsplit - 1 ? tr.n_keys : min(tr.n_keys, k0 + split_len);
  const int grp = threadIdx.x / lpk, ngrp = kSplitThreads / lpk, d0 = (threadIdx.x % lpk) * E;
  const bool active = d0 < D;  // lanes past the row only join the shuffles
  const int* bt = block_tables + static_cast<int64_t>(tr.seq) * max_blocks;

  float qv[G][E], acc[G][E], m[G], l[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const T* qrow = q + t * q_stride + static_cast<int64_t>(h0 + h) * D + d0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qv[h][e] = h < nh && active ? to_float(qrow[e]) * scale_log2 : 0.f;
      acc[h][e] = 0.f;
    }
    m[h] = -INFINITY;
    l[h] = 0.f;
  }

  // The loop bounds are uniform over the CTA, so every lane reaches the shuffles.
  for (int base = k0; base < k1; base += ngrp * KPI) {
    VecRaw<C> kr[KPI], vr[KPI];
    float ksc[KPI], vsc[KPI];
    bool valid[KPI];
#pragma unroll
    for (int j = 0; j < KPI; ++j) {  // all loads first: KPI rows of K and V in flight
      const int key = base + grp * KPI + j;
      const int blk = key < k1 ? bt[key / BS] : -1;
      valid[j] = blk >= 0 && blk < num_blocks;  // out-of-range block ids are masked out
      const int64_t row = valid[j] ? (static_cast<int64_t>(blk) * KVH + g) * BS + key % BS : 0;
      kr[j] = vr[j] = VecRaw<C>{};
      if (valid[j] && active) {
        kr[j] = *reinterpret_cast<const VecRaw<C>*>(kc + row * D + d0);
        vr[j] = *reinterpret_cast<const VecRaw<C>*>(vc + row * D + d0);
      }
      ksc[j] = vsc[j] = 1.f;
      if constexpr (Codec<C>::kQuant) {
        if (valid[j]) {
          ksc[j] = ks[row];
          vsc[j] = vs[row];
        }
      }
    }
    float sc[KPI][G];
#pragma unroll
    for (int j = 0; j < KPI; ++j) {
      float kf[E];
      decode_vec<C>(kr[j], kf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += qv[h][e] * kf[e];
        sc[j][h] = dot;
      }
    }
    for (int o = lpk >> 1; o > 0; o >>= 1) {
#pragma unroll
      for (int j = 0; j < KPI; ++j)
#pragma unroll
        for (int h = 0; h < G; ++h) sc[j][h] += __shfl_xor_sync(0xffffffffu, sc[j][h], o);
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float mn = m[h];
#pragma unroll
      for (int j = 0; j < KPI; ++j) {
        sc[j][h] *= ksc[j];
        if (valid[j]) mn = fmaxf(mn, sc[j][h]);
      }
      const float corr = mn == -INFINITY ? 1.f : exp2f(m[h] - mn);  // 0 while m is still -inf
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < KPI; ++j) {
        const float p = valid[j] ? exp2f(sc[j][h] - mn) : 0.f;
        sum += p;
        sc[j][h] = p * vsc[j];  // now the weight of V row j
      }
      l[h] = l[h] * corr + sum;
      m[h] = mn;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[h][e] *= corr;
    }
#pragma unroll
    for (int j = 0; j < KPI; ++j) {
      float vf[E];
      decode_vec<C>(vr[j], vf);
#pragma unroll
      for (int h = 0; h < G; ++h)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] += sc[j][h] * vf[e];
    }
  }

  // Merge the lane groups: per head the max, the rescaled sum, then the rescaled accumulators.
  const int ld = lpk * E;  // >= D
  if (d0 == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      sm_m[grp][h] = m[h];
      sm_l[grp][h] = l[h];
    }
  }
  if (active) {
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int e = 0; e < E; ++e) sm_acc[(grp * G + h) * ld + d0 + e] = acc[h][e];
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int h = threadIdx.x;
    float mx = -INFINITY, den = 0.f;
    for (int r = 0; r < ngrp; ++r) mx = fmaxf(mx, sm_m[r][h]);
    for (int r = 0; r < ngrp; ++r)
      if (sm_l[r][h] > 0.f) den += sm_l[r][h] * exp2f(sm_m[r][h] - mx);  // groups that saw no key weigh 0
    sm_max[h] = mx;
    sm_den[h] = den;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * D; i += kSplitThreads) {
    const int h = i / D, d = i - h * D;
    float o = 0.f;
    for (int r = 0; r < ngrp; ++r)
      if (sm_l[r][h] > 0.f) o += sm_acc[(r * G + h) * ld + d] * exp2f(sm_m[r][h] - sm_max[h]);
    const int64_t oh = static_cast<int64_t>(t) * H + h0 + h;
    if (nsplit == 1) {
      out[oh * D + d] = from_float<T>(sm_den[h] > 0.f ? o / sm_den[h] : 0.f);
    } else {
      const int64_t pi = oh * nsplit + split;
      part_acc[pi * D + d] = o;
      if (d == 0) {
        part_ml[pi * 2] = sm_max[h];
        part_ml[pi * 2 + 1] = sm_den[h];
      }
    }
  }
}

// Grid T * H: combines the nsplit partials of one (token, q head) into its output row.
template <typename T>
__global__ void __launch_bounds__(kSplitThreads)
    merge_splits_kernel(T* __restrict__ out, const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                        int D, int nsplit, const int* __restrict__ seq_lens, const int* __restrict__ qsl, int S,
                        int H, int cap, bool decodes_only) {
  __shared__ float w[kMaxSplits];
  const int64_t oh = blockIdx.x;
  if (decodes_only && token_range(qsl, seq_lens, S, static_cast<int>(oh / H), cap).q_len > 1) return;  // no partials
  const float* ml = part_ml + oh * nsplit * 2;
  const float* acc = part_acc + oh * nsplit * D;
  float mx = -INFINITY;
  for (int j = 0; j < nsplit; ++j) mx = fmaxf(mx, ml[2 * j]);
  for (int j = threadIdx.x; j < nsplit; j += blockDim.x) w[j] = ml[2 * j + 1] > 0.f ? exp2f(ml[2 * j] - mx) : 0.f;
  __syncthreads();
  float den = 0.f;
  for (int j = 0; j < nsplit; ++j) den += ml[2 * j + 1] * w[j];
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int j = 0; j < nsplit; ++j) o += acc[j * D + d] * w[j];
    out[oh * D + d] = from_float<T>(den > 0.f ? o / den : 0.f);
  }
}

constexpr int kAttnWarps = 8;
constexpr int kKeysPerIter = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

template <typename T, typename C>
__global__ void __launch_bounds__(kAttnWarps * 32)
    generic_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ kc,
                           const C* __restrict__ vc, const float* __restrict__ ks, const float* __restrict__ vs,
                           const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                           const int* __restrict__ qsl, int S, int H, int KVH, int D, int BS, int max_blocks,
                           int num_blocks, int64_t q_stride, float scale, bool decodes_only) {
  __shared__ float sm_m[kAttnWarps], sm_l[kAttnWarps], sm_acc[kAttnWarps][kMaxHeadDim];
  const int t = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const TokenRange tr = token_range(qsl, seq_lens, S, t, max_blocks * BS);
  if (decodes_only && tr.q_len > 1) return;  // uniform over the CTA
  const int s = tr.seq, n_keys = tr.n_keys;
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


template <typename T, typename C>
struct AttnArgs {
  T* out;
  const T* q;
  const C *kc, *vc;
  const float *ks, *vs;
  const int *block_tables, *seq_lens, *qsl;
  int64_t T_, S, H, KVH, D, BS, max_blocks, num_blocks, q_stride, max_seq_len;
  double scale;
  bool decodes_only;  // only the rows of sequences with one query token (the others: prefill_attention)
};

// Split-partials workspace, stream-ordered (see the top of the file).
float* split_workspace(size_t floats, cudaStream_t st, const char* op) {
  static std::atomic<uint64_t> raised{0};  // devices whose default pool keeps freed memory
  int dev = 0;
  check_call(cudaGetDevice(&dev), op);
  if (dev >= 64 || !((raised.load() >> dev) & 1)) {
    cudaMemPool_t pool;
    check_call(cudaDeviceGetDefaultMemPool(&pool, dev), op);
    uint64_t keep = UINT64_MAX;
    check_call(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), op);
    if (dev < 64) raised.fetch_or(uint64_t{1} << dev);
  }
  void* p = nullptr;
  check_call(cudaMallocAsync(&p, floats * sizeof(float), st), op);
  return static_cast<float*>(p);
}

template <typename T, typename C, int G>
void launch_split(const AttnArgs<T, C>& a, int lpk, cudaStream_t st, const char* op) {
  constexpr int KPI = G >= 8 ? 2 : 4;  // keys per lane group per step, as in the kernel
  const int64_t chunks = (a.H / a.KVH + G - 1) / G, ctas = a.T_ * a.KVH * chunks;
  const int64_t cap = a.max_blocks * a.BS;
  const int64_t max_keys = a.max_seq_len > 0 ? std::min(a.max_seq_len, cap) : cap;
  static const int per_sm = [] {  // resident CTAs per SM (registers, shared memory)
    int n = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, split_attention_kernel<T, C, G>, kSplitThreads, 0);
    return std::max(n, 1);
  }();
  int dev = 0, sms = 0;
  check_call(cudaGetDevice(&dev), op);
  check_call(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op);
  // Modelled time: waves of resident CTAs x keys per split; more splits only for a > 3% gain.
  const int64_t slots = static_cast<int64_t>(per_sm) * sms, step = (kSplitThreads / lpk) * KPI;
  int64_t nsplit = 1, split_len = std::max<int64_t>(max_keys, 1);
  double best = static_cast<double>((ctas + slots - 1) / slots) * split_len;
  const int64_t most = std::min<int64_t>(kMaxSplits, max_keys / kMinSplitKeys);
  for (int64_t n = 2; n <= most; ++n) {
    const int64_t len = ((max_keys + n - 1) / n + step - 1) / step * step, used = (max_keys + len - 1) / len;
    const double cost = static_cast<double>((ctas * used + slots - 1) / slots) * len;
    if (cost < 0.97 * best) {
      best = cost;
      nsplit = used;
      split_len = len;
    }
  }
  float *ml = nullptr, *acc = nullptr;
  if (nsplit > 1) {
    ml = split_workspace(static_cast<size_t>(a.T_ * a.H * nsplit * (a.D + 2)), st, op);
    acc = ml + a.T_ * a.H * nsplit * 2;
  }
  const dim3 grid(static_cast<unsigned>(a.T_), static_cast<unsigned>(a.KVH * chunks), static_cast<unsigned>(nsplit));
  split_attention_kernel<T, C, G><<<grid, kSplitThreads, 0, st>>>(
      a.out, ml, acc, a.q, a.kc, a.vc, a.ks, a.vs, a.block_tables, a.seq_lens, a.qsl, a.S, a.H, a.KVH, a.D, a.BS,
      a.max_blocks, a.num_blocks, a.q_stride, static_cast<float>(a.scale * 1.4426950408889634 /* log2 e */), lpk,
      static_cast<int>(split_len), a.decodes_only);
  if (nsplit == 1) return;
  const int threads = static_cast<int>(std::min<int64_t>(kSplitThreads, (a.D + 31) / 32 * 32));
  merge_splits_kernel<T><<<static_cast<unsigned>(a.T_ * a.H), threads, 0, st>>>(
      a.out, ml, acc, a.D, static_cast<int>(nsplit), a.seq_lens, a.qsl, static_cast<int>(a.S), static_cast<int>(a.H),
      static_cast<int>(a.max_blocks * a.BS), a.decodes_only);
  check_call(cudaFreeAsync(ml, st), op);  // launch errors are reported by the caller's check_launch
}

// The split kernel when a K/V row is a whole number of vector loads (at most 32) at aligned
// addresses; else the generic kernel.
template <typename T, typename C>
void launch_attention(const AttnArgs<T, C>& a, cudaStream_t st, const char* op) {
  constexpr int E = kVec<C>;
  const uintptr_t align = E * sizeof(C) - 1;
  const int64_t loads = a.D / E;
  if (a.D % E == 0 && loads <= 32 && !((reinterpret_cast<uintptr_t>(a.kc) | reinterpret_cast<uintptr_t>(a.vc)) & align)) {
    int lpk = 1;
    while (lpk < loads) lpk <<= 1;
    const int64_t group = a.H / a.KVH;
    if (group == 1) launch_split<T, C, 1>(a, lpk, st, op);
    else if (group == 2) launch_split<T, C, 2>(a, lpk, st, op);
    else if (group <= 4) launch_split<T, C, 4>(a, lpk, st, op);
    else launch_split<T, C, 8>(a, lpk, st, op);
    return;
  }
  const dim3 grid(static_cast<unsigned>(a.T_), static_cast<unsigned>(a.H));
  generic_attention_kernel<T, C><<<grid, kAttnWarps * 32, 0, st>>>(
      a.out, a.q, a.kc, a.vc, a.ks, a.vs, a.block_tables, a.seq_lens, a.qsl, a.S, a.H, a.KVH, a.D, a.BS,
      a.max_blocks, a.num_blocks, a.q_stride, static_cast<float>(a.scale), a.decodes_only);
}

}  // namespace

void check_attention_sizes(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           const char* op) {
  auto fail = [op](const char* what) { throw std::invalid_argument(std::string("pyengine._cuda.") + op + ": " + what); };
  if (head_dim <= 0 || head_dim > kMaxHeadDim) fail("head_dim must be in [1, 256]");
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) fail("num_heads must be a multiple of num_kv_heads");
  if (num_heads > 65535) fail("num_heads must be <= 65535");
  if (block_size <= 0) fail("block_size must be positive");
}

void reshape_and_cache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                       uintptr_t v_scales, uintptr_t slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t head_dim, int64_t key_token_stride, int64_t value_token_stride, int64_t num_blocks,
                       int64_t block_size, int src_dtype, int cache_dtype, uintptr_t stream, uintptr_t query,
                       int64_t query_token_stride, int64_t num_heads) {
  const char* op = "reshape_and_cache";
  if (query != 0 && (num_heads <= 0 || num_heads % num_kv_heads))
    throw std::invalid_argument("pyengine._cuda.reshape_and_cache: num_heads must be a positive multiple of num_kv_heads");
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
          block_size, key_token_stride, value_token_stride, num_blocks * block_size, ptr<const scalar_t>(query),
          query_token_stride, query != 0 ? static_cast<int>(num_heads / num_kv_heads) : 0);
    });
  });
  check_launch(op);
}

void paged_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                     uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                     int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype, int cache_dtype,
                     uintptr_t stream, int64_t window, double softcap) {
  paged_attention_rows(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc,
                       num_tokens, num_heads, num_kv_heads, head_dim, q_token_stride, num_blocks, block_size, num_seqs,
                       max_blocks_per_seq, max_seq_len, scale, q_dtype, cache_dtype, stream, window, softcap, false);
}

void paged_attention_rows(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                          uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                          int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype,
                          int cache_dtype, uintptr_t stream, int64_t window, double softcap, bool decodes_only) {
  const char* op = "paged_attention";
  auto fail = [](const char* what) { throw std::invalid_argument(std::string("pyengine._cuda.paged_attention: ") + what); };
  // the CPU kernel's options (Mistral/Gemma windows, Gemma 2's cap); models that need them load on the CPU only
  if (window != 0 || softcap != 0.0) fail("sliding windows and soft-capped scores are not implemented on CUDA");
  check_attention_sizes(num_heads, num_kv_heads, head_dim, block_size, op);
  const bool quant = cache_dtype == static_cast<int>(DType::kFloat8E4M3) || cache_dtype == static_cast<int>(DType::kInt8);
  if (quant && (k_scales == 0 || v_scales == 0)) fail("fp8/int8 caches need k_scales and v_scales");
  if (num_tokens == 0 || num_seqs == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(q), op);
  const cudaStream_t st = as_stream(stream);
  PYENGINE_DISPATCH_FLOAT(q_dtype, op, {
    DISPATCH_CACHE(cache_dtype, q_dtype, op, {
      const AttnArgs<scalar_t, cache_t> a{
          ptr<scalar_t>(out), ptr<const scalar_t>(q), ptr<const cache_t>(k_cache), ptr<const cache_t>(v_cache),
          ptr<const float>(k_scales), ptr<const float>(v_scales), ptr<const int>(block_tables),
          ptr<const int>(seq_lens), ptr<const int>(query_start_loc), num_tokens, num_seqs, num_heads, num_kv_heads,
          head_dim, block_size, max_blocks_per_seq, num_blocks, q_token_stride, max_seq_len, scale, decodes_only};
      launch_attention(a, st, op);
    });
  });
  check_launch(op);
}

}  // namespace cuda
}  // namespace pyengine
