// Element types shared by the CPU and CUDA kernels.
//
// DType values must match pyengine/ops/_dtype.py. bf16/fp16 are stored as
// uint16_t bit patterns on the CPU side; the conversions below are exact
// for float->bf16 with round-to-nearest-even (NaN kept quiet).
#pragma once

#include <cstdint>
#include <cstring>

namespace pyengine {

enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E4M3 = 3,  // KV cache only, with a scale per (token, kv head)
  kInt8 = 4,        // KV cache only, with a scale per (token, kv head)
};

#if !defined(__CUDACC__)
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in fp16
    float a;
    std::memcpy(&a, &absx, sizeof(a));
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(a * 16777216.0f + 0.5f));  // a / 2^-24, rounded
  }
  uint32_t mant_odd = (absx >> 13) & 1u;
  absx += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (absx >> 13));
}
#endif

}  // namespace pyengine
