// kvflow::GatherQ as an ONNX Runtime custom op: rows of a table kept in MatMulQ's quantized
// blocks, dequantized on the fly (the embedding lookup over a quantized or tied table, with no
// fp32 copy of the table in memory).
//
// Inputs: blocks uint8 [N, K / 32 * block_bytes] (exactly MatMulQ's weight layout,
// matmul_q_kernel.h: row n = output column n's blocks), indices int64 of any shape. Output:
// float [indices.shape..., K], element j of row indices[t] = d * q + m (bits 4, Q4_1 form) or
// d * q (bits 8), d and m converted from fp16, the product rounded to fp32 before the sum (no
// FMA): equal, element for element, to the dequantized table in fp32. Attributes bits, K, N.
// An index outside [0, N) is an ORT error naming it and N; nothing is written.
#pragma once

#include <onnxruntime_c_api.h>

#include <string>
#include <vector>

#include "matmul_q_ort.h"

namespace kvflow_ort {
namespace gather_q {

inline const OrtApi* g_api = nullptr;  // set by RegisterCustomOps

struct Attrs {
  int64_t bits, k, n;
};

inline OrtStatus* error(const std::string& msg) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvflow::GatherQ: " + msg).c_str());
}

// a * b + c with a * b rounded first, whatever -ffp-contract says.
inline float mul_add_unfused(float a, float b, float c) {
  float p = a * b;
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(p));
#else
  volatile float v = p;
  p = v;
#endif
  return p + c;
}

inline void dequantize_row(int bits, int64_t k, const uint8_t* row, float* out) {
  const int64_t nb = k / kQBlock;
  const uint16_t* dw = reinterpret_cast<const uint16_t*>(row);
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half(dw[b]);
    float* o = out + b * kQBlock;
    if (bits == 4) {
      const float m = half(dw[nb + b]);
      const uint8_t* qs = row + nb * 4 + b * 16;
      for (int j = 0; j < 16; ++j) {
        o[j] = mul_add_unfused(d, (float)(qs[j] & 0x0F), m);
        o[16 + j] = mul_add_unfused(d, (float)(qs[j] >> 4), m);
      }
    } else {
      const int8_t* qs = reinterpret_cast<const int8_t*>(row + nb * 2) + b * kQBlock;
      for (int j = 0; j < kQBlock; ++j) o[j] = d * (float)qs[j];
    }
  }
}

inline OrtStatus* compute(const Attrs& a, OrtKernelContext* ctx) {
  const void *blocks = nullptr, *idx = nullptr;
  std::vector<int64_t> bs, is;
  if (OrtStatus* s = matmul_q::input(ctx, 0, &blocks, &bs)) return s;
  if (OrtStatus* s = matmul_q::input(ctx, 1, &idx, &is)) return s;
  const int64_t row_bytes = a.k / kQBlock * block_bytes((int)a.bits);
  if (bs.size() != 2 || bs[0] != a.n || bs[1] != row_bytes)
    return error("blocks has shape " + matmul_q::dims(bs) + ", expected [" +
                 std::to_string(a.n) + ", " + std::to_string(row_bytes) + "] (N, K / 32 blocks of " +
                 std::to_string(block_bytes((int)a.bits)) + " bytes for bits " +
                 std::to_string(a.bits) + ")");
  int64_t t = 1;
  for (int64_t d : is) t *= d;
  const int64_t* indices = static_cast<const int64_t*>(idx);
  for (int64_t i = 0; i < t; ++i)
    if (indices[i] < 0 || indices[i] >= a.n)
      return error("index " + std::to_string(indices[i]) + " (element " + std::to_string(i) +
                   " of indices) is outside [0, N = " + std::to_string(a.n) + ")");
  std::vector<int64_t> ys = is;
  ys.push_back(a.k);
  OrtValue* out = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetOutput(ctx, 0, ys.data(), ys.size(), &out)) return s;
  void* y = nullptr;
  if (OrtStatus* s = g_api->GetTensorMutableData(out, &y)) return s;
  const uint8_t* table = static_cast<const uint8_t*>(blocks);
  for (int64_t i = 0; i < t; ++i)
    dequantize_row((int)a.bits, a.k, table + indices[i] * row_bytes,
                   static_cast<float*>(y) + i * a.k);
  return nullptr;
}

inline OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*,
                                             const OrtKernelInfo* info, void** kernel) {
  Attrs a{};
  std::string wrong = matmul_q::read_weight_attrs(info, &a.bits, &a.k, &a.n);
  if (!wrong.empty()) return error(wrong);
  *kernel = new Attrs(a);
  return nullptr;
}

inline OrtStatus* ORT_API_CALL kernel_compute(void* kernel, OrtKernelContext* ctx) {
  try {
    return compute(*static_cast<const Attrs*>(kernel), ctx);
  } catch (const std::exception& e) {
    return g_api->CreateStatus(ORT_FAIL, e.what());
  }
}

inline void ORT_API_CALL kernel_destroy(void* kernel) { delete static_cast<Attrs*>(kernel); }

// The output is indices' shape plus [K].
inline OrtStatus* ORT_API_CALL infer_shape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  OrtTensorTypeAndShapeInfo* in = nullptr;
  if (OrtStatus* s = g_api->ShapeInferContext_GetInputTypeShape(ctx, 1, &in)) return s;
  size_t rank = 0;
  if (OrtStatus* s = g_api->GetDimensionsCount(in, &rank)) return s;
  std::vector<int64_t> shape(rank);
  std::vector<const char*> names(rank);
  if (OrtStatus* s = g_api->GetDimensions(in, shape.data(), rank)) return s;
  if (OrtStatus* s = g_api->GetSymbolicDimensions(in, names.data(), rank)) return s;
  const OrtOpAttr* attr = nullptr;
  int64_t k = 0;
  size_t size = 0;
  if (OrtStatus* s = g_api->ShapeInferContext_GetAttribute(ctx, "K", &attr)) return s;
  if (attr == nullptr) return error("the node has no integer attribute K");
  if (OrtStatus* s = g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &k, sizeof k, &size)) return s;
  shape.push_back(k);
  names.push_back("");
  OrtTensorTypeAndShapeInfo* out = nullptr;
  if (OrtStatus* s = g_api->CreateTensorTypeAndShapeInfo(&out)) return s;
  OrtStatus* s = g_api->SetTensorElementType(out, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (!s) s = g_api->SetDimensions(out, shape.data(), shape.size());
  if (!s) s = g_api->SetSymbolicDimensions(out, names.data(), names.size());
  if (!s) s = g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, out);
  g_api->ReleaseTensorTypeAndShapeInfo(out);
  return s;
}

inline const char* ORT_API_CALL op_name(const OrtCustomOp*) { return "GatherQ"; }
inline ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp*, size_t index) {
  return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}

inline OrtCustomOp make_op() {
  OrtCustomOp op = matmul_q::make_op();  // the same plumbing; its own name, inputs, kernel
  op.GetName = op_name;
  op.GetInputType = input_type;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = kernel_compute;
  op.KernelDestroy = kernel_destroy;
  op.InferOutputShapeFn = infer_shape;
  return op;
}

}  // namespace gather_q
}  // namespace kvflow_ort
