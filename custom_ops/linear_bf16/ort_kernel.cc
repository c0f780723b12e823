// k3::LinearBF16 on ONNX Runtime's CPU provider: y [..., N] = x [..., K] . W^T, W [N, K] bf16 as stored, fp32
// activations and fp32 accumulation (reference.py). Compiled into the custom-op library by runtime/ort_kernels.py,
// which calls k3x_add_linear_bf16. The function body (onnx.py) runs MLAS on a widened fp32 copy of W; here W
// stays bf16 in memory, so a decode step streams half the bytes.
//
// - A bf16 is the high half of an fp32: widening is a zero-extension to 32 bits and a 16-bit left shift, exact.
//   The activations are never rounded to bf16 (no vdpbf16ps), so the only rounding is fp32 accumulation's.
// - Vectors are GCC vector extensions of LANES floats: 16 (zmm) where the build's -march has AVX-512F, else 8
//   (a ymm; two xmm halves without AVX): the same code, correct on any x86-64 target the build names
//   (intrinsics only where AVX2 / AVX-512F are defined, each with a generic form beside it).
// - M <= DECODE_ROWS rows (decode): a GEMV streaming W once, in order. Each task is a block of TASK_ROWS
//   output features, one row at a time (gemv_row: why not several at once), its weights widened in registers
//   and FMAed into every x row's dot product; the lanes summed four vectors at once (sums4), the K tail in
//   scalar. At M = 1 it streams W as fast as a plain sum reads memory (26-28 GB/s a core); at M = 2 to 4 it
//   loads M x vectors per weight vector, which bounds it below that (M = 4: about the time of MLAS's fp32 MatMul
//   on the same weights; neither four interleaved rows, a widened scratch of four rows nor the GEMM's panels
//   did better there).
// - More rows (prefill chunks): each task is a panel of NR output features. Per block of KC along K, the panel's
//   W is widened into a scratch transposed, [KC][NR] fp32 (LANES x LANES blocks transposed in registers), and
//   MR rows of x at a time are broadcast a value a step against its two vectors: an MR x NR tile of y in
//   registers, no horizontal sums, the tile carried over the K blocks through y. At 5 to 32 rows this measured
//   within 10 % of a 4 x 4 tile of dot products along K over a row-major scratch (no transposition), either
//   way, and faster at 128 rows and short K (1.2x of MLAS against 1.5x at K = 256: the dot products' horizontal
//   sums are per output, whatever K), so it is the one path.
// - Tasks on ONNX Runtime's intra-op threads; x is read by every task (small beside W at decode, in L2/L3 at
//   prefill).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int64_t MR = 12;      // x rows per GEMM tile: 12·2 accumulators + 2 panel vectors + a broadcast
#else
constexpr int64_t LANES = 8;
constexpr int64_t MR = 6;       // 6·2 + 2 + 1
#endif
constexpr int64_t DECODE_ROWS = 4;  // rows the GEMV path takes
constexpr int64_t TASK_ROWS = 64;   // W rows (output features) per GEMV task: 128 KB of bf16 at K = 1024
constexpr int64_t NR = 2 * LANES;   // output features per GEMM panel
constexpr int64_t KC = 512;         // K per panel block: NR·KC floats (64 KB at NR = 32; 256 measured 2-5 % slower)

typedef float Vec __attribute__((vector_size(4 * LANES), aligned(4)));  // unaligned loads and stores
typedef uint16_t Bf16s __attribute__((vector_size(2 * LANES), aligned(2)));
typedef uint32_t Bits __attribute__((vector_size(4 * LANES)));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Vec widen(const uint16_t* p) {  // LANES bf16 -> fp32, exact
#if defined(__AVX512F__)  // one vpmovzxwd (g++ splits the generic form below into two halves)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  Bf16s h;
  std::memcpy(&h, p, sizeof h);
  const Bits u = __builtin_convertvector(h, Bits) << 16;
  Vec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

inline float widen(uint16_t b) { return __builtin_bit_cast(float, uint32_t(b) << 16); }

// out[j] = the sum of v[j]'s lanes, j < 4: each vector folded to 8 lanes, then three horizontal adds and a fold
// of their halves give the four sums at once (~3 instructions a sum, against ~30 summing one vector's lanes)
inline void sums4(const Vec v[4], float out[4]) {
#if defined(__AVX__)
  __m256 h[4];
  for (int j = 0; j < 4; ++j) {
#if defined(__AVX512F__)
    const __m512 z = __m512(v[j]);
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
#else
    h[j] = __m256(v[j]);
#endif
  }
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));  // [a b c d | a b c d]
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int j = 0; j < 4; ++j) {
    out[j] = 0.f;
    for (int64_t i = 0; i < LANES; ++i) out[j] += v[j][i];
  }
#endif
}

struct Work {
  const float* x;     // [M, K]
  const uint16_t* w;  // [N, K] bf16 bits
  float* y;           // [M, N]
  int64_t M, N, K;
};

// y[m N + n] for m < M: row n of W against every x row, U vectors of the row a step, each widened once and FMAed
// into every x row's U independent accumulators. One row at a time, so W is read in order: rows n, n + 1, ..
// follow each other in memory and the prefetchers keep up (four rows interleaved at the same k, four streams
// 2 KB apart at K = 1024, streamed at less than half the rate on the Zen 4 machine, 11 GB/s a core against 26,
// and still 20 with the next rows prefetched in order).
template <int M>
void gemv_row(const Work& t, int64_t n) {
  constexpr int U = 4;
  const int64_t K = t.K;
  const uint16_t* w = t.w + n * K;
  Vec acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = Vec{};
  int64_t k = 0;
  for (; k + U * LANES <= K; k += U * LANES) {
    for (int u = 0; u < U; ++u) {
      Vec wv = widen(w + k + u * LANES);
      in_register(wv);
      for (int m = 0; m < M; ++m) acc[m][u] += load(t.x + m * K + k + u * LANES) * wv;
    }
  }
  for (; k + LANES <= K; k += LANES) {
    const Vec wv = widen(w + k);
    for (int m = 0; m < M; ++m) acc[m][0] += load(t.x + m * K + k) * wv;
  }
  for (int m = 0; m < M; ++m) {
    float s[4];
    sums4(acc[m], s);
    float sum = (s[0] + s[1]) + (s[2] + s[3]);
    for (int64_t j = k; j < K; ++j) sum += t.x[m * K + j] * widen(w[j]);
    t.y[m * t.N + n] = sum;
  }
}

template <int M>
void gemv(void* user, size_t task) {
  const Work& t = *static_cast<const Work*>(user);
  const int64_t lo = int64_t(task) * TASK_ROWS, hi = std::min(t.N, lo + TASK_ROWS);
  for (int64_t n = lo; n < hi; ++n) gemv_row<M>(t, n);
}

// c[i ldc + j] (+)= sum over k < kc of x[i ldx + k] · p[k NR + j], i < R, j < NR: R rows of x broadcast against
// the panel's two vectors a step; `first` starts from 0, else from c
template <int R>
void micro(const float* x, int64_t ldx, const float* p, int64_t kc, float* c, int64_t ldc, bool first) {
  Vec acc[R][2];
  for (int i = 0; i < R; ++i) {
    acc[i][0] = first ? Vec{} : load(c + i * ldc);
    acc[i][1] = first ? Vec{} : load(c + i * ldc + LANES);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const Vec b0 = load(p + k * NR), b1 = load(p + k * NR + LANES);
    for (int i = 0; i < R; ++i) {
      const Vec a = splat<Vec>(x[i * ldx + k]);
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
    }
  }
  for (int i = 0; i < R; ++i) {
    std::memcpy(c + i * ldc, &acc[i][0], sizeof(Vec));
    std::memcpy(c + i * ldc + LANES, &acc[i][1], sizeof(Vec));
  }
}

typedef int32_t Index __attribute__((vector_size(4 * LANES)));

// one butterfly stage of an in-register transpose: rows i and i + B (i's bit B clear) trade their off-diagonal
// B-blocks; after the stages B = 1, 2, 4, .. LANES/2, v[i][l] holds the input's v[l][i]
template <int B>
void trade(Vec v[LANES]) {
  Index lo, hi;
  for (int l = 0; l < LANES; ++l) {
    lo[l] = l & B ? LANES + l - B : l;
    hi[l] = l & B ? LANES + l : l + B;
  }
  for (int i = 0; i < LANES; ++i) {
    if (i & B) continue;
    const Vec a = v[i], b = v[i + B];
    v[i] = __builtin_shuffle(a, b, lo);
    v[i + B] = __builtin_shuffle(a, b, hi);
  }
}

// panel[k NR + j] = W[n0 + j, k0 + k] for j < NR, k < kc, widened (rows from n0 + cols on repeat the last one):
// LANES x LANES blocks widened a row at a time and transposed in registers, the K tail one by one
void pack(const uint16_t* W, int64_t K, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float* panel) {
  const int64_t kv = kc / LANES * LANES;
  for (int64_t j0 = 0; j0 < NR; j0 += LANES) {
    const uint16_t* rows[LANES];
    for (int64_t i = 0; i < LANES; ++i) rows[i] = W + (n0 + std::min(j0 + i, cols - 1)) * K + k0;
    for (int64_t k = 0; k < kv; k += LANES) {
      Vec v[LANES];
      for (int64_t i = 0; i < LANES; ++i) v[i] = widen(rows[i] + k);
      trade<1>(v);
      trade<2>(v);
      trade<4>(v);
      if constexpr (LANES == 16) trade<LANES / 2>(v);
      for (int64_t i = 0; i < LANES; ++i) std::memcpy(panel + (k + i) * NR + j0, &v[i], sizeof(Vec));
    }
    for (int64_t k = kv; k < kc; ++k)
      for (int64_t i = 0; i < LANES; ++i) panel[k * NR + j0 + i] = widen(rows[i][k]);
  }
}

template <int R = MR>
void micro_rows(int64_t rows, const float* x, int64_t ldx, const float* p, int64_t kc, float* c, int64_t ldc,
                bool first) {
  if constexpr (R > 1) {
    if (rows < R) return micro_rows<R - 1>(rows, x, ldx, p, kc, c, ldc, first);
  }
  micro<R>(x, ldx, p, kc, c, ldc, first);
}

void gemm(void* user, size_t task) {  // output features [n0, n0 + NR) of every row
  const Work& t = *static_cast<const Work*>(user);
  const int64_t n0 = int64_t(task) * NR, cols = std::min(NR, t.N - n0), K = t.K;
  std::unique_ptr<float[]> panel(new float[std::min(KC, K) * NR]), tile(new float[MR * NR]);  // uninitialised
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    pack(t.w, K, n0, cols, k0, kc, panel.get());
    for (int64_t m0 = 0; m0 < t.M; m0 += MR) {
      const int64_t rows = std::min(MR, t.M - m0);
      float* y = t.y + m0 * t.N + n0;
      if (cols == NR) {
        micro_rows(rows, t.x + m0 * K + k0, K, panel.get(), kc, y, t.N, k0 == 0);
        continue;
      }
      for (int64_t i = 0; i < rows; ++i) std::memcpy(tile.get() + i * NR, y + i * t.N, sizeof(float) * cols);
      micro_rows(rows, t.x + m0 * K + k0, K, panel.get(), kc, tile.get(), NR, k0 == 0);
      for (int64_t i = 0; i < rows; ++i) std::memcpy(y + i * t.N, tile.get() + i * NR, sizeof(float) * cols);
    }
  }
}

// y_i [..., N_i] = x [..., K] . W_i^T for each of the call's `parts` weights (inputs 1 + i, output i), every
// part's tasks in one ParallelFor. `op` names the node in errors, and a group's weight by its index.
void linear_bf16(Ort::KernelContext& ctx, const std::string& op, size_t parts) {
  auto x = ctx.GetInput(0);
  std::vector<int64_t> shape = shape_of(x);
  const int64_t K = shape.empty() ? 0 : shape.back();
  const int64_t M = K ? int64_t(x.GetTensorTypeAndShapeInfo().GetElementCount()) / K : 0;
  Parts<Work> run;
  for (size_t i = 0; i < parts; ++i) {
    auto w = ctx.GetInput(1 + i);
    const std::vector<int64_t> ws = shape_of(w);
    if (shape.empty() || ws.size() != 2 || ws[1] != K)
      throw Ort::Exception(op + ": x " + dims(shape) + " and weight" + (parts == 1 ? "" : " " + std::to_string(i)) +
                               " " + dims(ws) + ": expected [..., K] and [N, K]",
                           ORT_INVALID_ARGUMENT);
    const int64_t N = ws[0];
    shape.back() = N;
    float* y = ctx.GetOutput(i, shape).GetTensorMutableData<float>();
    if (M == 0 || N == 0) continue;
    if (K == 0) {
      std::fill(y, y + M * N, 0.f);
      continue;
    }
    const Work t{x.GetTensorData<float>(), reinterpret_cast<const uint16_t*>(w.GetTensorRawData()), y, M, N, K};
    static_assert(DECODE_ROWS == 4, "the GEMV path dispatches 1 to 4 rows");
    constexpr void (*GEMV[DECODE_ROWS])(void*, size_t) = {gemv<1>, gemv<2>, gemv<3>, gemv<4>};
    if (M <= DECODE_ROWS)
      run.add(t, GEMV[M - 1], size_t((N + TASK_ROWS - 1) / TASK_ROWS));
    else
      run.add(t, gemm, size_t((N + NR - 1) / NR));
  }
  if (run.tasks()) ctx.ParallelFor(Parts<Work>::run, run.tasks(), 0, &run);
}

// P = 1: k3::LinearBF16(x [..., K] float, weight [N, K] bfloat16) -> y [..., N] float.
// P = 2..8: k3x.fused::LinearBF16Group<P>(x, weight_0, .., weight_{P-1}) -> y_0 .. y_{P-1} (op types
// LinearBF16Group2 .. LinearBF16Group8): P LinearBF16s of one x (custom_ops/fused.py), each y_i as the
// one-projection kernel gives it (the same tasks, the same sums), every projection's tasks in one dispatch to
// the threads.
struct LinearBF16s {
  static constexpr const char* names[MAX_GROUP + 1] = {"", "LinearBF16", "LinearBF16Group2", "LinearBF16Group3",
                                                       "LinearBF16Group4", "LinearBF16Group5", "LinearBF16Group6",
                                                       "LinearBF16Group7", "LinearBF16Group8"};
  static constexpr size_t per_part = 1;  // weight_i
  static ONNXTensorElementDataType part_input_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16; }
  static void run(Ort::KernelContext& ctx, const std::string& op, size_t parts) { linear_bf16(ctx, op, parts); }
};

}  // namespace

void k3x_add_linear_bf16(Ort::CustomOpDomain& k3, Ort::CustomOpDomain& fused) {
  Projections<LinearBF16s>::add(k3, fused);
}
