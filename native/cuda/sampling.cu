// Token sampling and sampling penalties: the rules of native/cpu/sampling.cpp on the GPU.
//
// sample(): logits [B, V] fp32 row-major; temperature/top_p/min_p [B] fp32, top_k [B]
//   int32, seeds/steps [B] int64 (all device pointers); writes token_ids [B] int32 and, when the
//   pointers are non-zero, logprobs [B] and top_ids/top_logprobs [B, num_top]. An optional
//   bitmask [B, ceil(V/32)] int32 (bit j of word i set: token 32*i + j allowed) first sets the
//   disallowed logits to -inf in place (bitmask_kernel, one thread per word), as on the CPU;
//   otherwise the logits are only read.
//   Launch: grid.x = B, one 1024-thread block per row, no global scratch. Every pass over the row
//   is float4 loads, four in flight per thread (the row stays in L2). Searches are radix
//   searches (8 bits per level, four levels, a 256-bin shared histogram filled with atomics) for
//   the largest 32-bit key whose suffix weight reaches a target. Per row:
//   1. argmax (value, id), ties to the lowest id, NaN skipped (1 pass); T == 0 (or invalid): done.
//   2. top-k (0 < k < V): the k-th largest logit = the largest order-preserving key K with
//      count(key >= K) >= k (4 passes, exact, ties kept). When k <= 1024 the k-th largest of the
//      threads' maxima (a radix search in registers) bounds it from below, so only the few
//      logits above that bound reach the histogram.
//   3. min-p: threshold x_max + T*log(min_p); candidates are x_i >= max(thresholds).
//   4. weights w_i = exp((x_i - x_max) * min(1/T, 1e30)) over the candidates, summed as fixed
//      point (w * 2^(62 - ceil(log2 V)), uint64): exact in any order, so every sum below is
//      deterministic.
//   5. top-p < 1 (1 + 4 passes): the cut is the largest weight u with mass(w >= u) >= top_p *
//      total, a radix search over the float bits of w weighted by mass; weights below
//      (total - target) / V cannot reach the cut and skip the histogram. Ties at the cut are kept.
//   6. inverse CDF (1 pass + one warp's range): u = philox_uniform(seed, step), target =
//      floor(u * kept mass); warp w sums the kept weights of ids [w*span, (w+1)*span), the warp
//      holding the target scans its 128-id tiles (4 ids per lane, a warp prefix sum): the first
//      id whose cumulative weight exceeds the target. The CPU rule; the sums differ from the
//      CPU's doubles only by rounding, so a seeded draw matches the CPU's unless the target
//      falls within rounding of a boundary.
//   Logprobs: log_softmax of the input logits; top-N by N block argmax passes over (value, id)
//   ranked after the previous pick (value descending, then id ascending).
//   Parameters are not validated here (that would need a device->host sync): top_p outside
//   (0, 1] acts as 1, min_p <= 0 as off, temperature <= 0 or NaN as greedy.
// apply_penalties(): logits [B, V] fp32 in place; CSR token lists (int32 ids, [B+1] int32
//   offsets) of the prompt and the output per row; vLLM semantics, the same arithmetic as the
//   CPU. Launch: grid.x = B, 512 threads, dynamic shared memory = two bitmaps of V bits. The
//   first thread to set a token's bit (atomicOr) owns it: for output tokens it counts the
//   occurrences and applies repetition, frequency and presence; then (after a barrier) prompt
//   tokens not in the output get the repetition penalty once. Ids outside [0, V) are skipped.
#include <cfloat>
#include <climits>

#include "common.cuh"
#include "ops.cuh"
#include "pyengine/philox.h"

namespace pyengine {
namespace cuda {
namespace {

constexpr int kSampleThreads = 1024;

// Order-preserving map float -> uint32 (a < b  <=>  key(a) < key(b) for non-NaN floats).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

using u64 = unsigned long long;

// Calls f(value, id) for every element of the row x[0, V), spread over the block: 16-byte loads
// from the first 16-byte aligned element on, four of them in flight per thread.
template <class F>
__device__ __forceinline__ void for_row(const float* __restrict__ x, int V, F&& f) {
  const int n = blockDim.x;
  const int head = min(V, static_cast<int>((4 - ((reinterpret_cast<uintptr_t>(x) >> 2) & 3)) & 3));
  for (int i = threadIdx.x; i < head; i += n) f(__ldg(x + i), i);
  const float4* x4 = reinterpret_cast<const float4*>(x + head);
  const int n4 = (V - head) >> 2;
  int j = threadIdx.x;
  for (; j + 3 * n < n4; j += 4 * n) {
    float4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldg(x4 + j + u * n);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = head + 4 * (j + u * n);
      f(v[u].x, i);
      f(v[u].y, i + 1);
      f(v[u].z, i + 2);
      f(v[u].w, i + 3);
    }
  }
  for (; j < n4; j += n) {
    const float4 v = __ldg(x4 + j);
    const int i = head + 4 * j;
    f(v.x, i);
    f(v.y, i + 1);
    f(v.z, i + 2);
    f(v.w, i + 3);
  }
  for (int i = head + 4 * n4 + threadIdx.x; i < V; i += n) f(__ldg(x + i), i);
}

// (value, id) ranking: higher value first, then lower id. id == INT_MAX marks "none".
struct Ranked {
  float v;
  int id;
};
__device__ __forceinline__ bool better(const Ranked& a, const Ranked& b) {
  if (b.id == INT_MAX) return a.id != INT_MAX;
  if (a.id == INT_MAX) return false;
  return a.v > b.v || (a.v == b.v && a.id < b.id);
}

__device__ __forceinline__ Ranked warp_best(Ranked r) {
  for (int o = 16; o > 0; o >>= 1) {
    const Ranked other{__shfl_xor_sync(0xffffffffu, r.v, o), __shfl_xor_sync(0xffffffffu, r.id, o)};
    if (better(other, r)) r = other;
  }
  return r;
}

__device__ Ranked block_best(Ranked r, Ranked* scratch /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  r = warp_best(r);
  __syncthreads();
  if (lane == 0) scratch[warp] = r;
  __syncthreads();
  return warp_best(lane < (blockDim.x >> 5) ? scratch[lane] : Ranked{0.f, INT_MAX});
}

// This thread's best (value, id) of the row that ranks strictly after `prev` (prev.id == -1: no
// bound). NaN values never win (comparisons with NaN are false).
__device__ Ranked thread_best_after(const float* x, int V, Ranked prev) {
  Ranked r{0.f, INT_MAX};
  for_row(x, V, [&](float v, int i) {
    if (prev.id >= 0 && !(v < prev.v || (v == prev.v && i > prev.id))) return;
    const Ranked c{v, i};
    if (v == v && better(c, r)) r = c;
  });
  return r;
}

struct SampleShared {
  u64 hist[256];
  u64 u[32];
  double d[32];
  Ranked r[32];
  int digit;
  u64 above;
};

// Radix search over 32-bit keys, 8 bits per level from the top: the largest K such that the
// elements with key >= K weigh at least `need` (> 0). visit(add) calls add(key, weight) for the
// elements; it may leave out any element whose key is below the answer. False when even K = 0
// falls short. Block-wide: one visit per level, four levels; every thread must call it.
template <class Visit>
__device__ bool radix_search(Visit&& visit, u64 need, uint32_t& result, SampleShared& sh) {
  uint32_t prefix = 0;
  u64 above = 0;  // weight of the elements above the current prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t high = shift == 24 ? 0u : ~0u << (shift + 8);  // the bits decided so far
    visit([&](uint32_t key, u64 w) {
      if ((key & high) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255], w);
    });
    __syncthreads();
    if (threadIdx.x < 32) {  // the largest digit d with above + weight(digits >= d) >= need
      const int lane = threadIdx.x;
      u64 own = 0;  // digits 8 * lane .. 8 * lane + 7
      for (int b = 0; b < 8; ++b) own += sh.hist[8 * lane + b];
      u64 suffix = own;  // digits >= 8 * lane
      for (int o = 1; o < 32; o <<= 1) {
        const u64 up = __shfl_down_sync(0xffffffffu, suffix, o);
        if (lane + o < 32) suffix += up;
      }
      const unsigned ok = __ballot_sync(0xffffffffu, above + suffix >= need);
      if (ok == 0 && lane == 0) sh.digit = -1;
      if (ok != 0 && lane == 31 - __clz(ok)) {
        u64 acc = above + suffix - own;  // weight of the digits above this lane's
        int d = 8 * lane + 7;
        while (acc + sh.hist[d] < need) acc += sh.hist[d--];  // stops in this lane's digits
        sh.digit = d;
        sh.above = acc;
      }
    }
    __syncthreads();
    if (sh.digit < 0) return false;
    prefix |= static_cast<uint32_t>(sh.digit) << shift;
    above = sh.above;
  }
  result = prefix;
  return true;
}

// logits[b, i] = -inf where bit i of row b's mask is clear. grid = (ceil(words/256), B).
__global__ void bitmask_kernel(float* __restrict__ logits, const int32_t* __restrict__ bitmask, int V, int words) {
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  if (w >= words) return;
  const int64_t b = blockIdx.y;
  const uint32_t bits = static_cast<uint32_t>(bitmask[b * words + w]);
  if (bits == 0xffffffffu) return;
  float* row = logits + b * V;
  for (int j = 0; j < 32 && 32 * w + j < V; ++j)
    if (!((bits >> j) & 1u)) row[32 * w + j] = -INFINITY;
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int V, const float* __restrict__ temperature,
                  const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                  const int64_t* __restrict__ seeds, const int64_t* __restrict__ steps, int* __restrict__ token_ids,
                  float* __restrict__ logprobs, int num_top, int* __restrict__ top_ids,
                  float* __restrict__ top_logprobs) {
  __shared__ SampleShared sh;
  __shared__ int sh_token;
  const int b = blockIdx.x;
  const float* x = logits + static_cast<int64_t>(b) * V;
  const float T = temperature[b];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;

  const Ranked mine = thread_best_after(x, V, Ranked{0.f, -1});
  const Ranked best = block_best(mine, sh.r);
  const int argmax = best.id == INT_MAX ? 0 : best.id;  // all NaN: token 0, as on the CPU
  const float xmax = best.v;
  int token = argmax;
  if (T > 0.f && best.id != INT_MAX && xmax > -INFINITY) {
    float thr = -INFINITY;
    bool ok = true;
    const int k = top_k[b];
    if (k > 0 && k < V) {  // the k-th largest value: largest key K with count(key >= K) >= k
      uint32_t lb = 0;     // k <= threads: the k-th largest thread maximum bounds it from below
      if (k <= static_cast<int>(blockDim.x)) {
        const uint32_t tkey = mine.id == INT_MAX ? 0u : order_key(mine.v);
        radix_search([&](auto add) { add(tkey, 1); }, k, lb, sh);
      }
      uint32_t kth = 0;
      ok = radix_search(
          [&](auto add) {
            for_row(x, V, [&](float v, int) {
              const uint32_t key = order_key(v);
              if (v == v && key >= lb) add(key, 1);
            });
          },
          k, kth, sh);
      thr = key_to_float(kth);
    }
    const float mp = min_p[b];
    if (mp > 0.f && mp <= 1.f) thr = fmaxf(thr, xmax + T * logf(mp));
    const float inv_t = fminf(1.f / T, 1e30f);
    // Weights in fixed point (w in [0, 1] times 2^(62 - ceil(log2 V)), so a row sums below 2^62):
    // integer sums are exact in any order, so every block-wide sum is deterministic and the
    // inverse CDF below has exactly one answer.
    int bits = 0;
    while ((1 << bits) < V) ++bits;
    const float fx_scale = __int_as_float((127 + 62 - bits) << 23);
    auto weight = [&](float v) { return v >= thr ? expf((v - xmax) * inv_t) : 0.f; };  // NaN -> 0
    auto fixed = [&](float w) { return w > 0.f ? __float2ull_rn(w * fx_scale) : 0ull; };

    float cut = 0.f;  // kept: weight(v) > 0 with w >= cut
    const float tp = top_p[b];
    if (ok && tp > 0.f && tp < 1.f) {
      u64 part = 0;
      for_row(x, V, [&](float v, int) { part += fixed(weight(v)); });
      const u64 total = block_sum(part, sh.u);
      const u64 need = min(total, max(1ull, static_cast<u64>(ceil(static_cast<double>(tp) * total))));
      // Weights below (total - need) / V sit below the cut: together they weigh < total - need.
      const u64 skip_below = (total - need) / static_cast<u64>(V);
      uint32_t key = 0;
      radix_search(
          [&](auto add) {
            for_row(x, V, [&](float v, int) {
              const float w = weight(v);  // key: the float bits of w (monotone for w >= 0)
              const u64 f = fixed(w);
              if (f > 0 && f >= skip_below) add(__float_as_uint(w), f);
            });
          },
          need, key, sh);
      cut = __uint_as_float(key);
    }
    auto kept = [&](float v) {
      const float w = weight(v);
      return w >= cut ? fixed(w) : 0ull;
    };

    // Inverse CDF in id order: warp w owns ids [w * span, (w + 1) * span), read in tiles of 128
    // (4 consecutive ids per lane); the warp holding the target walks its tiles.
    const int span = (V + nwarps * 128 - 1) / (nwarps * 128) * 128;
    const int w0 = warp * span, w1 = min(V, w0 + span);
    auto lane_sum = [&](int i) {  // ids i .. i + 3
      u64 s = 0;
      for (int e = 0; e < 4; ++e) s += i + e < w1 ? kept(__ldg(x + i + e)) : 0ull;
      return s;
    };
    if (ok) {
      u64 mass = 0;
      for (int i = w0 + 4 * lane; i < w1; i += 128) mass += lane_sum(i);
      mass = warp_sum(mass);
      __syncthreads();
      if (lane == 0) sh.u[warp] = mass;
      __syncthreads();
      u64 before = 0, total = 0;
      for (int w = 0; w < nwarps; ++w) {
        before += w < warp ? sh.u[w] : 0ull;
        total += sh.u[w];
      }
      if (threadIdx.x == 0) sh_token = argmax;  // nothing kept (only with inf/NaN logits)
      __syncthreads();
      if (total > 0) {
        const double u = philox_uniform(static_cast<uint64_t>(seeds[b]), static_cast<uint64_t>(steps[b]));
        const u64 target = min(total - 1, static_cast<u64>(u * static_cast<double>(total)));
        if (before <= target && target < before + mass) {  // one warp: the first id with cum > target
          for (int t0 = w0; t0 < w1; t0 += 128) {
            const int i = t0 + 4 * lane;
            const u64 own = lane_sum(i);
            u64 incl = own;
            for (int o = 1; o < 32; o <<= 1) {
              const u64 up = __shfl_up_sync(0xffffffffu, incl, o);
              if (lane >= o) incl += up;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, before + incl > target);
            if (hit != 0) {
              if (lane == __ffs(hit) - 1) {
                u64 cum = before + incl - own;
                int id = i;
                while (cum + kept(__ldg(x + id)) <= target) cum += kept(__ldg(x + id++));
                sh_token = id;
              }
              break;
            }
            before += __shfl_sync(0xffffffffu, incl, 31);
          }
        }
      }
      __syncthreads();
      token = sh_token;
    }
  }
  if (threadIdx.x == 0) token_ids[b] = token;
  if (logprobs == nullptr) return;

  double part = 0.0;
  for_row(x, V, [&](float v, int) { part += expf(v - xmax); });
  const float lse = xmax + static_cast<float>(log(block_sum(part, sh.d)));
  if (threadIdx.x == 0) logprobs[b] = x[token] - lse;
  Ranked prev{0.f, -1};
  for (int j = 0; j < num_top; ++j) {
    prev = block_best(thread_best_after(x, V, prev), sh.r);
    if (threadIdx.x == 0) {
      const int64_t o = static_cast<int64_t>(b) * num_top + j;
      top_ids[o] = prev.id == INT_MAX ? 0 : prev.id;
      top_logprobs[o] = prev.id == INT_MAX ? -INFINITY : prev.v - lse;
    }
    if (prev.id == INT_MAX) prev = Ranked{-INFINITY, V};  // nothing left: the rest are placeholders
  }
}

constexpr int kPenaltyThreads = 512;

__global__ void __launch_bounds__(kPenaltyThreads)
    penalties_kernel(float* __restrict__ logits, int V, const int* __restrict__ prompt_ids, int num_prompt_ids,
                     const int* __restrict__ prompt_offsets, const int* __restrict__ output_ids, int num_output_ids,
                     const int* __restrict__ output_offsets, const float* __restrict__ presence,
                     const float* __restrict__ frequency, const float* __restrict__ repetition) {
  extern __shared__ uint32_t bits[];  // [2 * words]: tokens owned from the output, from the prompt
  const int b = blockIdx.x;
  const float rep = repetition[b], pres = presence[b], freq = frequency[b];
  if (rep == 1.f && pres == 0.f && freq == 0.f) return;
  const int words = (V + 31) / 32;
  uint32_t* out_bits = bits;
  uint32_t* prompt_bits = bits + words;
  for (int i = threadIdx.x; i < 2 * words; i += blockDim.x) bits[i] = 0;
  __syncthreads();
  float* row = logits + static_cast<int64_t>(b) * V;
  auto span = [](const int* off, int b, int n, int& lo, int& hi) {
    lo = min(max(off[b], 0), n);
    hi = min(max(off[b + 1], lo), n);
  };
  int o0, o1, p0, p1;
  span(output_offsets, b, num_output_ids, o0, o1);
  span(prompt_offsets, b, num_prompt_ids, p0, p1);

  for (int i = o0 + threadIdx.x; i < o1; i += blockDim.x) {
    const int t = output_ids[i];
    if (t < 0 || t >= V) continue;
    const uint32_t bit = 1u << (t & 31);
    if (atomicOr(&out_bits[t >> 5], bit) & bit) continue;  // another thread owns t
    int count = 0;
    for (int j = o0; j < o1; ++j) count += output_ids[j] == t;
    float v = row[t];
    if (rep != 1.f) v = v > 0.f ? v / rep : v * rep;
    v -= freq * static_cast<float>(count);
    v -= pres;
    row[t] = v;
  }
  __syncthreads();
  if (rep == 1.f) return;
  for (int i = p0 + threadIdx.x; i < p1; i += blockDim.x) {
    const int t = prompt_ids[i];
    if (t < 0 || t >= V) continue;
    const uint32_t bit = 1u << (t & 31);
    if (out_bits[t >> 5] & bit) continue;  // penalized with the output tokens
    if (atomicOr(&prompt_bits[t >> 5], bit) & bit) continue;
    const float v = row[t];
    row[t] = v > 0.f ? v / rep : v * rep;
  }
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

void sample(uintptr_t logits, int64_t batch, int64_t vocab, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
            uintptr_t min_p, uintptr_t seeds, uintptr_t steps, uintptr_t token_ids, uintptr_t logprobs,
            int64_t num_top, uintptr_t top_ids, uintptr_t top_logprobs, uintptr_t bitmask, uintptr_t stream) {
  const char* op = "sample";
  if (vocab <= 0 || vocab > INT_MAX / 2) throw std::invalid_argument("pyengine._cuda.sample: vocab must be in [1, 2^30]");
  if (num_top > 0 && (logprobs == 0 || top_ids == 0 || top_logprobs == 0))
    throw std::invalid_argument("pyengine._cuda.sample: num_top > 0 needs logprobs, top_ids and top_logprobs");
  if (batch == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(logits), op);
  if (bitmask) {
    const int words = static_cast<int>((vocab + 31) / 32);
    bitmask_kernel<<<dim3((words + 255) / 256, static_cast<unsigned>(batch)), 256, 0, as_stream(stream)>>>(
        ptr<float>(logits), ptr<const int32_t>(bitmask), static_cast<int>(vocab), words);
    check_launch(op);
  }
  sample_kernel<<<batch, kSampleThreads, 0, as_stream(stream)>>>(
      ptr<const float>(logits), static_cast<int>(vocab), ptr<const float>(temperature), ptr<const int>(top_k),
      ptr<const float>(top_p), ptr<const float>(min_p), ptr<const int64_t>(seeds), ptr<const int64_t>(steps),
      ptr<int>(token_ids), ptr<float>(logprobs), logprobs ? static_cast<int>(std::max<int64_t>(num_top, 0)) : 0,
      ptr<int>(top_ids), ptr<float>(top_logprobs));
  check_launch(op);
}

void apply_penalties(uintptr_t logits, int64_t batch, int64_t vocab, uintptr_t prompt_ids, int64_t num_prompt_ids,
                     uintptr_t prompt_offsets, uintptr_t output_ids, int64_t num_output_ids,
                     uintptr_t output_offsets, uintptr_t presence, uintptr_t frequency, uintptr_t repetition,
                     uintptr_t stream) {
  const char* op = "apply_penalties";
  if (vocab <= 0 || vocab > INT_MAX / 2)
    throw std::invalid_argument("pyengine._cuda.apply_penalties: vocab must be in [1, 2^30]");
  if (batch == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(logits), op);
  const size_t smem = 2 * sizeof(uint32_t) * ((vocab + 31) / 32);
  if (smem > 48 * 1024)  // beyond the default limit: opt in (up to the device's maximum, else the launch fails)
    check_call(cudaFuncSetAttribute(penalties_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)), op);
  penalties_kernel<<<batch, kPenaltyThreads, smem, as_stream(stream)>>>(
      ptr<float>(logits), static_cast<int>(vocab), ptr<const int>(prompt_ids), static_cast<int>(num_prompt_ids),
      ptr<const int>(prompt_offsets), ptr<const int>(output_ids), static_cast<int>(num_output_ids),
      ptr<const int>(output_offsets), ptr<const float>(presence), ptr<const float>(frequency),
      ptr<const float>(repetition));
  check_launch(op);
}

}  // namespace cuda
}  // namespace pyengine
