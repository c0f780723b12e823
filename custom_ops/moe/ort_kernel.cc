// k3x.fused::SiTUGLU on ONNX Runtime's CPU provider, fp32: the SiTU-GLU of reference.py `glu` in one pass
// over a and u (its function body, custom_ops/fused.py, runs it as nine graph ops, each a pass over [N, I]).
// Elements are split over ONNX Runtime's intra-op threads in blocks. Compiled into the custom-op library by
// runtime/ort_kernels.py, which calls k3x_add_moe.
//   y = [b1 tanh(a / b1) sigmoid(a)] * [b2 tanh(u / b2)],  b1 = beta, b2 = linear_beta (scalar inputs)
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t BLOCK = 16384;  // elements per task: 64 KB of a and of u

struct Glu {
  const float *a, *u;
  float* y;
  int64_t n;
  float b1, b2;
};

void glu_block(void* user, size_t block) {
  const Glu& g = *static_cast<const Glu*>(user);
  const int64_t lo = int64_t(block) * BLOCK, hi = std::min(g.n, lo + BLOCK);
  const float b1 = g.b1, b2 = g.b2, r1 = 1.f / b1, r2 = 1.f / b2;
  const float *a = g.a, *u = g.u;
  float* y = g.y;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i)
    y[i] = (b1 * tanh_approx(a[i] * r1) * sigmoid(a[i])) * (b2 * tanh_approx(u[i] * r2));
}

float scalar(const Ort::ConstValue& v, const char* name) {
  const auto info = v.GetTensorTypeAndShapeInfo();
  if (info.GetElementCount() != 1)
    throw Ort::Exception(std::string("k3x.fused::SiTUGLU: ") + name + " " + dims(info.GetShape()) +
                             ": expected one value", ORT_INVALID_ARGUMENT);
  return v.GetTensorData<float>()[0];
}

struct SiTUGLUKernel {
  static constexpr const char* name = "SiTUGLU";
  static constexpr size_t inputs = 4, int32_from = 4, outputs = 1;
  SiTUGLUKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto a = ctx.GetInput(0), u = ctx.GetInput(1);
    const auto shape = a.GetTensorTypeAndShapeInfo().GetShape(), other = u.GetTensorTypeAndShapeInfo().GetShape();
    if (shape != other)
      throw Ort::Exception("k3x.fused::SiTUGLU: a " + dims(shape) + " and u " + dims(other) +
                               ": expected one shape", ORT_INVALID_ARGUMENT);
    const int64_t n = a.GetTensorTypeAndShapeInfo().GetElementCount();
    Glu g{a.GetTensorData<float>(), u.GetTensorData<float>(),
          ctx.GetOutput(0, shape).GetTensorMutableData<float>(), n,
          scalar(ctx.GetInput(2), "beta"), scalar(ctx.GetInput(3), "linear_beta")};
    if (n > 0) ctx.ParallelFor(glu_block, size_t((n + BLOCK - 1) / BLOCK), 0, &g);
  }
};

CpuOp<SiTUGLUKernel> situ_glu_op;

}  // namespace

void k3x_add_moe(Ort::CustomOpDomain&, Ort::CustomOpDomain& fused) { fused.Add(&situ_glu_op); }
