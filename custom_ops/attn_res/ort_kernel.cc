// k3::AttnRes on ONNX Runtime's CPU provider, fp32: the Block Attention Residuals mixer of reference.py in one
// pass over each row's N + 1 sources (the function body in onnx.py runs it as ~10 graph ops, each a pass over
// the [rows, N+1, d] stack). Rows are split over ONNX Runtime's intra-op threads. Compiled into the custom-op
// library by runtime/ort_kernels.py, which calls k3x_add_attn_res.
//   out[r] = sum_j softmax_j(s)[j] * V[r, j],  s[j] = (V[r, j] . (norm_weight * proj_weight)) / sqrt(mean(V[r, j]^2) + eps)
//   V[r] = [bank[r, 0..N-1], prefix[r]]
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

struct Mix {
  const float* prefix;
  const float* bank;
  const float* query;  // norm_weight * proj_weight [d]
  float* out;
  int64_t sources;  // N + 1
  int64_t d;
  float eps;
};

void mix_row(void* user, size_t r) {
  const Mix& m = *static_cast<const Mix*>(user);
  const int64_t n = m.sources - 1, d = m.d;
  std::vector<float> p(m.sources);
  float top = -INFINITY;
  for (int64_t j = 0; j < m.sources; ++j) {
    const float* v = j < n ? m.bank + (r * n + j) * d : m.prefix + r * d;
    float squares = 0.f, dot = 0.f;
#pragma omp simd reduction(+ : squares, dot)  // lane-wise partial sums: vectorised (built with -fopenmp-simd)
    for (int64_t k = 0; k < d; ++k) {
      squares += v[k] * v[k];
      dot += v[k] * m.query[k];
    }
    p[j] = dot / std::sqrt(squares / float(d) + m.eps);
    top = std::max(top, p[j]);
  }
  float total = 0.f;
  for (float& x : p) total += (x = std::exp(x - top));
  float* o = m.out + r * d;
  for (int64_t k = 0; k < d; ++k) o[k] = 0.f;
  for (int64_t j = 0; j < m.sources; ++j) {
    const float* v = j < n ? m.bank + (r * n + j) * d : m.prefix + r * d;
    const float w = p[j] / total;
    for (int64_t k = 0; k < d; ++k) o[k] += w * v[k];
  }
}

struct AttnResKernel : Fp32Int32<4, 4, 1> {
  static constexpr const char* name = "AttnRes";
  float eps;
  AttnResKernel(const OrtApi&, const OrtKernelInfo* info) : eps(Ort::ConstKernelInfo(info).GetAttribute<float>("eps")) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto prefix = ctx.GetInput(0), bank = ctx.GetInput(1), norm = ctx.GetInput(2), proj = ctx.GetInput(3);
    const std::vector<int64_t> shape = prefix.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> bank_shape = bank.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t d = shape.empty() ? 0 : shape.back();
    const int64_t rows = d ? int64_t(prefix.GetTensorTypeAndShapeInfo().GetElementCount()) / d : 0;
    const int64_t n = bank_shape.size() >= 2 ? bank_shape[bank_shape.size() - 2] : 0;
    const bool ok = shape.size() >= 1 && bank_shape.size() == shape.size() + 1 && n >= 1 && bank_shape.back() == d &&
                    int64_t(bank.GetTensorTypeAndShapeInfo().GetElementCount()) == rows * n * d &&
                    int64_t(norm.GetTensorTypeAndShapeInfo().GetElementCount()) == d &&
                    int64_t(proj.GetTensorTypeAndShapeInfo().GetElementCount()) == d;
    if (!ok) {
      throw Ort::Exception("k3::AttnRes: bank " + dims(bank_shape) + " does not match prefix " + dims(shape) +
                               " (expected [..., N >= 1, d] and norm/proj weights of d elements)",
                           ORT_INVALID_ARGUMENT);
    }
    std::vector<float> query(d);
    const float* nw = norm.GetTensorData<float>();
    const float* pw = proj.GetTensorData<float>();
    for (int64_t k = 0; k < d; ++k) query[k] = nw[k] * pw[k];
    Mix m{prefix.GetTensorData<float>(), bank.GetTensorData<float>(), query.data(),
          ctx.GetOutput(0, shape).GetTensorMutableData<float>(), n + 1, d, eps};
    if (rows > 0) ctx.ParallelFor(mix_row, size_t(rows), 0, &m);
  }
};

CpuOp<AttnResKernel> attn_res_op;

}  // namespace

void k3x_add_attn_res(Ort::CustomOpDomain& k3, Ort::CustomOpDomain&) { k3.Add(&attn_res_op); }
