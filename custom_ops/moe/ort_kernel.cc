// The k3::MoE body's k3x.fused functions on ONNX Runtime's CPU provider, fp32. Compiled into the custom-op
// library by runtime/ort_kernels.py, which calls k3x_add_moe.
//
// SiTUGLU: the SiTU-GLU of reference.py `glu` in one pass over a and u (its function body, custom_ops/fused.py,
// runs it as nine graph ops, each a pass over [N, I]); elements split over the intra-op threads in blocks.
//   y = [b1 tanh(a / b1) sigmoid(a)] * [b2 tanh(u / b2)],  b1 = beta, b2 = linear_beta (scalar inputs)
//
// SiTUGLUExperts: the same on every routed expert's [a | u] rows (one Gemm against w1 and w3 stacked) in one call.
//
// MoEDispatch and MoECombine: the routing and the row traffic around the per-expert GEMMs (the bodies in
// custom_ops/moe/onnx_dispatch.py, some fifty graph ops and a row Gather per expert), as two passes.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t BLOCK = 4096;  // elements per task: 16 KB of a and of u (an expert's [32, 256] rows: 2 tasks)

struct Glu {
  const float *a, *u;
  float* y;
  int64_t n;
  float b1, b2;
};

void glu_block(void* user, size_t block) {
  const Glu& g = *static_cast<const Glu*>(user);
  const int64_t lo = int64_t(block) * BLOCK;
  situ_glu_span(g.a, g.u, g.y, lo, std::min(g.n, lo + BLOCK), g.b1, g.b2);
}

// The one value of a scalar input `name` of k3x.fused::`op`; an error names it otherwise.
template <class T>
T one_value(const Ort::ConstValue& v, const char* op, const char* name) {
  if (v.GetTensorTypeAndShapeInfo().GetElementCount() != 1)
    throw Ort::Exception(std::string("k3x.fused::") + op + ": " + name + " " + dims(shape_of(v)) +
                             ": expected one value", ORT_INVALID_ARGUMENT);
  return v.GetTensorData<T>()[0];
}

struct SiTUGLUKernel : Fp32Int32<4, 4, 1> {
  static constexpr const char* name = "SiTUGLU";
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
          one_value<float>(ctx.GetInput(2), name, "beta"),
          one_value<float>(ctx.GetInput(3), name, "linear_beta")};
    if (n > 0) ctx.ParallelFor(glu_block, size_t((n + BLOCK - 1) / BLOCK), 0, &g);
  }
};

// SiTUGLUExperts(beta, linear_beta, h_0..h_{E-1}) -> y_0..y_{E-1}: h_e [n_e, 2I] = [a_e | u_e], y_e [n_e, I] its
// SiTU-GLU; every expert's rows in tasks of about BLOCK outputs, so one call spreads them all over the threads.
struct SiTUGLUExpertsKernel {
  static constexpr const char* name = "SiTUGLUExperts";
  static constexpr size_t inputs = 3, outputs = 1;
  static constexpr bool variadic_input = true, variadic_output = true;
  static ONNXTensorElementDataType input_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  SiTUGLUExpertsKernel(const OrtApi&, const OrtKernelInfo*) {}

  struct Task {
    const float* h;
    float* y;
    int64_t rows, I;  // rows of [a | u] (2I wide) -> rows of y (I wide)
  };
  struct Work {
    std::vector<Task> tasks;
    float b1, b2;
  };
  static void run(void* user, size_t i) {
    const Work& w = *static_cast<const Work*>(user);
    const Task& t = w.tasks[i];
    for (int64_t r = 0; r < t.rows; ++r)
      situ_glu_span(t.h + r * 2 * t.I, t.h + r * 2 * t.I + t.I, t.y + r * t.I, 0, t.I, w.b1, w.b2);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Work w{{}, one_value<float>(ctx.GetInput(0), name, "beta"), one_value<float>(ctx.GetInput(1), name, "linear_beta")};
    for (size_t e = 2; e < ctx.GetInputCount(); ++e) {
      auto h = ctx.GetInput(e);
      const auto hs = shape_of(h);
      if (hs.size() != 2 || hs[1] % 2)
        throw Ort::Exception("k3x.fused::SiTUGLUExperts: h_" + std::to_string(e - 2) + " " + dims(hs) +
                                 ": expected [rows, 2I]", ORT_INVALID_ARGUMENT);
      const int64_t I = hs[1] / 2;
      float* y = ctx.GetOutput(e - 2, {hs[0], I}).GetTensorMutableData<float>();
      if (I == 0) continue;
      const int64_t step = std::max<int64_t>(1, BLOCK / I);  // rows per task
      const float* data = h.GetTensorData<float>();
      for (int64_t r = 0; r < hs[0]; r += step)
        w.tasks.push_back({data + r * 2 * I, y + r * I, std::min(step, hs[0] - r), I});
    }
    if (!w.tasks.empty()) ctx.ParallelFor(run, w.tasks.size(), 0, &w);
  }
};

// MoEDispatch(logits [N, E], gate_bias [E], z [N, L], renormalize, scale, top_k, num_experts (local),
// expert_offset) -> pair_w [N, k], pair_row [N, k] int64, x_0..x_{E_local-1} [n_e, L]:
//   s = sigmoid(logits); a token's k experts are the largest s + gate_bias (ties: the lower id, as TopK), its
//   weights their unbiased s, renormalised (w / (r (sum w + 1e-20) + 1 - r)) and scaled; an expert id becomes
//   local (id - expert_offset), another rank's weighs 0. The (token, slot) pairs sorted stably by local expert:
//   x_e holds expert e's rows of z in that order, pair_row the pair's row of [0; x_0; ...; x_{E-1}] (1 + its
//   sorted position; 0, the zero row, for another rank's expert).
struct MoEDispatchKernel {
  static constexpr const char* name = "MoEDispatch";
  static constexpr size_t inputs = 8, outputs = 3;
  static constexpr bool variadic_input = false, variadic_output = true;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i < 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                 : i < 7 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  }
  static ONNXTensorElementDataType output_type(size_t i) {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  MoEDispatchKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto logits = ctx.GetInput(0), bias = ctx.GetInput(1), zv = ctx.GetInput(2);
    const auto ls = shape_of(logits), zs = shape_of(zv);
    auto fail = [](const std::string& what) {
      throw Ort::Exception("k3x.fused::MoEDispatch: " + what, ORT_INVALID_ARGUMENT);
    };
    if (ls.size() != 2 || zs.size() != 2 || zs[0] != ls[0] || shape_of(bias) != std::vector<int64_t>{ls[1]})
      fail("logits " + dims(ls) + ", gate_bias " + dims(shape_of(bias)) + ", z " + dims(zs) +
           ": expected [N, E], [E], [N, L]");
    const int64_t N = ls[0], E = ls[1], L = zs[1];
    const float r = one_value<float>(ctx.GetInput(3), name, "renormalize");
    const float scale = one_value<float>(ctx.GetInput(4), name, "scale");
    const int64_t k = one_value<int64_t>(ctx.GetInput(5), name, "top_k");
    const int64_t local_n = one_value<int64_t>(ctx.GetInput(6), name, "num_experts");
    const int64_t offset = one_value<int32_t>(ctx.GetInput(7), name, "expert_offset");
    if (k < 1 || k > E) fail("top_k " + std::to_string(k) + " outside 1.." + std::to_string(E));
    if (local_n != int64_t(ctx.GetOutputCount()) - 2)
      fail("num_experts " + std::to_string(local_n) + " but " + std::to_string(ctx.GetOutputCount() - 2) +
           " expert outputs");
    const float *lg = logits.GetTensorData<float>(), *gb = bias.GetTensorData<float>(), *z = zv.GetTensorData<float>();
    float* w = ctx.GetOutput(0, {N, k}).GetTensorMutableData<float>();
    int64_t* row = ctx.GetOutput(1, {N, k}).GetTensorMutableData<int64_t>();

    const Routed p = route(lg, gb, N, E, k, r, scale, offset, local_n);
    for (int64_t i = 0; i < N * k; ++i) {
      w[i] = p.w[i];
      row[i] = 1 + p.pos[i];  // 0, the zero row, for another rank's expert
    }
    Rows job{z, L, p.token.data(), p.start, {}};
    for (int64_t e = 0; e < local_n; ++e)
      job.out.push_back(ctx.GetOutput(2 + e, {p.start[e + 1] - p.start[e], L}).GetTensorMutableData<float>());
    if (local_n > 0) ctx.ParallelFor(copy_rows, size_t(local_n), 0, &job);
  }

  struct Rows {
    const float* z;
    int64_t L;
    const int64_t* src;          // sorted position -> row of z
    std::vector<int64_t> start;  // expert e's first sorted position
    std::vector<float*> out;     // expert e's output
  };
  static void copy_rows(void* user, size_t e) {  // one task per expert: its rows of z in sorted order
    const Rows& j = *static_cast<const Rows*>(user);
    for (int64_t i = j.start[e]; i < j.start[e + 1]; ++i)
      std::memcpy(j.out[e] + (i - j.start[e]) * j.L, j.z + j.src[i] * j.L, sizeof(float) * j.L);
  }
};

// MoECombine(pair_w [N, k], pair_row [N, k] int64, y_0..y_{E-1} [n_e, L]) -> u [N, L]:
//   u[n] = sum over j of pair_w[n, j] * Y[pair_row[n, j]], Y = [0; y_0; ...; y_{E-1}], j in slot order.
struct MoECombineKernel {
  static constexpr const char* name = "MoECombine";
  static constexpr size_t inputs = 3, outputs = 1;
  static constexpr bool variadic_input = true, variadic_output = false;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  MoECombineKernel(const OrtApi&, const OrtKernelInfo*) {}

  static constexpr int64_t TOKENS = 8;  // tokens per task
  struct Sum {
    const float* w;
    const int64_t* row;
    std::vector<const float*> rows;  // Y's rows, rows[0] = nullptr (the zero row)
    float* u;
    int64_t N, k, L;
  };
  static void sum_tokens(void* user, size_t block) {
    const Sum& s = *static_cast<const Sum*>(user);
    const int64_t lo = int64_t(block) * TOKENS, hi = std::min(s.N, lo + TOKENS), L = s.L;
    for (int64_t n = lo; n < hi; ++n) {
      float* out = s.u + n * L;
      std::fill(out, out + L, 0.f);
      for (int64_t j = 0; j < s.k; ++j) {
        const float* y = s.rows[s.row[n * s.k + j]];
        const float wj = s.w[n * s.k + j];
        if (y == nullptr) continue;  // the zero row: adds 0
#pragma omp simd
        for (int64_t c = 0; c < L; ++c) out[c] += wj * y[c];
      }
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto wv = ctx.GetInput(0), rv = ctx.GetInput(1);
    const auto ws = shape_of(wv);
    auto fail = [](const std::string& what) {
      throw Ort::Exception("k3x.fused::MoECombine: " + what, ORT_INVALID_ARGUMENT);
    };
    if (ws.size() != 2 || shape_of(rv) != ws)
      fail("pair_w " + dims(ws) + " and pair_row " + dims(shape_of(rv)) + ": expected one shape [N, k]");
    int64_t L = -1;
    Sum s{wv.GetTensorData<float>(), rv.GetTensorData<int64_t>(), {nullptr}, nullptr, ws[0], ws[1], 0};
    for (size_t e = 2; e < ctx.GetInputCount(); ++e) {
      auto y = ctx.GetInput(e);
      const auto ys = shape_of(y);
      if (ys.size() != 2 || (L >= 0 && ys[1] != L))
        fail("y_" + std::to_string(e - 2) + " " + dims(ys) + ": expected [rows, " + std::to_string(L) + "]");
      L = ys[1];
      const float* data = y.GetTensorData<float>();
      for (int64_t i = 0; i < ys[0]; ++i) s.rows.push_back(data + i * L);
    }
    s.L = L < 0 ? 0 : L;
    const int64_t M = int64_t(s.rows.size());
    for (int64_t p = 0; p < s.N * s.k; ++p)
      if (s.row[p] < 0 || s.row[p] >= M)
        fail("pair_row " + std::to_string(s.row[p]) + " outside the " + std::to_string(M) + " rows of Y");
    s.u = ctx.GetOutput(0, {s.N, s.L}).GetTensorMutableData<float>();
    if (s.N > 0 && s.L > 0) ctx.ParallelFor(sum_tokens, size_t((s.N + TOKENS - 1) / TOKENS), 0, &s);
  }
};

CpuOp<MoEDispatchKernel> dispatch_op;
CpuOp<MoECombineKernel> combine_op;

CpuOp<SiTUGLUKernel> situ_glu_op;
CpuOp<SiTUGLUExpertsKernel> situ_glu_experts_op;

}  // namespace

void k3x_add_moe(Ort::CustomOpDomain&, Ort::CustomOpDomain& fused) {
  fused.Add(&situ_glu_op);
  fused.Add(&situ_glu_experts_op);
  fused.Add(&dispatch_op);
  fused.Add(&combine_op);
}
