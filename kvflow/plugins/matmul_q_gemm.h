// kvflow::MatMulQ's tiled int8 GEMM, for steps of many rows (prefill, large batches): the same
// results as the row kernels of matmul_q_kernel.h (same integer block sums, exact; same
// per-block fp32 scales d_w * d_x and Q4_1 minimum terms m_w * s_x; only the fp32 sums' order
// differs), with the weights' work shared by every row.
//
// Why it is faster: the row kernels spend, per 32-element block, a widening dot product, a
// conversion and an FMA on 8 lanes of partial sums of ONE output. Here a work item (kColumnTile
// = 16 output columns) first repacks its columns' blocks, once for all rows, so that one vector
// holds 16 columns x 4 consecutive codes (int32 lane c = the 4 codes k = 4g..4g+3 of column c).
// A row's 4 activation codes, broadcast, then meet 16 columns in one u8 x s8 dot product
// (VNNI's vpdpbusd: 64 multiply-adds an instruction into 16 int32 sums); 8 of them are a block,
// whose 16 sums get their scales in one conversion and one FMA. Rows go by groups of
// kGemmRows, each weight vector loaded once a group. This is the interleaved layout of
// llama.cpp's repacked q4_0 kernels, made on the fly per tile rather than stored (no second
// copy of any weight).
//
// Signs: vpdpbusd multiplies unsigned by signed bytes. Q4_1 codes (0..15) are the unsigned
// side, the activations the signed one. Q8_0 codes are signed, so the activations are biased
// to q + 128 (unsigned) and the block's 128 * sum(q_w) comes off the integer sum: exact.
// Without VNNI (AVX2) the unsigned x signed pairs go through vpmaddubsw (16-bit sums: Q4_1's
// eight groups stay below 8 * 2 * 15 * 127 = 30480, no saturation) and Q8_0 through the sign
// trick of the row kernels.
#pragma once

#include "isa.h"
#include "matmul_q_kernel.h"

#if defined(KVFLOW_GEMM_512) || defined(KVFLOW_GEMM_256)
#include <immintrin.h>

namespace kvflow_ort {

static_assert(kColumnTile == 16, "the GEMM's tiles are 16 columns");

// Below this many rows the row kernels win: a tile's repacking costs about what a few rows'
// products do. Measured (one thread, the default model's shapes): with VNNI the GEMM wins from
// 8 rows on; AVX2's Q8_0 (three instructions a dot product, as the row kernels') from 16.
inline int64_t gemm_min_rows(int bits) {
#if defined(KVFLOW_GEMM_512) || defined(__AVXVNNI__) || defined(__AVX512VNNI__)
  (void)bits;
  return 8;
#else
  return bits == 4 ? 8 : 16;
#endif
}

// One work item's columns, repacked: all nb blocks of 16 columns (columns past N are zeros).
struct GemmTile {
  std::vector<int32_t> codes;  // [nb][8 groups][16 columns]: 4 codes each
  std::vector<float> d, m;     // [nb][16]: fp32 d_w (and Q4_1 m_w)
  std::vector<int32_t> corr;   // [nb][16]: Q8_0's 128 * sum of the block's codes
};

// 8 vectors of 8 int32 (r[i] = column i's 8 groups) -> r[g] = group g's 8 columns.
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// Columns [c0, c0 + cols) of the weight into t (cols <= 16).
template <int Bits>
inline void pack_tile(const MatMulQArgs& a, int64_t c0, int cols, GemmTile& t) {
  const int64_t nb = a.k / kQBlock, row_bytes = nb * (Bits == 4 ? kQ41Bytes : kQ80Bytes);
  t.codes.resize((size_t)nb * 128);
  t.d.assign((size_t)nb * 16, 0.0f);
  t.m.assign((size_t)nb * 16, 0.0f);
  t.corr.resize((size_t)nb * 16);
  const __m256i low = _mm256_set1_epi8(0x0F), ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* qs[8];
    for (int i = 0; i < 8; ++i) {
      const int c = half * 8 + i;
      qs[i] = c < cols ? a.w + (c0 + c) * row_bytes + nb * (Bits == 4 ? 4 : 2) : nullptr;
    }
    for (int64_t b = 0; b < nb; ++b) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        if (!qs[i]) {
          r[i] = _mm256_setzero_si256();
        } else if (Bits == 4) {  // codes 0..15 low nibbles, 16..31 high nibbles
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs[i] + b * 16));
          const __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
          r[i] = _mm256_and_si256(both, low);
        } else {
          r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs[i] + b * 32));
        }
      }
      transpose8x8(r);
      int32_t* out = t.codes.data() + b * 128 + half * 8;
      __m256i sum = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 16), r[g]);
        if (Bits == 8)
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, r[g]),
                                                        ones16));
      }
      if (Bits == 8)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.corr.data() + b * 16 + half * 8),
                            _mm256_slli_epi32(sum, 7));
    }
  }
  for (int c = 0; c < cols; ++c) {
    const uint16_t* dw = reinterpret_cast<const uint16_t*>(a.w + (c0 + c) * row_bytes);
    for (int64_t b = 0; b < nb; ++b) {
      t.d[b * 16 + c] = half(dw[b]);
      if (Bits == 4) t.m[b * 16 + c] = half(dw[nb + b]);
    }
  }
}

inline int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace kvflow_ort

#include "matmul_q_gemm_x86.h"

namespace kvflow_ort {

// A work item is one tile for every row. NOTE: chunks of 64, 128 and 256 rows (each item one
// chunk x one tile, so that a chunk's activations stay in L2) measured no faster than this up
// to M = 1024 and K = 8192 (AMD EPYC, 1 MiB L2 a core): the activations stream well enough.
struct GemmArgs {
  const MatMulQArgs* a;
  size_t tiles;
};

inline GemmArgs gemm_args(const MatMulQArgs& a) {
  return {&a, (size_t)((a.n + kColumnTile - 1) / kColumnTile)};
}

inline size_t gemm_items(const GemmArgs& g) { return g.tiles; }

// Rows [r0, r1) x columns [c0, c0 + 16).
template <int Bits>
inline void gemm_tile(const MatMulQArgs& a, int64_t c0, int64_t r0, int64_t r1) {
  thread_local GemmTile t;
  const int cols = (int)std::min<int64_t>(kColumnTile, a.n - c0);
  pack_tile<Bits>(a, c0, cols, t);
  int64_t r = r0;
  for (; r + kGemmRows <= r1; r += kGemmRows) gemm_rows<Bits, kGemmRows>(a, t, c0, cols, r);
  switch (r1 - r) {
    case 1: gemm_rows<Bits, 1>(a, t, c0, cols, r); break;
    case 2: gemm_rows<Bits, 2>(a, t, c0, cols, r); break;
    case 3: gemm_rows<Bits, 3>(a, t, c0, cols, r); break;
#if kGemmRowsMacro > 4
    case 4: gemm_rows<Bits, 4>(a, t, c0, cols, r); break;
    case 5: gemm_rows<Bits, 5>(a, t, c0, cols, r); break;
    case 6: gemm_rows<Bits, 6>(a, t, c0, cols, r); break;
    case 7: gemm_rows<Bits, 7>(a, t, c0, cols, r); break;
#endif
    default: break;
  }
}

// Work item `index` of a GemmArgs: columns [16 index, 16 index + 16) of every row.
inline void run_gemm_tile(void* data, size_t index) {
  const MatMulQArgs& a = *static_cast<const GemmArgs*>(data)->a;
  const int64_t c0 = (int64_t)index * kColumnTile;
  if (a.bits == 4) gemm_tile<4>(a, c0, 0, a.m);
  else gemm_tile<8>(a, c0, 0, a.m);
}

}  // namespace kvflow_ort
#endif
