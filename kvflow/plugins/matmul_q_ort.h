// kvflow::MatMulQ as an ONNX Runtime custom op: y = x @ W with W in GGUF blocks (Q4_1, Q8_0),
// x quantized to int8 per 32-block once per call; the arithmetic is in matmul_q_kernel.h.
//
// Inputs: x float [..., K], w uint8 [N, K / 32 * block_bytes] (the layout in
// matmul_q_kernel.h, written at load time by kvflow/runtime/ort_graph_linear.py). Output:
// float [..., N]. Attributes: bits (4: Q4_1 blocks, 8: Q8_0 blocks), K, N (required),
// parallel_min_work (optional: below M * N * K / 32 blocks' work, run on the calling thread).
// Work items are tiles of kColumnTile output columns, each for every row, through ORT's
// intra-op pool (KernelContext_ParallelFor). From gemm_min_rows rows on, a tile runs the tiled
// int8 GEMM (matmul_q_gemm.h) where the build has one (kHasGemm), else the row kernels.
#pragma once

#include <onnxruntime_c_api.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "matmul_q_gemm.h"
#include "matmul_q_kernel.h"

namespace kvflow_ort {
namespace matmul_q {

inline const OrtApi* g_api = nullptr;  // set by RegisterCustomOps
constexpr int64_t kInlineBlocks = 16384;  // ~ M * N * K / 32 below which threads cost more

struct Attrs {
  int64_t bits, k, n, parallel_min_work;
};

inline OrtStatus* error(const std::string& msg) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvflow::MatMulQ: " + msg).c_str());
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
  const void *x = nullptr, *w = nullptr;
  std::vector<int64_t> xs, ws;
  if (OrtStatus* s = input(ctx, 0, &x, &xs)) return s;
  if (OrtStatus* s = input(ctx, 1, &w, &ws)) return s;
  const int64_t row_bytes = a.k / kQBlock * block_bytes((int)a.bits);
  if (xs.empty() || xs.back() != a.k)
    return error("x has shape " + dims(xs) + "; its last dimension must be K = " +
                 std::to_string(a.k));
  if (ws.size() != 2 || ws[0] != a.n || ws[1] != row_bytes)
    return error("w has shape " + dims(ws) + ", expected [" + std::to_string(a.n) + ", " +
                 std::to_string(row_bytes) + "] (N, K / 32 blocks of " +
                 std::to_string(block_bytes((int)a.bits)) + " bytes for bits " +
                 std::to_string(a.bits) + ")");
  int64_t m = 1;
  for (size_t i = 0; i + 1 < xs.size(); ++i) m *= xs[i];
  std::vector<int64_t> ys = xs;
  ys.back() = a.n;
  OrtValue* out = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetOutput(ctx, 0, ys.data(), ys.size(), &out)) return s;
  void* y = nullptr;
  if (OrtStatus* s = g_api->GetTensorMutableData(out, &y)) return s;
  if (m == 0) return nullptr;
  thread_local QActivations q;
  quantize_rows(static_cast<const float*>(x), m, a.k, q);
  MatMulQArgs args{(int)a.bits, m, a.k, a.n, static_cast<const uint8_t*>(w), &q,
                   static_cast<float*>(y)};
  void (*run)(void*, size_t) = run_column_tile;
  void* data = &args;
  size_t items = (size_t)((a.n + kColumnTile - 1) / kColumnTile);
#if defined(KVFLOW_GEMM_512) || defined(KVFLOW_GEMM_256)
  GemmArgs gemm = gemm_args(args);
  if (m >= gemm_min_rows((int)a.bits)) {
    run = run_gemm_tile;
    data = &gemm;
    items = gemm_items(gemm);
    if (a.bits == 8) {
      q.u.resize(q.q.size());
      for (size_t i = 0; i < q.q.size(); ++i) q.u[i] = (uint8_t)(q.q[i] ^ 0x80);  // q + 128
    }
  }
#endif
  bool done = false;
  if (m * a.n * (a.k / kQBlock) >= a.parallel_min_work && items > 1) {
    OrtStatus* s = g_api->KernelContext_ParallelFor(ctx, run, items, 0, data);
    done = s == nullptr;
    if (s) g_api->ReleaseStatus(s);  // no pool to run on: run here
  }
  if (!done)
    for (size_t i = 0; i < items; ++i) run(data, i);
  return nullptr;
}

// A block-quantized weight's attributes read and checked: bits, K, N and, when asked for, the
// optional parallel_min_work. Returns what is wrong ("" if nothing). GatherQ reads the same.
inline std::string read_weight_attrs(const OrtKernelInfo* info, int64_t* bits, int64_t* k,
                                     int64_t* n, int64_t* parallel_min_work = nullptr) {
  struct { const char* name; int64_t* field; bool required; int64_t fallback, min; } ints[] = {
      {"bits", bits, true, 0, 4},
      {"K", k, true, 0, kQBlock},
      {"N", n, true, 0, 1},
      {"parallel_min_work", parallel_min_work, false, kInlineBlocks, 0}};
  for (auto& f : ints) {
    if (f.field == nullptr) continue;
    if (OrtStatus* s = g_api->KernelInfoGetAttribute_int64(info, f.name, f.field)) {
      g_api->ReleaseStatus(s);
      if (f.required) return std::string("the node has no integer attribute ") + f.name;
      *f.field = f.fallback;
    }
    if (*f.field < f.min || *f.field > INT32_MAX)
      return std::string("attribute ") + f.name + " = " + std::to_string(*f.field) +
             " is outside [" + std::to_string(f.min) + ", " + std::to_string(INT32_MAX) + "]";
  }
  if (*bits != 4 && *bits != 8)
    return "bits " + std::to_string(*bits) + " is none of 4 (Q4_1 blocks), 8 (Q8_0)";
  if (*k % kQBlock) return "K " + std::to_string(*k) + " is no multiple of the block size 32";
  return "";
}

inline OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*,
                                             const OrtKernelInfo* info, void** kernel) {
  Attrs a{};
  std::string wrong = read_weight_attrs(info, &a.bits, &a.k, &a.n, &a.parallel_min_work);
  if (!wrong.empty()) return error(wrong);
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

// The output is x's shape with the last dimension N (the leading ones symbolic or not).
inline OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  // NOTE: the input's info belongs to the context; the output's is ours to release.
  OrtTensorTypeAndShapeInfo* in = nullptr;
  if (OrtStatus* s = g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &in)) return s;
  size_t rank = 0;
  if (OrtStatus* s = g_api->GetDimensionsCount(in, &rank)) return s;
  if (rank == 0) return error("x must have at least one dimension");
  std::vector<int64_t> shape(rank);
  std::vector<const char*> names(rank);
  if (OrtStatus* s = g_api->GetDimensions(in, shape.data(), rank)) return s;
  if (OrtStatus* s = g_api->GetSymbolicDimensions(in, names.data(), rank)) return s;
  const OrtOpAttr* attr = nullptr;
  int64_t n = 0;
  size_t size = 0;
  if (OrtStatus* s = g_api->ShapeInferContext_GetAttribute(ctx, "N", &attr)) return s;
  if (attr == nullptr) return error("the node has no integer attribute N");
  if (OrtStatus* s = g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &n, sizeof n, &size)) return s;
  shape.back() = n;
  names.back() = "";
  OrtTensorTypeAndShapeInfo* out = nullptr;
  if (OrtStatus* s = g_api->CreateTensorTypeAndShapeInfo(&out)) return s;
  OrtStatus* s = g_api->SetTensorElementType(out, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (!s) s = g_api->SetDimensions(out, shape.data(), rank);
  if (!s) s = g_api->SetSymbolicDimensions(out, names.data(), rank);
  if (!s) s = g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, out);
  g_api->ReleaseTensorTypeAndShapeInfo(out);
  return s;
}

inline const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "MatMulQ"; }
inline const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
inline ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
}
inline size_t ORT_API_CALL input_count(const OrtCustomOp*) { return 2; }
inline ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
inline size_t ORT_API_CALL one_output(const OrtCustomOp*) { return 1; }
inline OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
inline OrtMemType ORT_API_CALL mem_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
inline int ORT_API_CALL one(const OrtCustomOp*) { return 1; }
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
  op.GetMayInplace = no_pairs;
  op.ReleaseMayInplace = release_pairs;
  op.GetAliasMap = no_pairs;
  op.ReleaseAliasMap = release_pairs;
  return op;
}

}  // namespace matmul_q
}  // namespace kvflow_ort
