// The micro-kernels of matmul_q_gemm.h: R rows x one repacked tile of 16 columns, every block.
// 512-bit (AVX-512 VNNI): one vector is the tile's 16 columns. 256-bit (AVX2, AVX-VNNI): two
// halves of 8 columns, one after the other. Per block and row: 8 dot products into int32 sums
// (R independent chains), then sum * (d_w * d_x) and, Q4_1, m_w * s_x into fp32 accumulators.
#pragma once

namespace kvflow_ort {

#if defined(KVFLOW_GEMM_512)
#define kGemmRowsMacro 8
constexpr int kGemmRows = 8;

template <int Bits, int R>
inline void gemm_rows(const MatMulQArgs& a, const GemmTile& t, int64_t c0, int cols,
                      int64_t r0) {
  const int64_t nb = a.k / kQBlock;
  // Q4_1: signed activation codes; Q8_0: the same biased by 128 (unsigned).
  const uint8_t* xq = (Bits == 4 ? reinterpret_cast<const uint8_t*>(a.x->q.data())
                                 : a.x->u.data()) + r0 * a.k;
  const float* xd = a.x->d.data() + r0 * nb;
  const float* xs = a.x->s.data() + r0 * nb;
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* wb = t.codes.data() + b * 128;
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i w = _mm512_loadu_si512(wb + g * 16);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(load4(xq + r * a.k + b * kQBlock + 4 * g));
        acc[r] = Bits == 4 ? _mm512_dpbusd_epi32(acc[r], w, xv)
                           : _mm512_dpbusd_epi32(acc[r], xv, w);
      }
    }
    const __m512 dw = _mm512_loadu_ps(t.d.data() + b * 16);
    const __m512 mw = _mm512_loadu_ps(t.m.data() + b * 16);
    const __m512i corr = _mm512_loadu_si512(t.corr.data() + b * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i dot = Bits == 8 ? _mm512_sub_epi32(acc[r], corr) : acc[r];
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                             _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), f[r]);
      if (Bits == 4) f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), f[r]);
    }
  }
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.y + (r0 + r) * a.n + c0, mask, f[r]);
}

#elif defined(KVFLOW_GEMM_256)
#define kGemmRowsMacro 4
constexpr int kGemmRows = 4;

// 256-bit VNNI: AVX-VNNI's instruction, or AVX-512 VNNI's on 256 bits (VL) in a build without
// the rest of AVX-512 (tests/test_matmul_q_gemm.py builds one: it runs the AVX-VNNI code path
// on a CPU that has AVX-512 VNNI but no AVX-VNNI).
#if defined(__AVXVNNI__)
#define KVFLOW_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVFLOW_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#endif

template <int Bits, int R>
inline void gemm_rows(const MatMulQArgs& a, const GemmTile& t, int64_t c0, int cols,
                      int64_t r0) {
  const int64_t nb = a.k / kQBlock;
#ifdef KVFLOW_VNNI256
  const uint8_t* xq = (Bits == 4 ? reinterpret_cast<const uint8_t*>(a.x->q.data())
                                 : a.x->u.data()) + r0 * a.k;
#else
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(a.x->q.data()) + r0 * a.k;
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const float* xd = a.x->d.data() + r0 * nb;
  const float* xs = a.x->s.data() + r0 * nb;
  for (int h = 0; h < 2 && h * 8 < cols; ++h) {
    __m256 f[R];
    for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t* wb = t.codes.data() + b * 128 + h * 8;
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 16));
#ifndef KVFLOW_VNNI256
        const __m256i aw = Bits == 8 ? _mm256_sign_epi8(w, w) : w;  // |q_w|, unsigned
#endif
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(load4(xq + r * a.k + b * kQBlock + 4 * g));
#ifdef KVFLOW_VNNI256
          acc[r] = Bits == 4 ? dpbusd256(acc[r], w, xv) : dpbusd256(acc[r], xv, w);
#else
          if (Bits == 4)  // 16-bit sums: see the header comment of matmul_q_gemm.h
            acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w, xv));
          else
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
                _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones));
#endif
        }
      }
      const __m256 dw = _mm256_loadu_ps(t.d.data() + b * 16 + h * 8);
      const __m256 mw = _mm256_loadu_ps(t.m.data() + b * 16 + h * 8);
#ifdef KVFLOW_VNNI256
      const __m256i corr = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(t.corr.data() + b * 16 + h * 8));
#endif
      for (int r = 0; r < R; ++r) {
#ifdef KVFLOW_VNNI256
        const __m256i dot = Bits == 8 ? _mm256_sub_epi32(acc[r], corr) : acc[r];
#else
        const __m256i dot = Bits == 4 ? _mm256_madd_epi16(acc[r], ones) : acc[r];
#endif
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), f[r]);
        if (Bits == 4) f[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), f[r]);
      }
    }
    const int n = std::min(8, cols - h * 8);
    for (int r = 0; r < R; ++r) {
      float* y = a.y + (r0 + r) * a.n + c0 + h * 8;
      if (n == 8) {
        _mm256_storeu_ps(y, f[r]);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, f[r]);
        std::memcpy(y, tmp, sizeof(float) * n);
      }
    }
  }
}
#endif

}  // namespace kvflow_ort
