// Codecs for quantized KV caches: fp8 e4m3 (OCP "e4m3fn": no infinities, 0x7f/0xff = NaN,
// max 448) and int8 (symmetric, [-127, 127]).
//
// Scale convention (shared by the CPU and CUDA kernels and the Python reference):
//   one fp32 scale per (token, kv head) row of head_dim values,
//   int8: scale = absmax(row) / 127 (scale 0 for an all-zero row)
//   e4m3: of the kFp8ScaleSteps candidates fp8_scale_candidate(absmax, j) = absmax / 448 * (16 + j) / 16,
//         the first with the least squared error sum((decode(encode(x / scale)) * scale - x)^2)
//   stored  q = encode(x / scale), 0 when scale == 0   (round to nearest even, saturating at +-qmax;
//           K rows written with the step's q may take the other neighbouring code: round_k_for_queries)
//   value   x ~ decode(q) * scale
// Why e4m3 searches: it rounds each value to 1/8 of its binade, so the error depends on where the row's
// values fall inside their binades, which stretching the scale (by up to 2x; never below absmax / 448,
// so nothing saturates) moves. The best of 16 leaves Gaussian rows about a quarter less squared error;
// simulated on the default model it cut the fp8 cache's change of the text's log-probabilities by about
// a tenth (tests/test_kv_accuracy.py). int8's uniform steps gain nothing from it.
// Encoders never write NaN codes; the decoder does not special-case them.
//
// Everything here is plain scalar math usable from host code and, under nvcc, device code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "pyengine/portable.h"

namespace pyengine {

constexpr float kFp8E4M3Max = 448.0f;
constexpr float kInt8Max = 127.0f;

PYENGINE_HD uint32_t kvq_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

PYENGINE_HD float kvq_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Scale for a row whose largest magnitude is `absmax`.
PYENGINE_HD float kv_scale(float absmax, float qmax) { return absmax / qmax; }

// The value handed to an encoder: a true division (not x * (1/scale)) so ties round as in torch.
PYENGINE_HD float kv_scaled(float x, float scale) { return scale > 0.0f ? x / scale : 0.0f; }

// float -> e4m3fn, round to nearest even, saturating to +-448 (inf too); NaN -> 0x7f.
PYENGINE_HD uint8_t float_to_fp8e4m3(float x) {
  const uint32_t bits = kvq_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const float af = kvq_float(a);
  if (af >= kFp8E4M3Max) return static_cast<uint8_t>(sign | 0x7eu);
  if (af < 0.015625f) {  // below the smallest normal 2^-6: subnormal steps of 2^-9 (8 = smallest normal)
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(rintf(af * 512.0f)));
  }
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
  const uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);  // rebias 127 -> 7
  return static_cast<uint8_t>(sign | (code > 0x7eu ? 0x7eu : code));
}

PYENGINE_HD float fp8e4m3_to_float(uint8_t v) {
  const uint32_t em = v & 0x7fu;
  const float mag = em >= 8u ? kvq_float((em << 20) + (120u << 23))  // normal: exponent e-7
                             : static_cast<float>(em) * 0.001953125f;  // subnormal: m * 2^-9
  return kvq_float(kvq_bits(mag) | (static_cast<uint32_t>(v & 0x80u) << 24));
}

// float -> int8, round to nearest even, saturating to +-127 (NaN -> -127).
PYENGINE_HD int8_t float_to_int8(float x) {
  float r = rintf(x);
  r = r >= -kInt8Max ? (r <= kInt8Max ? r : kInt8Max) : -kInt8Max;
  return static_cast<int8_t>(r);
}

PYENGINE_HD float int8_to_float(int8_t v) { return static_cast<float>(v); }

constexpr int kFp8ScaleSteps = 16;

// Candidate j (0 <= j < kFp8ScaleSteps) of an e4m3 row's scale; (16 + j) / 16 is exact in fp32.
PYENGINE_HD float fp8_scale_candidate(float absmax, int j) {
  return kv_scale(absmax, kFp8E4M3Max) * (static_cast<float>(16 + j) * 0.0625f);
}

// Squared error of x stored as e4m3 with `scale` and read back.
PYENGINE_HD float fp8_sq_error(float x, float scale) {
  const float e = fp8e4m3_to_float(float_to_fp8e4m3(kv_scaled(x, scale))) * scale - x;
  return e * e;
}

}  // namespace pyengine
