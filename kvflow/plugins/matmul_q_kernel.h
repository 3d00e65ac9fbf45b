// The arithmetic of kvflow::MatMulQ (matmul_q_ort.h): y[M, N] = x[M, K] @ W, W in GGUF blocks
// of 32 along K, x quantized per 32-block to int8 (llama.cpp's q8_1), integer dot products.
//
// Weight layout (what kvflow/runtime/ort_graph_linear.py writes): one uint8 tensor
// [N, K / 32 * block_bytes], output column n's row holding its nb = K / 32 blocks as llama.cpp's
// blocks with the fields gathered (so that 8 blocks' scales are one vector load):
// - bits 4 (Q4_1, block_bytes 20): fp16 d[nb], fp16 m[nb], uint8 qs[nb][16]; element j of
//   block b is the low nibble of qs[b][j] (j < 16) or the high nibble of qs[b][j - 16];
//   w = d * q + m.
// - bits 8 (Q8_0, block_bytes 34): fp16 d[nb], int8 qs[nb][32]; w = d * q.
// Activations, per row and block of 32: d = amax / 127, q = rint(x * (127 / amax)) (0 when
// amax is 0; ties to even), s = d * sum(q). Per output, over blocks:
//   y = sum_b (d_w * d_x) * sum_j q_w q_x  [+ m_w * s_x]
// The integer sums are exact; the fp32 sums are in 8 lanes (AVX2) or in block order (the
// portable code under #ifndef __AVX2__), which differ only by rounding. Steps of many rows run
// the tiled GEMM of matmul_q_gemm.h instead: the same sums, in 16 columns' lanes.
// Built with VNNI (AVX-512 VL or AVX-VNNI), the widening dot products are vpdpbusd (one
// instruction, exact) instead of vpmaddubsw + vpmaddwd (whose 16-bit pair sums never saturate
// here: 2 * 15 * 127 for Q4_1, 2 * 128 * 127 for Q8_0's sign trick).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "paged_attention_ort_simd.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace kvflow_ort {

constexpr int kQBlock = 32;
constexpr int kQ41Bytes = 20;  // fp16 d, fp16 m, 16 bytes of nibbles
constexpr int kQ80Bytes = 34;  // fp16 d, 32 int8
constexpr int kColumnTile = 16;  // output columns per parallel work item
constexpr int kRowGroup = 4;     // activation rows sharing each unpacked weight block
constexpr int kChunkBlocks = 32;  // blocks whose scales are computed ahead, 8 at a time
// Weights are prefetched this many columns ahead: a decode step streams them from memory, and
// measured on the default engine (batch 1, one thread) this cut the step from 17 to 13 ms.
// NOTE: past the last column it points beyond the tensor (an integer address, never
// dereferenced: prefetches do not fault).
constexpr int kPrefetchColumns = 8;

inline int block_bytes(int bits) { return bits == 4 ? kQ41Bytes : kQ80Bytes; }

// x quantized: per row, K/32 blocks of 32 int8, and per block d and s.
struct QActivations {
  std::vector<int8_t> q;
  std::vector<uint8_t> u;  // q + 128, for the GEMM's Q8_0 VNNI dot products (else empty)
  std::vector<float> d, s;
};

inline float half(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

inline void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out) {
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max_abs = _mm_cvtss_f32(m4);
  // NOTE: 127 / amax by a division instruction (not amax's reciprocal): the reference's.
  const float id = max_abs != 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.0f), m4)) : 0.0f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i)
    i32[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                 _mm256_add_epi32(i32[2], i32[3]));
  __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
  const __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  // packs works within 128-bit lanes: put the 4-byte groups back in order.
  const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  const float d = max_abs / 127.0f;
  *d_out = d;
  *s_out = d * (float)_mm_cvtsi128_si32(s4);
#else
  float max_abs = 0.0f;
  for (int j = 0; j < kQBlock; ++j) max_abs = std::max(max_abs, std::fabs(x[j]));
  volatile float amax_v = max_abs;  // NOTE: keeps 127 / amax a true division
  const float id = max_abs != 0.0f ? 127.0f / amax_v : 0.0f;
  int32_t sum = 0;
  for (int j = 0; j < kQBlock; ++j) {
    const int32_t v = (int32_t)std::nearbyint(x[j] * id);
    q[j] = (int8_t)v;
    sum += v;
  }
  const float d = max_abs / 127.0f;
  *d_out = d;
  *s_out = d * (float)sum;
#endif
}

inline void quantize_rows(const float* x, int64_t rows, int64_t k, QActivations& a) {
  const int64_t nb = k / kQBlock;
  a.q.resize((size_t)(rows * k));
  a.d.resize((size_t)(rows * nb));
  a.s.resize((size_t)(rows * nb));
  for (int64_t i = 0; i < rows * nb; ++i)
    quantize_block(x + i * kQBlock, a.q.data() + i * kQBlock, &a.d[i], &a.s[i]);
}

struct MatMulQArgs {
  int bits;
  int64_t m, k, n;
  const uint8_t* w;   // [N, nb * block_bytes]
  const QActivations* x;
  float* y;           // [M, N]
};

#ifdef __AVX2__
// Per int32 lane, the sum of 4 products unsigned u x signed s.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// C columns (c0 ..) x R rows (r0 ..): each weight block is loaded and unpacked once for the R
// rows, each activation block once for the C columns; C * R independent FMA chains. Blocks go
// by chunks of kChunkBlocks: first the chunk's scales d_w * d_x and (Q4_1) its minimum terms
// m_w * s_x, 8 blocks a vector, then the integer dot products.
template <int Bits, int C, int R>
inline void column_rows(const MatMulQArgs& a, int64_t c0, int64_t r0) {
  constexpr int kCodeBytes = Bits == 4 ? 16 : 32;
  const int64_t nb = a.k / kQBlock, row_bytes = nb * (Bits == 4 ? kQ41Bytes : kQ80Bytes);
  const uint16_t* dw[C];
  const uint16_t* mw[C];
  const uint8_t* qs[C];
  for (int c = 0; c < C; ++c) {
    const uint8_t* col = a.w + (c0 + c) * row_bytes;
    dw[c] = reinterpret_cast<const uint16_t*>(col);
    mw[c] = dw[c] + nb;
    qs[c] = col + nb * (Bits == 4 ? 4 : 2);
  }
  const int8_t* xq = a.x->q.data() + r0 * a.k;
  const float* xd = a.x->d.data() + r0 * nb;
  const float* xs = a.x->s.data() + r0 * nb;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i shift = _mm256_setr_epi64x(0, 0, 4, 4);
  __m256 acc[C][R];
  float tail[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) { acc[c][r] = _mm256_setzero_ps(); tail[c][r] = 0.0f; }
  alignas(32) float scale[C][R][kChunkBlocks];
  for (int64_t b0 = 0; b0 < nb; b0 += kChunkBlocks) {
    const int bn = (int)std::min<int64_t>(kChunkBlocks, nb - b0);
    int j = 0;
    for (; j + 8 <= bn; j += 8)
      for (int c = 0; c < C; ++c) {
        const __m256 d = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(dw[c] + b0 + j)));
        const __m256 m = Bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                         reinterpret_cast<const __m128i*>(mw[c] + b0 + j)))
                                   : d;
        for (int r = 0; r < R; ++r) {
          _mm256_store_ps(&scale[c][r][j], _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * nb + b0 + j)));
          if (Bits == 4)  // the minimum terms go straight into the accumulator's lanes
            acc[c][r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + r * nb + b0 + j), acc[c][r]);
        }
      }
    for (; j < bn; ++j)
      for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) {
          scale[c][r][j] = half(dw[c][b0 + j]) * xd[r * nb + b0 + j];
          if (Bits == 4) tail[c][r] += half(mw[c][b0 + j]) * xs[r * nb + b0 + j];
        }
    for (j = 0; j < bn; ++j) {
      const int64_t b = b0 + j;
      __m256i qx[R];
      for (int r = 0; r < R; ++r)
        qx[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * a.k + b * kQBlock));
      for (int c = 0; c < C; ++c) {
        const uint8_t* p = qs[c] + b * kCodeBytes;
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) +
                                                   kPrefetchColumns * row_bytes),
                     _MM_HINT_T0);
        __m256i qw, aw;
        if (Bits == 4) {  // low nibbles in the low lane, high nibbles in the high lane
          qw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          aw = qw = _mm256_and_si256(_mm256_srlv_epi64(qw, shift), low);
        } else {
          qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          aw = _mm256_sign_epi8(qw, qw);  // |q_w|, unsigned
        }
        for (int r = 0; r < R; ++r) {
          // Q8_0: sign(q_w) * q_x, so that |q_w| * that = q_w * q_x
          const __m256i sx = Bits == 4 ? qx[r] : _mm256_sign_epi8(qx[r], qw);
          const __m256i dot = dot_u8s8(aw, sx);
          acc[c][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[c][r][j]),
                                      _mm256_cvtepi32_ps(dot), acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) a.y[(r0 + r) * a.n + c0 + c] = hsum8(acc[c][r]) + tail[c][r];
}
#else
template <int Bits, int C, int R>
inline void column_rows(const MatMulQArgs& a, int64_t c0, int64_t r0) {
  const int64_t nb = a.k / kQBlock, row_bytes = nb * (Bits == 4 ? kQ41Bytes : kQ80Bytes);
  for (int64_t col = c0; col < c0 + C; ++col)
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = a.w + col * row_bytes;
      const uint16_t* dw = reinterpret_cast<const uint16_t*>(w);
      const uint8_t* qs = w + nb * (Bits == 4 ? 4 : 2);
      const int8_t* xq = a.x->q.data() + (r0 + r) * a.k;
      const float* xd = a.x->d.data() + (r0 + r) * nb;
      const float* xs = a.x->s.data() + (r0 + r) * nb;
      float acc = 0.0f, mins = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        if (Bits == 4) {
          const uint8_t* p = qs + b * 16;
          for (int j = 0; j < 16; ++j)
            dot += (p[j] & 0x0F) * xq[b * kQBlock + j] + (p[j] >> 4) * xq[b * kQBlock + 16 + j];
          mins += half(dw[nb + b]) * xs[b];
        } else {
          const int8_t* p = reinterpret_cast<const int8_t*>(qs) + b * kQBlock;
          for (int j = 0; j < kQBlock; ++j) dot += p[j] * xq[b * kQBlock + j];
        }
        acc += half(dw[b]) * xd[b] * (float)dot;
      }
      a.y[(r0 + r) * a.n + col] = acc + mins;
    }
}
#endif

}  // namespace kvflow_ort

#include "matmul_q_gemv512.h"

namespace kvflow_ort {

// Columns [c0, c1) for every row: the tile's weights stay in cache across the row groups.
// One row (a decode step) goes 4 Q4_1 columns at a time, more rows 1 column x 4 rows.
template <int Bits, int C, int R>
inline void columns(const MatMulQArgs& a, int64_t c0, int64_t c1, int64_t r) {
  int64_t c = c0;
  for (; c + C <= c1; c += C) column_rows<Bits, C, R>(a, c, r);
  for (; c < c1; ++c) column_rows<Bits, 1, R>(a, c, r);
}

template <int Bits>
inline void column_tile(const MatMulQArgs& a, int64_t c0, int64_t c1) {
  int64_t r = 0;
  for (; r + kRowGroup <= a.m; r += kRowGroup) columns<Bits, 1, kRowGroup>(a, c0, c1, r);
  const int64_t left = a.m - r;
  if (left == 3) columns<Bits, 1, 3>(a, c0, c1, r);
  else if (left == 2) columns<Bits, 2, 2>(a, c0, c1, r);
  // NOTE: Q8_0 (the 576 x 49152 head, memory-bound) one column at a time: measured faster.
#if defined(KVFLOW_GEMM_512)
  else if (left == 1 && Bits == 4) {  // a decode step's Q4_1: two blocks a 512-bit vector
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4) column_row_q4_512<4>(a, c, r);
    for (; c < c1; ++c) column_row_q4_512<1>(a, c, r);
  }
#endif
  else if (left == 1) columns<Bits, Bits == 4 ? 4 : 1, 1>(a, c0, c1, r);
}

inline void run_column_tile(void* data, size_t index) {
  const MatMulQArgs& a = *static_cast<const MatMulQArgs*>(data);
  const int64_t c0 = (int64_t)index * kColumnTile, c1 = std::min(a.n, c0 + kColumnTile);
  if (a.bits == 4) column_tile<4>(a, c0, c1);
  else column_tile<8>(a, c0, c1);
}

}  // namespace kvflow_ort
