// Standalone probe: the AVX2 decode kernels' compute alone (native/cpu/attention/decode_avx2.h), one core, the
// default model's shape (D 64, 3 rows: the q heads of one kv head). Prints TSC ticks per q-head score (one
// q row against one cached token, 64 products each way) for the bf16, int8, fp8 and fp32 caches:
//   - of QK, the softmax step and PV, each run on one 64-token chunk held in L1, so no memory wait counts;
//   - of the three in the driver's order (QK, softmax, PV; the next chunk's tiles prefetched) over N
//     distinct chunks in shuffled tiles, for N = 1 (L1), 8 (L2), 400 (L3: 3-7 MB) and 4,000 (DRAM).
//
//   g++ -O3 -march=native -std=c++17 -Inative/cpu -Inative/include bench/lab/decode_avx2_probe.cpp -o /tmp/probe
//   /tmp/probe
//
// Against bench_attention's decode times (cold, from memory) it says how much of a call is compute.
// Measured on an AMD EPYC (Zen 2, family 23 model 49, TSC 2.245 GHz, cores ~3.1-3.3 GHz), QK / softmax / PV:
// bf16 4.9 / 1.0 / 5.0, int8 3.6 / 1.7 / 3.9, fp8 6.0 / 1.2 / 6.0, fp32 7.1 / 0.9 / 7.2. In sequence,
// N = 1 / 8 / 400 / 4,000: bf16 10.1 / 10.5 / 11.1 / 24.6, int8 9.1 / 9.2 / 9.9 / 20.8, fp8 13.1 /
// 13.3 / 13.5 / 23.1, fp32 15.0 / 15.8 / 21.8 / 46.4. (fp8 since placed in fp32's bit layout, not
// through F16C: 5.0 / 0.9 / 5.4; in sequence 11.3 / 11.5 / 11.9 / 18.3-18.6, against 12.9 / 13.1 /
// 13.3 / 20-21 for F16C in the same runs.) From L3 the chunks cost 5-10% more (fp32's 4 KB
// tiles 40%); from DRAM (one thread, prefetching one chunk ahead) about twice: the memory's time is
// added to the compute's rather than hidden behind it. A build with -fwrapv, as CPython's flags give
// the extension, ran bf16 12% slower until pv_group's index math went unsigned; it now runs the same.
#include <x86intrin.h>

#include <algorithm>
#include <cstdio>
#include <utility>
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

// n chunks of shuffled tiles (random codes) with their scales.
template <Operands O>
struct Chunks {
  static constexpr int64_t kTileBytes = kBlock * kD * elem_bytes(O);
  std::vector<char> k, v;
  std::vector<float> scales;
  std::vector<ChunkPtrs> at;

  explicit Chunks(int n) : k(n * kTiles * kTileBytes), v(n * kTiles * kTileBytes), scales(n * kTiles * kBlock, 0.01f), at(n) {
    fill<O>(k, 1), fill<O>(v, 2);
    std::vector<int> order(n * kTiles);
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    uint32_t seed = 7;
    for (size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[(seed = seed * 1664525u + 1013904223u) % (i + 1)]);
    for (int c = 0; c < n; ++c) {
      for (int i = 0; i < kTiles; ++i) {
        const int t = order[c * kTiles + i];
        at[c].k0[i] = at[c].k1[i] = k.data() + t * kTileBytes, at[c].v0[i] = at[c].v1[i] = v.data() + t * kTileBytes;
        at[c].ks0[i] = at[c].ks1[i] = at[c].vs0[i] = at[c].vs1[i] = scales.data() + kBlock * t;
      }
      at[c].n = kChunk;
    }
  }
};

// The state of kRows q rows (q = 1.0) and the steps the decode driver runs per chunk.
template <Operands O>
struct Rows {
  const int64_t q_bytes = q_row_bytes(Avx2{}, O, kD), w_bytes = weight_row_bytes(Avx2{}, O);
  std::vector<char> q = std::vector<char>(kRows * q_bytes), w = std::vector<char>(kRows * w_bytes);
  std::vector<float> qs = std::vector<float>(kRows), sc = std::vector<float>(kRows * kChunk),
                     acc = std::vector<float>(kRows * kD, 0.0f);
  std::vector<int32_t> qsum = std::vector<int32_t>(kRows);
  float m[kRows] = {}, l[kRows] = {}, alpha[kRows] = {}, wscale[kRows] = {};

  Rows() {
    const std::vector<uint16_t> q_bf16(kRows * kD, 0x3f80);  // 1.0
    for (int r = 0; r < kRows; ++r)
      qs[r] = stage_q<O>(Avx2{}, q_bf16.data() + r * kD, pyengine::DType::kBFloat16, kD, q.data() + r * q_bytes,
                         &qsum[r]);
  }
  void qk(const ChunkPtrs& c, const ChunkPtrs& next) {
    qk_group<O, kD / 32, kRows, false>(Avx2{}, c, next, kBlock * lane_bytes(O), q.data(), q_bytes, qs.data(),
                                       qsum.data(), sc.data(), 0.1f);
  }
  void softmax(const ChunkPtrs& c) {
    for (int r = 0; r < kRows; ++r)
      alpha[r] = softmax_row<O, false>(Avx2{}, sc.data() + r * kChunk, 0, kChunk, kChunk, c, w.data() + r * w_bytes,
                                       m[r], l[r], wscale[r]);
  }
  void pv(const ChunkPtrs& c, const ChunkPtrs& next) {
    pv_group<O, kD / 32, kRows, false>(Avx2{}, c, next, w.data(), alpha, wscale, acc.data(), kChunk);
  }
};

template <Operands O>
void probe(const char* name) {
  Chunks<O> one(1);
  const ChunkPtrs& c = one.at[0];
  Rows<O> rows;
  const uint64_t t0 = __rdtsc();
  for (int it = 0; it < kIters; ++it) rows.qk(c, c);
  const uint64_t t1 = __rdtsc();
  for (int it = 0; it < kIters; ++it) rows.softmax(c);
  const uint64_t t2 = __rdtsc();
  for (int it = 0; it < kIters; ++it) rows.pv(c, c);
  const uint64_t t3 = __rdtsc();
  const double scores = double(kIters) * kRows * kChunk;
  std::printf("%-5s TSC ticks per score: QK %.2f  softmax %.2f  PV %.2f   (checksum %g)\n", name, (t1 - t0) / scores,
              (t2 - t1) / scores, (t3 - t2) / scores, static_cast<double>(rows.acc[0]));
}

// QK, softmax and PV in the driver's order over n distinct chunks (the next one's tiles prefetched),
// best of 5 sweeps of ~20,000 chunks: TSC ticks per score.
template <Operands O>
double in_sequence(int n) {
  Chunks<O> chunks(n);
  Rows<O> rows;
  const int sweeps = std::max(1, 20000 / n);
  uint64_t best = ~uint64_t{0};
  for (int rep = 0; rep < 5; ++rep) {
    const uint64_t t0 = __rdtsc();
    for (int s = 0; s < sweeps; ++s)
      for (int c = 0; c < n; ++c) {
        const ChunkPtrs &cur = chunks.at[c], &next = chunks.at[(c + 1) % n];
        rows.qk(cur, next);
        rows.softmax(cur);
        rows.pv(cur, next);
      }
    best = std::min<uint64_t>(best, __rdtsc() - t0);
  }
  return static_cast<double>(best) / (double(sweeps) * n * kRows * kChunk);
}

template <Operands O>
void sequence_probe(const char* name) {
  std::printf("%-5s in sequence, TSC ticks per score:", name);
  for (int n : {1, 8, 400, 4000}) std::printf("  N %d: %.2f", n, in_sequence<O>(n));
  std::printf("\n");
}

}  // namespace

int main() {
  probe<Operands::kBf16>("bf16");
  probe<Operands::kInt8>("int8");
  probe<Operands::kFp8Fp32>("fp8");
  probe<Operands::kFp32>("fp32");
  sequence_probe<Operands::kBf16>("bf16");
  sequence_probe<Operands::kInt8>("int8");
  sequence_probe<Operands::kFp8Fp32>("fp8");
  sequence_probe<Operands::kFp32>("fp32");
}
