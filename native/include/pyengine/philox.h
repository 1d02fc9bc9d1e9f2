// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11; the same generator as Random123 / cuRAND's Philox_4x32_10). Host/device portable: the
// CUDA kernels include this header and draw the same numbers as the CPU ones.
//
// A draw is a pure function of (counter, key): the sampler keys it by the request's seed and
// counts by its decode step, so a seeded request sees the same random numbers whatever batch
// or row it lands in.
#pragma once

#include <cstdint>

#include "pyengine/portable.h"

namespace pyengine {

struct Philox4x32Out {
  uint32_t v[4];
};

PYENGINE_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  lo = static_cast<uint32_t>(p);
  hi = static_cast<uint32_t>(p >> 32);
#endif
}

// Ten rounds of Philox4x32 on counter c with key k.
PYENGINE_HD Philox4x32Out philox4x32_10(const uint32_t c_in[4], const uint32_t k_in[2]) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  uint32_t c0 = c_in[0], c1 = c_in[1], c2 = c_in[2], c3 = c_in[3];
  uint32_t k0 = k_in[0], k1 = k_in[1];
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4x32Out{{c0, c1, c2, c3}};
}

// A uniform double in [0, 1) with 53 random bits, keyed by (seed, step).
PYENGINE_HD double philox_uniform(uint64_t seed, uint64_t step) {
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  const uint32_t ctr[4] = {static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u};
  const Philox4x32Out r = philox4x32_10(ctr, key);
  const uint64_t bits = (static_cast<uint64_t>(r.v[0]) << 32 | r.v[1]) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);  // 2^-53
}

}  // namespace pyengine
