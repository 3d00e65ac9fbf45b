// kvflow::PagedAttention as an ONNX Runtime custom op: one ORT session runs the whole engine.
//
// The node's contract is kvflow/plugins/torch_op.py's (inputs q, k, v, kv_cache_ptrs,
// slot_mapping, block_tables, seq_lens, query_start_loc; attributes layer_idx, num_heads,
// num_kv_heads, head_dim, block_size, scale), plus two the runner adds at load time: kv_dtype
// (0 = float32, 1 = float16 pool) and num_blocks (the pool's size, for bounds checks).
// Built against the C API headers only (kvflow/plugins/ort_custom_ops.py): the API table comes
// through RegisterCustomOps, so the library loads into any runtime that serves API 21.
//
// Algorithm (the numba kernel's, kvflow/plugins/paged_attention_native.py, tiled):
// 1. Every input is checked before anything is written; a bad value is an ORT error that names
//    the input and its limit. Then the new K/V rows go into the pool through slot_mapping.
// 2. Work items are (sequence, KV head, tile of up to kMaxRows / G query tokens). A tile holds
//    all G query heads of its KV head, so each key and value loaded serves every row of it.
//    Keys go by chunks of kChunk through the block table. The queries are stored transposed
//    (head_dim x rows), so scores, the causal mask and the online softmax (fp32) are vector
//    operations over rows; P x V runs over head_dim with each value row loaded once per row.
// 3. Small steps (a single-stream decode) run on the calling thread; larger ones go to ORT's
//    intra-op pool (KernelContext_ParallelFor), costliest items first.
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

const OrtApi* g_api = nullptr;

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int kChunk = 16;    // keys per online-softmax step
constexpr int kMaxRows = 64;  // query rows (token x group head) per tile: 8 vectors of scores
// NOTE: a masked score is a large finite number, not -inf: nothing relies on IEEE infinities.
constexpr float kMasked = -1e30f;
// Row-key pairs of a step below which it runs on the calling thread: waking the pool costs more.
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

OrtStatus* error(const std::string& msg) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvflow::PagedAttention: " + msg).c_str());
}

// Scores of one chunk: st[j][m] = sum_x key_j[x] * qt[x][m], NV vectors of 8 rows.
template <int NV>
void chunk_scores(const float* const* krow, int kc, int d, const float* qt, int mp, float* st) {
  for (int j = 0; j < kc; ++j) {
    v8f acc[NV] = {};
    const float* kr = krow[j];
    for (int x = 0; x < d; ++x) {
      v8f b = splat(kr[x]);
      const float* qx = qt + (size_t)x * mp;
      for (int v = 0; v < NV; ++v) acc[v] += b * load8(qx + v * kLanes);
    }
    for (int v = 0; v < NV; ++v) store8(st + (size_t)j * mp + v * kLanes, acc[v]);
  }
}

using ScoresFn = void (*)(const float* const*, int, int, const float*, int, float*);
const ScoresFn kScores[] = {chunk_scores<1>, chunk_scores<2>, chunk_scores<3>, chunk_scores<4>,
                            chunk_scores<5>, chunk_scores<6>, chunk_scores<7>, chunk_scores<8>};

void attend(const Step& st, const Item& it, std::vector<float>& scratch) {
  const Attrs& a = *st.a;
  const int d = (int)a.head_dim, kvh = (int)a.num_kv_heads, bs = (int)a.block_size;
  const int g = (int)(a.num_heads / a.num_kv_heads), hd = (int)(a.num_heads * a.head_dim);
  const int start = st.qsl[it.seq], n = st.qsl[it.seq + 1] - start, len = st.seq_lens[it.seq];
  const int m_rows = (it.tok1 - it.tok0) * g, nv = (m_rows + kLanes - 1) / kLanes;
  const int mp = nv * kLanes;
  const size_t need = (size_t)d * mp + (size_t)kChunk * mp + (size_t)m_rows * d + 3 * mp +
                      2 * (size_t)kChunk * d;
  if (scratch.size() < need) scratch.resize(need);
  float* qt = scratch.data();            // [d][mp] queries, scaled, transposed
  float* sc = qt + (size_t)d * mp;       // [kChunk][mp] scores, then probabilities
  float* acc = sc + (size_t)kChunk * mp; // [m_rows][d]
  float* m_run = acc + (size_t)m_rows * d;
  float* l_run = m_run + mp;
  float* corr = l_run + mp;
  float* kconv = corr + mp;              // [kChunk][d] converted fp16 rows
  float* vconv = kconv + (size_t)kChunk * d;
  int32_t lim[kMaxRows];                  // last key position each row sees

  for (int m = 0; m < mp; ++m) {
    const int i = it.tok0 + m / g;
    lim[m] = m < m_rows ? len - n + i : -1;
    m_run[m] = kMasked;
    l_run[m] = 0.0f;
  }
  for (int x = 0; x < d; ++x)
    for (int m = m_rows; m < mp; ++m) qt[(size_t)x * mp + m] = 0.0f;
  for (int m = 0; m < m_rows; ++m) {
    const int i = it.tok0 + m / g, head = it.head * g + m % g;
    const float* qrow = st.q + (size_t)(start + i) * hd + (size_t)head * d;
    for (int x = 0; x < d; ++x) qt[(size_t)x * mp + m] = qrow[x] * a.scale;
  }
  std::memset(acc, 0, sizeof(float) * (size_t)m_rows * d);

  const int key_end = len - n + it.tok1, min_lim = len - n + it.tok0;
  const int32_t* table = st.block_tables + (size_t)it.seq * st.max_blocks;
  const size_t row_stride = (size_t)kvh * d;
  const float* krow[kChunk];
  const float* vrow[kChunk];
  for (int c0 = 0; c0 < key_end; c0 += kChunk) {
    const int kc = std::min(kChunk, key_end - c0);
    for (int j = 0; j < kc; ++j) {
      const int pos = c0 + j;
      const size_t row = ((size_t)table[pos / bs] * bs + pos % bs) * row_stride + (size_t)it.head * d;
      if (a.kv_dtype == 0) {
        krow[j] = static_cast<const float*>(st.k_pool) + row;
        vrow[j] = static_cast<const float*>(st.v_pool) + row;
      } else {
        halves_to_floats(static_cast<const uint16_t*>(st.k_pool) + row, kconv + (size_t)j * d, d);
        halves_to_floats(static_cast<const uint16_t*>(st.v_pool) + row, vconv + (size_t)j * d, d);
        krow[j] = kconv + (size_t)j * d;
        vrow[j] = vconv + (size_t)j * d;
      }
    }
    kScores[nv - 1](krow, kc, d, qt, mp, sc);
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
    for (int v = 0; v < nv; ++v) {  // online softmax, 8 rows at a time
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
    for (int m = 0; m < m_rows; ++m) {  // acc = acc * corr + P x V
      float* ar = acc + (size_t)m * d;
      const v8f c = splat(corr[m]);
      int x = 0;
      for (; x + kLanes <= d; x += kLanes) {
        v8f s = load8(ar + x) * c;
        for (int j = 0; j < kc; ++j) s += splat(sc[(size_t)j * mp + m]) * load8(vrow[j] + x);
        store8(ar + x, s);
      }
      for (; x < d; ++x) {
        float s = ar[x] * corr[m];
        for (int j = 0; j < kc; ++j) s += sc[(size_t)j * mp + m] * vrow[j][x];
        ar[x] = s;
      }
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

// ---- ORT plumbing ------------------------------------------------------------------------

struct Tensor {
  const void* data = nullptr;
  std::vector<int64_t> shape;
};

OrtStatus* get_input(OrtKernelContext* ctx, size_t index, Tensor* t) {
  const OrtValue* value = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetInput(ctx, index, &value)) return s;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = g_api->GetTensorTypeAndShape(value, &info)) return s;
  size_t rank = 0;
  OrtStatus* s = g_api->GetDimensionsCount(info, &rank);
  if (!s) {
    t->shape.resize(rank);
    s = g_api->GetDimensions(info, t->shape.data(), rank);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  if (s) return s;
  void* data = nullptr;
  if ((s = g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &data))) return s;
  t->data = data;
  return nullptr;
}

std::string dims(const std::vector<int64_t>& shape) {
  std::string r = "[";
  for (size_t i = 0; i < shape.size(); ++i) r += (i ? ", " : "") + std::to_string(shape[i]);
  return r + "]";
}

OrtStatus* expect_shape(const char* name, const Tensor& t, std::vector<int64_t> want) {
  bool ok = t.shape.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || t.shape[i] == want[i];
  if (ok) return nullptr;
  for (auto& w : want) w = w < 0 ? -1 : w;
  return error(std::string(name) + " has shape " + dims(t.shape) + ", expected " + dims(want) +
               " (-1: any)");
}

OrtStatus* compute(const Attrs& a, OrtKernelContext* ctx) {
  Tensor q, k, v, ptrs, slots, tables, lens, qsl;
  Tensor* in[] = {&q, &k, &v, &ptrs, &slots, &tables, &lens, &qsl};
  for (size_t i = 0; i < 8; ++i)
    if (OrtStatus* s = get_input(ctx, i, in[i])) return s;
  const int64_t hd = a.num_heads * a.head_dim, kvd = a.num_kv_heads * a.head_dim;
  if (q.shape.size() != 2) return expect_shape("q", q, {-1, hd});
  const int64_t t = q.shape[0];
  if (OrtStatus* s = expect_shape("q", q, {t, hd})) return s;
  if (OrtStatus* s = expect_shape("k", k, {t, kvd})) return s;
  if (OrtStatus* s = expect_shape("v", v, {t, kvd})) return s;
  if (OrtStatus* s = expect_shape("kv_cache_ptrs", ptrs, {-1, 2})) return s;
  if (OrtStatus* s = expect_shape("slot_mapping", slots, {t})) return s;
  if (OrtStatus* s = expect_shape("block_tables", tables, {-1, -1})) return s;
  const int64_t num_seqs = tables.shape[0], max_blocks = tables.shape[1];
  if (OrtStatus* s = expect_shape("seq_lens", lens, {num_seqs})) return s;
  if (OrtStatus* s = expect_shape("query_start_loc", qsl, {num_seqs + 1})) return s;
  if (a.layer_idx >= ptrs.shape[0])
    return error("layer_idx " + std::to_string(a.layer_idx) + " is past kv_cache_ptrs' " +
                 std::to_string(ptrs.shape[0]) + " layers");
  const int64_t* p = static_cast<const int64_t*>(ptrs.data) + 2 * a.layer_idx;
  if (p[0] == 0 || p[1] == 0)
    return error("kv_cache_ptrs[" + std::to_string(a.layer_idx) + "] holds a null address");

  const int32_t* sl = static_cast<const int32_t*>(lens.data);
  const int32_t* ql = static_cast<const int32_t*>(qsl.data);
  const int32_t* bt = static_cast<const int32_t*>(tables.data);
  const int64_t* sm = static_cast<const int64_t*>(slots.data);
  // NOTE: tokens past query_start_loc[S] belong to no sequence (padding): their output is 0.
  const int64_t packed = ql[num_seqs];
  if (ql[0] != 0 || packed > t)
    return error("query_start_loc must run from 0 to at most the " + std::to_string(t) +
                 " tokens of q; it runs from " + std::to_string(ql[0]) + " to " +
                 std::to_string(packed));
  const int64_t pool_slots = a.num_blocks * a.block_size;
  for (int64_t i = 0; i < t; ++i)
    if (sm[i] >= pool_slots)
      return error("slot_mapping[" + std::to_string(i) + "] = " + std::to_string(sm[i]) +
                   " is past the KV pool (num_blocks * block_size = " +
                   std::to_string(pool_slots) + " slots)");
  const int g = (int)(a.num_heads / a.num_kv_heads);
  const int tile = std::max(1, kMaxRows / g);
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = (int64_t)ql[s + 1] - ql[s], len = sl[s];
    if (n < 0)
      return error("query_start_loc decreases at sequence " + std::to_string(s));
    if (n == 0) continue;
    if (len < n)
      return error("seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
                   " is below its " + std::to_string(n) + " new tokens (query_start_loc)");
    const int64_t nb = (len + a.block_size - 1) / a.block_size;
    if (nb > max_blocks)
      return error("seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) + " needs " +
                   std::to_string(nb) + " blocks; block_tables has " +
                   std::to_string(max_blocks) + " columns");
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t id = bt[s * max_blocks + b];
      if (id < 0 || id >= a.num_blocks)
        return error("block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
                     std::to_string(id) + " is outside the KV pool's " +
                     std::to_string(a.num_blocks) + " blocks (num_blocks)");
    }
    for (int64_t t0 = 0; t0 < n; t0 += tile) {
      const int64_t t1 = std::min(n, t0 + tile), cost = (t1 - t0) * g * (len - n + t1);
      for (int64_t h = 0; h < a.num_kv_heads; ++h)
        items.push_back({(int32_t)s, (int32_t)h, (int32_t)t0, (int32_t)t1, cost});
      work += cost * a.num_kv_heads;
    }
  }

  // 1. New K/V into the pool (all checked above).
  void* k_pool = reinterpret_cast<void*>(p[0]);
  void* v_pool = reinterpret_cast<void*>(p[1]);
  const float* kin = static_cast<const float*>(k.data);
  const float* vin = static_cast<const float*>(v.data);
  for (int64_t i = 0; i < t; ++i) {
    if (sm[i] < 0) continue;
    const size_t dst = (size_t)sm[i] * kvd, src = (size_t)i * kvd;
    if (a.kv_dtype == 0) {
      std::memcpy(static_cast<float*>(k_pool) + dst, kin + src, sizeof(float) * kvd);
      std::memcpy(static_cast<float*>(v_pool) + dst, vin + src, sizeof(float) * kvd);
    } else {
      floats_to_halves(kin + src, static_cast<uint16_t*>(k_pool) + dst, (int)kvd);
      floats_to_halves(vin + src, static_cast<uint16_t*>(v_pool) + dst, (int)kvd);
    }
  }

  // 2. Attention.
  OrtValue* out_value = nullptr;
  const int64_t out_shape[2] = {t, hd};
  if (OrtStatus* s = g_api->KernelContext_GetOutput(ctx, 0, out_shape, 2, &out_value)) return s;
  void* out = nullptr;
  if (OrtStatus* s = g_api->GetTensorMutableData(out_value, &out)) return s;
  std::memset(static_cast<float*>(out) + packed * hd, 0, sizeof(float) * (t - packed) * hd);
  Step step{&a, static_cast<const float*>(q.data), static_cast<float*>(out), k_pool, v_pool,
            bt, sl, ql, max_blocks};
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.cost > y.cost; });
  Job job{&step, &items};
  if (work >= kInlineWork && items.size() > 1) {
    OrtStatus* s = g_api->KernelContext_ParallelFor(ctx, run_item, items.size(), 0, &job);
    if (!s) return nullptr;
    g_api->ReleaseStatus(s);  // no pool to run on: do it here
  }
  for (size_t i = 0; i < items.size(); ++i) run_item(&job, i);
  return nullptr;
}

// ---- the op ------------------------------------------------------------------------------

OrtStatus* get_int(const OrtKernelInfo* info, const char* name, int64_t* out, bool required,
                   int64_t fallback) {
  OrtStatus* s = g_api->KernelInfoGetAttribute_int64(info, name, out);
  if (!s) return nullptr;
  g_api->ReleaseStatus(s);
  if (!required) {
    *out = fallback;
    return nullptr;
  }
  return error(std::string("the node has no integer attribute ") + name +
               (std::strcmp(name, "num_blocks") == 0
                    ? " (the runner sets it to the KV pool's block count at load time)"
                    : ""));
}

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info,
                                      void** kernel) {
  Attrs a{};
  struct { const char* name; int64_t* field; bool required; int64_t fallback; } ints[] = {
      {"layer_idx", &a.layer_idx, true, 0},   {"num_heads", &a.num_heads, true, 0},
      {"num_kv_heads", &a.num_kv_heads, true, 0}, {"head_dim", &a.head_dim, true, 0},
      {"block_size", &a.block_size, true, 0}, {"num_blocks", &a.num_blocks, true, 0},
      {"kv_dtype", &a.kv_dtype, false, 0}};
  for (auto& f : ints)
    if (OrtStatus* s = get_int(info, f.name, f.field, f.required, f.fallback)) return s;
  if (OrtStatus* s = g_api->KernelInfoGetAttribute_float(info, "scale", &a.scale)) {
    g_api->ReleaseStatus(s);
    return error("the node has no float attribute scale");
  }
  for (auto& f : ints)
    if (*f.field < (std::strcmp(f.name, "layer_idx") == 0 || std::strcmp(f.name, "kv_dtype") == 0
                        ? 0 : 1) || *f.field > INT32_MAX)
      return error(std::string("attribute ") + f.name + " = " + std::to_string(*f.field) +
                   " is out of range");
  if (a.num_heads % a.num_kv_heads != 0)
    return error("num_heads " + std::to_string(a.num_heads) + " is no multiple of num_kv_heads " +
                 std::to_string(a.num_kv_heads));
  if (a.num_heads / a.num_kv_heads > kMaxRows)
    return error("num_heads / num_kv_heads = " + std::to_string(a.num_heads / a.num_kv_heads) +
                 " is above the supported " + std::to_string(kMaxRows));
  if (a.kv_dtype != 0 && a.kv_dtype != 1)
    return error("kv_dtype " + std::to_string(a.kv_dtype) + " is none of 0 (float32), 1 (float16)");
  *kernel = new Attrs(a);
  return nullptr;
}

OrtStatus* ORT_API_CALL kernel_compute(void* kernel, OrtKernelContext* ctx) {
  try {
    return compute(*static_cast<const Attrs*>(kernel), ctx);
  } catch (const std::exception& e) {  // std::bad_alloc: never let it cross into ORT
    return g_api->CreateStatus(ORT_FAIL, e.what());
  }
}

void ORT_API_CALL kernel_destroy(void* kernel) { delete static_cast<Attrs*>(kernel); }

const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "PagedAttention"; }
const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  if (index < 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (index < 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
}
size_t ORT_API_CALL input_count(const OrtCustomOp*) { return 8; }
ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL output_count(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
OrtMemType ORT_API_CALL mem_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int ORT_API_CALL one(const OrtCustomOp*) { return 1; }
size_t ORT_API_CALL no_pairs(int** a, int** b) { *a = nullptr; *b = nullptr; return 0; }
void ORT_API_CALL release_pairs(int*, int*) {}

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof op);
  op.version = ORT_API_VERSION;
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = mem_type;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = one;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = one;
  op.CreateKernelV2 = create_kernel;  // NOTE: CreateKernel/KernelCompute stay null: V2 is used
  op.KernelComputeV2 = kernel_compute;
  op.KernelDestroy = kernel_destroy;
  op.GetStartVersion = one;
  op.GetEndVersion = one;
  op.GetMayInplace = no_pairs;
  op.ReleaseMayInplace = release_pairs;
  op.GetAliasMap = no_pairs;
  op.ReleaseAliasMap = release_pairs;
  return op;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // the first table entry, CreateStatus, is in every API version
    const OrtApi* v1 = api_base->GetApi(1);
    std::string msg = std::string("kvflow::PagedAttention needs ONNX Runtime API ") +
                      std::to_string(ORT_API_VERSION) + " or newer; this runtime is " +
                      api_base->GetVersionString();
    return v1 ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  g_api = api;
  // NOTE: one op and one domain for the process, shared by every session (never freed: ORT
  // keeps pointers to them for each session's lifetime).
  static OrtCustomOp op = make_op();
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* created = [&]() -> OrtStatus* {
    if (OrtStatus* s = api->CreateCustomOpDomain("kvflow", &domain)) return s;
    return api->CustomOpDomain_Add(domain, &op);
  }();
  if (created) return api->CreateStatus(api->GetErrorCode(created), api->GetErrorMessage(created));
  return api->AddCustomOpDomain(options, domain);
}
