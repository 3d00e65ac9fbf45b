// One row (a decode step) x C Q4_1 columns on AVX-512 VNNI: matmul_q_kernel.h's column_rows
// with two blocks a 512-bit vector. A column's 32 bytes of nibbles (blocks b, b + 1) become
// [b low, b high, b+1 low, b+1 high] 16-byte lanes, which meet the row's 64 activation codes in
// one vpdpbusd (lanes 0-7: block b's partial sums, 8-15: block b + 1's); one conversion and one
// FMA with the two blocks' scales (d_w * d_x, each over its 8 lanes) then serve both blocks.
// Same arithmetic as column_rows: exact integer sums, per-block fp32 scales, only the fp32
// sums' order differs.
#pragma once

#if defined(KVFLOW_GEMM_512)
namespace kvflow_ort {

template <int C>
inline void column_row_q4_512(const MatMulQArgs& a, int64_t c0, int64_t r0) {
  const int64_t nb = a.k / kQBlock, row_bytes = nb * kQ41Bytes;
  const uint16_t* dw[C];
  const uint16_t* mw[C];
  const uint8_t* qs[C];
  for (int c = 0; c < C; ++c) {
    const uint8_t* col = a.w + (c0 + c) * row_bytes;
    dw[c] = reinterpret_cast<const uint16_t*>(col);
    mw[c] = dw[c] + nb;
    qs[c] = col + nb * 4;
  }
  const int8_t* xq = a.x->q.data() + r0 * a.k;
  const float* xd = a.x->d.data() + r0 * nb;
  const float* xs = a.x->s.data() + r0 * nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[C], mins[C];
  float tail[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = mins[c] = _mm512_setzero_ps();
    tail[c] = 0.0f;
  }
  alignas(64) float scale[C][kChunkBlocks];
  for (int64_t b0 = 0; b0 < nb; b0 += kChunkBlocks) {
    const int bn = (int)std::min<int64_t>(kChunkBlocks, nb - b0);
    int j = 0;
    for (; j + 16 <= bn; j += 16)
      for (int c = 0; c < C; ++c) {
        const __m512 d = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw[c] + b0 + j)));
        const __m512 m = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mw[c] + b0 + j)));
        _mm512_store_ps(&scale[c][j], _mm512_mul_ps(d, _mm512_loadu_ps(xd + b0 + j)));
        mins[c] = _mm512_fmadd_ps(m, _mm512_loadu_ps(xs + b0 + j), mins[c]);
      }
    for (; j < bn; ++j)
      for (int c = 0; c < C; ++c) {
        scale[c][j] = half(dw[c][b0 + j]) * xd[b0 + j];
        tail[c] += half(mw[c][b0 + j]) * xs[b0 + j];
      }
    for (j = 0; j + 2 <= bn; j += 2) {
      const int64_t b = b0 + j;
      const __m512i qx = _mm512_loadu_si512(xq + b * kQBlock);
      for (int c = 0; c < C; ++c) {
        const uint8_t* p = qs[c] + b * 16;
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) +
                                                   kPrefetchColumns * row_bytes),
                     _MM_HINT_T0);
        const __m512i v = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512i w = _mm512_and_si512(
            _mm512_srlv_epi64(_mm512_shuffle_i64x2(v, v, 0x50), shift), low);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qx);
        const __m512 s = _mm512_permutexvar_ps(
            pair, _mm512_castps256_ps512(_mm256_castps128_ps256(
                      _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(&scale[c][j]))))));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[c]);
      }
    }
    if (j < bn) {  // an odd block count: the last block on 256 bits
      const int64_t b = b0 + j;
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kQBlock));
      const __m256i shift256 = _mm256_setr_epi64x(0, 0, 4, 4);
      for (int c = 0; c < C; ++c) {
        const __m256i qw = _mm256_and_si256(
            _mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(qs[c] + b * 16))),
                              shift256),
            _mm256_set1_epi8(0x0F));
        tail[c] += scale[c][j] * (float)_mm512_reduce_add_epi32(_mm512_zextsi256_si512(dot_u8s8(qw, qx)));
      }
    }
  }
  for (int c = 0; c < C; ++c)
    a.y[r0 * a.n + c0 + c] =
        _mm512_reduce_add_ps(acc[c]) + _mm512_reduce_add_ps(mins[c]) + tail[c];
}

}  // namespace kvflow_ort
#endif
