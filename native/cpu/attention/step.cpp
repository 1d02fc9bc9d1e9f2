// attention_step (CPU): one step's paged attention, split by sequence between the two kernels.
// Sequences with >= kPrefillMinQueries query tokens (prompts, prompt chunks) go to the prefill kernel
// (attention/prefill.cpp) when it takes the step's dtypes and head_dim; the rest (decodes, short
// chunks) to paged_attention_cpu (attention/paged.cpp). With both kinds in one step, the short sequences'
// q rows and block-table rows are gathered into compact copies (a few rows: the decodes) for
// paged_attention_cpu and its output rows scattered back; the prefill kernel reads the step in place.
// The whole step is validated here first, so a bad argument changes nothing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "prefill.h"
#include "pyengine/cpu_ops.h"
#include "pyengine/kv_layout.h"

namespace pyengine {
namespace {

constexpr int64_t kMaxHeadDim = 512;

}  // namespace

void check_attention_step(const AttentionStep& a) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("paged_attention: " + msg); };
  if (a.KVH <= 0 || a.H % a.KVH != 0)
    fail("num_heads (" + std::to_string(a.H) + ") must be a multiple of num_kv_heads (" + std::to_string(a.KVH) + ")");
  if (a.D <= 0 || a.D > kMaxHeadDim) fail("head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "]");
  const bool quant = a.cdt == DType::kFloat8E4M3 || a.cdt == DType::kInt8;
  const int64_t lane = kv_lane(quant ? 1 : 2);
  if (a.BS <= 0 || a.BS % lane || a.D % lane)
    fail("block_size and head_dim must be positive multiples of " + std::to_string(lane) + " (the CPU cache layout)");
  if (!quant && a.cdt != a.qdt) fail("the cache dtype must match q's dtype (or be fp8/int8)");
  if (quant && (a.ks == nullptr || a.vs == nullptr)) fail("fp8/int8 caches need k_scales and v_scales");
  if (a.qdt != DType::kFloat32 && a.qdt != DType::kBFloat16 && a.qdt != DType::kFloat16)
    fail("q must be fp32, bf16 or fp16");
  if (a.window < 0) fail("window must be >= 0 (0: no window)");
  if (!(a.softcap >= 0.0f) || !std::isfinite(a.softcap)) fail("softcap must be a finite value >= 0 (0: none)");
  if (a.qsl[0] != 0 || a.qsl[a.S] != a.T)
    fail("query_start_loc must start at 0 and end at num_tokens (" + std::to_string(a.T) + "), got " +
         std::to_string(a.qsl[0]) + " .. " + std::to_string(a.qsl[a.S]));
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t q_len = a.qsl[s + 1] - a.qsl[s], len = a.seq_lens[s];
    const std::string who = "sequence " + std::to_string(s) + ": ";
    if (q_len < 0) fail(who + "query_start_loc must be non-decreasing");
    if (len < q_len) fail(who + "seq_len " + std::to_string(len) + " < its query length " + std::to_string(q_len));
    if (len > a.MB * a.BS || len > a.max_seq_len)
      fail(who + "seq_len " + std::to_string(len) + " exceeds the block table capacity (" +
           std::to_string(a.MB * a.BS) + ") or max_seq_len (" + std::to_string(a.max_seq_len) + ")");
    for (int64_t b = 0; b < (len + a.BS - 1) / a.BS; ++b) {
      const int64_t blk = a.block_tables[s * a.MB + b];
      if (blk < 0 || blk >= a.NB)
        fail(who + "block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " + std::to_string(blk) +
             " is outside [0, " + std::to_string(a.NB) + ")");
    }
  }
}

namespace {

// paged_attention_cpu over the sequences `seqs` of the step, in place when that is all of them.
void run_decode_kernel(const AttentionStep& a, const std::vector<int32_t>& seqs) {
  auto call = [&](void* out, const void* q, const int32_t* tables, const int32_t* lens, const int32_t* qsl, int64_t T,
                  int64_t q_stride, int64_t S, int64_t MB) {
    paged_attention_cpu(out, q, a.k, a.v, a.ks, a.vs, tables, lens, qsl, T, a.H, a.KVH, a.D, q_stride, a.NB, a.BS,
                        S, MB, a.max_seq_len, a.scale, a.qdt, a.cdt, a.window, a.softcap);
  };
  if (static_cast<int64_t>(seqs.size()) == a.S) {
    call(a.out, a.q, a.block_tables, a.seq_lens, a.qsl, a.T, a.q_stride, a.S, a.MB);
    return;
  }
  const int64_t S = static_cast<int64_t>(seqs.size());
  const size_t row = a.H * a.D * (a.qdt == DType::kFloat32 ? 4 : 2);  // bytes of one token's q / out row
  int64_t MB = 1;
  for (const int32_t s : seqs) MB = std::max<int64_t>(MB, (a.seq_lens[s] + a.BS - 1) / a.BS);
  std::vector<int32_t> tables(S * MB, 0), lens(S), qsl(S + 1, 0);
  for (int64_t i = 0; i < S; ++i) {
    const int32_t s = seqs[i];
    lens[i] = a.seq_lens[s];
    qsl[i + 1] = qsl[i] + a.qsl[s + 1] - a.qsl[s];
    std::copy_n(a.block_tables + s * a.MB, (lens[i] + a.BS - 1) / a.BS, tables.data() + i * MB);
  }
  const int64_t T = qsl[S];
  if (T == 0) return;
  std::vector<char> q(T * row), out(T * row);
  const size_t q_token_bytes = a.q_stride * (row / (a.H * a.D));
  for (int64_t i = 0; i < S; ++i)
    for (int64_t t = 0; t < qsl[i + 1] - qsl[i]; ++t)
      std::memcpy(q.data() + (qsl[i] + t) * row,
                  static_cast<const char*>(a.q) + (a.qsl[seqs[i]] + t) * q_token_bytes, row);
  call(out.data(), q.data(), tables.data(), lens.data(), qsl.data(), T, a.H * a.D, S, MB);
  for (int64_t i = 0; i < S; ++i)
    std::memcpy(static_cast<char*>(a.out) + a.qsl[seqs[i]] * row, out.data() + qsl[i] * row,
                (qsl[i + 1] - qsl[i]) * row);
}

}  // namespace

void attention_step_cpu(void* out, const void* q, const void* k_cache, const void* v_cache, const float* k_scales,
                        const float* v_scales, const int32_t* block_tables, const int32_t* seq_lens,
                        const int32_t* query_start_loc, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t q_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                        int64_t max_blocks_per_seq, int64_t max_seq_len, float scale, DType q_dtype,
                        DType cache_dtype, int64_t window, float softcap) {
  const AttentionStep a{out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc,
                        num_tokens, num_heads, num_kv_heads, head_dim, q_stride, num_blocks, block_size, num_seqs,
                        max_blocks_per_seq, max_seq_len, scale, q_dtype, cache_dtype, window, softcap};
  check_attention_step(a);
  std::vector<int32_t> prompts, others;
  const bool prefill_ok = prefill_attention_supports(a);
  for (int32_t s = 0; s < a.S; ++s)
    (prefill_ok && a.qsl[s + 1] - a.qsl[s] >= kPrefillMinQueries ? prompts : others).push_back(s);
  if (!others.empty()) run_decode_kernel(a, others);
  if (!prompts.empty()) prefill_attention_cpu(a, prompts.data(), static_cast<int64_t>(prompts.size()));
}

}  // namespace pyengine
