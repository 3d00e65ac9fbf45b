// kvflow::PagedAttention as an ONNX Runtime custom op: one ORT session runs the whole engine.
//
// The node's contract is kvflow/plugins/torch_op.py's (inputs q, k, v, kv_cache_ptrs,
// slot_mapping, block_tables, seq_lens, query_start_loc; attributes layer_idx, num_heads,
// num_kv_heads, head_dim, block_size, scale, and the optional sliding_window and logit_softcap,
// 0 = off when absent, as in graphs exported before they existed), plus what the runner adds
// at load time:
// num_blocks (the pool's size, for bounds checks; required), kv_dtype (0 = float32, the
// default, 1 = float16 pool) and parallel_min_work (optional, see kInlineWork).
// Built against the C API headers only (kvflow/plugins/ort_custom_ops.py): the API table comes
// through RegisterCustomOps, so the library loads into any runtime that serves API 21.
//
// Algorithm (the numba kernel's, kvflow/plugins/paged_attention_native.py, tiled; the
// arithmetic is in paged_attention_ort_kernel.h):
// 1. Every input is checked before anything is written; a bad value is an ORT error that names
//    the input and its limit. Then the new K/V rows go into the pool through slot_mapping
//    (float16: rounded to nearest even). Tokens past query_start_loc[S] are padding: output 0.
// 2. Work items are (sequence, KV head, tile of up to kMaxRows / G query tokens). A tile holds
//    all G query heads of its KV head, so each key and value loaded serves every row of it.
//    Keys go by chunks of kChunk through the block table, the next chunk prefetched. A tile's
//    queries are stored transposed (head_dim x rows): scores come from a GEMM micro-kernel,
//    and the causal mask and the online softmax (fp32) are vector operations over rows; P x V
//    is a second micro-kernel. A decode group (kDirectRows rows at most) scores by dot
//    products along head_dim instead, its softmax row by row. With a sliding window a tile's
//    keys start at the window of its first token (no block-table entry before it is read or
//    checked: the KV manager may have released those blocks), and each row also masks the
//    keys before its own window; soft-capping maps each score s to cap * tanh(s / cap).
// 3. Small steps (a single-stream decode) run on the calling thread; larger ones go to ORT's
//    intra-op pool (KernelContext_ParallelFor), costliest items first.
#include <onnxruntime_c_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gather_q_ort.h"
#include "isa.h"
#include "lora_matmul_ort.h"
#include "matmul_q_ort.h"
#include "paged_attention_ort_kernel.h"

namespace {

using namespace kvflow_ort;

const OrtApi* g_api = nullptr;

OrtStatus* error(const std::string& msg) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvflow::PagedAttention: " + msg).c_str());
}

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
    for (int64_t b = first_key(a, len - n) / a.block_size; b < nb; ++b) {
      const int32_t id = bt[s * max_blocks + b];
      if (id < 0 || id >= a.num_blocks)
        return error("block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
                     std::to_string(id) + " is outside the KV pool's " +
                     std::to_string(a.num_blocks) + " blocks (num_blocks)");
    }
    for (int64_t t0 = 0; t0 < n; t0 += tile) {
      const int64_t t1 = std::min(n, t0 + tile), key0 = first_key(a, len - n + t0);
      const int64_t cost = (t1 - t0) * g * (len - n + t1 - key0);
      for (int64_t h = 0; h < a.num_kv_heads; ++h)
        items.push_back({(int32_t)s, (int32_t)h, (int32_t)t0, (int32_t)t1, (int32_t)key0,
                         INT32_MAX, -1, cost});
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
  if (t > packed)
    std::memset(static_cast<float*>(out) + packed * hd, 0, sizeof(float) * (t - packed) * hd);
  const bool parallel = work >= a.parallel_min_work;
  std::vector<Split> splits;
  std::vector<float> partials;
  if (parallel && items.size() < (size_t)kSplitBelowItems) split_decodes(a, ql, sl, items, splits);
  if (!splits.empty()) {
    const Split& last = splits.back();
    partials.resize((size_t)(last.first_part + last.parts) * g * (a.head_dim + 2));
  }
  Step step{&a, static_cast<const float*>(q.data), static_cast<float*>(out), k_pool, v_pool,
            bt, sl, ql, max_blocks, partials.data()};
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.cost > y.cost; });
  Job job{&step, &items};
  bool done = false;
  if (parallel && items.size() > 1) {
    OrtStatus* s = g_api->KernelContext_ParallelFor(ctx, run_item, items.size(), 0, &job);
    done = s == nullptr;
    if (s) g_api->ReleaseStatus(s);  // no pool to run on: run here
  }
  if (!done)
    for (size_t i = 0; i < items.size(); ++i) run_item(&job, i);
  for (const Split& sp : splits) merge_parts(step, sp);
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
  struct { const char* name; int64_t* field; bool required; int64_t fallback, min; } ints[] = {
      {"layer_idx", &a.layer_idx, true, 0, 0},
      {"num_heads", &a.num_heads, true, 0, 1},
      {"num_kv_heads", &a.num_kv_heads, true, 0, 1},
      {"head_dim", &a.head_dim, true, 0, 1},
      {"block_size", &a.block_size, true, 0, 1},
      {"num_blocks", &a.num_blocks, true, 0, 1},
      {"kv_dtype", &a.kv_dtype, false, 0, 0},
      {"sliding_window", &a.sliding_window, false, 0, 0},
      {"parallel_min_work", &a.parallel_min_work, false, kInlineWork, 0}};
  for (auto& f : ints) {
    if (OrtStatus* s = get_int(info, f.name, f.field, f.required, f.fallback)) return s;
    if (*f.field < f.min || *f.field > INT32_MAX)
      return error(std::string("attribute ") + f.name + " = " + std::to_string(*f.field) +
                   " is outside [" + std::to_string(f.min) + ", " + std::to_string(INT32_MAX) +
                   "]");
  }
  if (OrtStatus* s = g_api->KernelInfoGetAttribute_float(info, "scale", &a.scale)) {
    g_api->ReleaseStatus(s);
    return error("the node has no float attribute scale");
  }
  if (OrtStatus* s = g_api->KernelInfoGetAttribute_float(info, "logit_softcap",
                                                         &a.logit_softcap)) {
    g_api->ReleaseStatus(s);  // absent (a graph exported before it existed): no capping
    a.logit_softcap = 0.0f;
  }
  if (!(a.logit_softcap >= 0.0f) || a.logit_softcap > 3.0e38f)
    return error("attribute logit_softcap = " + std::to_string(a.logit_softcap) +
                 " is not a finite number >= 0 (0 = none)");
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

// The output has q's shape ([T, H*D], T symbolic): ORT's optimizers downstream see it.
OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  // NOTE: the info belongs to the context (ORT frees it); releasing it here frees it twice.
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &info)) return s;
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

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
  op.InferOutputShapeFn = infer_shape;
  op.GetStartVersion = one;
  op.GetEndVersion = one;
  op.GetMayInplace = no_pairs;
  op.ReleaseMayInplace = release_pairs;
  op.GetAliasMap = no_pairs;
  op.ReleaseAliasMap = release_pairs;
  return op;
}

}  // namespace

// What this build is, for kvflow/plugins/ort_custom_ops.py (ctypes): its ISA's name, and
// whether kvflow::MatMulQ has the tiled GEMM (matmul_q_gemm.h).
extern "C" __attribute__((visibility("default"))) const char* kvflow_ortops_isa() {
  return KVFLOW_ISA_NAME;
}

extern "C" __attribute__((visibility("default"))) int kvflow_ortops_gemm() {
  return kHasGemm ? 1 : 0;
}

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
  const std::string lacks = cpu_lacks();
  if (!lacks.empty())
    return api->CreateStatus(ORT_FAIL, (std::string("kvflow ops built for ") + KVFLOW_ISA_NAME +
                                        ": this CPU lacks " + lacks).c_str());
  g_api = api;
  matmul_q::g_api = api;
  gather_q::g_api = api;
  lora_matmul::g_api = api;
  // NOTE: the ops and one domain for the process, shared by every session (never freed: ORT
  // keeps pointers to them for each session's lifetime). kvflow::MatMulQ: matmul_q_ort.h.
  static OrtCustomOp op = make_op();
  static OrtCustomOp matmul_q_op = matmul_q::make_op();
  static OrtCustomOp gather_q_op = gather_q::make_op();
  static OrtCustomOp lora_op = lora_matmul::make_op();  // lora_matmul_ort.h
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* created = [&]() -> OrtStatus* {
    if (OrtStatus* s = api->CreateCustomOpDomain("kvflow", &domain)) return s;
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, &op)) return s;
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, &matmul_q_op)) return s;
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, &lora_op)) return s;
    return api->CustomOpDomain_Add(domain, &gather_q_op);
  }();
  if (created) return api->CreateStatus(api->GetErrorCode(created), api->GetErrorMessage(created));
  return api->AddCustomOpDomain(options, domain);
}
