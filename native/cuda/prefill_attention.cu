// prefill_attention: FlashAttention-2 on tensor cores over the paged KV cache, for steps that
// carry prompt chunks (max_query_len > 1). Same arguments and semantics as paged_attention
// (attention.cu); cases it does not cover run paged_attention instead:
//   - q dtype bf16 or fp16 and a cache of the same dtype (fp32 and fp8/int8 caches: paged_attention),
//   - head_dim 64 or 128, 16-byte aligned q/out/cache rows (q_token_stride a multiple of 8),
//   - max_query_len > 1 (a decode-only step is what the split-KV kernel is for), num_seqs <= 65535.
// In a mixed step the sequences with one query token (decodes) still run the split-KV kernel
// (paged_attention_rows with decodes_only), launched first; this kernel skips them.
//
// Launch shape (fixed from host-side numbers, no plan on the device):
//   grid = (H, ceil(max_query_len / 64), S), 128 threads (4 warps), dynamic shared memory
//   Q [64][D] + K [2][64][D] + V [2][64][D] (bf16/fp16; 40 KB at D 64, 80 KB at D 128).
//   One CTA = 64 query rows of one sequence and one q head; the kv head is h / (H / KVH) (GQA: the
//   heads of a group read the same K/V tiles, which stay in L2). CTAs whose tile starts past the
//   sequence's q_len return at once (short sequences of a mixed step). blockIdx.y runs the q tiles
//   last-first: the tiles with the most keys (causal) start first.
//   Warp w owns query rows [16w, 16w + 16) of the tile. Per 64-key tile: S = Q K^T with
//   mma.sync m16n8k16 (fp32 accumulators), scale and causal/validity mask, online softmax in base 2
//   (row max and sum per thread pair of rows, the sum reduced over the quad only at the end),
//   P (rounded to bf16/fp16 in registers, the S accumulator layout is the A operand layout) times V.
//   K/V tiles are gathered row by row through the block table with cp.async (zero-filled past the
//   end and for out-of-range block ids, which are masked as in paged_attention), double-buffered:
//   tile j + 1 loads while tile j is computed. Tiles whose keys are all present and seen by every row of a
//   warp skip the mask.
//   Shared tiles are stored with a 16-byte-chunk XOR swizzle (chunk c of row r at c ^ (r & 7)), so
//   the ldmatrix reads of 8 rows at one column hit 8 different bank groups.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common.cuh"
#include "ops.cuh"

namespace pyengine {
namespace cuda {
namespace {

constexpr int kBM = 64;  // query rows per CTA
constexpr int kBN = 64;  // keys per tile
constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16 bytes global -> shared, asynchronously; valid = false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Two floats -> one register of two 16-bit values, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Element offset of (row, 8-element chunk c) in a swizzled [rows][D] tile.
template <int D>
__device__ __forceinline__ int swz(int row, int c) {
  return row * D + ((c ^ (row & 7)) << 3);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefill_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ kc,
                             const T* __restrict__ vc, const int* __restrict__ block_tables,
                             const int* __restrict__ seq_lens, const int* __restrict__ qsl, int H, int KVH, int BS,
                             int max_blocks, int num_blocks, int64_t q_stride, float scale_log2) {
  // Sequences with one query token (decodes) are paged_attention_rows' (split-KV: a 64-row tile would waste
  // 63 rows and one CTA per head would read a long context alone).
  constexpr int C = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);  // [kBM][D]
  T* sk = sq + kBM * D;                     // [2][kBN][D]
  T* sv = sk + 2 * kBN * D;                 // [2][kBN][D]
  __shared__ bool s_valid[2][kBN];          // key row present (in range and a valid block id)

  const int h = blockIdx.x, s = blockIdx.z;
  const int q0 = qsl[s], q_len = qsl[s + 1] - q0;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * kBM;
  if (m0 >= q_len || q_len == 1) return;  // uniform over the CTA
  const int seq_len = seq_lens[s];
  const int ctx = seq_len - q_len;  // cached keys before this chunk: row i sits at position ctx + i
  const int n_total = min(seq_len, max_blocks * BS);
  const int n_keys = max(0, min(n_total, ctx + min(m0 + kBM, q_len)));  // keys the tile's last row sees
  const int n_tiles = (n_keys + kBN - 1) / kBN;
  const int g = h / (H / KVH);
  const int* bt = block_tables + static_cast<int64_t>(s) * max_blocks;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int i = tid; i < kBM * C; i += kThreads) {
    const int r = i / C, c = i % C;
    const bool valid = m0 + r < q_len;
    const T* src = valid ? q + static_cast<int64_t>(q0 + m0 + r) * q_stride + static_cast<int64_t>(h) * D + c * 8 : q;
    cp_async_16(sq + swz<D>(r, c), src, valid);
  }
  // Issues the loads of key tile `tile` into stage `st`; returns whether every row this thread loaded is
  // present (the CTA's AND of it says whether the tile needs its validity mask).
  auto load_kv = [&](int tile, int st) {
    const int kb = tile * kBN;
    bool all = true;
    for (int i = tid; i < kBN * C; i += kThreads) {
      const int r = i / C, c = i % C, key = kb + r;
      const int blk = key < n_keys ? bt[key / BS] : -1;
      const bool valid = blk >= 0 && blk < num_blocks;
      const int64_t off = valid ? ((static_cast<int64_t>(blk) * KVH + g) * BS + key % BS) * D + c * 8 : 0;
      cp_async_16(sk + st * kBN * D + swz<D>(r, c), kc + off, valid);
      cp_async_16(sv + st * kBN * D + swz<D>(r, c), vc + off, valid);
      if (c == 0) s_valid[st][r] = valid;
      all &= valid;
    }
    return all;
  };
  bool tile_present = n_tiles > 0 ? load_kv(0, 0) : true;  // this thread's rows of the tile computed next
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // This warp's rows of Q as A fragments: k-step kk covers dims [16kk, 16kk + 16).
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qa[kk], sq + swz<D>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 2 + (lane >> 4)));

  const int row_lo = m0 + warp * 16 + (lane >> 2);  // this thread's rows: row_lo and row_lo + 8
  const int lim[2] = {min(n_total, ctx + row_lo + 1), min(n_total, ctx + row_lo + 9)};  // keys < lim seen
  const bool warp_live = m0 + warp * 16 < q_len;
  const int warp_keys = min(n_total, ctx + min(m0 + warp * 16 + 16, q_len));  // keys its last row sees
  const int warp_first_keys = min(n_total, ctx + m0 + warp * 16 + 1);        // keys its first row sees
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j & 1, kb = j * kBN;
    const bool next_present = j + 1 < n_tiles ? load_kv(j + 1, st ^ 1) : true;
    cp_async_commit();
    cp_async_wait<1>();
    const bool present = __syncthreads_and(tile_present);  // the barrier that publishes tile j, too
    tile_present = next_present;
    // No mask where every key of the tile is present and seen by every row of the warp.
    const bool full = present && kb + kBN <= warp_first_keys;
    if (warp_live && kb < warp_keys) {
      const T* k_tile = sk + st * kBN * D;
      const T* v_tile = sv + st * kBN * D;
      float sc[kBN / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int jn = 0; jn < kBN / 16; ++jn) {
          uint32_t b[4];
          ldmatrix_x4(b, k_tile + swz<D>(jn * 16 + (lane & 7) + (lane >> 4) * 8, kk * 2 + ((lane >> 3) & 1)));
          mma_16816<T>(sc[2 * jn], qa[kk], b[0], b[1]);
          mma_16816<T>(sc[2 * jn + 1], qa[kk], b[2], b[3]);
        }
      }
      // Scale into base 2, mask, and the online softmax update of this thread's two rows.
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int jn = 0; jn < kBN / 8; ++jn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, key_in_tile = jn * 8 + 2 * (lane & 3) + (e & 1);
          const bool keep = full || (kb + key_in_tile < lim[r] && s_valid[st][key_in_tile]);
          sc[jn][e] = keep ? sc[jn][e] * scale_log2 : -INFINITY;
          mx[r] = fmaxf(mx[r], sc[jn][e]);
        }
      }
      float corr[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // a row with no key yet: every p is 0
        corr[r] = exp2f(m[r] - base[r]);             // 0 while m is -inf
        m[r] = mx[r];
        l[r] *= corr[r];
      }
#pragma unroll
      for (int jn = 0; jn < kBN / 8; ++jn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          sc[jn][e] = exp2f(sc[jn][e] - base[r]);
          l[r] += sc[jn][e];
        }
      }
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        o[dn][0] *= corr[0];
        o[dn][1] *= corr[0];
        o[dn][2] *= corr[1];
        o[dn][3] *= corr[1];
      }
      // O += P V: P's accumulators of key tiles 2kk, 2kk + 1 are the A fragment of keys [16kk, 16kk + 16).
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        const uint32_t pa[4] = {pack2<T>(sc[2 * kk][0], sc[2 * kk][1]), pack2<T>(sc[2 * kk][2], sc[2 * kk][3]),
                                pack2<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                pack2<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_tile + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dn * 2 + (lane >> 4)));
          mma_16816<T>(o[2 * dn], pa, b[0], b[1]);
          mma_16816<T>(o[2 * dn + 1], pa, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the next iteration loads into this stage
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    if (row >= q_len) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no key seen: zeros, as paged_attention
    T* orow = out + (static_cast<int64_t>(q0 + row) * H + h) * D + 2 * (lane & 3);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      *reinterpret_cast<uint32_t*>(orow + dn * 8) = pack2<T>(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv);
  }
}

template <typename T, int D>
void launch_prefill(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
                    uintptr_t seq_lens, uintptr_t qsl, int64_t H, int64_t KVH, int64_t BS, int64_t S,
                    int64_t max_blocks, int64_t num_blocks, int64_t q_stride, int64_t max_query_len, double scale,
                    cudaStream_t st, const char* op) {
  constexpr int smem = (kBM + 4 * kBN) * D * static_cast<int>(sizeof(T));
  static const cudaError_t attr =  // once per instantiation: opt in to > 48 KB of dynamic shared memory
      cudaFuncSetAttribute(prefill_attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check_call(attr, op);
  const dim3 grid(static_cast<unsigned>(H), static_cast<unsigned>((max_query_len + kBM - 1) / kBM),
                  static_cast<unsigned>(S));
  prefill_attention_kernel<T, D><<<grid, kThreads, smem, st>>>(
      reinterpret_cast<T*>(out), reinterpret_cast<const T*>(q), reinterpret_cast<const T*>(k_cache),
      reinterpret_cast<const T*>(v_cache), reinterpret_cast<const int*>(block_tables),
      reinterpret_cast<const int*>(seq_lens), reinterpret_cast<const int*>(qsl), static_cast<int>(H),
      static_cast<int>(KVH), static_cast<int>(BS), static_cast<int>(max_blocks), static_cast<int>(num_blocks), q_stride,
      static_cast<float>(scale * 1.4426950408889634 /* log2 e */));
}

bool prefill_attention_supported(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache,
                                 int64_t num_heads, int64_t head_dim, int64_t q_token_stride, int64_t num_seqs,
                                 int64_t max_query_len, int q_dtype, int cache_dtype, int64_t window,
                                 double softcap) {
  const bool half = q_dtype == static_cast<int>(DType::kBFloat16) || q_dtype == static_cast<int>(DType::kFloat16);
  const bool aligned = !((out | q | k_cache | v_cache) & 15) && q_token_stride % 8 == 0;
  return half && cache_dtype == q_dtype && (head_dim == 64 || head_dim == 128) && aligned && window == 0 &&
         softcap == 0.0 && max_query_len > 1 && (max_query_len + kBM - 1) / kBM <= 65535 && num_seqs <= 65535 &&
         num_heads <= 65535;
}

}  // namespace

void prefill_attention(uintptr_t out, uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_scales,
                       uintptr_t v_scales, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                       int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t q_token_stride, int64_t num_blocks, int64_t block_size, int64_t num_seqs,
                       int64_t max_blocks_per_seq, int64_t max_seq_len, double scale, int q_dtype, int cache_dtype,
                       uintptr_t stream, int64_t window, double softcap, int64_t max_query_len) {
  if (!prefill_attention_supported(out, q, k_cache, v_cache, num_heads, head_dim, q_token_stride, num_seqs,
                                   max_query_len, q_dtype, cache_dtype, window, softcap)) {
    paged_attention(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc,
                    num_tokens, num_heads, num_kv_heads, head_dim, q_token_stride, num_blocks, block_size, num_seqs,
                    max_blocks_per_seq, max_seq_len, scale, q_dtype, cache_dtype, stream, window, softcap);
    return;
  }
  const char* op = "prefill_attention";
  check_attention_sizes(num_heads, num_kv_heads, head_dim, block_size, op);
  if (num_tokens == 0 || num_seqs == 0) return;
  // the decode rows first, on the split-KV kernel (the host cannot see whether the step has any: a step
  // without them pays for CTAs that return at once)
  paged_attention_rows(out, q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc,
                       num_tokens, num_heads, num_kv_heads, head_dim, q_token_stride, num_blocks, block_size, num_seqs,
                       max_blocks_per_seq, max_seq_len, scale, q_dtype, cache_dtype, stream, window, softcap, true);
  DeviceGuard guard(reinterpret_cast<void*>(q), op);
  const cudaStream_t st = as_stream(stream);
  const auto run = [&](auto tag, auto dim) {
    using T = decltype(tag);
    launch_prefill<T, decltype(dim)::value>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                            num_heads, num_kv_heads, block_size, num_seqs, max_blocks_per_seq,
                                            num_blocks, q_token_stride, max_query_len, scale, st, op);
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (q_dtype == static_cast<int>(DType::kBFloat16)) {
    head_dim == 64 ? run(__nv_bfloat16{}, D64{}) : run(__nv_bfloat16{}, D128{});
  } else {
    head_dim == 64 ? run(__half{}, D64{}) : run(__half{}, D128{});
  }
  check_launch(op);
}

}  // namespace cuda
}  // namespace pyengine
