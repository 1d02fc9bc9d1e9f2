// The CPU kernels' entry points (native/cpu/*.cpp), for the bindings and for native code that
// chains them (decoder.cpp). Pointers are raw addresses; dtype codes are DType values (dtype.h).
#pragma once
#include <cstdint>
#include <string>

#include "pyengine/dtype.h"

namespace pyengine {

void paged_attention_cpu(void* out, const void* q, const void* k_cache, const void* v_cache, const float* k_scales,
                         const float* v_scales, const int32_t* block_tables, const int32_t* seq_lens,
                         const int32_t* query_start_loc, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t q_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                         int64_t max_blocks_per_seq, int64_t max_seq_len, float scale, DType q_dtype,
                         DType cache_dtype, int64_t window = 0, float softcap = 0.0f);

// One step's attention: paged_attention_cpu's arguments; prompts (>= 16 query tokens) go to the
// prefill kernel, the rest to paged_attention_cpu (attention/step.cpp). What the bindings call.
void attention_step_cpu(void* out, const void* q, const void* k_cache, const void* v_cache, const float* k_scales,
                        const float* v_scales, const int32_t* block_tables, const int32_t* seq_lens,
                        const int32_t* query_start_loc, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t q_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                        int64_t max_blocks_per_seq, int64_t max_seq_len, float scale, DType q_dtype,
                        DType cache_dtype, int64_t window = 0, float softcap = 0.0f);
// The prefill kernel's path: "amx", "avx512_bf16", "portable" or "paged" (prompts on the decode kernel;
// attention/prefill.cpp). set caps it
// (tests run each path; the default, "amx", means the best there is); get says which one runs for
// prompts with q of q_dtype: "bfloat16" (the paths above), or "float32" (fp32 caches: "avx2_fp32",
// attention/prefill_fp32.cpp, unless capped to "paged" or built without AVX2 and FMA).
void set_prefill_attention_path(const std::string& name);
std::string prefill_attention_path(const std::string& q_dtype = "bfloat16");
// The decode kernel's path (attention/paged.cpp; the sequences below the prefill kernel's cut):
// "avx512_fp16" (as avx512_bf16, but fp8 caches in fp16 FMAs; builds for AVX512-FP16), "avx512_bf16"
// (bf16 q: vdpbf16ps / vpdpbusd on the cache tiles), "avx2" (bf16 or fp32 q: fp32 FMAs / vpmaddwd on
// the cache tiles; the best of builds for AVX2 and FMA without AVX-512, and AVX-512 ones have it for
// tests) or "fp32" (each chunk dequantized to fp32; every build). set caps it (tests run each path;
// the default, "avx512_fp16", means the best there is); get says which one runs for bf16 q.
void set_decode_attention_path(const std::string& name);
std::string decode_attention_path();

void reshape_and_cache_cpu(const void* key, const void* value, void* k_cache, void* v_cache, float* k_scales,
                           float* v_scales, const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                           int64_t head_dim, int64_t key_stride, int64_t value_stride, int64_t num_blocks,
                           int64_t block_size, DType src_dtype, DType cache_dtype, const void* query = nullptr,
                           int64_t query_stride = 0, int64_t num_heads = 0);

namespace cpu {

// rms_norm: x in `dtype`, out in `out_dtype` (x's, or any where x is fp32); weight out's type or fp32.
void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t out, int64_t rows, int64_t dim, double eps, int dtype,
              int weight_dtype, int out_dtype);
// add_rms_norm: x in `dtype`; residual in `residual_dtype` (x's or fp32); weight x's type or fp32.
void add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t dim, double eps,
                  int dtype, int weight_dtype, int residual_dtype);
void rotary_embedding(uintptr_t positions, uintptr_t q, uintptr_t k, uintptr_t cos_sin_cache, int64_t tokens,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t q_row_stride,
                      int64_t k_row_stride, int64_t max_position, int dtype);
void hadamard_heads(uintptr_t x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride, int dtype);
void silu_and_mul(uintptr_t x, uintptr_t out, int64_t rows, int64_t inter, int dtype);
void linear_bf16(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t out, int64_t M, int64_t N, int64_t K,
                 int out_dtype);
void set_linear_path(const std::string& name);  // "amx" (the best available), "avx512_fp32" or "avx512_bf16" (tests)
std::string linear_path(int64_t K);  // the path linear_bf16 takes for a weight of K columns (any M)
// fp32 out[M, N] = x[M, K] @ W^T + bias (or null) on AVX2 + FMA builds (linear/fp32.cpp), W packed
// [ceil(N/16)][K][16] fp32, 64-byte aligned; linear_fp32_available() is false on builds without them.
bool linear_fp32_available();
void linear_fp32(const float* x, const float* packed, const float* bias, float* out, int64_t M, int64_t N, int64_t K);
// Quantized weights (linear/quant.cpp; types and layout in ggml_blocks.h).
int64_t qpacked_bytes(int type, int64_t N, int64_t K);
void qpack(int type, uintptr_t src, int64_t N, int64_t K, uintptr_t dst);
// segments: int64 [1 + 3 n] = n, then (GGML type, rows, tiled weight address) per row range of W.
void qlinear(uintptr_t x, int x_dtype, uintptr_t segments, uintptr_t bias, uintptr_t out, int64_t M, int64_t N,
             int64_t K, int out_dtype);
void qembedding(uintptr_t ids, int64_t T, uintptr_t packed, int type, int64_t N, int64_t K, uintptr_t out,
                int out_dtype);
// From this many rows of bf16 x (0: never), qlinear dequantizes the weight a strip at a time for
// linear_bf16's kernel (linear/quant_strips.cpp) instead of running its int8 kernels. Default: 8 where
// linear_bf16 runs on AMX, else 0.
void set_qlinear_strip_rows(int64_t rows);
int64_t qlinear_strip_rows();
// The kernel qlinear runs for M rows of bf16 x: "strips", or the int8 kernels' SIMD path.
std::string qlinear_path(int64_t M, int64_t K);
void set_qlinear_isa(const std::string& name);  // "scalar", "avx2", "avx512_vnni" (where built)
std::string qlinear_isa();
std::string qlinear_isas();
bool decoder_layers(uintptr_t residual, uintptr_t x, uintptr_t qkv, uintptr_t attn, uintptr_t gate_up, uintptr_t act,
                    const int64_t* layers, int64_t num_layers, uintptr_t positions, uintptr_t cos_sin_cache,
                    int64_t max_position, uintptr_t slot_mapping, uintptr_t block_tables, uintptr_t seq_lens,
                    uintptr_t query_start_loc, int64_t T, int64_t hidden, int64_t H, int64_t KVH, int64_t D,
                    int64_t inter, int64_t num_blocks, int64_t block_size, int64_t num_seqs, int64_t max_blocks,
                    int64_t max_seq_len, double eps, double scale, int norm_dtype, int cache_dtype,
                    int64_t window, uintptr_t final_norm, uintptr_t stop_flag);

}  // namespace cpu
}  // namespace pyengine
