// The float vectors the panel GEMMs (packed_gemm.cpp, exact_block_gemm.cpp) are written in: GCC vector
// extensions of VL floats, one AVX-512 register (VL = 16) or one AVX2 register (VL = 8, with FMA), so
// one source serves both builds. A 32-column panel is kPanelVectors = 32 / VL vectors per k step.
//
// Every multiply-add goes through `fma` (one rounding, never split or reassociated) and every
// product that must be rounded on its own through `mul_rounded` (never fused into a later FMA), so
// a sum taken in k order gives the same bits on either width: the exact blocks' results equal the
// float32 panels' on one build, and the AVX2 build's equal the AVX-512 build's.
//
// TRITONLLM_PANEL_GEMM is 1 where the kernels exist (AVX-512F, or AVX2 with FMA), else 0 and the
// engine keeps oneDNN (devices/cpu/packed_linear.py).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TRITONLLM_PANEL_GEMM 1
#include <immintrin.h>
#else
#define TRITONLLM_PANEL_GEMM 0
#endif

#if TRITONLLM_PANEL_GEMM

namespace tritonllm::panel {

#if defined(__AVX512F__)
#define TRITONLLM_PANEL_VL 16
#else
#define TRITONLLM_PANEL_VL 8
#endif
constexpr int VL = TRITONLLM_PANEL_VL;
constexpr int kPanelVectors = 32 / VL;  // vectors per k step of a 32-column panel

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf zero() { return vf{}; }
inline vf splat(float x) { return x - vf{}; }

// a * b + c with one rounding.
inline vf fma(vf a, vf b, vf c) {
#if TRITONLLM_PANEL_VL == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// fl(a * b), a product the compiler may not fuse into a later add (-ffast-math would otherwise allow it).
inline vf mul_rounded(vf a, vf b) {
#if TRITONLLM_PANEL_VL == 16
  return (vf)_mm512_mul_round_ps((__m512)a, (__m512)b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  vf p = a * b;
  asm("" : "+x"(p));  // opaque: the product is rounded and stored as it is
  return p;
#endif
}

// VL bytes (unsigned / signed) from p, widened to int32 lanes. (Intrinsics: GCC 12 widens a
// __builtin_convertvector of bytes lane by lane through general registers.)
inline vi widen_u8(const uint8_t* p) {
#if TRITONLLM_PANEL_VL == 16
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline vi widen_s8(const uint8_t* p) {
#if TRITONLLM_PANEL_VL == 16
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }
// VL bfloat16 values from p as float32 (exact: their bits, shifted up).
inline vf widen_bf16(const uint8_t* p) {
#if TRITONLLM_PANEL_VL == 16
  const vu32 v = (vu32)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  const vu32 v = (vu32)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  return (vf)(v << 16);
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

}  // namespace tritonllm::panel

#endif
