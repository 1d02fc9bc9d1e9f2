// The CPU kernels' SIMD preamble: x86 intrinsics for whatever ISA the build's -march enables (each
// kernel guards its own code with the feature macros it needs), and GCC's false -Wuninitialized
// warnings on the _mm512_undefined_*() placeholders inside its own AVX-512 intrinsics silenced.
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
