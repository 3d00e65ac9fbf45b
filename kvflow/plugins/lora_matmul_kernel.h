// The arithmetic of kvflow::LoraMatMul (lora_matmul_ort.h): one work item is a tile of up to
// kTile tokens of one slot (Punica's SGMV segment, cut into tiles), so that each row of A and
// of Bt read serves every token of the tile.
//
// For each part p of the slot with rank r > 0:
// 1. shrink: u[t][j] = A[s, p, j] . x_t for the tile's tokens t and j < r, the tokens' dot
//    products side by side (NT independent sums per row of A, vectorized along K);
// 2. expand: y_t[cols_p] += sum_j u[t][j] Bt[s, j, cols_p], kColumnChunk columns at a time so
//    that the chunk's r rows of Bt stay in L1 across the tile's tokens.
// Sums in fp32; the pool's A and Bt are float32, or float16 (weight_dtype 1: half the bytes a
// decode step reads) converted as they load.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "paged_attention_ort_simd.h"

namespace kvflow_ort {
namespace lora_matmul {

constexpr int kTile = 8;
constexpr int64_t kColumnChunk = 256;
constexpr int64_t kMaxRank = 512;
constexpr int kRows = 4;  // expand's rows of Bt per pass

struct Tile {
  int32_t slot, first, count;  // first: index into the step's token order
};

struct Step {
  const float* x;
  float* y;
  const void* pool_a;   // [S, P, R, K], float or float16 (weight_dtype)
  const void* pool_bt;  // [S, R, N], the same type
  const int32_t* ranks;  // [S, P]
  const int32_t* order;  // tokens sorted by slot
  const Tile* tiles;
  const int64_t* part_cols;  // P + 1 boundaries
  int64_t k, n, parts, rmax, weight_dtype;
};

// u[t][j] = A row j . x_t: 8 lanes at a time (v8f: paged_attention_ort_simd.h; float16 rows
// converted as they load), the tile's NT sums side by side so that each load of A serves all.
template <int NT, typename W>
inline void shrink(const W* a_rows, int64_t r, int64_t k, const float* const* xs,
                   float (*u)[kMaxRank]) {
  for (int64_t j = 0; j < r; ++j) {
    const W* row = a_rows + j * k;
    v8f acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const v8f w = load8(row + i);
      for (int t = 0; t < NT; ++t) acc[t] += w * load8(xs[t] + i);
    }
    for (int t = 0; t < NT; ++t) {
      float sum = hsum(acc[t]);
      for (int64_t c = i; c < k; ++c) sum += to_float(row[c]) * xs[t][c];
      u[t][j] = sum;
    }
  }
}

// y += u . Bt over columns [c0, c1): kRows rows of Bt at a time, summed in a register of 8
// columns before y is stored (fewer stores than one axpy per row), but no more rows at once:
// Bt's rows lie N elements apart, often a multiple of 4 KiB, where many rows at a time would
// fight over the same L1 sets.
template <typename W>
inline void expand(const W* bt, int64_t r, int64_t n, int64_t c0, int64_t c1, int nt,
                   const float (*u)[kMaxRank], float* const* ys) {
  for (int64_t cc = c0; cc < c1; cc += kColumnChunk) {
    const int64_t ce = std::min(c1, cc + kColumnChunk);
    for (int64_t j0 = 0; j0 < r; j0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, r - j0);
      const W* b = bt + j0 * n;
      for (int t = 0; t < nt; ++t) {
        float* y = ys[t];
        const float* ut = u[t] + j0;
        int64_t c = cc;
        if (rows == kRows) {
          for (; c + 8 <= ce; c += 8) {
            v8f acc = load8(y + c);
            acc += ut[0] * load8(b + c) + ut[1] * load8(b + n + c) +
                   ut[2] * load8(b + 2 * n + c) + ut[3] * load8(b + 3 * n + c);
            store8(y + c, acc);
          }
        }
        for (; c < ce; ++c) {
          float acc = y[c];
          for (int64_t j = 0; j < rows; ++j) acc += ut[j] * to_float(b[j * n + c]);
          y[c] = acc;
        }
      }
    }
  }
}

template <typename W>
inline void run_tile_as(const Step& st, const Tile& tile) {
  const int64_t s = tile.slot;
  const float* xs[kTile];
  float* ys[kTile];
  for (int t = 0; t < tile.count; ++t) {
    const int64_t token = st.order[tile.first + t];
    xs[t] = st.x + token * st.k;
    ys[t] = st.y + token * st.n;
  }
  float u[kTile][kMaxRank];
  const W* pool_a = static_cast<const W*>(st.pool_a);
  for (int64_t p = 0; p < st.parts; ++p) {
    const int64_t r = std::min<int64_t>(st.ranks[s * st.parts + p], st.rmax);
    if (r <= 0) continue;
    const W* a_rows = pool_a + ((s * st.parts + p) * st.rmax) * st.k;
    switch (tile.count) {
      case 1: shrink<1>(a_rows, r, st.k, xs, u); break;
      case 2: shrink<2>(a_rows, r, st.k, xs, u); break;
      case 3: shrink<3>(a_rows, r, st.k, xs, u); break;
      case 4: shrink<4>(a_rows, r, st.k, xs, u); break;
      case 5: shrink<5>(a_rows, r, st.k, xs, u); break;
      case 6: shrink<6>(a_rows, r, st.k, xs, u); break;
      case 7: shrink<7>(a_rows, r, st.k, xs, u); break;
      default: shrink<kTile>(a_rows, r, st.k, xs, u); break;
    }
    expand(static_cast<const W*>(st.pool_bt) + s * st.rmax * st.n, r, st.n, st.part_cols[p],
           st.part_cols[p + 1], tile.count, u, ys);
  }
}

inline void run_tile(void* data, size_t index) {
  const Step& st = *static_cast<const Step*>(data);
  if (st.weight_dtype == 1)
    run_tile_as<uint16_t>(st, st.tiles[index]);
  else
    run_tile_as<float>(st, st.tiles[index]);
}

}  // namespace lora_matmul
}  // namespace kvflow_ort
