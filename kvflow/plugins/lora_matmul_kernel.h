// The arithmetic of kvflow::LoraMatMul (lora_matmul_ort.h): one work item is a tile of up to
// kTile tokens of one slot (Punica's SGMV segment, cut into tiles), so that each row of A and
// of Bt read serves every token of the tile.
//
// For each part p of the slot with rank r > 0:
// 1. shrink: u[t][j] = A[s, p, j] . x_t for the tile's tokens t and j < r, the tokens' dot
//    products side by side (NT independent sums per row of A, vectorized along K);
// 2. expand: y_t[cols_p] += sum_j u[t][j] Bt[s, j, cols_p], kColumnChunk columns at a time so
//    that the chunk's r rows of Bt stay in L1 across the tile's tokens.
// fp32 throughout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvflow_ort {
namespace lora_matmul {

constexpr int kTile = 8;
constexpr int64_t kColumnChunk = 256;
constexpr int64_t kMaxRank = 512;
constexpr int kRows = 4;   // expand's rows of Bt per pass
constexpr int kLanes = 8;  // expand's register block of columns (GCC vector extension: one
                           // 256-bit register with AVX2, two 128-bit ones in the portable build)
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

struct Tile {
  int32_t slot, first, count;  // first: index into the step's token order
};

struct Step {
  const float* x;
  float* y;
  const float* pool_a;   // [S, P, R, K]
  const float* pool_bt;  // [S, R, N]
  const int32_t* ranks;  // [S, P]
  const int32_t* order;  // tokens sorted by slot
  const Tile* tiles;
  const int64_t* part_cols;  // P + 1 boundaries
  int64_t k, n, parts, rmax;
};

template <int NT>
inline void shrink(const float* __restrict a_rows, int64_t r, int64_t k,
                   const float* const* xs, float (*u)[kMaxRank]) {
  for (int64_t j = 0; j < r; ++j) {
    const float* __restrict row = a_rows + j * k;
    float acc[NT] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float w = row[i];
      for (int t = 0; t < NT; ++t) acc[t] += w * xs[t][i];
    }
    for (int t = 0; t < NT; ++t) u[t][j] = acc[t];
  }
}

// y += u . Bt over columns [c0, c1): kRows rows of Bt at a time, summed into a register of
// kLanes columns before y is stored (fewer stores than one axpy per row), but no more rows at
// once: Bt's rows lie N floats apart, often a multiple of 4 KiB, where many rows at a time
// would fight over the same L1 sets.
inline void expand(const float* __restrict bt, int64_t r, int64_t n, int64_t c0, int64_t c1,
                   int nt, const float (*u)[kMaxRank], float* const* ys) {
  for (int64_t cc = c0; cc < c1; cc += kColumnChunk) {
    const int64_t ce = std::min(c1, cc + kColumnChunk);
    for (int64_t j0 = 0; j0 < r; j0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, r - j0);
      const float* __restrict b = bt + j0 * n;
      for (int t = 0; t < nt; ++t) {
        float* __restrict y = ys[t];
        const float* ut = u[t] + j0;
        int64_t c = cc;
        if (rows == kRows) {
          for (; c + kLanes <= ce; c += kLanes) {
            Lanes acc, b0, b1, b2, b3;
            std::memcpy(&acc, y + c, sizeof acc);
            std::memcpy(&b0, b + c, sizeof b0);
            std::memcpy(&b1, b + n + c, sizeof b1);
            std::memcpy(&b2, b + 2 * n + c, sizeof b2);
            std::memcpy(&b3, b + 3 * n + c, sizeof b3);
            acc += ut[0] * b0 + ut[1] * b1 + ut[2] * b2 + ut[3] * b3;
            std::memcpy(y + c, &acc, sizeof acc);
          }
        }
        for (; c < ce; ++c) {
          float acc = y[c];
          for (int64_t j = 0; j < rows; ++j) acc += ut[j] * b[j * n + c];
          y[c] = acc;
        }
      }
    }
  }
}

inline void run_tile(void* data, size_t index) {
  const Step& st = *static_cast<const Step*>(data);
  const Tile& tile = st.tiles[index];
  const int64_t s = tile.slot;
  const float* xs[kTile];
  float* ys[kTile];
  for (int t = 0; t < tile.count; ++t) {
    const int64_t token = st.order[tile.first + t];
    xs[t] = st.x + token * st.k;
    ys[t] = st.y + token * st.n;
  }
  float u[kTile][kMaxRank];
  for (int64_t p = 0; p < st.parts; ++p) {
    const int64_t r = std::min<int64_t>(st.ranks[s * st.parts + p], st.rmax);
    if (r <= 0) continue;
    const float* a_rows = st.pool_a + ((s * st.parts + p) * st.rmax) * st.k;
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
    expand(st.pool_bt + s * st.rmax * st.n, r, st.n, st.part_cols[p], st.part_cols[p + 1],
           tile.count, u, ys);
  }
}

}  // namespace lora_matmul
}  // namespace kvflow_ort
