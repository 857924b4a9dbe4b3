// MOE_SIMD_CLONES: a function compiled for several x86 levels in one binary (GCC emits an
// AVX-512 (x86-64-v4), an AVX2 and a baseline copy and picks one when the program loads, by the
// CPU: ifunc). For short elementwise loops written in fixed blocks so that -O2 vectorizes them;
// every copy computes the same results. At the bottom of the libraries (tensor) so that every
// layer may use it; numerics/simd_clones.h adds the AVX-512 check of the hand-written paths.
//
//   MOE_SIMD_CLONES bool BlockHasNonFinite(const uint16_t* bits);
#ifndef MOE_SERVICES_TENSOR_SIMD_CLONES_H_
#define MOE_SERVICES_TENSOR_SIMD_CLONES_H_

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MOE_SIMD_CLONES
#endif

#endif  // MOE_SERVICES_TENSOR_SIMD_CLONES_H_
