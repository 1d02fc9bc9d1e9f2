// Token sampling and sampling penalties: the rules of native/cpu/sampling.cpp on the GPU.
//
// sample(): logits [B, V] fp32 row-major (read only); temperature/top_p/min_p [B] fp32, top_k [B]
//   int32, seeds/steps [B] int64 (all device pointers); writes token_ids [B] int32 and, when the
//   pointers are non-zero, logprobs [B] and top_ids/top_logprobs [B, num_top].
//   Launch: grid.x = B, one 1024-thread block per row; no scratch memory: every pass re-reads the
//   row (it stays in L1/L2). Per row:
//   1. T == 0 (or T invalid): exact argmax, ties to the lowest id (block reduce on (value, id)).
//   2. top-k (0 < k < V): the k-th largest logit, found by bisection over the order-preserving
//      uint32 image of the floats (32 block-wide counting passes; exact, ties kept).
//   3. min-p: threshold x_max + T*log(min_p); candidates are x_i >= max(thresholds).
//   4. weights w_i = exp((x_i - x_max) * min(1/T, 1e30)) over the candidates.
//   5. top-p < 1: the cut is the largest weight value u with mass(w >= u) >= top_p * total,
//      by bisection over the float bits of u in [0, 1] (~30 passes; block sums in double, in a
//      fixed order, so the result is deterministic). Tokens tied at the cut are all kept.
//   6. inverse CDF: u = philox_uniform(seed, step); each thread sums the kept weights of one
//      contiguous id range, an exclusive block scan (double) places target = u * kept_mass, and
//      the thread whose range holds it walks its ids: the first id whose cumulative weight
//      exceeds the target. Same rule as the CPU; the sums differ only in rounding (order), so a
//      seeded draw matches the CPU's unless the target falls within rounding of a boundary.
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

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sums over a 1024-thread block; every thread gets the result.
__device__ double block_sum_d(double v, double* scratch /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum_d(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum_d(lane < (blockDim.x >> 5) ? scratch[lane] : 0.0);
}

__device__ int block_count(int v, int* scratch /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? scratch[lane] : 0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
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

__device__ Ranked block_best(Ranked r, Ranked* scratch /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    Ranked other{__shfl_xor_sync(0xffffffffu, r.v, o), __shfl_xor_sync(0xffffffffu, r.id, o)};
    if (better(other, r)) r = other;
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = r;
  __syncthreads();
  r = lane < (blockDim.x >> 5) ? scratch[lane] : Ranked{0.f, INT_MAX};
  for (int o = 16; o > 0; o >>= 1) {
    Ranked other{__shfl_xor_sync(0xffffffffu, r.v, o), __shfl_xor_sync(0xffffffffu, r.id, o)};
    if (better(other, r)) r = other;
  }
  return r;
}

// The best (value, id) of the row that ranks strictly after `prev` (prev.id == -1: no bound).
// NaN values never win (comparisons with NaN are false).
__device__ Ranked row_best_after(const float* x, int V, Ranked prev, Ranked* scratch) {
  Ranked r{0.f, INT_MAX};
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float v = x[i];
    if (prev.id >= 0 && !(v < prev.v || (v == prev.v && i > prev.id))) continue;
    const Ranked c{v, i};
    if (v == v && better(c, r)) r = c;
  }
  return block_best(r, scratch);
}

struct SampleShared {
  double d[32];
  int n[32];
  Ranked r[32];
};

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int V, const float* __restrict__ temperature,
                  const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                  const int64_t* __restrict__ seeds, const int64_t* __restrict__ steps, int* __restrict__ token_ids,
                  float* __restrict__ logprobs, int num_top, int* __restrict__ top_ids,
                  float* __restrict__ top_logprobs) {
  __shared__ SampleShared sh;
  const int b = blockIdx.x;
  const float* x = logits + static_cast<int64_t>(b) * V;
  const float T = temperature[b];

  const Ranked best = row_best_after(x, V, Ranked{0.f, -1}, sh.r);
  const int argmax = best.id == INT_MAX ? 0 : best.id;  // all NaN: token 0, as on the CPU
  const float xmax = best.v;
  int token = argmax;
  if (T > 0.f && best.id != INT_MAX && xmax > -INFINITY) {
    float thr = -INFINITY;
    const int k = top_k[b];
    if (k > 0 && k < V) {  // largest key K with count(key >= K) >= k: the k-th largest value
      uint32_t lo = 0, hi = 0xffffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + static_cast<uint32_t>((static_cast<uint64_t>(hi) - lo + 1) / 2);
        int c = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) c += order_key(x[i]) >= mid && x[i] == x[i];
        if (block_count(c, sh.n) >= k) lo = mid; else hi = mid - 1;
      }
      thr = key_to_float(lo);
    }
    const float mp = min_p[b];
    if (mp > 0.f && mp <= 1.f) thr = fmaxf(thr, xmax + T * logf(mp));
    const float inv_t = fminf(1.f / T, 1e30f);
    auto weight = [&](float v) { return v >= thr ? expf((v - xmax) * inv_t) : 0.f; };  // NaN -> 0

    float cut = 0.f;
    const float tp = top_p[b];
    if (tp > 0.f && tp < 1.f) {
      double part = 0.0;
      for (int i = threadIdx.x; i < V; i += blockDim.x) part += weight(x[i]);
      const double target = static_cast<double>(tp) * block_sum_d(part, sh.d);
      // Largest u in [0, 1] (as float bits) with mass(w >= u) >= target; mass(w >= 0) = total.
      uint32_t lo = 0, hi = __float_as_uint(1.f);
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo + 1) / 2;
        const float u = __uint_as_float(mid);
        double m = 0.0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
          const float w = weight(x[i]);
          if (w >= u) m += w;
        }
        if (block_sum_d(m, sh.d) >= target) lo = mid; else hi = mid - 1;
      }
      cut = __uint_as_float(lo);
    }

    // Inverse CDF in id order: thread t owns ids [t * chunk, (t + 1) * chunk).
    const int chunk = (V + blockDim.x - 1) / blockDim.x;
    const int i0 = min(V, static_cast<int>(threadIdx.x) * chunk), i1 = min(V, i0 + chunk);
    double local = 0.0;
    int last_kept = -1;
    for (int i = i0; i < i1; ++i) {
      const float w = weight(x[i]);
      if (w >= cut && w > 0.f) {
        local += w;
        last_kept = i;
      }
    }
    // Exclusive scan of `local` over the block: warp scan, then a scan of the warp totals.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double incl = local;
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    __syncthreads();
    if (lane == 31) sh.d[warp] = incl;
    __syncthreads();
    double warp_prefix = 0.0, total = 0.0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      if (w < warp) warp_prefix += sh.d[w];
      total += sh.d[w];
    }
    const double before = warp_prefix + incl - local;
    const double target = philox_uniform(static_cast<uint64_t>(seeds[b]), static_cast<uint64_t>(steps[b])) * total;
    // The first kept id whose cumulative weight exceeds the target. Rounding can leave the
    // target in no range (then: the row's last kept id) or in two (then: the lower id).
    int claim = INT_MAX;
    if (local > 0.0 && before <= target && target < before + local) {
      double cum = before;
      for (int i = i0; i < i1 && claim == INT_MAX; ++i) {
        const float w = weight(x[i]);
        if (!(w >= cut && w > 0.f)) continue;
        cum += w;
        if (cum > target) claim = i;
      }
      if (claim == INT_MAX) claim = last_kept;
    }
    const int first = block_best(Ranked{0.f, claim}, sh.r).id;
    const int last = block_best(Ranked{0.f, last_kept >= 0 ? INT_MAX - 1 - last_kept : INT_MAX}, sh.r).id;
    token = first != INT_MAX ? first : last != INT_MAX ? INT_MAX - 1 - last : argmax;  // block-uniform
  }
  if (threadIdx.x == 0) token_ids[b] = token;
  if (logprobs == nullptr) return;

  double part = 0.0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) part += expf(x[i] - xmax);
  const float lse = xmax + static_cast<float>(log(block_sum_d(part, sh.d)));
  if (threadIdx.x == 0) logprobs[b] = x[token] - lse;
  Ranked prev{0.f, -1};
  for (int j = 0; j < num_top; ++j) {
    prev = row_best_after(x, V, prev, sh.r);
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
            int64_t num_top, uintptr_t top_ids, uintptr_t top_logprobs, uintptr_t stream) {
  const char* op = "sample";
  if (vocab <= 0 || vocab > INT_MAX / 2) throw std::invalid_argument("pyengine._cuda.sample: vocab must be in [1, 2^30]");
  if (num_top > 0 && (logprobs == 0 || top_ids == 0 || top_logprobs == 0))
    throw std::invalid_argument("pyengine._cuda.sample: num_top > 0 needs logprobs, top_ids and top_logprobs");
  if (batch == 0) return;
  DeviceGuard guard(reinterpret_cast<void*>(logits), op);
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
