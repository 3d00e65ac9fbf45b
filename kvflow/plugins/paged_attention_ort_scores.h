// The kvflow::PagedAttention ORT kernel's scores (paged_attention_ort_kernel.h): the two
// micro-kernels that score a chunk of keys against a tile's queries, and soft-capping.
#pragma once

#include <cstdint>
#include <cstring>

#include "paged_attention_ort_simd.h"

namespace kvflow_ort {

constexpr int kChunk = 16;  // keys per online-softmax step
// NOTE: a masked score is a large finite number, not -inf: nothing relies on IEEE infinities.
constexpr float kMasked = -1e30f;

// Scores of one chunk from the transposed queries, st[j][m] = sum_x key_j[x] * qt[x][m], for
// KJ keys x 8 NV rows from key j and row vector v: a GEMM micro-kernel, KJ * NV sums in
// registers, each query vector loaded once for KJ keys and each key element for NV vectors.
template <int KJ, int NV>
inline void scores_tile(const float* const* krow, int j, int d, const float* qt, int mp, int v,
                        float* st) {
  v8f acc[KJ][NV] = {};
  for (int x = 0; x < d; ++x) {
    const float* qx = qt + (size_t)x * mp + v * kLanes;
    v8f q[NV];
    for (int w = 0; w < NV; ++w) q[w] = load8(qx + w * kLanes);
    for (int u = 0; u < KJ; ++u) {
      const v8f b = splat(krow[j + u][x]);
      for (int w = 0; w < NV; ++w) acc[u][w] += b * q[w];
    }
  }
  for (int u = 0; u < KJ; ++u)
    for (int w = 0; w < NV; ++w) store8(st + (size_t)(j + u) * mp + (v + w) * kLanes, acc[u][w]);
}

template <int NV>
void scores_vectors(const float* const* krow, int kc, int d, const float* qt, int mp, int v,
                    float* st) {
  int j = 0;
  for (; j + 6 <= kc; j += 6) scores_tile<6, NV>(krow, j, d, qt, mp, v, st);
  for (; j + 4 <= kc; j += 4) scores_tile<4, NV>(krow, j, d, qt, mp, v, st);
  for (; j + 2 <= kc; j += 2) scores_tile<2, NV>(krow, j, d, qt, mp, v, st);
  for (; j < kc; ++j) scores_tile<1, NV>(krow, j, d, qt, mp, v, st);
}

void scores_by_rows(const float* const* krow, int kc, int d, const float* qt, int mp, float* st) {
  const int nv = mp / kLanes;
  int v = 0;
  for (; v + 2 <= nv; v += 2) scores_vectors<2>(krow, kc, d, qt, mp, v, st);
  if (v < nv) scores_vectors<1>(krow, kc, d, qt, mp, v, st);
}


// Scores of a few rows (a decode step's group, kDirectRows at most) as dot products along
// head_dim, row-major: sc[m][j] (kChunk a row). Eight keys at a time share each query load.
template <typename T>
void scores_by_dots(const T* const* krow, int kc, int d, const float* qr, int m_rows,
                    float* sc) {
  for (int m = 0; m < m_rows; ++m) {
    const float* q = qr + (size_t)m * d;
    float* out = sc + (size_t)m * kChunk;
    int j = 0;
    for (; j + kLanes <= kc && d % kLanes == 0; j += kLanes) {
      v8f acc[kLanes] = {};
      for (int x = 0; x < d; x += kLanes) {
        const v8f qv = load8(q + x);
        for (int u = 0; u < kLanes; ++u) acc[u] += qv * load8(krow[j + u] + x);
      }
      store8(out + j, hsum8(acc));
    }
    for (; j < kc; ++j) {
      const T* kr = krow[j];
      v8f a0 = splat(0.0f);
      int x = 0;
      for (; x + kLanes <= d; x += kLanes) a0 += load8(q + x) * load8(kr + x);
      float sum = hsum(a0);
      for (; x < d; ++x) sum += q[x] * to_float(kr[x]);
      out[j] = sum;
    }
    for (; j < kChunk; ++j) out[j] = kMasked;
  }
}

// Soft-capping of n contiguous scores in place: s -> cap * tanh(s / cap), tanh from vexp
// (exp(-2|x|) never overflows).
inline void cap_scores(float* s, int n, float cap) {
  const v8f inv = splat(1.0f / cap), c = splat(cap), one = splat(1.0f);
  auto capped = [&](v8f x) {
    x = x * inv;
    const v8f ax = x < splat(0.0f) ? -x : x, e = vexp(ax * splat(-2.0f));
    const v8f t = (one - e) / (one + e);
    return c * (x < splat(0.0f) ? -t : t);
  };
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) store8(s + i, capped(load8(s + i)));
  if (i < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, s + i, sizeof(float) * (n - i));
    store8(tail, capped(load8(tail)));
    std::memcpy(s + i, tail, sizeof(float) * (n - i));
  }
}

}  // namespace kvflow_ort
