// The kvflow::PagedAttention kernel's arithmetic, for paged_attention_ort.cc (which holds the
// ORT plumbing and the algorithm's description). Header-only: one translation unit includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_attention_ort_scores.h"
#include "paged_attention_ort_simd.h"

namespace kvflow_ort {

constexpr int kMaxRows = 64;  // query rows (token x group head) per tile: 8 vectors of scores
constexpr int kDirectRows = 4;  // tiles of at most this many rows score by dot products
// Row-key pairs (query rows x keys each reads) of a step below which it runs on the calling
// thread, where waking the pool costs more than the work; the attribute parallel_min_work
// overrides it.
constexpr int64_t kInlineWork = 16384;
// A parallel step of fewer work items than this splits its decodes' keys into parts of at least
// kSplitKeys keys (FlashDecoding), so that a small batch with long contexts keeps every thread
// busy.
constexpr int kSplitBelowItems = 16;
constexpr int kSplitKeys = 256;

struct Attrs {
  int64_t layer_idx, num_heads, num_kv_heads, head_dim, block_size, kv_dtype, num_blocks;
  int64_t parallel_min_work;
  int64_t sliding_window;  // 0: full causal attention
  float scale;
  float logit_softcap;  // 0: none
};

// The first key a query at ``position`` sees (0 without a window).
inline int64_t first_key(const Attrs& a, int64_t position) {
  return a.sliding_window > 0 ? std::max<int64_t>(0, position - a.sliding_window + 1) : 0;
}

// One call's inputs, checked; what every work item reads.
struct Step {
  const Attrs* a;
  const float* q;
  float* out;
  void* k_pool;
  void* v_pool;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  int64_t max_blocks;
  float* partials;  // per part, per row: running max, running sum, then head_dim sums
};

struct Item {
  int32_t seq, head, tok0, tok1;  // tokens [tok0, tok1) of the sequence's new ones
  int32_t key0, key1;  // the keys it reads: from the window's start (0 without one) to the
                       // last token's (key1 INT32_MAX), or a part of a split decode's
  int32_t part;        // -1: it writes the output; else its slot in Step::partials
  int64_t cost;        // rows x keys
};

// A decode (one token) whose keys are split over several items, the parts merged after.
struct Split {
  int32_t seq, head, first_part, parts;
};

struct Job {
  const Step* step;
  const std::vector<Item>* items;
};

// The online softmax of row-major scores (scores_by_dots): probabilities in place, running
// max and sum updated, each row's rescaling factor in corr. Row m sees keys lo[m] .. lim[m].
void softmax_by_dots(float* sc, int m_rows, const int32_t* lim, const int32_t* lo, int c0,
                     int kc, float* m_run, float* l_run, float* corr) {
  for (int m = 0; m < m_rows; ++m) {
    float* row = sc + (size_t)m * kChunk;
    for (int j = std::max(0, lim[m] + 1 - c0); j < kc; ++j) row[j] = kMasked;  // causal
    for (int j = 0; j < std::min(kc, lo[m] - c0); ++j) row[j] = kMasked;  // before the window
    constexpr int nv = kChunk / kLanes;
    v8f p[nv], mx = load8(row);
    for (int v = 0; v < nv; ++v) mx = vmax(mx, p[v] = load8(row + v * kLanes));
    float m_new = m_run[m];
    for (int i = 0; i < kLanes; ++i) m_new = std::max(m_new, mx[i]);
    v8f sum = splat(0.0f);
    for (int v = 0; v < nv; ++v) {
      p[v] = vexp(p[v] - splat(m_new));
      store8(row + v * kLanes, p[v]);
      sum += p[v];
    }
    corr[m] = vexp(splat(m_run[m] - m_new))[0];
    l_run[m] = l_run[m] * corr[m] + hsum(sum);
    m_run[m] = m_new;
  }
}

// The online softmax of scores by rows (scores_by_rows), 8 rows at a time. Row m sees keys
// lo[m] .. lim[m]; min_lim and max_lo are the tile's smallest lim and largest lo.
// NOTE: a row whose window starts past a whole chunk keeps the masked value as its running
// max and gives that chunk's (real, finite) values weight 1; the first key it sees rescales
// them by vexp(kMasked - max) = exactly 0, so they never reach the output.
void softmax_by_rows(float* sc, int mp, const int32_t* lim, const int32_t* lo, int c0, int kc,
                     int min_lim, int max_lo, float* m_run, float* l_run, float* corr) {
  const int nv = mp / kLanes;
  // Masks: some row of the tile ends inside this chunk (causal), or starts after its first key.
  if (c0 + kc - 1 > min_lim || c0 < max_lo) {
    for (int j = 0; j < kc; ++j) {
      const v8i pos = v8i{0, 0, 0, 0, 0, 0, 0, 0} + (c0 + j);
      for (int v = 0; v < nv; ++v) {
        v8i lv, fv;
        std::memcpy(&lv, lim + v * kLanes, sizeof lv);
        std::memcpy(&fv, lo + v * kLanes, sizeof fv);
        float* p = sc + (size_t)j * mp + v * kLanes;
        store8(p, (pos > lv) | (pos < fv) ? splat(kMasked) : load8(p));
      }
    }
  }
  for (int v = 0; v < nv; ++v) {
    v8f mx = load8(sc + v * kLanes);
    for (int j = 1; j < kc; ++j) mx = vmax(mx, load8(sc + (size_t)j * mp + v * kLanes));
    const v8f old = load8(m_run + v * kLanes), m_new = vmax(old, mx);
    const v8f c = vexp(old - m_new);
    v8f sum = splat(0.0f);
    for (int j = 0; j < kc; ++j) {
      float* p = sc + (size_t)j * mp + v * kLanes;
      const v8f e = vexp(load8(p) - m_new);
      store8(p, e);
      sum += e;
    }
    store8(m_run + v * kLanes, m_new);
    store8(l_run + v * kLanes, load8(l_run + v * kLanes) * c + sum);
    store8(corr + v * kLanes, c);
  }
}

// acc[m0 + r][x0 : x0 + 8 NX] = acc * corr + sum_j p[j][m0 + r] * v_j[x0 : ...] for MR rows:
// MR * NX sums in registers, each value vector loaded once for MR rows.
template <int MR, int NX, typename T>
inline void pv_tile(float* acc, int d, const float* corr, const float* sc, int pj, int pm,
                    int m0, const T* const* vrow, int kc, int x0) {
  v8f s[MR][NX];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < NX; ++u)
      s[r][u] = load8(acc + (size_t)(m0 + r) * d + x0 + u * kLanes) * splat(corr[m0 + r]);
  for (int j = 0; j < kc; ++j) {
    v8f val[NX];
    for (int u = 0; u < NX; ++u) val[u] = load8(vrow[j] + x0 + u * kLanes);
    for (int r = 0; r < MR; ++r) {
      const v8f w = splat(sc[(size_t)j * pj + (size_t)(m0 + r) * pm]);
      for (int u = 0; u < NX; ++u) s[r][u] += w * val[u];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < NX; ++u) store8(acc + (size_t)(m0 + r) * d + x0 + u * kLanes, s[r][u]);
}

template <int NX, typename T>
void pv_columns(float* acc, int d, const float* corr, const float* sc, int pj, int pm,
                int m_rows, const T* const* vrow, int kc, int x0) {
  int m = 0;
  for (; m + 6 <= m_rows; m += 6) pv_tile<6, NX, T>(acc, d, corr, sc, pj, pm, m, vrow, kc, x0);
  for (; m + 3 <= m_rows; m += 3) pv_tile<3, NX, T>(acc, d, corr, sc, pj, pm, m, vrow, kc, x0);
  for (; m < m_rows; ++m) pv_tile<1, NX, T>(acc, d, corr, sc, pj, pm, m, vrow, kc, x0);
}

// acc = acc * corr + P x V over the chunk, every row of the tile; row m's probability of key
// j at sc[j * pj + m * pm].
template <typename T>
void pv(float* acc, int d, const float* corr, const float* sc, int pj, int pm, int m_rows,
        const T* const* vrow, int kc) {
  int x = 0;
  for (; x + 2 * kLanes <= d; x += 2 * kLanes)
    pv_columns<2, T>(acc, d, corr, sc, pj, pm, m_rows, vrow, kc, x);
  if (x + kLanes <= d) {
    pv_columns<1, T>(acc, d, corr, sc, pj, pm, m_rows, vrow, kc, x);
    x += kLanes;
  }
  for (; x < d; ++x)
    for (int m = 0; m < m_rows; ++m) {
      float s = acc[(size_t)m * d + x] * corr[m];
      for (int j = 0; j < kc; ++j) s += sc[(size_t)j * pj + (size_t)m * pm] * to_float(vrow[j][x]);
      acc[(size_t)m * d + x] = s;
    }
}

// Replaces the items of long decodes by parts of their keys (see kSplitBelowItems).
void split_decodes(const Attrs& a, const int32_t* ql, const int32_t* sl, std::vector<Item>& items,
                   std::vector<Split>& splits) {
  const int64_t want = (kSplitBelowItems + (int64_t)items.size() - 1) / (int64_t)items.size();
  std::vector<Item> out;
  int32_t next_part = 0;
  for (const Item& it : items) {
    const int32_t len = sl[it.seq], keys = len - it.key0;  // the window's keys
    const int64_t parts = std::min<int64_t>(want, keys / kSplitKeys);
    if (ql[it.seq + 1] - ql[it.seq] != 1 || parts < 2) {
      out.push_back(it);
      continue;
    }
    const int32_t step = (int32_t)((keys + parts - 1) / parts + kChunk - 1) / kChunk * kChunk;
    const int32_t first = next_part;
    for (int32_t k0 = it.key0; k0 < len; k0 += step, ++next_part)
      out.push_back({it.seq, it.head, it.tok0, it.tok1, k0, k0 + step, next_part,
                     (int64_t)std::min(step, len - k0) * (it.tok1 - it.tok0) *
                         (a.num_heads / a.num_kv_heads)});
    splits.push_back({it.seq, it.head, first, next_part - first});
  }
  items.swap(out);
}

void attend(const Step& st, const Item& it, std::vector<float>& scratch) {
  const Attrs& a = *st.a;
  const int d = (int)a.head_dim, kvh = (int)a.num_kv_heads, bs = (int)a.block_size;
  const int g = (int)(a.num_heads / a.num_kv_heads), hd = (int)(a.num_heads * a.head_dim);
  const int start = st.qsl[it.seq], n = st.qsl[it.seq + 1] - start, len = st.seq_lens[it.seq];
  const int m_rows = (it.tok1 - it.tok0) * g, nv = (m_rows + kLanes - 1) / kLanes;
  const int mp = nv * kLanes;
  const bool by_dots = m_rows <= kDirectRows;
  const size_t need = (size_t)d * mp + (size_t)kChunk * mp + (size_t)m_rows * d + 3 * mp +
                      2 * (size_t)kChunk * d;
  if (scratch.size() < need) scratch.resize(need);
  float* qt = scratch.data();             // [d][mp] queries, scaled, transposed (or [m][d])
  float* sc = qt + (size_t)d * mp;        // [kChunk][mp] scores, then probabilities
  float* acc = sc + (size_t)kChunk * mp;  // [m_rows][d]
  float* m_run = acc + (size_t)m_rows * d;
  float* l_run = m_run + mp;
  float* corr = l_run + mp;
  float* kconv = corr + mp;  // [kChunk][d] fp16 rows converted
  float* vconv = kconv + (size_t)kChunk * d;
  int32_t lim[kMaxRows];  // the last key position each row sees
  int32_t lo[kMaxRows];   // the first (its window's; 0 without one)

  for (int m = 0; m < mp; ++m) {
    lim[m] = m < m_rows ? len - n + it.tok0 + m / g : -1;
    lo[m] = m < m_rows ? (int32_t)first_key(a, lim[m]) : 0;
    m_run[m] = kMasked;
    l_run[m] = 0.0f;
  }
  std::memset(qt, 0, sizeof(float) * (size_t)d * mp);
  for (int m = 0; m < m_rows; ++m) {
    const int i = it.tok0 + m / g, head = it.head * g + m % g;
    const float* qrow = st.q + (size_t)(start + i) * hd + (size_t)head * d;
    for (int x = 0; x < d; ++x) {
      if (by_dots)
        qt[(size_t)m * d + x] = qrow[x] * a.scale;
      else
        qt[(size_t)x * mp + m] = qrow[x] * a.scale;
    }
  }
  std::memset(acc, 0, sizeof(float) * (size_t)m_rows * d);

  // Keys [it.key0, key_end): it.key0 is the window's start for the tile's first token (or a
  // split part's start), so no block-table entry before the window is read.
  const int key_end = std::min(len - n + it.tok1, it.key1), min_lim = len - n + it.tok0;
  const int max_lo = lo[m_rows - 1];
  const int32_t* table = st.block_tables + (size_t)it.seq * st.max_blocks;
  const size_t row_stride = (size_t)kvh * d, head_off = (size_t)it.head * d;
  const float* krow[kChunk];
  const float* vrow[kChunk];
  const size_t elem = a.kv_dtype == 0 ? sizeof(float) : sizeof(uint16_t);
  const char* k_pool = static_cast<const char*>(st.k_pool);
  const char* v_pool = static_cast<const char*>(st.v_pool);
  // Element offsets of the keys of the next chunk, found through the block table; prefetched
  // while this chunk is computed (blocks are scattered: the hardware cannot guess them).
  size_t rows[kChunk], next[kChunk];
  int blk = it.key0 / bs, off = it.key0 % bs;
  auto locate = [&](int count) {
    for (int j = 0; j < count; ++j, ++off) {
      if (off == bs) {
        ++blk;
        off = 0;
      }
      next[j] = ((size_t)table[blk] * bs + off) * row_stride + head_off;
      for (size_t byte = 0; byte < d * elem; byte += 64) {
        __builtin_prefetch(k_pool + next[j] * elem + byte);
        __builtin_prefetch(v_pool + next[j] * elem + byte);
      }
    }
  };
  locate(std::min(kChunk, key_end - it.key0));
  for (int c0 = it.key0; c0 < key_end; c0 += kChunk) {
    const int kc = std::min(kChunk, key_end - c0);
    std::memcpy(rows, next, sizeof rows);
    if (c0 + kChunk < key_end) locate(std::min(kChunk, key_end - c0 - kChunk));
    const uint16_t* khalf[kChunk];
    const uint16_t* vhalf[kChunk];
    for (int j = 0; j < kc; ++j) {
      if (a.kv_dtype == 0) {
        krow[j] = reinterpret_cast<const float*>(k_pool) + rows[j];
        vrow[j] = reinterpret_cast<const float*>(v_pool) + rows[j];
      } else if (by_dots) {  // few rows: each half converted as it is used, in registers
        khalf[j] = reinterpret_cast<const uint16_t*>(k_pool) + rows[j];
        vhalf[j] = reinterpret_cast<const uint16_t*>(v_pool) + rows[j];
      } else {  // a tile: each row converted once, for all the tile's rows
        halves_to_floats(reinterpret_cast<const uint16_t*>(k_pool) + rows[j],
                         kconv + (size_t)j * d, d);
        halves_to_floats(reinterpret_cast<const uint16_t*>(v_pool) + rows[j],
                         vconv + (size_t)j * d, d);
        krow[j] = kconv + (size_t)j * d;
        vrow[j] = vconv + (size_t)j * d;
      }
    }
    if (by_dots) {
      if (a.kv_dtype == 0)
        scores_by_dots(krow, kc, d, qt, m_rows, sc);
      else
        scores_by_dots(khalf, kc, d, qt, m_rows, sc);
      if (a.logit_softcap > 0.0f)  // the chunk's keys only: the padding stays masked
        for (int m = 0; m < m_rows; ++m) cap_scores(sc + (size_t)m * kChunk, kc, a.logit_softcap);
      softmax_by_dots(sc, m_rows, lim, lo, c0, kc, m_run, l_run, corr);
      if (a.kv_dtype == 0)
        pv(acc, d, corr, sc, 1, kChunk, m_rows, vrow, kc);
      else
        pv(acc, d, corr, sc, 1, kChunk, m_rows, vhalf, kc);
    } else {
      scores_by_rows(krow, kc, d, qt, mp, sc);
      if (a.logit_softcap > 0.0f) cap_scores(sc, kc * mp, a.logit_softcap);
      softmax_by_rows(sc, mp, lim, lo, c0, kc, min_lim, max_lo, m_run, l_run, corr);
      pv(acc, d, corr, sc, mp, 1, m_rows, vrow, kc);
    }
  }
  if (it.part >= 0) {  // a part of a split decode: its state, merged by merge_parts
    float* dst = st.partials + (size_t)it.part * m_rows * (d + 2);
    for (int m = 0; m < m_rows; ++m, dst += d + 2) {
      dst[0] = m_run[m];
      dst[1] = l_run[m];
      std::memcpy(dst + 2, acc + (size_t)m * d, sizeof(float) * d);
    }
    return;
  }
  for (int m = 0; m < m_rows; ++m) {
    const int i = it.tok0 + m / g, head = it.head * g + m % g;
    float* orow = st.out + (size_t)(start + i) * hd + (size_t)head * d;
    const float inv = 1.0f / l_run[m];
    for (int x = 0; x < d; ++x) orow[x] = acc[(size_t)m * d + x] * inv;
  }
}

// The output of a split decode from its parts' running maxima, sums and accumulators.
void merge_parts(const Step& st, const Split& sp) {
  const int d = (int)st.a->head_dim, g = (int)(st.a->num_heads / st.a->num_kv_heads);
  const size_t stride = (size_t)g * (d + 2);
  float* orow = st.out + (size_t)st.qsl[sp.seq] * st.a->num_heads * d;
  for (int m = 0; m < g; ++m) {
    const float* first = st.partials + (size_t)sp.first_part * stride + (size_t)m * (d + 2);
    float top = first[0], total = 0.0f;
    for (int p = 1; p < sp.parts; ++p) top = std::max(top, first[p * stride]);
    float* o = orow + (size_t)(sp.head * g + m) * d;
    std::memset(o, 0, sizeof(float) * d);
    for (int p = 0; p < sp.parts; ++p) {
      const float* part = first + p * stride;
      const float w = vexp(splat(part[0] - top))[0];
      total += w * part[1];
      for (int x = 0; x < d; ++x) o[x] += w * part[2 + x];
    }
    for (int x = 0; x < d; ++x) o[x] /= total;
  }
}

void run_item(void* data, size_t index) {
  thread_local std::vector<float> scratch;
  const Job* job = static_cast<const Job*>(data);
  attend(*job->step, (*job->items)[index], scratch);
}

}  // namespace kvflow_ort
