// The prompt side of paged attention (attention/prefill.cpp) and the step entry that splits a mixed
// step between it and the decode kernel (attention/step.cpp).
#pragma once
#include <cstdint>

#include "pyengine/dtype.h"

namespace pyengine {

// One attention step's arguments: paged_attention_cpu's list (cpu_ops.h), as a struct.
struct AttentionStep {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  const float* ks;
  const float* vs;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  int64_t T, H, KVH, D, q_stride, NB, BS, S, MB, max_seq_len;
  float scale;
  DType qdt, cdt;
  int64_t window;  // 0 = unlimited
  float softcap;   // 0 = none
};

// Throws std::invalid_argument naming the first bad argument of a step (shapes, dtypes, block ids),
// before any kernel writes: both attention_step_cpu and paged_attention_cpu validate through it.
void check_attention_step(const AttentionStep& a);

// Sequences with at least this many query tokens in a step go to the prefill kernel (when it takes
// the step's dtypes and head_dim); shorter ones, decodes included, to paged_attention_cpu.
constexpr int64_t kPrefillMinQueries = 16;

// Both kernels' online softmax lets the running max (log2 units) lag the scores by up to this much:
// it moves only when a score passes it by more, so most chunks need no horizontal max and no rescale,
// and the probabilities stay <= 2^kMaxSlack (harmless in fp32, bf16 and int8's per-chunk u8 scale).
constexpr float kMaxSlack = 8.0f;

// bf16 q over a bf16, fp8 or int8 cache, head_dim a multiple of 64 (<= 256); or fp32 q over an fp32
// cache (prefill_fp32 below). Neither when capped to "paged" (set_prefill_attention_path).
bool prefill_attention_supports(const AttentionStep& a);

// Attention of the sequences seqs[0, nseqs) of a validated step (the others are not touched).
void prefill_attention_cpu(const AttentionStep& a, const int32_t* seqs, int64_t nseqs);

// fp32 q over an fp32 cache in fp32 FMAs (attention/prefill_fp32.cpp): builds with AVX2 and FMA, head_dim a
// multiple of 8 (<= 256), no soft-cap. prefill_attention_cpu routes fp32 steps there.
bool prefill_fp32_supports(const AttentionStep& a);
void prefill_fp32_cpu(const AttentionStep& a, const int32_t* seqs, int64_t nseqs);

}  // namespace pyengine
