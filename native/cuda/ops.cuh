// Host launchers of the CUDA kernels, called by native/bindings/cuda_*.cpp.
//
// Plain C++ (no CUDA headers) so the pybind11 files compile with the host
// compiler. Pointers are device addresses as uintptr_t; dtype codes are
// pyengine::DType values; `stream` is a cudaStream_t handle (0 = default).
// Each launcher enqueues its kernel(s) on `stream` and does not synchronize;
// it throws std::invalid_argument (ValueError in Python) for arguments it
// rejects and std::runtime_error (RuntimeError) if the launch failed.
#pragma once

#include <cstdint>

namespace pyengine {
namespace cuda {

// --- layers.cu -------------------------------------------------------------
// Same argument lists as the CPU kernels (native/cpu/layers.cpp) plus the stream.
// x, residual, out [rows, dim] contiguous; weight [dim] of the activation dtype or fp32 (weight_dtype).
// x in `dtype`, out in `out_dtype` (x's, or any where x is fp32: an fp32 residual stream).
void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows, int64_t dim, double eps, int dtype,
              int weight_dtype, int out_dtype, uintptr_t stream);
// In place: residual += x (rounded to residual_dtype: dtype or fp32); x = rms_norm(residual) * weight.
void add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t dim, double eps,
                  int dtype, int weight_dtype, int residual_dtype, uintptr_t stream);
// In place neox rotary. positions [tokens] int64; q rows of q_heads*head_dim, k rows of
// kv_heads*head_dim, rows q_row_stride / k_row_stride elements apart; cos_sin_cache
// [max_position, head_dim] fp32. Tokens whose position is outside [0, max_position) are
// left unchanged (checking would need a device->host sync).
void rotary_embedding(uintptr_t positions, uintptr_t q, uintptr_t k, uintptr_t cos_sin_cache, int64_t tokens,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_row_stride,
                      int64_t k_row_stride, int64_t max_position, int dtype, uintptr_t stream);
// x [rows, 2*inter] -> out [rows, inter] = silu(x[:, :inter]) * x[:, inter:].
void silu_and_mul(uintptr_t x, uintptr_t out, int64_t rows, int64_t inter, int dtype, uintptr_t stream);

// --- attention.cu ----------------------------------------------------------
// Same argument lists as native/bindings/cpu_attention.cpp; layouts and the
// quantization at the top of attention.cu. Index values (slots, block ids,
// lengths) are not validated on the GPU (that would need a device->host sync):
// out-of-range slots and block ids are skipped instead of read or written.
void paged_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                     uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                     int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                     int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype, int cache_dtype,
                     uintptr_t stream, int64_t window, double softcap);
// paged_attention; decodes_only: only the rows of sequences with one query token are computed (and
// written), the others left to prefill_attention's kernel.
void paged_attention_rows(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                          uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                          int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype,
                          int cache_dtype, uintptr_t stream, int64_t window, double softcap, bool decodes_only);
// Throws std::invalid_argument (naming `op`) for head/block sizes paged_attention cannot run.
void check_attention_sizes(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           const char* op);
void reshape_and_cache(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                       uintptr_t v_scales, uintptr_t slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t head_dim, int64_t key_token_stride, int64_t value_token_stride, int64_t num_blocks,
                       int64_t block_size, int src_dtype, int cache_dtype, uintptr_t stream, uintptr_t query,
                       int64_t query_token_stride, int64_t num_heads);

// --- prefill_attention.cu --------------------------------------------------
// paged_attention's arguments plus max_query_len, an upper bound on the step's query lengths (host
// side, like max_seq_len): FlashAttention-2 on tensor cores where it applies (bf16/fp16, unquantized
// cache, head_dim 64/128, max_query_len > 1; see the top of prefill_attention.cu), else paged_attention.
void prefill_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                       uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                       int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                       int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype, int cache_dtype,
                       uintptr_t stream, int64_t window, double softcap, int64_t max_query_len);

// --- sampling.cu -----------------------------------------------------------
// Same argument lists as native/bindings/cpu_sampling.cpp; rules at the top of sampling.cu.
void sample(uintptr_t logits, int64_t batch, int64_t vocab, uintptr_t temperature, uintptr_t top_k, uintptr_t top_p,
            uintptr_t min_p, uintptr_t seeds, uintptr_t steps, uintptr_t token_ids, uintptr_t logprobs,
            int64_t num_top, uintptr_t top_ids, uintptr_t top_logprobs, uintptr_t bitmask, uintptr_t stream);
void apply_penalties(uintptr_t logits, int64_t batch, int64_t vocab, uintptr_t prompt_ids, int64_t num_prompt_ids,
                     uintptr_t prompt_offsets, uintptr_t output_ids, int64_t num_output_ids,
                     uintptr_t output_offsets, uintptr_t presence, uintptr_t frequency, uintptr_t repetition,
                     uintptr_t stream);

}  // namespace cuda
}  // namespace pyengine
