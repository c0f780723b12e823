// What the ONNX Runtime CPU kernels (custom_ops/<family>/ort_kernel.cc) share: vectorisable fp32 math, shapes
// as text, a packed serving step's cu_seqlens / slots, checked, and the custom-op declaration. The build
// (runtime/ort_kernels.py) puts this folder on the include path. Header-only, inline, internal linkage;
// include it after onnxruntime_cxx_api.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// e^x and ln x within a few ulp (Cephes' expf and logf: a polynomial on a reduced range, scaled by a power of
// two), branch-free so the kernels' `omp simd` loops vectorise them: std::exp and std::log1p are scalar calls
// (in k3::KDAPrep they took 3/4 of the node's time). Their clamps and selects vectorise only under
// -fno-trapping-math (runtime/ort_kernels.py FLAGS); adding and subtracting 1.5·2^23 rounds to the nearest integer.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);  // 2^n stays a normal float
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

inline float log_approx(float x) {  // x > 0, finite
  const int32_t bits = __builtin_bit_cast(int32_t, x);
  float e = float(((bits >> 23) & 0xff) - 126);
  float m = __builtin_bit_cast(float, (bits & 0x807fffff) | 0x3f000000);  // x = m·2^e, m in [0.5, 1)
  const bool low = m < 0.707106781f;
  e = low ? e - 1.f : e;
  m = low ? m + m - 1.f : m - 1.f;
  const float z = m * m;
  float p = 7.0376836292e-2f;
  p = p * m - 1.1514610310e-1f;
  p = p * m + 1.1676998740e-1f;
  p = p * m - 1.2420140846e-1f;
  p = p * m + 1.4249322787e-1f;
  p = p * m - 1.6668057665e-1f;
  p = p * m + 2.0000714765e-1f;
  p = p * m - 2.4999993993e-1f;
  p = p * m + 3.3333331174e-1f;
  const float y = m * z * p + e * -2.12194440e-4f - 0.5f * z;
  return m + y + e * 0.693359375f;
}

inline float sigmoid(float x) { return 1.f / (1.f + exp_approx(-x)); }

// tanh as a ratio num / den, so that a product of tanh and sigmoid factors takes one division (a division is
// most of the cost of such a vectorised loop: the SiTU-GLU ran 2.15x faster with one instead of three). Within a
// few ulp (Cephes' tanhf): an odd polynomial below |x| = 0.625 (den 1), where (e - 1) / (e + 1), e = e^2|x|, would
// lose the low bits; that form above, |x| clamped at 9 (fp32 tanh is 1 from there), so num and den stay below
// 7e7 and a product of a few stays finite. Both computed, one selected, so it vectorises.
struct Ratio {
  float num, den;
};

inline Ratio tanh_ratio(float x) {
  const float ax = std::abs(x), z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x, e = exp_approx(2.f * (ax < 9.f ? ax : 9.f));
  return ax < 0.625f ? Ratio{small, 1.f} : Ratio{x < 0.f ? 1.f - e : e - 1.f, e + 1.f};
}

inline std::string dims(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

inline std::vector<int64_t> shape_of(const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); }

// B sequences packed over N rows: cu_seqlens [B+1] (int32, rising from 0 to N) as int64 offsets; an error
// names `op`.
inline std::vector<int64_t> offsets(const std::string& op, const Ort::ConstValue& cu, int64_t B, int64_t N) {
  const int32_t* c = cu.GetTensorData<int32_t>();
  std::vector<int64_t> o(c, c + B + 1);
  bool rising = o[0] == 0 && o[B] == N;
  for (int64_t i = 0; i < B; ++i) rising = rising && o[i] <= o[i + 1];
  if (!rising)
    throw Ort::Exception(op + ": cu_seqlens must rise from 0 to N = " + std::to_string(N), ORT_INVALID_ARGUMENT);
  return o;
}

// The same with slots [B] (rows of a pool of S), int32 inputs, as int64; an error names `op` and the bad input.
struct Packing {
  std::vector<int64_t> offsets, slots;
  int64_t B;
};

inline Packing packing(const std::string& op, const Ort::ConstValue& cu, const Ort::ConstValue& slots, int64_t N,
                       int64_t S) {
  const auto cu_s = shape_of(cu), slots_s = shape_of(slots);
  auto fail = [&](const std::string& what) { throw Ort::Exception(op + ": " + what, ORT_INVALID_ARGUMENT); };
  if (slots_s.size() != 1 || cu_s != std::vector<int64_t>{slots_s[0] + 1})
    fail("cu_seqlens " + dims(cu_s) + " and slots " + dims(slots_s) + ": expected [B+1] and [B]");
  const int64_t B = slots_s[0];
  const int32_t* r = slots.GetTensorData<int32_t>();
  Packing p{offsets(op, cu, B, N), std::vector<int64_t>(r, r + B), B};
  for (int64_t row : p.slots)
    if (row < 0 || row >= S) fail("slot " + std::to_string(row) + " outside the pool of " + std::to_string(S));
  return p;
}

// A kernel's ports: `In` inputs, fp32 before `Int32From` and int32 from there on, `Out` fp32 outputs, none
// variadic (CpuOp reads inputs, outputs, input_type, output_type, variadic_input, variadic_output).
template <size_t In, size_t Int32From, size_t Out>
struct Fp32Int32 {
  static constexpr size_t inputs = In, outputs = Out;
  static constexpr bool variadic_input = false, variadic_output = false;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i >= Int32From ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// The CPU custom op of `Kernel` (constructed from (api, info), with Compute): Kernel::name, its ports
// (Fp32Int32, or the same members of its own: a variadic input or output is the last one, homogeneous, one or
// more values, of the type its index gives).
template <class Kernel>
struct CpuOp : Ort::CustomOpBase<CpuOp<Kernel>, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetName() const { return Kernel::name; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return Kernel::inputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const { return Kernel::input_type(i); }
  size_t GetOutputTypeCount() const { return Kernel::outputs; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return Kernel::output_type(i); }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return Kernel::variadic_input && i + 1 == Kernel::inputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return Kernel::variadic_output && i + 1 == Kernel::outputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
  }
};

}  // namespace
