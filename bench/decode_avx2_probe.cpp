// Standalone probe: the AVX2 decode kernels' compute alone (native/cpu/decode_avx2.h), one core, one
// 64-token chunk of the default model's shape (D 64, 3 rows: the q heads of one kv head) held in L1,
// so no memory wait counts. Prints TSC ticks per q-head score of QK, the softmax step and PV for the
// bf16, int8, fp8 and fp32 caches (a score: one q row against one cached token, 64 products each way).
//
//   g++ -O3 -march=native -std=c++17 -Inative/cpu -Inative/include bench/decode_avx2_probe.cpp \
//       -o /tmp/decode_avx2_probe && /tmp/decode_avx2_probe
//
// Against bench_attention's decode times (cold, from memory) it says how much of a call is compute.
// Measured on an AMD EPYC (Zen 2, family 23 model 49, TSC 2.245 GHz, cores ~2.8 GHz), QK / softmax / PV:
// bf16 5.0 / 0.8 / 5.0, int8 4.0 / 1.8 / 4.2, fp8 6.1 / 1.1 / 6.2, fp32 5.3 / 0.9 / 5.5; from memory, 2
// threads, the kernels take about twice that (bench_attention, batch 32 x 2,048: bf16 27, int8 18).
#include <x86intrin.h>

#include <cstdio>
#include <vector>

#include "decode_avx2.h"

using namespace pyengine::decode;

namespace {

constexpr int kRows = 3, kD = 64, kBlock = 16, kIters = 20000;

// Random codes of the cache dtype whose values are normal numbers of a few units (bf16, fp32: |x| in
// [0.5, 4)).
template <Operands O>
void fill(std::vector<char>& buf, uint32_t seed) {
  auto next = [&] { return (seed = seed * 1664525u + 1013904223u) >> 8; };
  for (size_t i = 0; i < buf.size(); ++i) {
    const uint32_t sign = next() % 2 ? 0x80 : 0;
    if constexpr (O == Operands::kFp32) buf[i] = static_cast<char>(i % 4 == 3 ? 0x3f + next() % 2 + sign : next());
    else if constexpr (O == Operands::kBf16) buf[i] = static_cast<char>(i % 2 ? 0x3f + next() % 2 + sign : next());
    else if constexpr (O == Operands::kInt8) buf[i] = static_cast<char>(next() % 255 - 127);
    else buf[i] = static_cast<char>(0x30 + next() % 0x40 + sign);
  }
}

template <Operands O>
void probe(const char* name) {
  constexpr int64_t tile_bytes = kBlock * kD * elem_bytes(O);
  std::vector<char> k(kTiles * tile_bytes), v(kTiles * tile_bytes);
  fill<O>(k, 1), fill<O>(v, 2);
  std::vector<float> scales(kTiles * kBlock, 0.01f);
  ChunkPtrs c{};
  for (int i = 0; i < kTiles; ++i) {
    c.k0[i] = c.k1[i] = k.data() + i * tile_bytes, c.v0[i] = c.v1[i] = v.data() + i * tile_bytes;
    c.ks0[i] = c.ks1[i] = c.vs0[i] = c.vs1[i] = scales.data() + kBlock * i;
  }
  c.n = kChunk;
  const int64_t q_bytes = q_row_bytes(Avx2{}, O, kD), w_bytes = weight_row_bytes(Avx2{}, O);
  std::vector<uint16_t> q_bf16(kRows * kD, 0x3f80);  // 1.0
  std::vector<char> q(kRows * q_bytes), w(kRows * w_bytes);
  std::vector<float> qs(kRows), sc(kRows * kChunk), acc(kRows * kD, 0.0f);
  std::vector<int32_t> qsum(kRows);
  float m[kRows] = {}, l[kRows] = {}, alpha[kRows], wscale[kRows];
  for (int r = 0; r < kRows; ++r)
    qs[r] = stage_q<O>(Avx2{}, q_bf16.data() + r * kD, pyengine::DType::kBFloat16, kD, q.data() + r * q_bytes,
                       &qsum[r]);
  const uint64_t t0 = __rdtsc();
  for (int it = 0; it < kIters; ++it)
    qk_group<O, kD / 32, kRows, false>(Avx2{}, c, c, kBlock * lane_bytes(O), q.data(), q_bytes, qs.data(), qsum.data(), sc.data(),
                                       0.1f);
  const uint64_t t1 = __rdtsc();
  for (int it = 0; it < kIters; ++it)
    for (int r = 0; r < kRows; ++r)
      alpha[r] = softmax_row<O, false>(Avx2{}, sc.data() + r * kChunk, 0, kChunk, kChunk, c, w.data() + r * w_bytes,
                                       m[r], l[r], wscale[r]);
  const uint64_t t2 = __rdtsc();
  for (int it = 0; it < kIters; ++it)
    pv_group<O, kD / 32, kRows, false>(Avx2{}, c, c, w.data(), alpha, wscale, acc.data(), kChunk);
  const uint64_t t3 = __rdtsc();
  const double scores = double(kIters) * kRows * kChunk;
  std::printf("%-5s TSC ticks per score: QK %.2f  softmax %.2f  PV %.2f   (checksum %g)\n", name, (t1 - t0) / scores,
              (t2 - t1) / scores, (t3 - t2) / scores, static_cast<double>(acc[0]));
}

}  // namespace

int main() {
  probe<Operands::kBf16>("bf16");
  probe<Operands::kInt8>("int8");
  probe<Operands::kFp8Half>("fp8");
  probe<Operands::kFp32>("fp32");
}
