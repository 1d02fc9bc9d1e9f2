// Software prefetches the compiler keeps.
//
// GCC (12 here) models _mm_prefetch / __builtin_prefetch as touching no memory. A function or lambda
// whose only effect is prefetching is then judged const, and its calls are deleted as dead code where
// it was not inlined first, silently: before this header the binary held none of the prefetches of
// prefill_attention's and prefill_fp32's chunks, of the cache writes' rows, nor the AVX2 decode
// kernel's of K (objdump -d of the built module shows which prefetches exist). An asm statement
// marked volatile is an effect of its own, which no pass removes.
#pragma once
#include <xmmintrin.h>

namespace pyengine {

// Fetch the cache line holding p for reading, into the level Hint names (_MM_HINT_T0: L1 and down,
// T1: L2, T2: L3, NTA: close to the core, evicted first).
template <int Hint>
inline void prefetch(const void* p) {
  const char& line = *static_cast<const char*>(p);
  if constexpr (Hint == _MM_HINT_T0) asm volatile("prefetcht0 %0" : : "m"(line));
  else if constexpr (Hint == _MM_HINT_T1) asm volatile("prefetcht1 %0" : : "m"(line));
  else if constexpr (Hint == _MM_HINT_T2) asm volatile("prefetcht2 %0" : : "m"(line));
  else asm volatile("prefetchnta %0" : : "m"(line));
}

// Fetch the line holding p for writing: exclusive (prefetchw) where the CPU has PRFCHW, else into L1.
inline void prefetch_for_write(const void* p) {
  const char& line = *static_cast<const char*>(p);
#if defined(__PRFCHW__)
  asm volatile("prefetchw %0" : : "m"(line));
#else
  asm volatile("prefetcht0 %0" : : "m"(line));
#endif
}

}  // namespace pyengine
