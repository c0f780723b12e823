// k3::KDAPrep on ONNX Runtime's CPU provider, fp32: KDA's pre-recurrence over packed sequences in one pass per
// row (the function body in onnx.py runs it as ~40 graph ops, each a pass over [N, C]). Rows are split over
// ONNX Runtime's intra-op threads, then the sequences' new conv states. Compiled into the custom-op library by
// runtime/ort_kernels.py, which calls k3x_add_kda_prep. Per row n of sequence b (local position t):
//   y[c] = sum_i w[c, i] * in(t - (W-1) + i),  in(p) = qkv[start_b + p, c] (p >= 0) or pool[slot_b, c, W-1+p]
//   q, k = l2norm(silu(y)) per head (eps 1e-6); v = silu(y); beta = sigmoid(b)
//   g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))  (lb != 0),  -exp(A_log[h]) * softplus(f + dt_bias)  (lb = 0)
//   new_conv[b, c, j] = in(len_b - (W-1) + j)
// Also k3x.fused::DepthwiseConv1d (custom_ops/fused.py): the batch interface's short conv, ONNX's Conv with
// group = channels, its sums in the order ONNX Runtime's Conv makes them (bit for bit: the products rounded, not
// fused; one output a channel (decode) summed in pairs, more in tap order from 0; then + b[c]). ORT's Conv runs
// such a node as one im2col + GEMM per channel: k3-bench's 3,072 channels took ~0.35 ms a decode step, a layer.
// And k3x.fused::KDAShortConv: that conv with the SiLU and q/k L2 norm after it, one pass per row (below).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

struct Prep {
  const float *qkv, *f, *b, *wt, *decay, *dt_bias, *pool;  // wt: the conv weight as [W, C]; decay: exp(A_log[h])
  const int64_t *cu, *slots;
  float *q, *k, *v, *g, *beta, *conv;
  int64_t B, C, H, K, V, W;
  float lb;
};

// the sequence that owns row n: the last b with cu[b] <= n (cu rises; empty sequences own no row)
int64_t sequence_of(const Prep& p, int64_t n) {
  return int64_t(std::upper_bound(p.cu, p.cu + p.B + 1, n) - p.cu) - 1;
}

// Channel c of sequence s at local position pos (>= -(W-1)) is x[c * stride]: this step's row (stride 1), or
// the pool row before it (channels W-1 apart).
struct Tap {
  const float* x;
  int64_t stride;
};

Tap tap(const Prep& p, int64_t s, int64_t pos) {
  const int64_t M = p.W - 1;
  if (pos >= 0) return {p.qkv + (p.cu[s] + pos) * p.C, 1};
  return {p.pool + p.slots[s] * p.C * M + (M + pos), M};
}

void prep_row(void* user, size_t row) {
  const Prep& p = *static_cast<const Prep*>(user);
  const int64_t n = int64_t(row), C = p.C, H = p.H, K = p.K, V = p.V, M = p.W - 1;
  const int64_t s = sequence_of(p, n), t = n - p.cu[s];
  std::vector<float> y(C, 0.f);
  for (int64_t i = 0; i < p.W; ++i) {
    const float* w = p.wt + i * C;
    const Tap in = tap(p, s, t - M + i);
    if (in.stride == 1) {  // its own loop, so the contiguous row vectorises
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) y[c] += w[c] * in.x[c];
    } else {
      for (int64_t c = 0; c < C; ++c) y[c] += w[c] * in.x[c * in.stride];
    }
  }
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) y[c] = y[c] * sigmoid(y[c]);
  for (int64_t part = 0; part < 2; ++part) {  // q, then k: L2-normalised per head
    float* out = (part == 0 ? p.q : p.k) + n * H * K;
    for (int64_t h = 0; h < H; ++h) {
      const float* z = y.data() + part * H * K + h * K;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < K; ++j) squares += z[j] * z[j];
      const float inv = 1.f / std::sqrt(squares + 1e-6f);
      for (int64_t j = 0; j < K; ++j) out[h * K + j] = z[j] * inv;
    }
  }
  std::copy(y.data() + 2 * H * K, y.data() + C, p.v + n * H * V);
  const float lb = p.lb;  // locals, not loads through `p` that a store to g could alias
  for (int64_t h = 0; h < H; ++h) {
    const float a = p.decay[h];
    const float* f = p.f + (n * H + h) * K;
    float* g = p.g + (n * H + h) * K;
    const float* dt = p.dt_bias + h * K;
    if (lb != 0.f) {
#pragma omp simd
      for (int64_t j = 0; j < K; ++j) g[j] = lb * sigmoid(a * (f[j] + dt[j]));
    } else {  // softplus with torch's threshold (x past 20 is its own softplus), in two passes: GCC vectorises
              // exp and log alone but not their composition
#pragma omp simd
      for (int64_t j = 0; j < K; ++j) g[j] = exp_approx(std::min(f[j] + dt[j], 20.f));
#pragma omp simd
      for (int64_t j = 0; j < K; ++j) {
        const float x = f[j] + dt[j], soft = log_approx(1.f + g[j]);
        g[j] = -a * (x > 20.f ? x : soft);
      }
    }
    p.beta[n * H + h] = sigmoid(p.b[n * H + h]);
  }
}

// new_conv[s, :, j] = in(length - M + j), a position at a time (an element at a time through a helper choosing
// the pool or this step's rows took 1.46-1.50 ms against 1.06-1.10: 32 decode rows, 9 layers, one thread, Zen 3)
void prep_state(void* user, size_t seq) {
  const Prep& p = *static_cast<const Prep*>(user);
  const int64_t s = int64_t(seq), C = p.C, M = p.W - 1, length = p.cu[s + 1] - p.cu[s];
  float* out = p.conv + s * C * M;
  for (int64_t j = 0; j < M; ++j) {
    const Tap in = tap(p, s, length - M + j);
    for (int64_t c = 0; c < C; ++c) out[c * M + j] = in.x[c * in.stride];
  }
}

// a conv weight [C, W] ([C, 1, W]) tap-major: a tap's C channels contiguous
std::vector<float> tap_major(const float* w, int64_t C, int64_t W) {
  std::vector<float> wt(W * C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < W; ++i) wt[i * C + c] = w[c * W + i];
  return wt;
}

constexpr const char* KDA_PREP = "k3::KDAPrep";  // its errors name the node

struct KDAPrepKernel : Fp32Int32<9, 7, 6> {
  static constexpr const char* name = "KDAPrep";
  int64_t H, K, V, W;
  float lb;
  KDAPrepKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo i(info);
    H = i.GetAttribute<int64_t>("num_heads");
    K = i.GetAttribute<int64_t>("head_dim");
    V = i.GetAttribute<int64_t>("value_dim");
    W = i.GetAttribute<int64_t>("conv_kernel");
    lb = i.GetAttribute<float>("gate_lower_bound");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto qkv = ctx.GetInput(0), f = ctx.GetInput(1), b = ctx.GetInput(2), w = ctx.GetInput(3);
    auto a_log = ctx.GetInput(4), dt = ctx.GetInput(5), pool = ctx.GetInput(6), cu = ctx.GetInput(7);
    auto slots = ctx.GetInput(8);
    const int64_t C = 2 * H * K + H * V, M = W - 1;
    const auto xs = shape_of(qkv), pool_s = shape_of(pool);
    require(KDA_PREP, W >= 1 && xs.size() == 2 && xs[1] == C,
            "qkv " + dims(xs) + ": expected [N, 2HK+HV = " + std::to_string(C) + "]");
    const int64_t N = xs[0];
    require(KDA_PREP, shape_of(f) == std::vector<int64_t>{N, H, K},
            "f " + dims(shape_of(f)) + ": expected [N, H, K]");
    require(KDA_PREP, shape_of(b) == std::vector<int64_t>{N, H}, "b " + dims(shape_of(b)) + ": expected [N, H]");
    require(KDA_PREP, shape_of(w) == std::vector<int64_t>{C, W},
            "conv_weight " + dims(shape_of(w)) + ": expected [C, W]");
    require(KDA_PREP, shape_of(a_log).size() == 1 && shape_of(a_log)[0] >= H,
            "A_log " + dims(shape_of(a_log)) + ": expected at least H entries");
    require(KDA_PREP, shape_of(dt) == std::vector<int64_t>{H * K},
            "dt_bias " + dims(shape_of(dt)) + ": expected [H*K]");
    require(KDA_PREP, pool_s.size() == 3 && pool_s[1] == C && pool_s[2] == M,
            "conv_pool " + dims(pool_s) + ": expected [S, C, W-1]");
    const Packing seqs = packing("k3::KDAPrep", cu, slots, N, pool_s[0]);
    const int64_t B = seqs.B;
    const std::vector<float> wt = tap_major(w.GetTensorData<float>(), C, W);
    std::vector<float> decay(H);
    for (int64_t h = 0; h < H; ++h) decay[h] = std::exp(a_log.GetTensorData<float>()[h]);
    Prep p{qkv.GetTensorData<float>(), f.GetTensorData<float>(), b.GetTensorData<float>(), wt.data(), decay.data(),
           dt.GetTensorData<float>(), pool.GetTensorData<float>(), seqs.offsets.data(), seqs.slots.data(),
           ctx.GetOutput(0, {N, H, K}).GetTensorMutableData<float>(),
           ctx.GetOutput(1, {N, H, K}).GetTensorMutableData<float>(),
           ctx.GetOutput(2, {N, H, V}).GetTensorMutableData<float>(),
           ctx.GetOutput(3, {N, H, K}).GetTensorMutableData<float>(),
           ctx.GetOutput(4, {N, H}).GetTensorMutableData<float>(),
           ctx.GetOutput(5, {B, C, M}).GetTensorMutableData<float>(), B, C, H, K, V, W, lb};
    if (N > 0) ctx.ParallelFor(prep_row, size_t(N), 0, &p);
    if (B > 0 && M > 0) ctx.ParallelFor(prep_state, size_t(B), 0, &p);
  }
};

CpuOp<KDAPrepKernel> kda_prep_op;

struct Conv {
  const float *x, *w, *b;  // x [B, C, L], w [C, 1, W], b [C]
  float* y;            // [B, C, L - W + 1]
  int64_t rows, C, L, W;  // rows = B * C
};

constexpr int64_t CONV_CHANNELS = 256;  // channels per task
constexpr int64_t CONV_INLINE = 1 << 16;  // multiply-adds below which one thread does all (a decode step: ~12k)

// The sum of p[0..n) as ONNX Runtime's Conv (MLAS, 1.31) sums a one-output channel: adjacent pairs, then pairs
// of those, .. (n <= 16 on the stack: KDA's conv_kernel is 4)
float pairwise(float* p, int64_t n) {
  for (; n > 1; n = (n + 1) / 2)
    for (int64_t i = 0; i < n; i += 2) p[i / 2] = i + 1 < n ? p[i] + p[i + 1] : p[i];
  return p[0];
}

// rows [lo, hi) of x's B * C rows; products rounded before each add as MLAS's (g++ would otherwise fuse them)
__attribute__((optimize("fp-contract=off"))) void conv_channels(const Conv& p, int64_t lo, int64_t hi) {
  const int64_t T = p.L - p.W + 1;
  if (T == 1 && p.W == 4) {  // a decode step of KDA's conv: x and w rows of 4 side by side, so it vectorises
    for (int64_t r = lo; r < hi;) {
      const int64_t c0 = r % p.C, n = std::min(hi - r, p.C - c0);  // one division per sequence, not per row
      const float *x = p.x + r * 4, *w = p.w + c0 * 4, *b = p.b + c0;
      float* y = p.y + r;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c)
        y[c] = ((w[4 * c] * x[4 * c] + w[4 * c + 1] * x[4 * c + 1]) +
                (w[4 * c + 2] * x[4 * c + 2] + w[4 * c + 3] * x[4 * c + 3])) + b[c];
      r += n;
    }
    return;
  }
  float prod[16];
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t c = r % p.C;
    const float *x = p.x + r * p.L, *w = p.w + c * p.W;
    float* y = p.y + r * T;
    if (T == 1 && p.W <= 16) {  // one output of another width
      for (int64_t i = 0; i < p.W; ++i) prod[i] = w[i] * x[i];
      y[0] = pairwise(prod, p.W) + p.b[c];
      continue;
    }
    for (int64_t t = 0; t < T; ++t) {
      float acc = 0.f;
      for (int64_t i = 0; i < p.W; ++i) acc += w[i] * x[t + i];
      y[t] = acc + p.b[c];
    }
  }
}

void conv_task(void* user, size_t task) {
  const Conv& p = *static_cast<const Conv*>(user);
  const int64_t lo = int64_t(task) * CONV_CHANNELS;
  conv_channels(p, lo, std::min(p.rows, lo + CONV_CHANNELS));
}

// DepthwiseConv1d(x [B, C, L] float, w [C, 1, W] float, b [C] float) -> y [B, C, L - W + 1] float
struct DepthwiseConv1dKernel : Fp32Int32<3, 3, 1> {
  static constexpr const char* name = "DepthwiseConv1d";
  DepthwiseConv1dKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0), w = ctx.GetInput(1), b = ctx.GetInput(2);
    const auto xs = shape_of(x), ws = shape_of(w), bs = shape_of(b);
    if (xs.size() != 3 || ws.size() != 3 || ws[0] != xs[1] || ws[1] != 1 || ws[2] < 1 || xs[2] < ws[2] ||
        bs != std::vector<int64_t>{xs[1]})
      throw Ort::Exception("k3x.fused::DepthwiseConv1d: x " + dims(xs) + ", w " + dims(ws) + " and b " + dims(bs) +
                               ": expected [B, C, L], [C, 1, W] and [C], W <= L",
                           ORT_INVALID_ARGUMENT);
    const int64_t B = xs[0], C = xs[1], L = xs[2], W = ws[2], T = L - W + 1;
    Conv p{x.GetTensorData<float>(), w.GetTensorData<float>(), b.GetTensorData<float>(),
           ctx.GetOutput(0, std::vector<int64_t>{B, C, T}).GetTensorMutableData<float>(), B * C, C, L, W};
    if (p.rows * T * W < CONV_INLINE) return conv_channels(p, 0, p.rows);
    ctx.ParallelFor(conv_task, size_t((p.rows + CONV_CHANNELS - 1) / CONV_CHANNELS), 0, &p);
  }
};

CpuOp<DepthwiseConv1dKernel> depthwise_conv_op;

// k3x.fused::KDAShortConv (custom_ops/fused.py): the batch interface's conv, SiLU and q/k L2 norm in one pass per
// row (b, t), rows over ONNX Runtime's intra-op threads; the conv's sums in the Conv's order, as DepthwiseConv1d's
// (its body's Conv), the SiLU's sigmoid and the norms within fp32 rounding of its body's ops.
struct ShortConv {
  const float *x, *state, *wt, *b;  // x [B, T, C], state [B, C, M], wt the weight tap-major [W, C], b [C]
  float *q, *k, *v, *conv;          // q, k, v [B, T, H, D], conv [B, C, M]
  int64_t rows, T, C, H, D, W;
  float eps;
};

constexpr int64_t SHORT_CONV_ROWS = 8;  // rows per task
constexpr int64_t SPLIT_HEADS = 4;      // heads a task where a call's rows are one row each (decode) and few: a
                                        // k3-bench decode call was one task on one thread (23 us)

// channel c of batch element s at window position pos (0 .. M-1+T) is x[c * stride]: the past state (pos < M), or
// x's row pos - M
Tap window(const ShortConv& p, int64_t s, int64_t pos) {
  const int64_t M = p.W - 1;
  if (pos < M) return {p.state + s * p.C * M + pos, M};
  return {p.x + (s * p.T + pos - M) * p.C, 1};
}

// y [n] = the conv of row `row`'s channels [c0, c0 + n) plus their bias; prod [W, n] scratch. Products rounded
// before each add, as MLAS's; each channel's sum is its own, so any channel range gives the same values.
__attribute__((optimize("fp-contract=off"))) void short_conv_sums(const ShortConv& p, int64_t row, int64_t c0,
                                                                   int64_t n, float* y, float* prod) {
  const int64_t C = p.C, W = p.W, s = row / p.T, t = row % p.T;
  const bool pairs = p.T == 1 && W <= 16;  // one output a channel: summed in pairs (DepthwiseConv1d's rule)
  if (!pairs) std::fill(y, y + n, 0.f);
  for (int64_t i = 0; i < W; ++i) {
    const float* w = p.wt + i * C + c0;
    const Tap tap = window(p, s, t + i);
    const float* x = tap.x + c0 * tap.stride;
    const int64_t stride = tap.stride;
    float* out = pairs ? prod + i * n : y;
    if (stride == 1 && pairs) {  // each case its own loop, so the contiguous ones vectorise
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) out[c] = w[c] * x[c];
    } else if (stride == 1) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) out[c] += w[c] * x[c];
    } else if (pairs) {
      for (int64_t c = 0; c < n; ++c) out[c] = w[c] * x[c * stride];
    } else {
      for (int64_t c = 0; c < n; ++c) out[c] += w[c] * x[c * stride];
    }
  }
  if (pairs) {  // adjacent taps, then pairs of those, ..
    for (int64_t m = W; m > 1; m = (m + 1) / 2)
      for (int64_t i = 0; i < m; i += 2) {
        float *dst = prod + (i / 2) * n, *a = prod + i * n, *b = prod + (i + 1) * n;
        if (i + 1 == m) {  // an odd count's last, carried up
          std::copy(a, a + n, dst);
          continue;
        }
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) dst[c] = a[c] + b[c];
      }
    std::copy(prod, prod + n, y);
  }
  const float* bias = p.b + c0;
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) y[c] += bias[c];
}

// row `row`'s channels [c0, c0 + n), whole heads (c0 and n multiples of D): the conv, SiLU, then q's and k's heads
// L2-normalised and v's copied
void short_conv_channels(const ShortConv& p, int64_t row, int64_t c0, int64_t n, float* y, float* prod) {
  const int64_t H = p.H, D = p.D;
  short_conv_sums(p, row, c0, n, y, prod);
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) y[c] = y[c] * sigmoid(y[c]);
  for (int64_t head = c0 / D; head < (c0 + n) / D; ++head) {  // head of q, k, v in turn: part = head / H
    const int64_t part = head / H, h = head % H;
    const float* z = y + head * D - c0;
    float* out = (part == 0 ? p.q : part == 1 ? p.k : p.v) + (row * H + h) * D;
    if (part == 2) {
      std::copy(z, z + D, out);
      continue;
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < D; ++j) squares += z[j] * z[j];
    const float norm = std::sqrt(squares + p.eps);
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) out[j] = z[j] / norm;
  }
}

// batch element s's new state, channels [c0, c1): window positions T .. T+M-1
void new_state(const ShortConv& p, int64_t s, int64_t c0, int64_t c1) {
  const int64_t M = p.W - 1;
  for (int64_t j = 0; j < M; ++j) {
    const Tap in = window(p, s, p.T + j);
    float* out = p.conv + s * p.C * M + j;
    for (int64_t c = c0; c < c1; ++c) out[c * M] = in.x[c * in.stride];
  }
}

void short_conv_rows(const ShortConv& p, int64_t lo, int64_t hi) {
  std::vector<float> y(p.C), prod(p.T == 1 ? p.W * p.C : 0);
  for (int64_t row = lo; row < hi; ++row) short_conv_channels(p, row, 0, p.C, y.data(), prod.data());
}

void short_conv_task(void* user, size_t task) {
  const ShortConv& p = *static_cast<const ShortConv*>(user);
  const int64_t lo = int64_t(task) * SHORT_CONV_ROWS;
  short_conv_rows(p, lo, std::min(p.rows, lo + SHORT_CONV_ROWS));
}

// tasks a row of a split call: q's, k's and v's heads in groups of SPLIT_HEADS
inline int64_t split_tasks(int64_t H) { return 3 * ((H + SPLIT_HEADS - 1) / SPLIT_HEADS); }

// T = 1: row (= batch element) task / parts, its part's SPLIT_HEADS heads of q, k or v, and their new state
void short_conv_split_task(void* user, size_t task) {
  const ShortConv& p = *static_cast<const ShortConv*>(user);
  const int64_t parts = split_tasks(p.H), per_part = parts / 3;
  const int64_t row = int64_t(task) / parts, part = int64_t(task) % parts / per_part;
  const int64_t h0 = int64_t(task) % per_part * SPLIT_HEADS, h1 = std::min(p.H, h0 + SPLIT_HEADS);
  const int64_t c0 = (part * p.H + h0) * p.D, n = (h1 - h0) * p.D;
  std::vector<float> y(n), prod(p.W * n);
  short_conv_channels(p, row, c0, n, y.data(), prod.data());
  new_state(p, row, c0, c0 + n);
}

struct ShortConvPorts {
  static constexpr size_t inputs = 6, outputs = 4;
  static constexpr bool variadic_input = false, variadic_output = false;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// KDAShortConv(x [B, T, C], state [B, C, W-1], w [C, 1, W], b [C], heads int64 [3, H, D], eps fp32 [])
//   -> q, k, v [B, T, H, D], conv [B, C, W-1]   (C = 3 H D)
struct KDAShortConvKernel : ShortConvPorts {
  static constexpr const char* name = "KDAShortConv";
  std::vector<float> wt;  // the weight tap-major, made once when it is a constant (its initializer, once folded;
  int64_t wt_C = -1, wt_W = -1;  // a k3-bench decode call, one thread: 23 us with the transposition, 18 without)
  KDAShortConvKernel(const OrtApi&, const OrtKernelInfo* info) {
    int constant = 0;
    const Ort::ConstValue w = Ort::ConstKernelInfo(info).GetTensorConstantInput(2, &constant);
    if (!constant) return;
    const auto ws = shape_of(w);
    if (ws.size() != 3 || ws[1] != 1) return;  // Compute names the shape
    wt = tap_major(w.GetTensorData<float>(), ws[0], ws[2]);
    wt_C = ws[0], wt_W = ws[2];
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0), state = ctx.GetInput(1), w = ctx.GetInput(2), b = ctx.GetInput(3);
    auto heads = ctx.GetInput(4), eps = ctx.GetInput(5);
    const auto xs = shape_of(x), ss = shape_of(state), ws = shape_of(w), bs = shape_of(b), hs = shape_of(heads);
    const int64_t* hd = heads.GetTensorData<int64_t>();
    const bool ok = xs.size() == 3 && ss.size() == 3 && ws.size() == 3 && hs == std::vector<int64_t>{3} &&
                    hd[0] == 3 && hd[1] > 0 && hd[2] > 0 && xs[2] == 3 * hd[1] * hd[2] && ss[0] == xs[0] &&
                    ss[1] == xs[2] && ws == std::vector<int64_t>{xs[2], 1, ss[2] + 1} &&
                    bs == std::vector<int64_t>{xs[2]} && shape_of(eps).size() <= 1 &&
                    eps.GetTensorTypeAndShapeInfo().GetElementCount() == 1;
    if (!ok)
      throw Ort::Exception("k3x.fused::KDAShortConv: x " + dims(xs) + ", state " + dims(ss) + ", w " + dims(ws) +
                               ", b " + dims(bs) + " and heads " +
                               (hs == std::vector<int64_t>{3} ? dims({hd[0], hd[1], hd[2]}) : dims(hs)) +
                               ": expected [B, T, C], [B, C, W-1], [C, 1, W], [C] and [3, H, D] with C = 3 H D",
                           ORT_INVALID_ARGUMENT);
    const int64_t B = xs[0], T = xs[1], C = xs[2], H = hd[1], D = hd[2], W = ws[2], M = W - 1;
    const std::vector<float> fresh = C == wt_C && W == wt_W ? std::vector<float>() :
                                                                tap_major(w.GetTensorData<float>(), C, W);
    const std::vector<int64_t> per_head{B, T, H, D};
    ShortConv p{x.GetTensorData<float>(), state.GetTensorData<float>(), fresh.empty() ? wt.data() : fresh.data(),
                b.GetTensorData<float>(),
                ctx.GetOutput(0, per_head).GetTensorMutableData<float>(),
                ctx.GetOutput(1, per_head).GetTensorMutableData<float>(),
                ctx.GetOutput(2, per_head).GetTensorMutableData<float>(),
                ctx.GetOutput(3, {B, C, M}).GetTensorMutableData<float>(), B * T, T, C, H, D, W,
                eps.GetTensorData<float>()[0]};
    const int64_t tasks = (p.rows + SHORT_CONV_ROWS - 1) / SHORT_CONV_ROWS;
    if (T == 1 && tasks == 1) {  // a few one-row sequences (decode): each row over tasks of heads, with its state
      ctx.ParallelFor(short_conv_split_task, size_t(p.rows * split_tasks(H)), 0, &p);
      return;
    }
    if (tasks == 1) short_conv_rows(p, 0, p.rows);
    else if (tasks > 1) ctx.ParallelFor(short_conv_task, size_t(tasks), 0, &p);
    for (int64_t s = 0; s < B; ++s) new_state(p, s, 0, C);
  }
};

CpuOp<KDAShortConvKernel> kda_short_conv_op;

}  // namespace

void k3x_add_kda_prep(Ort::CustomOpDomain& k3, Ort::CustomOpDomain& fused) {
  k3.Add(&kda_prep_op);
  fused.Add(&depthwise_conv_op);
  fused.Add(&kda_short_conv_op);
}
