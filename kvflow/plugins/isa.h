// Which instruction set this build of the op library is for. kvflow/plugins/ort_isa.py compiles
// one library per ISA (its flags, and -DKVFLOW_ISA_NAME) and loads the one the CPU runs; the
// kernels choose their code paths by the compiler's macros (__AVX2__, __AVX512VNNI__, ...).
// RegisterCustomOps refuses to register on a CPU that lacks what the build was compiled for
// (cpu_lacks): a library loaded by hand on the wrong machine is an error, not SIGILL.
#pragma once

#include <string>

#ifndef KVFLOW_ISA_NAME
#define KVFLOW_ISA_NAME "unnamed"
#endif

// The tiled int8 GEMM (matmul_q_gemm.h): 512-bit with VNNI, else 256-bit with AVX2 (and
// AVX-VNNI's dot products where built with them). The portable build has none.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512F__) && defined(__F16C__) && defined(__FMA__)
#define KVFLOW_GEMM_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVFLOW_GEMM_256 1
#endif

#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
// NOTE: GCC 12's 512-bit intrinsics pass _mm512_undefined_*() (a self-initialised variable) as
// their pass-through operand and warn about it at every use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvflow_ort {

#if defined(KVFLOW_GEMM_512) || defined(KVFLOW_GEMM_256)
constexpr bool kHasGemm = true;
#else
constexpr bool kHasGemm = false;
#endif

// The features this build uses that the CPU lacks ("" when it runs here), by cpuid.
inline std::string cpu_lacks() {
  std::string missing;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#define KVFLOW_NEED(feature) \
  if (!__builtin_cpu_supports(feature)) missing += (missing.empty() ? "" : " ") + std::string(feature)
#ifdef __AVX2__
  KVFLOW_NEED("avx2");
#endif
#ifdef __FMA__
  KVFLOW_NEED("fma");
#endif
#ifdef __F16C__
  KVFLOW_NEED("f16c");
#endif
#ifdef __BMI2__
  KVFLOW_NEED("bmi2");
#endif
#ifdef __AVX512F__
  KVFLOW_NEED("avx512f");
#endif
#ifdef __AVX512BW__
  KVFLOW_NEED("avx512bw");
#endif
#ifdef __AVX512VL__
  KVFLOW_NEED("avx512vl");
#endif
#ifdef __AVX512DQ__
  KVFLOW_NEED("avx512dq");
#endif
#ifdef __AVX512VNNI__
  KVFLOW_NEED("avx512vnni");
#endif
#ifdef __AVXVNNI__
  KVFLOW_NEED("avxvnni");
#endif
#undef KVFLOW_NEED
#endif
  return missing;
}

}  // namespace kvflow_ort
