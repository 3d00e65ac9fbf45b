// Vector helpers of the kvflow::PagedAttention ORT kernel (paged_attention_ort_kernel.h): GCC
// vector extensions (8 floats, AVX registers on x86 with -march=native, pairs of SSE registers
// or scalars elsewhere), exp, horizontal sums and float16 conversion.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvflow_ort {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kLanes = 8;

inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8f vmax(v8f a, v8f b) { return a > b ? a : b; }

// exp over 8 lanes (Cephes' expf polynomial, relative error ~1e-7); x < -87.3 gives exactly 0.
inline v8f vexp(v8f x) {
  const v8f orig = x;
  x = vmax(x, splat(-87.3f));
  x = x < splat(88.3f) ? x : splat(88.3f);
  v8f fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8f fl = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8f);
  fl = fl > fx ? fl - splat(1.0f) : fl;
  x = x - fl * splat(0.693359375f) + fl * splat(2.12194440e-4f);
  v8f y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * x * x + x + splat(1.0f);
  v8i e = (__builtin_convertvector(fl, v8i) + 127) << 23;
  v8f pow2n;
  std::memcpy(&pow2n, &e, sizeof pow2n);
  y = y * pow2n;
  return orig < splat(-87.3f) ? splat(0.0f) : y;
}

// float16 <-> float32. F16C when the build machine has it; otherwise the bit-exact portable
// conversion (round to nearest even on the way down, as numpy's astype does).
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // rounds past 65504: inf
  if (ax < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (ax < 0x33000000u) return (uint16_t)sign;
    uint32_t man = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23);
    uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t h = ((ax >> 13) - (112u << 10)), rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return (uint16_t)(sign | h);
}

inline v8f load8(const uint16_t* p) {
#if defined(__F16C__)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  v8f v;
  for (int i = 0; i < kLanes; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t h) { return half_to_float(h); }

inline void halves_to_floats(const uint16_t* src, float* dst, int n) {
  int x = 0;
#if defined(__F16C__)
  for (; x + 8 <= n; x += 8)
    _mm256_storeu_ps(dst + x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + x))));
#endif
  for (; x < n; ++x) dst[x] = half_to_float(src[x]);
}

inline void floats_to_halves(const float* src, uint16_t* dst, int n) {
  int x = 0;
#if defined(__F16C__)
  for (; x + 8 <= n; x += 8)
    _mm_storeu_si128((__m128i*)(dst + x),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + x), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; x < n; ++x) dst[x] = float_to_half(src[x]);
}

inline float hsum(v8f v) {
#if defined(__AVX__)
  __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// Eight sums of eight vectors at once: {hsum(a[0]), ..., hsum(a[7])}.
inline v8f hsum8(const v8f* a) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                            _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8f r;
  for (int i = 0; i < kLanes; ++i) r[i] = hsum(a[i]);
  return r;
#endif
}

}  // namespace kvflow_ort
