// decoder_layers (CPU): every decoder layer of a Llama-family model for one step, in one native
// call. The same kernels in the same order as LlamaForCausalLM.forward's op-by-op path
// (pyengine/model/llama.py), on the same buffers, so the result is bit-identical; what goes away is
// the Python between ~300 kernel calls per step (a quarter of a batch-1 decode step of the default
// model when measured: docs/performance.md, "one native call per step"). Used for every step of a bf16 model on the CPU (PackedLinear or QuantLinear
// projections) whose layers are Llama-shaped (one attention window for all layers, or none: Mistral,
// Phi-3).
//
// Per layer l (x [T, hidden] bf16, residual [T, hidden] fp32; both updated in place). The residual
// stream stays fp32, as in an fp32 model: rounding it to bf16 after every add was the largest part of
// the bf16 model's distance from fp32 (tests/test_kv_accuracy.py); everything else is bf16.
//   x = rms_norm(residual) (l = 0)  |  residual += x; x = rms_norm(residual) (l > 0)   input_norm
//   qkv = x Wqkv^T (+ b)              [T, (H + 2 KVH) D]: q | k | v column blocks
//   rope(q, k) in place (positions, cos_sin_cache [max_position, D] fp32)
//   reshape_and_cache(k, v) into layer l's cache;  attn = paged_attention(q)   [T, H D]
//   fp8/int8 cache: q, k and v rotated before (hadamard_heads: K and V are cached rotated), attn after
//   x = attn Wo^T (+ b);  residual += x; x = rms_norm(residual)                   post_norm
//   x = silu_and_mul(x Wgu^T) Wdown^T                [T, 2 I] -> [T, I] -> [T, hidden]
// Then, where final_norm is given (not 0): residual += x; x = rms_norm(residual), the model's final norm,
// so a decode step goes from the embedding to the lm_head's input in this one call.
// stop_flag (0 for none): the address of an int32 that another thread may set while the call runs; it is
// read before each layer, and once it is non-zero the call returns false with the step half done (the
// caller discards it: see pyengine/interrupt.py). Returns true when every layer ran.
// Scratch: qkv [T, (H + 2 KVH) D], attn [T, H D], gate_up [T, 2 I], act [T, I], all bf16.
// Layer table: int64 [num_layers, kLayerFields], one row of addresses per layer (fields below;
// 0 for an absent bias or scales). A projection's weight is PackedLinear's bf16 layout (linear/bf16.cpp)
// where its type field is 0, else (field 1) a QuantLinear's segment table (linear/quant.cpp).
#include <cstdint>

#include "pyengine/cpu_ops.h"

namespace pyengine::cpu {

enum LayerField : int64_t {
  kInputNorm, kQkv, kQkvBias, kO, kOBias, kPostNorm, kGateUp, kDown, kKCache, kVCache, kKScales, kVScales,
  kQkvType, kOType, kGateUpType, kDownType, kLayerFields
};

namespace {

// out[M, N] = x[M, K] W^T (+ bias), bf16 in and out; `type` 0: w is packed bf16, else a segment table.
void project(uintptr_t x, uintptr_t w, int64_t type, uintptr_t bias, uintptr_t out, int64_t M, int64_t N, int64_t K) {
  const int bf16 = static_cast<int>(DType::kBFloat16);
  if (type == 0) linear_bf16(x, w, bias, out, M, N, K, bf16);
  else qlinear(x, bf16, w, bias, out, M, N, K, bf16);
}

}  // namespace

bool decoder_layers(uintptr_t residual, uintptr_t x, uintptr_t qkv, uintptr_t attn, uintptr_t gate_up, uintptr_t act,
                    const int64_t* layers, int64_t num_layers, uintptr_t positions, uintptr_t cos_sin_cache,
                    int64_t max_position, uintptr_t slot_mapping, uintptr_t block_tables, uintptr_t seq_lens,
                    uintptr_t query_start_loc, int64_t T, int64_t hidden, int64_t H, int64_t KVH, int64_t D,
                    int64_t inter, int64_t num_blocks, int64_t block_size, int64_t num_seqs, int64_t max_blocks,
                    int64_t max_seq_len, double eps, double scale, int norm_dtype, int cache_dtype,
                    int64_t window, uintptr_t final_norm, uintptr_t stop_flag) {
  const int bf16 = static_cast<int>(DType::kBFloat16), fp32 = static_cast<int>(DType::kFloat32);
  const int64_t nqkv = (H + 2 * KVH) * D;
  const uintptr_t q = qkv, k = qkv + H * D * 2, v = qkv + (H + KVH) * D * 2;
  const bool rotate = cache_dtype == static_cast<int>(DType::kInt8) ||
                      cache_dtype == static_cast<int>(DType::kFloat8E4M3);
  const int32_t* stop = reinterpret_cast<const int32_t*>(stop_flag);
  for (int64_t l = 0; l < num_layers; ++l) {
    if (stop && __atomic_load_n(stop, __ATOMIC_RELAXED)) return false;
    const int64_t* w = layers + l * kLayerFields;
    auto at = [&](LayerField f) { return static_cast<uintptr_t>(w[f]); };
    if (l == 0) rms_norm(residual, at(kInputNorm), x, T, hidden, eps, fp32, norm_dtype, bf16);
    else add_rms_norm(x, residual, at(kInputNorm), T, hidden, eps, bf16, norm_dtype, fp32);
    project(x, at(kQkv), w[kQkvType], at(kQkvBias), qkv, T, nqkv, hidden);
    rotary_embedding(positions, q, k, cos_sin_cache, T, H, KVH, D, nqkv, nqkv, max_position, bf16);
    if (rotate) {
      hadamard_heads(q, T, H, D, nqkv, bf16);
      hadamard_heads(k, T, KVH, D, nqkv, bf16);
      hadamard_heads(v, T, KVH, D, nqkv, bf16);
    }
    reshape_and_cache_cpu(reinterpret_cast<const void*>(k), reinterpret_cast<const void*>(v),
                          reinterpret_cast<void*>(at(kKCache)), reinterpret_cast<void*>(at(kVCache)),
                          reinterpret_cast<float*>(at(kKScales)), reinterpret_cast<float*>(at(kVScales)),
                          reinterpret_cast<const int64_t*>(slot_mapping), T, KVH, D, nqkv, nqkv, num_blocks,
                          block_size, DType::kBFloat16, static_cast<DType>(cache_dtype),
                          reinterpret_cast<const void*>(q), nqkv, H);  // quantized caches round K for q
    attention_step_cpu(reinterpret_cast<void*>(attn), reinterpret_cast<const void*>(q),
                       reinterpret_cast<const void*>(at(kKCache)), reinterpret_cast<const void*>(at(kVCache)),
                       reinterpret_cast<const float*>(at(kKScales)), reinterpret_cast<const float*>(at(kVScales)),
                       reinterpret_cast<const int32_t*>(block_tables), reinterpret_cast<const int32_t*>(seq_lens),
                       reinterpret_cast<const int32_t*>(query_start_loc), T, H, KVH, D, nqkv, num_blocks,
                       block_size, num_seqs, max_blocks, max_seq_len, static_cast<float>(scale), DType::kBFloat16,
                       static_cast<DType>(cache_dtype), window);
    if (rotate) hadamard_heads(attn, T, H, D, H * D, bf16);  // back from rotated V
    project(attn, at(kO), w[kOType], at(kOBias), x, T, hidden, H * D);
    add_rms_norm(x, residual, at(kPostNorm), T, hidden, eps, bf16, norm_dtype, fp32);
    project(x, at(kGateUp), w[kGateUpType], 0, gate_up, T, 2 * inter, hidden);
    silu_and_mul(gate_up, act, T, inter, bf16);
    project(act, at(kDown), w[kDownType], 0, x, T, hidden, inter);
  }
  if (final_norm) add_rms_norm(x, residual, final_norm, T, hidden, eps, bf16, norm_dtype, fp32);
  return true;
}

}  // namespace pyengine::cpu
