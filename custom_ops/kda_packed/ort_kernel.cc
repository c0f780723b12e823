// k3::KDAPacked on ONNX Runtime's CPU provider, fp32: the gated delta rule of k3::kda (reference.py) over B
// sequences packed end to end, each from its row of the state pool, with no padding (the function body in
// onnx.py pads the sequences to the longest and runs ONNX Runtime's LinearAttention between gathers). The
// recurrence is custom_ops/kda/ort_recurrence.h's (one task per sequence, head and block of state columns, over
// ONNX Runtime's intra-op threads), shared with the k3::KDA kernel. Compiled into the custom-op library by
// runtime/ort_kernels.py, which calls k3x_add_kda_packed.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"
#include "kda/ort_recurrence.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr const char* OP = "k3::KDAPacked";  // errors name the node

struct KDAPackedKernel : Fp32Int32<8, 6, 2> {
  static constexpr const char* name = "KDAPacked";
  float scale;
  KDAPackedKernel(const OrtApi&, const OrtKernelInfo* info) {
    scale = Ort::ConstKernelInfo(info).GetAttribute<float>("scale");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2), g = ctx.GetInput(3);
    auto beta = ctx.GetInput(4), pool = ctx.GetInput(5), cu = ctx.GetInput(6), slots = ctx.GetInput(7);
    const auto qs = shape_of(q), vs = shape_of(v), pool_s = shape_of(pool);
    require(OP, qs.size() == 3, "q " + dims(qs) + ": expected [N, H, K]");
    const int64_t N = qs[0], H = qs[1], K = qs[2];
    require(OP, shape_of(k) == qs && shape_of(g) == qs,
            "k " + dims(shape_of(k)) + " and g " + dims(shape_of(g)) + ": expected q's " + dims(qs));
    require(OP, vs.size() == 3 && vs[0] == N && vs[1] == H, "v " + dims(vs) + ": expected [N, H, V]");
    const int64_t V = vs[2];
    require(OP, shape_of(beta) == std::vector<int64_t>{N, H}, "beta " + dims(shape_of(beta)) + ": expected [N, H]");
    require(OP, pool_s == std::vector<int64_t>{pool_s.empty() ? 0 : pool_s[0], H, K, V},
            "state_pool " + dims(pool_s) + ": expected [S, H, K, V]");
    const Packing seqs = packing("k3::KDAPacked", cu, slots, N, pool_s[0]);
    const int64_t B = seqs.B;
    const int64_t blocks = (V + VB - 1) / VB;
    Packed p{q.GetTensorData<float>(), k.GetTensorData<float>(), v.GetTensorData<float>(), nullptr,
             beta.GetTensorData<float>(), pool.GetTensorData<float>(), seqs.offsets.data(), seqs.slots.data(),
             ctx.GetOutput(0, {N, H, V}).GetTensorMutableData<float>(),
             ctx.GetOutput(1, {B, H, K, V}).GetTensorMutableData<float>(), H, K, V, blocks, scale};
    run_recurrence(ctx, p, g.GetTensorData<float>(), N, B);
  }
};

CpuOp<KDAPackedKernel> kda_packed_op;

}  // namespace

void k3x_add_kda_packed(Ort::CustomOpDomain& k3, Ort::CustomOpDomain&) { k3.Add(&kda_packed_op); }
