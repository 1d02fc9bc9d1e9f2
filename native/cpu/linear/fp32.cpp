// linear_fp32 (CPU, AVX2 + FMA): out[M, N] = x[M, K] @ W^T + bias in fp32, for fp32 models on CPUs
// without AVX-512 (resolve_dtype runs fp32 there), where torch's MKL sgemm reached well below the FMA
// peak (docs/performance.md, "fp32 linear"; bench/kernels/bench_linear.py --fp32).
//
// Layout: W packed once at load (ops/linear.py pack_weight_fp32) in panels of 16 outputs,
//   packed[p][k][16] = W[16 p + j, k]  (zero past N), 64-byte aligned,
// so a k step of a panel is two aligned vectors. The micro-kernel takes kRows = 6 rows of x and one
// panel: per k, 2 panel vectors x 6 broadcasts of x into 12 accumulators (12 FMAs against 8 loads),
// over a block of kDepth k (the panel's 16 KB slice stays in L1 while the rows pass). Work: groups of
// kPanels panels (64 outputs) per task, the tasks spread over the thread pool; inside a task, k blocks,
// then 6-row strips of x, then the group's panels, so a strip of x (6 KB) serves 4 panels from L1.
// The accumulators are named registers, not an array: GCC 12 kept an array's vectors in registers but
// also stored them to the stack every k step (one store a cycle: about half the rate in registers).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pyengine/cpu_ops.h"
#include "pyengine/parallel.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pyengine::cpu {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int kRows = 6;           // x rows per micro-kernel
constexpr int64_t kDepth = 256;    // k per block
constexpr int64_t kPanels = 4;     // 16-output panels per task

// y[r][0, 16) (+)= sum over k in [k0, k1) of x[r][k] * panel[k][0, 16) for NR rows (x rows ldx apart, y
// rows ldy apart): `first` stores, else adds to y; bias (16 values, or null) is added on the way out.
template <int NR>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, float* y,
                         int64_t ldy, bool first, const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* xk = x + k0;
  const float* wk = panel + k0 * 16;
  for (int64_t n = k1 - k0; n > 0; --n, ++xk, wk += 16) {
    const __m256 b0 = _mm256_load_ps(wk), b1 = _mm256_load_ps(wk + 8);
    __m256 a;
#define PYENGINE_ROW(r)                               \
  if constexpr (NR > r) {                             \
    a = _mm256_broadcast_ss(xk + r * ldx);            \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);        \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);        \
  }
    PYENGINE_ROW(0) PYENGINE_ROW(1) PYENGINE_ROW(2) PYENGINE_ROW(3) PYENGINE_ROW(4) PYENGINE_ROW(5)
#undef PYENGINE_ROW
  }
  const __m256 acc[kRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int r = 0; r < NR; ++r) {
    __m256 v0 = _mm256_add_ps(acc[r][0], bias0), v1 = _mm256_add_ps(acc[r][1], bias1);
    if (!first) v0 = _mm256_add_ps(v0, _mm256_loadu_ps(y + r * ldy)), v1 = _mm256_add_ps(v1, _mm256_loadu_ps(y + r * ldy + 8));
    _mm256_storeu_ps(y + r * ldy, v0);
    _mm256_storeu_ps(y + r * ldy + 8, v1);
  }
}

// micro_kernel for nr (1..6) rows.
inline void micro_kernel_rows(int nr, const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
                              float* y, int64_t ldy, bool first, const float* bias) {
  switch (nr) {
    case 6: return micro_kernel<6>(x, ldx, panel, k0, k1, y, ldy, first, bias);
    case 5: return micro_kernel<5>(x, ldx, panel, k0, k1, y, ldy, first, bias);
    case 4: return micro_kernel<4>(x, ldx, panel, k0, k1, y, ldy, first, bias);
    case 3: return micro_kernel<3>(x, ldx, panel, k0, k1, y, ldy, first, bias);
    case 2: return micro_kernel<2>(x, ldx, panel, k0, k1, y, ldy, first, bias);
    default: return micro_kernel<1>(x, ldx, panel, k0, k1, y, ldy, first, bias);
  }
}

// Panels [p0, p1) for all M rows. A panel past N's last whole 16 goes through a 6 x 16 buffer, of
// which only its columns < N reach out.
void run_panels(const float* x, const float* packed, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                int64_t p0, int64_t p1) {
  alignas(32) float edge[kRows * 16];
  alignas(32) float edge_bias[16];
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    const int64_t k1 = std::min(K, k0 + kDepth);
    const bool first = k0 == 0, last = k1 == K;
    for (int64_t m = 0; m < M; m += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, M - m));
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = packed + p * K * 16;
        const int64_t n0 = 16 * p, cols = std::min<int64_t>(16, N - n0);
        const float* b = last && bias ? bias + n0 : nullptr;
        if (cols == 16) {
          micro_kernel_rows(nr, x + m * K, K, panel, k0, k1, out + m * N + n0, N, first, b);
          continue;
        }
        if (b) std::fill(edge_bias, edge_bias + 16, 0.0f), std::copy(b, b + cols, edge_bias);
        for (int r = 0; r < nr && !first; ++r) std::copy(out + (m + r) * N + n0, out + (m + r) * N + N, edge + r * 16);
        micro_kernel_rows(nr, x + m * K, K, panel, k0, k1, edge, 16, first, b ? edge_bias : nullptr);
        for (int r = 0; r < nr; ++r) std::copy(edge + r * 16, edge + r * 16 + cols, out + (m + r) * N + n0);
      }
    }
  }
}

}  // namespace

bool linear_fp32_available() { return true; }

void linear_fp32(const float* x, const float* packed, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return;
  const int64_t panels = (N + 15) / 16, tasks = (panels + kPanels - 1) / kPanels;
  ThreadPool::instance().parallel_for(tasks, [&](int64_t t) {
    run_panels(x, packed, bias, out, M, N, K, t * kPanels, std::min(panels, (t + 1) * kPanels));
  });
}

#else  // no AVX2 + FMA: fp32 layers stay on torch

bool linear_fp32_available() { return false; }
void linear_fp32(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t) {}

#endif

}  // namespace pyengine::cpu
