// Token sampling and sampling penalties.
//
// sample(): logits [B, V] fp32 row-major; per-row temperature/top_p/min_p fp32, top_k int32,
//   seeds/steps int64; writes token_ids [B] int32 and, on request, logprobs [B] fp32 and
//   top_ids/top_logprobs [B, N]. An optional bitmask [B, ceil(V/32)] int32 (bit j of word i set:
//   token 32*i + j allowed; xgrammar's layout) first sets the disallowed logits to -inf in place,
//   so everything below (and the logprobs) sees the constrained distribution. Otherwise the
//   logits are only read. One row at a time, no state shared between rows:
//   1. T == 0: exact argmax, ties to the lowest id.
//   2. top-k: the minimum of the maxima of k disjoint id groups bounds the k-th largest logit from
//      below; one vectorized gather above it leaves a few*k candidates, whose k-th largest value is
//      found by selection (nth_element). O(V) vector work, never a sort of V. Top-N logprobs reuse it.
//   3. min-p: p_i >= min_p * p_max  <=>  x_i >= x_max + T*log(min_p), a logit threshold; with
//      top-k the two thresholds combine (both keep the max, so their order does not matter).
//   4. candidates x_i >= threshold are gathered (id order) with weights w_i = exp((x_i - x_max)/T).
//   5. top-p over the renormalized candidates: the smallest descending-probability prefix with mass
//      >= top_p (vLLM's rule: a token is kept iff the mass strictly above it is < top_p), found by a
//      threshold search: an 11-bit radix histogram of the weights' float bits (mass per bucket),
//      refining only the bucket that crosses the target; <= 128 survivors are sorted. Tokens tied at
//      the threshold are all kept.
//   6. inverse CDF: u = Philox4x32-10 keyed by (seed, step), one uniform per row; the token is the
//      first kept candidate (in id order) whose cumulative weight exceeds u * total.
//   Logprobs are log_softmax of the input logits (before temperature and filters).
//   Parallel shape: rows over the ThreadPool when B >= 2 and B*V is large; rows are independent and
//   each draw depends only on (row logits, params, seed, step), so results do not depend on the batch.
// apply_penalties(): logits [B, V] fp32 in place; CSR token lists (int32 ids, [B+1] offsets) of the
//   prompt and of the output per row; vLLM semantics. Per-thread count arrays of size V, reset by
//   walking the lists again (O(list length) per row, not O(V)).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyengine/parallel.h"
#include "pyengine/philox.h"
#include "pyengine/vec_exp.h"

// GCC 12 flags its own AVX-512 intrinsics (_mm512_undefined_*) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace pyengine::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
inline __m512 vexp(__m512 x) { return exp512(x); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
inline __m256 vexp(__m256 x) { return exp256(x); }
#else
constexpr int64_t kLanes = 1;
#endif

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// max of x[0, n) (-inf when empty or all -inf).
float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = kNegInf;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(kNegInf);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__)
  __m256 vm = _mm256_set1_ps(kNegInf);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// The lowest index holding the maximum (exact argmax, ties to the lowest id).
int32_t row_argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == m) return static_cast<int32_t>(i);
  return 0;  // all NaN
}

// sum_i exp(scale * (x_i - shift)) over x[0, n).
double sum_exp(const float* x, int64_t n, float shift, float scale) {
  int64_t i = 0;
  double total = 0.0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(shift), vc = _mm512_set1_ps(scale);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16)
    acc = _mm512_add_ps(acc, vexp(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vs), vc)));
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vs = _mm256_set1_ps(shift), vc = _mm256_set1_ps(scale);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    acc = _mm256_add_ps(acc, vexp(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs), vc)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) total += v;
#endif
  for (; i < n; ++i) total += std::exp(scale * (x[i] - shift));
  return total;
}

// w_i = exp(scale * (x_i - shift)) in place over x[0, n).
void exp_inplace(float* x, int64_t n, float shift, float scale) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(shift), vc = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, vexp(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vs), vc)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vs = _mm256_set1_ps(shift), vc = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, vexp(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs), vc)));
#endif
  for (; i < n; ++i) x[i] = std::exp(scale * (x[i] - shift));
}

// Gathers (x_i, i) with x_i >= thr, in id order, into vals/ids (each sized >= V + kLanes); returns count.
int64_t gather_at_least(const float* x, int64_t V, float thr, float* vals, int32_t* ids) {
  int64_t n = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 vt = _mm512_set1_ps(thr);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= V; i += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 m = _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ);
    if (!m) continue;
    // compress into a register, then a plain store (memory-destination compress is slow on some cores)
    _mm512_storeu_ps(vals + n, _mm512_maskz_compress_ps(m, v));
    _mm512_storeu_si512(ids + n, _mm512_maskz_compress_epi32(m, idx));
    n += __builtin_popcount(m);
  }
#endif
  for (; i < V; ++i) {
    if (x[i] >= thr) {
      vals[n] = x[i];
      ids[n++] = static_cast<int32_t>(i);
    }
  }
  return n;
}

// Gathers every (x_i, i) that can be among the n largest of x[0, V) (0 < n <= V), in id order:
// the minimum of the maxima of n disjoint groups is <= the n-th largest value (n distinct elements
// reach it), so one max pass and one gather pass above that bound leave a few times n candidates.
// Returns the count (>= n unless x holds NaN); xmax = max of x.
int64_t gather_top_candidates(const float* x, int64_t V, int64_t n, float* vals, int32_t* ids, float& xmax) {
  const int64_t group = V / n;
  float lo = std::numeric_limits<float>::infinity();
  xmax = kNegInf;
  for (int64_t j = 0; j < n; ++j) {
    const float m = row_max(x + j * group, j == n - 1 ? V - j * group : group);
    lo = std::min(lo, m);
    xmax = std::max(xmax, m);
  }
  return gather_at_least(x, V, lo, vals, ids);
}

struct Cand {
  float v;
  int32_t id;
};
// a ranks before b: higher value, then lower id.
inline bool ranks_before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

// The top-p threshold: the value t of w (positive weights, n >= 1) such that the descending prefix
// ending at t is the shortest with mass >= target. Radix refinement over the float bits (monotone
// for positive floats): 11-bit digits at shifts 20, 9, then the last 9 bits; only the bucket holding
// the crossing point is kept at each level. `work` holds >= n floats.
float nucleus_threshold(const float* w, int64_t n, double target, std::vector<float>& work) {
  static constexpr int kShift[3] = {20, 9, 0};
  static constexpr uint32_t kMask[3] = {0x7ff, 0x7ff, 0x1ff};
  const float* vals = w;
  double above = 0.0;  // mass of values above the current bucket
  for (int level = 0;; ++level) {
    if (n <= 128 || level == 3) {  // sort the few survivors (level 3: all bits equal, i.e. ties)
      if (vals == work.data()) {
        work.resize(n);
      } else {
        work.assign(vals, vals + n);
      }
      std::sort(work.begin(), work.end(), [](float a, float b) { return a > b; });
      for (float v : work) {
        above += v;
        if (above >= target) return v;
      }
      return work.back();
    }
    double mass[2048] = {};
    const int shift = kShift[level];
    const uint32_t mask = kMask[level];
    for (int64_t i = 0; i < n; ++i) mass[(float_bits(vals[i]) >> shift) & mask] += vals[i];
    int64_t key = mask;
    for (; key > 0 && above + mass[key] < target; --key) above += mass[key];
    work.resize(std::max<size_t>(work.size(), n));
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i)  // in place is safe once vals == work: kept <= i
      if (((float_bits(vals[i]) >> shift) & mask) == static_cast<uint32_t>(key)) work[kept++] = vals[i];
    if (kept == 0) return vals[0];  // unreachable for positive weights; keeps the loop total
    vals = work.data();
    n = kept;
  }
}

struct Scratch {
  std::vector<float> vals, work;
  std::vector<int32_t> ids;
  std::vector<Cand> top;
};

Scratch& scratch(int64_t V) {
  static thread_local Scratch s;
  if (static_cast<int64_t>(s.vals.size()) < V + kLanes) {
    s.vals.resize(V + 16);
    s.ids.resize(V + 16);
  }
  return s;
}

struct RowParams {
  float temperature;
  int32_t top_k;
  float top_p, min_p;
  uint64_t seed, step;
};

int32_t sample_row(const float* x, int64_t V, const RowParams& p, Scratch& s) {
  if (p.temperature == 0.0f) return row_argmax(x, V);
  float thr = kNegInf, xmax;
  const bool use_top_k = p.top_k > 0 && p.top_k < V;
  int64_t n = 0;
  if (use_top_k) {  // candidates for the top k, then the k-th largest among them by selection
    n = gather_top_candidates(x, V, p.top_k, s.vals.data(), s.ids.data(), xmax);
    if (n < p.top_k) return row_argmax(x, V);  // only with NaN logits
    s.work.assign(s.vals.begin(), s.vals.begin() + n);
    std::nth_element(s.work.begin(), s.work.begin() + (p.top_k - 1), s.work.end(), std::greater<float>());
    thr = s.work[p.top_k - 1];
  } else {
    xmax = row_max(x, V);
  }
  if (!(xmax > kNegInf)) return row_argmax(x, V);  // nothing finite to sample from
  if (p.min_p > 0.0f) thr = std::max(thr, xmax + p.temperature * std::log(p.min_p));
  thr = std::max(thr, std::numeric_limits<float>::lowest());  // a -inf (masked) token is never a candidate
  if (use_top_k) {  // keep the candidates >= thr, in place (id order is kept)
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i)
      if (s.vals[i] >= thr) s.vals[kept] = s.vals[i], s.ids[kept++] = s.ids[i];
    n = kept;
  } else {
    n = gather_at_least(x, V, thr, s.vals.data(), s.ids.data());
  }
  // (x - xmax) / T, with 1/T capped so that the max stays exp(0) = 1 even for a denormal T
  exp_inplace(s.vals.data(), n, xmax, std::min(1.0f / p.temperature, 1e30f));
  float cut = 0.0f;
  if (p.top_p < 1.0f) {
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += s.vals[i];
    cut = nucleus_threshold(s.vals.data(), n, p.top_p * total, s.work);
  }
  double kept_mass = 0.0;
  for (int64_t i = 0; i < n; ++i)
    if (s.vals[i] >= cut) kept_mass += s.vals[i];
  // the same additions in the same order as above, so the walk always ends inside the kept set
  const double target = philox_uniform(p.seed, p.step) * kept_mass;
  double cum = 0.0;
  int32_t last = s.ids[0];
  for (int64_t i = 0; i < n; ++i) {
    if (s.vals[i] < cut || s.vals[i] == 0.0f) continue;
    cum += s.vals[i];
    last = s.ids[i];
    if (cum > target) return last;
  }
  return last;
}

// x[i] = -inf where bit i of `mask` is clear (x holds V floats, mask ceil(V/32) words).
void apply_row_bitmask(float* x, const int32_t* mask, int64_t V) {
  int64_t w = 0;
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  for (; 32 * w + 32 <= V; ++w) {
    const uint32_t bits = static_cast<uint32_t>(mask[w]);
    if (bits == 0xffffffffu) continue;
    float* p = x + 32 * w;
    _mm512_storeu_ps(p, _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(bits), _mm512_loadu_ps(p)));
    _mm512_storeu_ps(p + 16, _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(bits >> 16), _mm512_loadu_ps(p + 16)));
  }
#endif
  for (int64_t i = 32 * w; i < V; ++i)
    if (!((static_cast<uint32_t>(mask[i >> 5]) >> (i & 31)) & 1u)) x[i] = kNegInf;
}

template <class T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

[[noreturn]] void bad_value(const char* op, const char* what, int64_t row, double value, const char* allowed) {
  throw std::invalid_argument(std::string(op) + ": " + what + "[" + std::to_string(row) + "] = " +
                              std::to_string(value) + "; allowed: " + allowed);
}

// Rows on the pool when there are several and the call is big enough to pay a wake-up.
template <class F>
void for_rows(int64_t rows, int64_t work, F&& fn) {
  if (rows >= 2 && work >= 32768) {
    ThreadPool::instance().parallel_for(rows, [&](int64_t r) { fn(r); });  // an rvalue: parallel_for takes F&&
  } else {
    for (int64_t r = 0; r < rows; ++r) fn(r);
  }
}

}  // namespace

void sample(uintptr_t logits, int64_t B, int64_t V, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
            uintptr_t min_p, uintptr_t seeds, uintptr_t steps, uintptr_t token_ids, uintptr_t logprobs,
            int64_t num_top, uintptr_t top_ids, uintptr_t top_logprobs, uintptr_t bitmask) {
  const float *temp = ptr<const float>(temperature), *tp = ptr<const float>(top_p), *mp = ptr<const float>(min_p);
  const int32_t* tk = ptr<const int32_t>(top_k);
  for (int64_t b = 0; b < B; ++b) {
    if (!(temp[b] >= 0.0f) || std::isinf(temp[b])) bad_value("sample", "temperature", b, temp[b], "finite and >= 0");
    if (!(tp[b] > 0.0f && tp[b] <= 1.0f)) bad_value("sample", "top_p", b, tp[b], "(0, 1]");
    if (!(mp[b] >= 0.0f && mp[b] <= 1.0f)) bad_value("sample", "min_p", b, mp[b], "[0, 1]");
  }
  float* x = ptr<float>(logits);
  const int32_t* mask = ptr<const int32_t>(bitmask);
  const int64_t words = (V + 31) / 32;
  const int64_t* sd = ptr<const int64_t>(seeds);
  const int64_t* st = ptr<const int64_t>(steps);
  int32_t* out = ptr<int32_t>(token_ids);
  for_rows(B, B * V, [&](int64_t b) {
    float* row = x + b * V;
    if (mask) apply_row_bitmask(row, mask + b * words, V);
    Scratch& s = scratch(V);
    const RowParams p{temp[b], tk[b], tp[b], mp[b], static_cast<uint64_t>(sd[b]), static_cast<uint64_t>(st[b])};
    const int32_t tok = sample_row(row, V, p, s);
    out[b] = tok;
    if (!logprobs) return;
    const float m = row_max(row, V);
    const float lse = m + static_cast<float>(std::log(sum_exp(row, V, m, 1.0f)));
    ptr<float>(logprobs)[b] = row[tok] - lse;
    if (num_top <= 0) return;
    float unused_max;
    const int64_t n = gather_top_candidates(row, V, num_top, s.vals.data(), s.ids.data(), unused_max);
    s.top.resize(n);
    for (int64_t i = 0; i < n; ++i) s.top[i] = {s.vals[i], s.ids[i]};
    const int64_t shown = std::min(num_top, n);  // n < num_top only with NaN logits
    std::partial_sort(s.top.begin(), s.top.begin() + shown, s.top.end(), ranks_before);
    for (int64_t j = 0; j < num_top; ++j) {
      ptr<int32_t>(top_ids)[b * num_top + j] = j < shown ? s.top[j].id : 0;
      ptr<float>(top_logprobs)[b * num_top + j] = j < shown ? s.top[j].v - lse : kNegInf;
    }
  });
}

void apply_penalties(uintptr_t logits, int64_t B, int64_t V, uintptr_t prompt_ids, int64_t num_prompt_ids,
                     uintptr_t prompt_offsets, uintptr_t output_ids, int64_t num_output_ids,
                     uintptr_t output_offsets, uintptr_t presence, uintptr_t frequency, uintptr_t repetition) {
  const int32_t *pid = ptr<const int32_t>(prompt_ids), *poff = ptr<const int32_t>(prompt_offsets);
  const int32_t *oid = ptr<const int32_t>(output_ids), *ooff = ptr<const int32_t>(output_offsets);
  const float *pres = ptr<const float>(presence), *freq = ptr<const float>(frequency);
  const float* rep = ptr<const float>(repetition);
  auto check_csr = [&](const char* ids_name, const char* offsets_name, const int32_t* ids, int64_t num_ids,
                       const int32_t* off) {
    for (int64_t b = 0; b < B; ++b)
      if (off[b] < 0 || off[b] > off[b + 1] || off[b + 1] > num_ids)
        throw std::invalid_argument(std::string("apply_penalties: ") + offsets_name + " must be non-decreasing in [0, " +
                                    std::to_string(num_ids) + "]; row " + std::to_string(b) + " spans [" +
                                    std::to_string(off[b]) + ", " + std::to_string(off[b + 1]) + ")");
    for (int64_t i = 0; i < num_ids; ++i)
      if (ids[i] < 0 || ids[i] >= V) bad_value("apply_penalties", ids_name, i, ids[i], "[0, vocab_size)");
  };
  check_csr("prompt_ids", "prompt_offsets", pid, num_prompt_ids, poff);
  check_csr("output_ids", "output_offsets", oid, num_output_ids, ooff);
  for (int64_t b = 0; b < B; ++b) {
    if (!(rep[b] > 0.0f) || std::isinf(rep[b])) bad_value("apply_penalties", "repetition", b, rep[b], "finite and > 0");
    if (!std::isfinite(pres[b])) bad_value("apply_penalties", "presence", b, pres[b], "finite");
    if (!std::isfinite(freq[b])) bad_value("apply_penalties", "frequency", b, freq[b], "finite");
  }
  float* x = ptr<float>(logits);
  for_rows(B, num_prompt_ids + num_output_ids, [&](int64_t b) {
    if (rep[b] == 1.0f && pres[b] == 0.0f && freq[b] == 0.0f) return;
    // per-thread scratch: counts[t] = occurrences in the output; state[t]: 1 = seen, 2 = done
    static thread_local std::vector<int32_t> counts;
    static thread_local std::vector<uint8_t> state;
    if (static_cast<int64_t>(counts.size()) < V) {
      counts.assign(V, 0);
      state.assign(V, 0);
    }
    float* row = x + b * V;
    const int32_t *o0 = oid + ooff[b], *o1 = oid + ooff[b + 1];
    const int32_t *p0 = pid + poff[b], *p1 = pid + poff[b + 1];
    for (const int32_t* t = o0; t < o1; ++t) ++counts[*t], state[*t] = 1;
    for (const int32_t* t = p0; t < p1; ++t) state[*t] = 1;
    auto penalize = [&](int32_t t) {
      if (state[t] != 1) return;
      state[t] = 2;
      float v = row[t];
      if (rep[b] != 1.0f) v = v > 0.0f ? v / rep[b] : v * rep[b];
      if (counts[t] > 0) {
        v -= freq[b] * static_cast<float>(counts[t]);
        v -= pres[b];
      }
      row[t] = v;
    };
    for (const int32_t* t = o0; t < o1; ++t) penalize(*t);
    for (const int32_t* t = p0; t < p1; ++t) penalize(*t);
    for (const int32_t* t = o0; t < o1; ++t) counts[*t] = 0, state[*t] = 0;
    for (const int32_t* t = p0; t < p1; ++t) state[*t] = 0;
  });
}

}  // namespace pyengine::cpu
