// k3::LinearBF16 on ONNX Runtime's CPU provider: y [..., N] = x [..., K] . W^T, W [N, K] bf16 as stored, fp32
// activations and fp32 accumulation (reference.py). Compiled into the custom-op library by runtime/ort_kernels.py,
// which calls k3x_add_linear_bf16. The function body (onnx.py) runs MLAS on a widened fp32 copy of W; here W
// stays bf16 in memory, so a decode step streams half the bytes.
//
// - A bf16 is the high half of an fp32: widening is a zero-extension to 32 bits and a 16-bit left shift, exact.
//   The activations are never rounded to bf16 (no vdpbf16ps), so the only rounding is fp32 accumulation's.
// - Vectors are GCC vector extensions of LANES floats: 16 (zmm) where the build's -march has AVX-512F, else 8
//   (two xmm halves without AVX; the same code, correct on any x86-64 target the build names).
// - M <= DECODE_ROWS rows (decode): a GEMV streaming W once. Each task is a block of output features; it takes
//   R rows of W at a time, widens LANES weights of each in registers and FMAs them into the M x R dot products
//   (every x row loaded once per R weight vectors); the K tail and the horizontal sums in scalar.
// - More rows (prefill chunks): OUTS rows of W are widened once into a scratch (OUTS·K floats, in L1/L2), then
//   swept over the x rows four at a time: a 4 x OUTS tile of dot products along K, each weight and x vector
//   loaded once into a register per step (4 + OUTS loads for 4·OUTS FMAs); a row tail one row at a time.
// - Tasks over output features on ONNX Runtime's intra-op threads; x is read by every task (it is small beside
//   W at decode and shared in L3 at prefill).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int64_t OUTS = 6;      // scratch rows of W per sweep: 4·6 accumulators + 6 + 1 of AVX-512's 32 registers
constexpr int64_t GEMV_RS = 4;   // W rows per GEMV step, any M <= 4: 16 accumulators + 4 + 1
#else
constexpr int64_t LANES = 8;
constexpr int64_t OUTS = 3;      // 4·3 + 3 + 1 = 16 ymm registers
constexpr int64_t GEMV_RS = 2;   // at M = 4: 8 accumulators + 2 + 1
#endif
constexpr int64_t DECODE_ROWS = 4;  // rows the GEMV path takes
constexpr int64_t TASK_ROWS = 64;   // W rows (output features) per task: 128 KB of bf16 at K = 1024

typedef float Vec __attribute__((vector_size(4 * LANES), aligned(4)));  // unaligned loads and stores
typedef uint16_t Bf16s __attribute__((vector_size(2 * LANES), aligned(2)));
typedef uint32_t Bits __attribute__((vector_size(4 * LANES)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec widen(const uint16_t* p) {  // LANES bf16 -> fp32, exact
  Bf16s h;
  std::memcpy(&h, p, sizeof h);
  const Bits u = __builtin_convertvector(h, Bits) << 16;
  Vec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float widen(uint16_t b) { return __builtin_bit_cast(float, uint32_t(b) << 16); }

// v held in a register: g++ otherwise folds a vector's load into every FMA that uses it (see moe_mxfp4's
// kernel: the sweep became load-bound)
inline void in_register(Vec& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

inline float lanes(Vec v) {
  float sum = 0.f;
  for (int64_t i = 0; i < LANES; ++i) sum += v[i];
  return sum;
}

struct Work {
  const float* x;     // [M, K]
  const uint16_t* w;  // [N, K] bf16 bits
  float* y;           // [M, N]
  int64_t M, N, K;
};

// y[m N + n + r] for r < R, m < M: rows n .. n+R-1 of W against every x row, W widened in registers
template <int M, int R>
void gemv_step(const Work& t, int64_t n) {
  const int64_t K = t.K;
  const uint16_t* w = t.w + n * K;
  Vec acc[M][R] = {};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = widen(w + r * K + k);
      in_register(wv[r]);
    }
    for (int m = 0; m < M; ++m) {
      Vec xv = load(t.x + m * K + k);
      in_register(xv);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = lanes(acc[m][r]);
      for (int64_t j = k; j < K; ++j) s += t.x[m * K + j] * widen(w[r * K + j]);
      t.y[m * t.N + n + r] = s;
    }
  }
}

template <int M>
void gemv(void* user, size_t task) {
  const Work& t = *static_cast<const Work*>(user);
  const int64_t lo = int64_t(task) * TASK_ROWS, hi = std::min(t.N, lo + TASK_ROWS);
  int64_t n = lo;
  for (; n + GEMV_RS <= hi; n += GEMV_RS) gemv_step<M, GEMV_RS>(t, n);
  for (; n < hi; ++n) gemv_step<M, 1>(t, n);
}

// y[r N + j] for j < n (<= OUTS), rows r of x: the widened W rows s (OUTS rows, K floats apart) against every
// x row, four at a time, then one
void sweep(const Work& t, const float* s, int64_t n, float* y) {
  const int64_t K = t.K, kv = K / LANES * LANES;
  int64_t r = 0;
  for (; r + 4 <= t.M; r += 4) {
    Vec acc[4][OUTS] = {};
    for (int64_t k = 0; k < kv; k += LANES) {
      Vec v[OUTS];
      for (int64_t j = 0; j < OUTS; ++j) {
        v[j] = load(s + j * K + k);
        in_register(v[j]);
      }
      for (int64_t i = 0; i < 4; ++i) {
        Vec x = load(t.x + (r + i) * K + k);
        in_register(x);
        for (int64_t j = 0; j < OUTS; ++j) acc[i][j] += x * v[j];
      }
    }
    for (int64_t i = 0; i < 4; ++i) {
      const float* xr = t.x + (r + i) * K;
      for (int64_t j = 0; j < n; ++j) {
        float sum = lanes(acc[i][j]);
        for (int64_t k = kv; k < K; ++k) sum += xr[k] * s[j * K + k];
        y[(r + i) * t.N + j] = sum;
      }
    }
  }
  for (; r < t.M; ++r) {
    const float* xr = t.x + r * K;
    Vec acc[OUTS] = {};
    for (int64_t k = 0; k < kv; k += LANES) {
      const Vec x = load(xr + k);
      for (int64_t j = 0; j < OUTS; ++j) acc[j] += x * load(s + j * K + k);
    }
    for (int64_t j = 0; j < n; ++j) {
      float sum = lanes(acc[j]);
      for (int64_t k = kv; k < K; ++k) sum += xr[k] * s[j * K + k];
      y[r * t.N + j] = sum;
    }
  }
}

void gemm(void* user, size_t task) {
  const Work& t = *static_cast<const Work*>(user);
  const int64_t lo = int64_t(task) * TASK_ROWS, hi = std::min(t.N, lo + TASK_ROWS), K = t.K;
  std::vector<float> scratch(OUTS * K);
  for (int64_t o = lo; o < hi; o += OUTS) {
    const int64_t n = std::min(OUTS, hi - o);
    for (int64_t j = 0; j < OUTS; ++j) {  // a tail repeats its last row (computed, not stored)
      const uint16_t* w = t.w + (o + std::min(j, n - 1)) * K;
      float* s = scratch.data() + j * K;
      int64_t k = 0;
      for (; k + LANES <= K; k += LANES) {
        const Vec v = widen(w + k);
        std::memcpy(s + k, &v, sizeof v);
      }
      for (; k < K; ++k) s[k] = widen(w[k]);
    }
    sweep(t, scratch.data(), n, t.y + o);
  }
}

// LinearBF16(x [..., K] float, weight [N, K] bfloat16) -> y [..., N] float
struct LinearBF16Kernel {
  static constexpr const char* name = "LinearBF16";
  static constexpr size_t inputs = 2, outputs = 1;
  static constexpr bool variadic_input = false, variadic_output = false;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
  }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

  LinearBF16Kernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0), w = ctx.GetInput(1);
    std::vector<int64_t> shape = shape_of(x);
    const std::vector<int64_t> ws = shape_of(w);
    if (shape.empty() || ws.size() != 2 || ws[1] != shape.back())
      throw Ort::Exception("k3::LinearBF16: x " + dims(shape) + " and weight " + dims(ws) +
                               ": expected [..., K] and [N, K]",
                           ORT_INVALID_ARGUMENT);
    const int64_t K = ws[1], N = ws[0];
    const int64_t M = K ? int64_t(x.GetTensorTypeAndShapeInfo().GetElementCount()) / K : 0;
    shape.back() = N;
    float* y = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    if (M == 0 || N == 0) return;
    if (K == 0) {
      std::fill(y, y + M * N, 0.f);
      return;
    }
    Work t{x.GetTensorData<float>(), reinterpret_cast<const uint16_t*>(w.GetTensorRawData()), y, M, N, K};
    const size_t tasks = size_t((N + TASK_ROWS - 1) / TASK_ROWS);
    static_assert(DECODE_ROWS == 4, "the GEMV path dispatches 1 to 4 rows");
    switch (M) {
      case 1: return ctx.ParallelFor(gemv<1>, tasks, 0, &t);
      case 2: return ctx.ParallelFor(gemv<2>, tasks, 0, &t);
      case 3: return ctx.ParallelFor(gemv<3>, tasks, 0, &t);
      case 4: return ctx.ParallelFor(gemv<4>, tasks, 0, &t);
      default: return ctx.ParallelFor(gemm, tasks, 0, &t);
    }
  }
};

CpuOp<LinearBF16Kernel> linear_bf16_op;

}  // namespace

void k3x_add_linear_bf16(Ort::CustomOpDomain& k3, Ort::CustomOpDomain&) { k3.Add(&linear_bf16_op); }
