// k3::KDA on ONNX Runtime's CPU provider, fp32: the batch interface's recurrence (reference.py
// `kda_recurrent`), B sequences of T rows, each from its row of initial_state. The function body (onnx.py) runs
// ONNX Runtime's LinearAttention: 141 us a k3-bench decode step a layer (8 heads, K = V = 128, 2 threads on the
// 2-core EPYC), where this kernel runs custom_ops/kda/ort_recurrence.h, the k3::KDAPacked kernel's recurrence:
// one task per (sequence, head, block of state columns), a decode row reading the state once and storing the
// update straight to final_state. Compiled into the custom-op library by runtime/ort_kernels.py, which calls
// k3x_add_kda.
//   q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V]
//   -> o [B, T, H, V], final_state [B, H, K, V]
// The rows of [B, T, H, ·] are KDAPacked's [N = B·T, H, ·]: sequence b is rows b·T .. b·T + T - 1, state row b.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"
#include "kda/ort_recurrence.h"

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr const char* OP = "k3::KDA";  // errors name the node

struct KDAKernel : Fp32Int32<6, 6, 2> {
  static constexpr const char* name = "KDA";
  float scale;
  KDAKernel(const OrtApi&, const OrtKernelInfo* info) {
    scale = Ort::ConstKernelInfo(info).GetAttribute<float>("scale");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2), g = ctx.GetInput(3);
    auto beta = ctx.GetInput(4), state = ctx.GetInput(5);
    const auto qs = shape_of(q), vs = shape_of(v);
    require(OP, qs.size() == 4, "q " + dims(qs) + ": expected [B, T, H, K]");
    const int64_t B = qs[0], T = qs[1], H = qs[2], K = qs[3];
    require(OP, shape_of(k) == qs && shape_of(g) == qs,
            "k " + dims(shape_of(k)) + " and g " + dims(shape_of(g)) + ": expected q's " + dims(qs));
    require(OP, vs.size() == 4 && vs[0] == B && vs[1] == T && vs[2] == H,
            "v " + dims(vs) + ": expected [B, T, H, V]");
    const int64_t V = vs[3];
    require(OP, shape_of(beta) == std::vector<int64_t>{B, T, H},
            "beta " + dims(shape_of(beta)) + ": expected [B, T, H]");
    require(OP, shape_of(state) == std::vector<int64_t>{B, H, K, V},
            "initial_state " + dims(shape_of(state)) + ": expected [B, H, K, V] = " + dims({B, H, K, V}));
    std::vector<int64_t> offsets(B + 1), slots(B);
    for (int64_t b = 0; b <= B; ++b) offsets[b] = b * T;
    for (int64_t b = 0; b < B; ++b) slots[b] = b;
    Packed p{q.GetTensorData<float>(), k.GetTensorData<float>(), v.GetTensorData<float>(), nullptr,
             beta.GetTensorData<float>(), state.GetTensorData<float>(), offsets.data(), slots.data(),
             ctx.GetOutput(0, {B, T, H, V}).GetTensorMutableData<float>(),
             ctx.GetOutput(1, {B, H, K, V}).GetTensorMutableData<float>(), H, K, V, (V + VB - 1) / VB, scale};
    run_recurrence(ctx, p, g.GetTensorData<float>(), B * T, B);
  }
};

CpuOp<KDAKernel> kda_op;

}  // namespace

void k3x_add_kda(Ort::CustomOpDomain& k3, Ort::CustomOpDomain&) { k3.Add(&kda_op); }
