// The kvflow::PagedAttention kernel's arithmetic, for paged_attention_ort.cc (which holds the
// ORT plumbing and the algorithm's description). Header-only: one translation unit includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvflow_ort {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int kChunk = 16;    // keys per online-softmax step
constexpr int kMaxRows = 64;  // query rows (token x group head) per tile: 8 vectors of scores
constexpr int kDirectRows = 4;  // tiles of at most this many rows score by dot products
// NOTE: a masked score is a large finite number, not -inf: nothing relies on IEEE infinities.
constexpr float kMasked = -1e30f;
// Row-key pairs (query rows x keys each reads) of a step below which it runs on the calling
// thread, where waking the pool costs more than the work; the attribute parallel_min_work
// overrides it.
constexpr int64_t kInlineWork = 16384;

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

struct Attrs {
  int64_t layer_idx, num_heads, num_kv_heads, head_dim, block_size, kv_dtype, num_blocks;
  int64_t parallel_min_work;
  float scale;
};

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
};

struct Item {
  int32_t seq, head, tok0, tok1;  // tokens [tok0, tok1) of the sequence's new ones
  int64_t cost;                   // rows x keys
};

struct Job {
  const Step* step;
  const std::vector<Item>* items;
};

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

// Scores of a few rows (a decode step's group, kDirectRows at most) as dot products along
// head_dim, row-major: sc[m][j] (kChunk a row). Eight keys at a time share each query load.
void scores_by_dots(const float* const* krow, int kc, int d, const float* qr, int m_rows,
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
      const float* kr = krow[j];
      v8f a0 = splat(0.0f);
      int x = 0;
      for (; x + kLanes <= d; x += kLanes) a0 += load8(q + x) * load8(kr + x);
      float sum = hsum(a0);
      for (; x < d; ++x) sum += q[x] * kr[x];
      out[j] = sum;
    }
    for (; j < kChunk; ++j) out[j] = kMasked;
  }
}

// The online softmax of row-major scores (scores_by_dots): probabilities in place, running
// max and sum updated, each row's rescaling factor in corr.
void softmax_by_dots(float* sc, int m_rows, const int32_t* lim, int c0, int kc, float* m_run,
                     float* l_run, float* corr) {
  for (int m = 0; m < m_rows; ++m) {
    float* row = sc + (size_t)m * kChunk;
    for (int j = std::max(0, lim[m] + 1 - c0); j < kc; ++j) row[j] = kMasked;  // causal
    v8f lo = load8(row), hi = load8(row + kLanes);
    const v8f mx = vmax(lo, hi);
    float m_new = m_run[m];
    for (int i = 0; i < kLanes; ++i) m_new = std::max(m_new, mx[i]);
    const v8f shift = splat(m_new);
    lo = vexp(lo - shift);
    hi = vexp(hi - shift);
    store8(row, lo);
    store8(row + kLanes, hi);
    corr[m] = vexp(splat(m_run[m] - m_new))[0];
    l_run[m] = l_run[m] * corr[m] + hsum(lo + hi);
    m_run[m] = m_new;
  }
}

// The online softmax of scores by rows (scores_by_rows), 8 rows at a time.
void softmax_by_rows(float* sc, int mp, const int32_t* lim, int c0, int kc, int min_lim,
                     float* m_run, float* l_run, float* corr) {
  const int nv = mp / kLanes;
  if (c0 + kc - 1 > min_lim) {  // causal mask: some row of the tile ends inside this chunk
    for (int j = 0; j < kc; ++j) {
      const v8i pos = v8i{0, 0, 0, 0, 0, 0, 0, 0} + (c0 + j);
      for (int v = 0; v < nv; ++v) {
        v8i lv;
        std::memcpy(&lv, lim + v * kLanes, sizeof lv);
        float* p = sc + (size_t)j * mp + v * kLanes;
        store8(p, pos > lv ? splat(kMasked) : load8(p));
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
template <int MR, int NX>
inline void pv_tile(float* acc, int d, const float* corr, const float* sc, int pj, int pm,
                    int m0, const float* const* vrow, int kc, int x0) {
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

template <int NX>
void pv_columns(float* acc, int d, const float* corr, const float* sc, int pj, int pm,
                int m_rows, const float* const* vrow, int kc, int x0) {
  int m = 0;
  for (; m + 6 <= m_rows; m += 6) pv_tile<6, NX>(acc, d, corr, sc, pj, pm, m, vrow, kc, x0);
  for (; m + 3 <= m_rows; m += 3) pv_tile<3, NX>(acc, d, corr, sc, pj, pm, m, vrow, kc, x0);
  for (; m < m_rows; ++m) pv_tile<1, NX>(acc, d, corr, sc, pj, pm, m, vrow, kc, x0);
}

// acc = acc * corr + P x V over the chunk, every row of the tile; row m's probability of key
// j at sc[j * pj + m * pm].
void pv(float* acc, int d, const float* corr, const float* sc, int pj, int pm, int m_rows,
        const float* const* vrow, int kc) {
  int x = 0;
  for (; x + 2 * kLanes <= d; x += 2 * kLanes)
    pv_columns<2>(acc, d, corr, sc, pj, pm, m_rows, vrow, kc, x);
  if (x + kLanes <= d) {
    pv_columns<1>(acc, d, corr, sc, pj, pm, m_rows, vrow, kc, x);
    x += kLanes;
  }
  for (; x < d; ++x)
    for (int m = 0; m < m_rows; ++m) {
      float s = acc[(size_t)m * d + x] * corr[m];
      for (int j = 0; j < kc; ++j) s += sc[(size_t)j * pj + (size_t)m * pm] * vrow[j][x];
      acc[(size_t)m * d + x] = s;
    }
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

  for (int m = 0; m < mp; ++m) {
    lim[m] = m < m_rows ? len - n + it.tok0 + m / g : -1;
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

  const int key_end = len - n + it.tok1, min_lim = len - n + it.tok0;
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
  int blk = 0, off = 0;
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
  locate(std::min(kChunk, key_end));
  for (int c0 = 0; c0 < key_end; c0 += kChunk) {
    const int kc = std::min(kChunk, key_end - c0);
    std::memcpy(rows, next, sizeof rows);
    if (c0 + kChunk < key_end) locate(std::min(kChunk, key_end - c0 - kChunk));
    for (int j = 0; j < kc; ++j) {
      if (a.kv_dtype == 0) {
        krow[j] = reinterpret_cast<const float*>(k_pool) + rows[j];
        vrow[j] = reinterpret_cast<const float*>(v_pool) + rows[j];
      } else {
        halves_to_floats(reinterpret_cast<const uint16_t*>(k_pool) + rows[j],
                         kconv + (size_t)j * d, d);
        halves_to_floats(reinterpret_cast<const uint16_t*>(v_pool) + rows[j],
                         vconv + (size_t)j * d, d);
        krow[j] = kconv + (size_t)j * d;
        vrow[j] = vconv + (size_t)j * d;
      }
    }
    if (by_dots) {
      scores_by_dots(krow, kc, d, qt, m_rows, sc);
      softmax_by_dots(sc, m_rows, lim, c0, kc, m_run, l_run, corr);
      pv(acc, d, corr, sc, 1, kChunk, m_rows, vrow, kc);
    } else {
      scores_by_rows(krow, kc, d, qt, mp, sc);
      softmax_by_rows(sc, mp, lim, c0, kc, min_lim, m_run, l_run, corr);
      pv(acc, d, corr, sc, mp, 1, m_rows, vrow, kc);
    }
  }
  for (int m = 0; m < m_rows; ++m) {
    const int i = it.tok0 + m / g, head = it.head * g + m % g;
    float* orow = st.out + (size_t)(start + i) * hd + (size_t)head * d;
    const float inv = 1.0f / l_run[m];
    for (int x = 0; x < d; ++x) orow[x] = acc[(size_t)m * d + x] * inv;
  }
}

void run_item(void* data, size_t index) {
  thread_local std::vector<float> scratch;
  const Job* job = static_cast<const Job*>(data);
  attend(*job->step, (*job->items)[index], scratch);
}

}  // namespace kvflow_ort
