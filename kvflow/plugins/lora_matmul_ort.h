// kvflow::LoraMatMul as an ONNX Runtime custom op: the multi-LoRA product of one linear group
// (kvflow/runtime/lora_pool.py), tokens of different adapters in one batch (Punica's SGMV).
//
// Inputs: y_in float [T, N] (the base linear's output), x float [T, K] (its input),
// lora_ptrs int64 [M, 3] (per layer and group, the addresses of the pool's A float
// [S, P, R, K], Bt float [S, R, N] and ranks int32 [S, P]), lora_slots int32 [T] (each token's
// slot, -1: the base model) or [0] (no token of the step has an adapter: y_out = y_in).
// Output: y_out float [T, N] = y_in + for each token t of slot s >= 0 and each part p of rank
// r = ranks[s, p] > 0: (A[s, p, :r] x_t) . Bt[s, :r, cols_p]. Attributes: module (the row of
// lora_ptrs), part_cols (each part's column count; they sum to N), rank (R), num_slots (S),
// weight_dtype (optional: 0 float32 A and Bt, the default; 1 float16), parallel_min_work
// (optional: below it, multiply-adds of the step, run on the calling thread).
// Work items are tiles of up to kTile tokens of one slot (lora_matmul_kernel.h: the arithmetic),
// through ORT's intra-op pool. The op may run in place (y_out the buffer of y_in, which only it
// reads): then nothing is copied.
#pragma once

#include <onnxruntime_c_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "lora_matmul_kernel.h"

namespace kvflow_ort {
namespace lora_matmul {

inline const OrtApi* g_api = nullptr;  // set by RegisterCustomOps
constexpr int64_t kInlineWork = 1 << 16;  // multiply-adds below which threads cost more
constexpr int kMaxParts = 8;

struct Attrs {
  int64_t module, rank, num_slots, parallel_min_work, weight_dtype;
  std::vector<int64_t> part_cols;  // each part's first column, then N
};

inline OrtStatus* error(const std::string& msg) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvflow::LoraMatMul: " + msg).c_str());
}

inline OrtStatus* input(OrtKernelContext* ctx, size_t index, const void** data,
                        std::vector<int64_t>* shape) {
  const OrtValue* value = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetInput(ctx, index, &value)) return s;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = g_api->GetTensorTypeAndShape(value, &info)) return s;
  size_t rank = 0;
  OrtStatus* s = g_api->GetDimensionsCount(info, &rank);
  if (!s) {
    shape->resize(rank);
    s = g_api->GetDimensions(info, shape->data(), rank);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  if (s) return s;
  void* p = nullptr;
  if ((s = g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &p))) return s;
  *data = p;
  return nullptr;
}

inline std::string dims(const std::vector<int64_t>& shape) {
  std::string r = "[";
  for (size_t i = 0; i < shape.size(); ++i) r += (i ? ", " : "") + std::to_string(shape[i]);
  return r + "]";
}

inline OrtStatus* compute(const Attrs& a, OrtKernelContext* ctx) {
  const void *yin = nullptr, *x = nullptr, *ptrs = nullptr, *slots = nullptr;
  std::vector<int64_t> ys, xs, ps, ss;
  if (OrtStatus* s = input(ctx, 0, &yin, &ys)) return s;
  if (OrtStatus* s = input(ctx, 1, &x, &xs)) return s;
  if (OrtStatus* s = input(ctx, 2, &ptrs, &ps)) return s;
  if (OrtStatus* s = input(ctx, 3, &slots, &ss)) return s;
  const int64_t n = a.part_cols.back();
  if (ys.size() != 2 || ys[1] != n)
    return error("y_in has shape " + dims(ys) + ", expected [T, " + std::to_string(n) +
                 "] (part_cols sum to " + std::to_string(n) + ")");
  const int64_t t = ys[0];
  if (xs.size() != 2 || xs[0] != t)
    return error("x has shape " + dims(xs) + ", expected [" + std::to_string(t) + ", K]");
  const int64_t k = xs[1];
  if (ss.size() != 1 || (ss[0] != t && ss[0] != 0))
    return error("lora_slots has shape " + dims(ss) + ", expected [" + std::to_string(t) +
                 "] (one slot per token) or [0] (no adapter in the step)");
  OrtValue* out = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetOutput(ctx, 0, ys.data(), ys.size(), &out)) return s;
  void* y = nullptr;
  if (OrtStatus* s = g_api->GetTensorMutableData(out, &y)) return s;
  if (y != yin && t > 0) std::memcpy(y, yin, sizeof(float) * (size_t)(t * n));
  if (ss[0] == 0 || t == 0) return nullptr;
  if (ps.size() != 2 || ps[1] != 3 || ps[0] <= a.module)
    return error("lora_ptrs has shape " + dims(ps) + ", expected [M > " +
                 std::to_string(a.module) + " (module), 3]");
  const int64_t* row = static_cast<const int64_t*>(ptrs) + 3 * a.module;
  if (row[0] == 0 || row[1] == 0 || row[2] == 0)
    return error("lora_ptrs[" + std::to_string(a.module) + "] holds a null address");
  const int32_t* sl = static_cast<const int32_t*>(slots);
  const int32_t* ranks = reinterpret_cast<const int32_t*>(row[2]);
  const int64_t parts = (int64_t)a.part_cols.size() - 1;
  // Tokens by slot (a counting sort), then each slot's tokens in tiles of kTile.
  std::vector<int32_t> count((size_t)a.num_slots + 1, 0);
  for (int64_t i = 0; i < t; ++i) {
    if (sl[i] < -1 || sl[i] >= a.num_slots)
      return error("lora_slots[" + std::to_string(i) + "] = " + std::to_string(sl[i]) +
                   " is outside -1 (base) .. " + std::to_string(a.num_slots - 1) +
                   " (num_slots - 1)");
    ++count[(size_t)sl[i] + 1];
  }
  std::vector<int32_t> start(count.size() + 1, 0), order((size_t)t);
  for (size_t c = 0; c < count.size(); ++c) start[c + 1] = start[c] + count[c];
  std::vector<int32_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < t; ++i) order[(size_t)next[(size_t)sl[i] + 1]++] = (int32_t)i;
  std::vector<Tile> tiles;
  int64_t work = 0;
  for (int64_t s = 0; s < a.num_slots; ++s) {
    const int32_t first = start[(size_t)s + 1], n_tokens = count[(size_t)s + 1];
    int64_t per_token = 0;
    for (int64_t p = 0; p < parts; ++p)
      per_token += std::min<int64_t>(ranks[s * parts + p], a.rank) *
                   (k + a.part_cols[p + 1] - a.part_cols[p]);
    if (n_tokens == 0 || per_token <= 0) continue;
    for (int32_t f = 0; f < n_tokens; f += kTile)
      tiles.push_back({(int32_t)s, first + f, std::min<int32_t>(kTile, n_tokens - f)});
    work += per_token * n_tokens;
  }
  if (tiles.empty()) return nullptr;
  Step step{static_cast<const float*>(x), static_cast<float*>(y),
            reinterpret_cast<const void*>(row[0]), reinterpret_cast<const void*>(row[1]),
            ranks, order.data(), tiles.data(), a.part_cols.data(), k, n, parts, a.rank,
            a.weight_dtype};
  bool done = false;
  if (work >= a.parallel_min_work && tiles.size() > 1) {
    OrtStatus* s = g_api->KernelContext_ParallelFor(ctx, run_tile, tiles.size(), 0, &step);
    done = s == nullptr;
    if (s) g_api->ReleaseStatus(s);  // no pool to run on: run here
  }
  if (!done)
    for (size_t i = 0; i < tiles.size(); ++i) run_tile(&step, i);
  return nullptr;
}

inline OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*,
                                             const OrtKernelInfo* info, void** kernel) {
  Attrs a{};
  struct { const char* name; int64_t* field; bool required; int64_t fallback, min; } ints[] = {
      {"module", &a.module, true, 0, 0},
      {"rank", &a.rank, true, 0, 1},  // at most kMaxRank: checked below
      {"num_slots", &a.num_slots, true, 0, 1},
      {"parallel_min_work", &a.parallel_min_work, false, kInlineWork, 0},
      {"weight_dtype", &a.weight_dtype, false, 0, 0}};
  for (auto& f : ints) {
    if (OrtStatus* s = g_api->KernelInfoGetAttribute_int64(info, f.name, f.field)) {
      g_api->ReleaseStatus(s);
      if (f.required) return error(std::string("the node has no integer attribute ") + f.name);
      *f.field = f.fallback;
    }
    if (*f.field < f.min || *f.field > INT32_MAX)
      return error(std::string("attribute ") + f.name + " = " + std::to_string(*f.field) +
                   " is outside [" + std::to_string(f.min) + ", " + std::to_string(INT32_MAX) +
                   "]");
  }
  if (a.weight_dtype > 1)
    return error("weight_dtype " + std::to_string(a.weight_dtype) +
                 " is none of 0 (float32), 1 (float16)");
  if (a.rank > kMaxRank)
    return error("attribute rank = " + std::to_string(a.rank) + " is above the supported " +
                 std::to_string(kMaxRank));
  size_t count = 0;
  OrtStatus* s = g_api->KernelInfoGetAttributeArray_int64(info, "part_cols", nullptr, &count);
  std::vector<int64_t> cols(count);
  if (!s && count) s = g_api->KernelInfoGetAttributeArray_int64(info, "part_cols", cols.data(),
                                                                 &count);
  if (s) {
    g_api->ReleaseStatus(s);
    return error("the node has no integer list attribute part_cols");
  }
  if (count < 1 || count > (size_t)kMaxParts)
    return error("part_cols has " + std::to_string(count) + " parts; 1 to " +
                 std::to_string(kMaxParts) + " are supported");
  a.part_cols.push_back(0);
  for (int64_t c : cols) {
    if (c < 1 || c > INT32_MAX) return error("part_cols holds " + std::to_string(c) + " (< 1)");
    a.part_cols.push_back(a.part_cols.back() + c);
  }
  *kernel = new Attrs(a);
  return nullptr;
}

inline OrtStatus* ORT_API_CALL kernel_compute(void* kernel, OrtKernelContext* ctx) {
  try {
    return compute(*static_cast<const Attrs*>(kernel), ctx);
  } catch (const std::exception& e) {  // std::bad_alloc: never let it cross into ORT
    return g_api->CreateStatus(ORT_FAIL, e.what());
  }
}

inline void ORT_API_CALL kernel_destroy(void* kernel) { delete static_cast<Attrs*>(kernel); }

// y_out has y_in's shape (symbolic dimensions kept) for ORT's optimizers downstream.
inline OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  // NOTE: the info belongs to the context (ORT frees it).
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &info)) return s;
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

inline const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "LoraMatMul"; }
inline const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
inline ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  if (index < 2) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  return index == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
}
inline size_t ORT_API_CALL input_count(const OrtCustomOp*) { return 4; }
inline ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
inline size_t ORT_API_CALL one_output(const OrtCustomOp*) { return 1; }
inline OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
inline OrtMemType ORT_API_CALL mem_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
inline int ORT_API_CALL one(const OrtCustomOp*) { return 1; }
// y_in (input 0) may share its buffer with y_out (output 0): compute copies only when not.
inline size_t ORT_API_CALL in_place(int** inputs, int** outputs) {
  *inputs = new int[1]{0};
  *outputs = new int[1]{0};
  return 1;
}
inline void ORT_API_CALL release_in_place(int* inputs, int* outputs) {
  delete[] inputs;
  delete[] outputs;
}
inline size_t ORT_API_CALL no_pairs(int** a, int** b) { *a = nullptr; *b = nullptr; return 0; }
inline void ORT_API_CALL release_pairs(int*, int*) {}

inline OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof op);
  op.version = ORT_API_VERSION;
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = one_output;
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
  op.GetMayInplace = in_place;
  op.ReleaseMayInplace = release_in_place;
  op.GetAliasMap = no_pairs;
  op.ReleaseAliasMap = release_pairs;
  return op;
}

}  // namespace lora_matmul
}  // namespace kvflow_ort
