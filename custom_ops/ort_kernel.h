// What the ONNX Runtime CPU kernels (custom_ops/<family>/ort_kernel.cc) share: vectorisable fp32 math, an AVX
// vector's lane sum, the routed MoE's routing and SiTU-GLU (the dense and the MXFP4 expert kernels), shapes as text, a packed serving
// step's cu_seqlens / slots, checked, and the custom-op declaration. The build (runtime/ort_kernels.py) puts
// this folder on the include path. Header-only, inline, internal linkage; include it after onnxruntime_cxx_api.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

// v held in a register where it is used: g++ folds a vector's load into every FMA that uses it (a load per
// product), which left loops load-bound (moe_mxfp4's sweep: 22 GMAC/s a core against 40-45 this way; mla_paged's
// scores: 20 loads for 16 products). Any vector type (ymm, and zmm under AVX-512); a no-op without AVX.
template <class V>
inline void in_register(V& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));  // any of the 32 registers
#elif defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// x in every lane of V, a vector type of floats (ymm, or zmm under AVX-512): one broadcast. `V{} + x` adds a
// zero vector, which g++ keeps (-0 + 0 is +0): a dependent add before every use.
template <class V>
inline V splat(float x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return V(_mm512_set1_ps(x));
#endif
#if defined(__AVX__)
  if constexpr (sizeof(V) == 32) return V(_mm256_set1_ps(x));
#endif
  V v;
  for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) v[i] = x;
  return v;
}

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

// The SiTU-GLU of custom_ops/moe/reference.py `glu`, y[i] for i in [lo, hi): b1 b2 tanh(a / b1) tanh(u / b2) /
// (1 + e^-a), one division (the dense MoE's k3x.fused::SiTUGLU and the MXFP4 expert kernel)
inline void situ_glu_span(const float* a, const float* u, float* y, int64_t lo, int64_t hi, float b1, float b2) {
  const float r1 = 1.f / b1, r2 = 1.f / b2;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const Ratio t1 = tanh_ratio(a[i] * r1), t2 = tanh_ratio(u[i] * r2);
    y[i] = b1 * b2 * t1.num * t2.num / (t1.den * t2.den * (1.f + exp_approx(-a[i])));
  }
}

// The routing of custom_ops/moe/reference.py `route` and `local_ids` for N tokens over E experts, from the
// router logits [N, E]: s = sigmoid(logits); a token's k experts are the largest s + gate_bias (ties: the lower
// id, as TopK), its weights their unbiased s renormalised (w / (r (sum w + 1e-20) + 1 - r)) and scaled; an
// expert id becomes local (id - offset), another rank's (id outside 0..local_n-1) weighs 0. The (token, slot)
// pairs p = n k + j, sorted stably by local expert (the dense MoEDispatch kernel and the MXFP4 expert kernel).
struct Routed {
  std::vector<float> w;         // [N k] each pair's weight, 0 for another rank's expert
  std::vector<int64_t> ids;     // [N k] each pair's local expert, local_n for another rank's
  std::vector<int64_t> start;   // [local_n + 1] expert e's pairs are sorted positions start[e] .. start[e+1]-1
  std::vector<int64_t> pos;     // [N k] each pair's sorted position, -1 for another rank's expert
  std::vector<int64_t> token;   // [start[local_n]] sorted position -> its token
};

inline Routed route(const float* logits, const float* bias, int64_t N, int64_t E, int64_t k, float r, float scale,
                    int64_t offset, int64_t local_n) {
  Routed out{std::vector<float>(N * k), std::vector<int64_t>(N * k), std::vector<int64_t>(local_n + 1, 0),
             std::vector<int64_t>(N * k), {}};
  std::vector<int64_t> counts(local_n + 1, 0);
  std::vector<float> s(E), biased(E);
  std::vector<char> taken(E);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) {
      s[e] = 1.f / (1.f + std::exp(-logits[n * E + e]));
      biased[e] = s[e] + bias[e];
      taken[e] = 0;
    }
    float total = 0.f;
    for (int64_t j = 0; j < k; ++j) {  // k passes: the largest not yet taken, the lower id on ties
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || biased[e] > biased[best])) best = e;
      taken[best] = 1;
      out.w[n * k + j] = s[best];
      total += s[best];
      const int64_t id = best - offset;
      out.ids[n * k + j] = id >= 0 && id < local_n ? id : local_n;
      ++counts[out.ids[n * k + j]];
    }
    const float denom = r * (total + 1e-20f) + (1.f - r);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = n * k + j;
      out.w[p] = out.ids[p] < local_n ? out.w[p] / denom * scale : 0.f;
    }
  }
  for (int64_t e = 0; e < local_n; ++e) out.start[e + 1] = out.start[e] + counts[e];
  std::vector<int64_t> next(out.start.begin(), out.start.end() - 1);
  out.token.resize(out.start[local_n]);
  for (int64_t p = 0; p < N * k; ++p) {  // stable counting sort by local id
    const int64_t e = out.ids[p];
    out.pos[p] = e == local_n ? -1 : next[e]++;
    if (e < local_n) out.token[out.pos[p]] = p / k;
  }
  return out;
}

#if defined(__AVX__)
// the sum of a vector's eight lanes (the MXFP4 and int8 kernels' AVX2 dot products, mla_paged's scores)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

inline std::string dims(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

inline std::vector<int64_t> shape_of(const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); }

// A kernel's input check: an ORT_INVALID_ARGUMENT "<op>: <what>" unless `ok`
inline void require(const std::string& op, bool ok, const std::string& what) {
  if (!ok) throw Ort::Exception(op + ": " + what, ORT_INVALID_ARGUMENT);
}

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

// The custom op of `Kernel`, made once (it must outlive every session that uses it)
template <class Kernel>
const OrtCustomOp* cpu_op() {
  static CpuOp<Kernel> op;
  return &op;
}

// A projection group's arities: Group<2> .. Group<MAX_GROUP>, one op type each (custom_ops/fused.py
// LINEAR_GROUP_ARITIES), added to `domain` by add_groups<Group>(domain)
constexpr size_t MAX_GROUP = 8;
template <template <size_t> class Group, size_t... I>
void add_arities(Ort::CustomOpDomain& domain, std::index_sequence<I...>) {
  (domain.Add(cpu_op<Group<I + 2>>()), ...);
}
template <template <size_t> class Group>
void add_groups(Ort::CustomOpDomain& domain) {
  add_arities<Group>(domain, std::make_index_sequence<MAX_GROUP - 1>());
}

// A projection family's kernels: Kernel<1> its k3 op (Family::names[1]), Kernel<P> for P = 2..MAX_GROUP its
// k3x.fused group ops (names[P]). Inputs: x (fp32), then Family::per_part a part (part_input_type(j) the j-th's
// type); one fp32 output a part. Compute runs Family::run(ctx, op, P), `op` the node's domain and name for errors.
template <class Family>
struct Projections {
  template <size_t P>
  struct Kernel {
    static constexpr const char* name = Family::names[P];
    static constexpr size_t inputs = 1 + Family::per_part * P, outputs = P;
    static constexpr bool variadic_input = false, variadic_output = false;
    static ONNXTensorElementDataType input_type(size_t i) {
      return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : Family::part_input_type((i - 1) % Family::per_part);
    }
    static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

    Kernel(const OrtApi&, const OrtKernelInfo*) {}

    void Compute(OrtKernelContext* context) {
      static const std::string op = std::string(P == 1 ? "k3::" : "k3x.fused::") + name;  // built once
      Ort::KernelContext ctx(context);
      Family::run(ctx, op, P);
    }
  };

  static void add(Ort::CustomOpDomain& k3, Ort::CustomOpDomain& fused) {  // every arity, each in its domain
    k3.Add(cpu_op<Kernel<1>>());
    add_groups<Kernel>(fused);
  }
};

// The tasks of several parts in one ParallelFor (a grouped call's projections, one pool dispatch for all): part
// i's tasks are [first[i], first[i + 1]), each run as fn[i](&items[i], its index within the part).
template <class Item>
struct Parts {
  std::vector<Item> items;
  std::vector<void (*)(void*, size_t)> fn;
  std::vector<size_t> first{0};
  void add(const Item& item, void (*f)(void*, size_t), size_t tasks) {
    items.push_back(item);
    fn.push_back(f);
    first.push_back(first.back() + tasks);
  }
  size_t tasks() const { return first.back(); }
  static void run(void* user, size_t index) {
    Parts& p = *static_cast<Parts*>(user);
    size_t i = 0;
    while (index >= p.first[i + 1]) ++i;  // a handful of parts: a linear search
    p.fn[i](&p.items[i], index - p.first[i]);
  }
};

}  // namespace
