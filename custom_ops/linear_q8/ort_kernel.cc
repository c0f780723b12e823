// k3::LinearQ8 on ONNX Runtime's CPU provider: y [..., N] = x [..., K] through 8-bit block-quantised weights
// (reference.py `linear_q8`): each row of x quantised per block of BLOCK along K (scale absmax / 127, code
// round-half-even(x / scale) clamped to +-127, a zero block scale 0 and codes 0, the last block zero-padded); each
// block's dot product of codes an exact int32; times the two blocks' scales ((dot * x scale) * w scale, as the
// reference), summed over the blocks in fp32. Only that sum's order differs from the reference (and from MLAS's
// MatMulNBits, the function body). Compiled into the custom-op library by runtime/ort_kernels.py, which calls
// k3x_add_linear_q8.
//
// - Weights uint8 [N, KB, BLOCK] (code 128 is zero), scales fp32 [N, KB]; BLOCK is the weight's last dimension
//   (the node's block_size), any multiple of 4 (else an Ort::Exception naming it).
// - The activations are quantised once per call, before any task: int8 codes [M, KB·BLOCK], their scales
//   [M, KB] and 128 · each block's sum of codes [M, KB] (the VNNI path's correction). K values a row: cheap.
// - A block's integer dot product, 32 weights a 256-bit step, by what the build's -march has:
//   AVX512_VNNI + VL (or AVX-VNNI): vpdpbusd of the uint8 weights and the int8 codes, less 128 · the codes' sum
//   (exact: Σ (w - 128) a = Σ w a - 128 Σ a); AVX2: the weights xor 0x80 (int8, -128..127), vpmaddubsw of their
//   magnitudes and the codes with their signs (|w| a: two products a pair, at most 2 · 128 · 127 < 32767, no
//   saturation), vpmaddwd by ones; else a scalar loop. Eight blocks' eight-lane sums are reduced to one vector of
//   eight block sums (hadd tree), scaled by the x and w scale vectors and added to eight fp32 lanes (the last
//   KB % 8 blocks: one more reduce, scaled one by one); BLOCK a multiple of 32 takes that path, other blocks the
//   per-block loop (`dot_any`); measured with the last blocks on that loop, K = 128 (four blocks) N = 1024 took
//   62-67 us a node against 18-20 now (2 threads, cold weights). Both paths are also compiled for BLOCK = 32 as a
//   constant (the trunk's): one thread's CPU time a node fell 1.7-1.9x at four rows, ~15 % at one row and
//   ~25 % in the GEMM against the block size read at run time.
// - Decode (M <= 4 rows, the GEMV): tasks of TASK_COLS output features (weight rows), each weight row read in
//   order, against every x row (re-read from L1 per row), so W streams once. Calls with less than SERIAL_BYTES
//   of weights x rows (N <= 85 at K = 1024, one row) run on the calling thread: on the 2-core machine, under another
//   process's load, N = 8 to 64 measured the same either way and N >= 128 gained from the second core when it
//   was free; staying off the pool below that spares a wake-up. Software prefetch 2 KB ahead measured no gain.
// - Prefill (M > 4, the GEMM, AVX2 and up; the scalar build keeps the GEMV's row passes): tasks of NC = 16
//   features packed into a panel (pack: 4-byte groups transposed so that one vector holds a group of each of
//   the 16 features), against all M rows (or GEMM_ROWS-row spans where N has fewer than 16 panels) in tiles of
//   4 rows x 16 features: a broadcast group of codes against the panel's two vectors a step, the block's int32
//   dot products in lanes, no horizontal sums; measured against MatMulNBits in docs/model.md §6.1.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TASK_COLS = 64;        // weight rows per task: 68 KB of weights at K = 1024, BLOCK = 32
constexpr int64_t TASK_ROWS = 64;        // x rows per task (the scalar build's prefill)
constexpr int64_t RB = 4;                // x rows a pass over a weight row
constexpr int64_t SERIAL_BYTES = 96 << 10;  // weight bytes x rows below which a call stays on one thread
constexpr int ZERO = 128;                // the weights' code of 0

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool VNNI = true;  // dot32 is Σ w a: less the block's 128 Σ a
#else
constexpr bool VNNI = false;  // dot32 is Σ (w - 128) a
#endif

struct Work {
  const int8_t* codes;   // [M, KP] activation codes, KP = KB · BLOCK, zero-padded
  const float* xs;       // [M, KB] activation scales
  const int32_t* corr;   // [M, KB] 128 · each block's sum of codes
  const uint8_t* w;      // [N, KB, BLOCK]
  const float* ws;       // [N, KB]
  float* y;              // [M, N]
  int64_t M, N, KB, BLOCK;
  int64_t row_tasks;     // tasks along M: task = col_task · row_tasks + row_task
};

// Σ (w[i] - 128) a[i] over n values: exact in int32 (n · 128 · 127 < 2^31 for any n below 132,000)
inline int32_t dot_any(const uint8_t* w, const int8_t* a, int64_t n) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += (int32_t(w[i]) - ZERO) * int32_t(a[i]);
  return s;
}

#if defined(__AVX2__)
// acc + per lane j: the dot product of the lane's four bytes of `w` (VNNI: as uint8, vpdpbusd's unsigned side;
// else as int8, w - 128, through vpmaddubsw on |w| and the codes with w's signs: 2 · 128 · 127 < 32767, no
// saturation) and its four codes of `a`
inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, a);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, a);
#else
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

constexpr int W_XOR = VNNI ? 0 : 0x80;  // what dot4's weight bytes are: w (VNNI) or w - 128 (w xor 0x80)

// acc + the eight 4-byte groups' dot products of 32 weights and 32 codes (VNNI: Σ w a; else Σ (w - 128) a)
inline __m256i dot32(__m256i acc, const uint8_t* w, const int8_t* a) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return dot4(acc, _mm256_xor_si256(wv, _mm256_set1_epi8(char(W_XOR))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
}

// lane j = the sum of v[j]'s eight lanes
inline __m256i reduce8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
#endif

// y[m, n] for m in [m0, m0 + R): weight row n against R rows of codes; BS the block size when it is known at
// compile time (32, the trunk's), else 0
template <int R, int BS>
void dot_rows(const Work& t, int64_t n, int64_t m0) {
  const int64_t KB = t.KB, BLOCK = BS ? BS : t.BLOCK, KP = KB * BLOCK;
  const uint8_t* w = t.w + n * KP;
  const float* ws = t.ws + n * KB;
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const int8_t* a = t.codes + m * KP;
    const float* xs = t.xs + m * KB;
    int64_t b = 0;
    float sum = 0.f;
#if defined(__AVX2__)
    if (BLOCK % 32 == 0) {
      __m256 acc = _mm256_setzero_ps();
      for (; b + 8 <= KB; b += 8) {
        __m256i v[8];
        for (int j = 0; j < 8; ++j) {
          v[j] = _mm256_setzero_si256();
          for (int64_t i = 0; i < BLOCK; i += 32) v[j] = dot32(v[j], w + (b + j) * BLOCK + i, a + (b + j) * BLOCK + i);
        }
        __m256i d = reduce8(v);
        if constexpr (VNNI) d = _mm256_sub_epi32(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.corr + m * KB + b)));
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(xs + b));
        acc = _mm256_fmadd_ps(p, _mm256_loadu_ps(ws + b), acc);
      }
      sum = hsum(acc);
      if (b < KB) {  // the last KB % 8 blocks: one more reduce, the absent blocks' sums zero
        const int64_t rest = KB - b;
        __m256i v[8];
        for (int j = 0; j < 8; ++j) {
          v[j] = _mm256_setzero_si256();
          for (int64_t i = 0; j < rest && i < BLOCK; i += 32)
            v[j] = dot32(v[j], w + (b + j) * BLOCK + i, a + (b + j) * BLOCK + i);
        }
        int32_t d[8];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), reduce8(v));
        for (int64_t j = 0; j < rest; ++j)
          sum += float(VNNI ? d[j] - t.corr[m * KB + b + j] : d[j]) * xs[b + j] * ws[b + j];
        b = KB;
      }
    }
#endif
    for (; b < KB; ++b) sum += float(dot_any(w + b * BLOCK, a + b * BLOCK, BLOCK)) * xs[b] * ws[b];
    t.y[m * t.N + n] = sum;
  }
}

// dot_rows for 1 to RB rows, the block size a constant 32 (the trunk's) or read at run time
static_assert(RB == 4, "the row tables below hold 1 to 4 rows");
using DotRows = void (*)(const Work&, int64_t, int64_t);
constexpr DotRows DOT_ROWS_32[RB] = {dot_rows<1, 32>, dot_rows<2, 32>, dot_rows<3, 32>, dot_rows<4, 32>};
constexpr DotRows DOT_ROWS[RB] = {dot_rows<1, 0>, dot_rows<2, 0>, dot_rows<3, 0>, dot_rows<4, 0>};

void task(void* user, size_t index) {
  const Work& t = *static_cast<const Work*>(user);
  const int64_t ct = int64_t(index) / t.row_tasks, rt = int64_t(index) % t.row_tasks;
  const int64_t n0 = ct * TASK_COLS, n1 = std::min(t.N, n0 + TASK_COLS);
  const int64_t r0 = rt * TASK_ROWS, r1 = std::min(t.M, r0 + TASK_ROWS);
  const auto rows_of = t.BLOCK == 32 ? DOT_ROWS_32 : DOT_ROWS;
  for (int64_t m = r0; m < r1; m += RB)
    for (int64_t n = n0; n < n1; ++n) rows_of[std::min(RB, r1 - m) - 1](t, n, m);
}

#if defined(__AVX2__)
constexpr int64_t NC = 16;          // output features per GEMM panel: two vectors of eight
constexpr int64_t GEMM_ROWS = 256;  // x rows per GEMM task where N has fewer than 16 panels

// features [n0, n0 + NC) (the last one repeated past N) as a panel [KB][BLOCK / 4][NC][4] bytes, each 4-byte group
// of a block the NC features' side by side (one vector a group for dot4), and their scales [KB][NC]: the weights'
// [NC][KP / 4] groups transposed, eight features by eight groups in registers
void pack(const Work& t, int64_t n0, uint8_t* panel, float* scales) {
  const int64_t KB = t.KB, KP = KB * t.BLOCK, Q = KP / 4;
  const __m256i flip = _mm256_set1_epi8(char(W_XOR));
  for (int64_t j0 = 0; j0 < NC; j0 += 8) {
    const uint8_t* rows[8];
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t n = std::min(n0 + j0 + j, t.N - 1);
      rows[j] = t.w + n * KP;
      for (int64_t b = 0; b < KB; ++b) scales[b * NC + j0 + j] = t.ws[n * KB + b];
    }
    int64_t q = 0;
    for (; q + 8 <= Q; q += 8) {
      __m256i r[8], u[8];
      for (int j = 0; j < 8; ++j)
        r[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + 4 * q)), flip);
      for (int j = 0; j < 8; j += 2) {
        u[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
        u[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
      }
      for (int j = 0; j < 8; j += 4) {
        r[j] = _mm256_unpacklo_epi64(u[j], u[j + 2]);
        r[j + 1] = _mm256_unpackhi_epi64(u[j], u[j + 2]);
        r[j + 2] = _mm256_unpacklo_epi64(u[j + 1], u[j + 3]);
        r[j + 3] = _mm256_unpackhi_epi64(u[j + 1], u[j + 3]);
      }
      for (int i = 0; i < 4; ++i) {  // r[i] holds groups i, i + 4 of features 0-3, r[i + 4] of features 4-7
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((q + i) * NC + j0) * 4),
                            _mm256_permute2x128_si256(r[i], r[i + 4], 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + ((q + i + 4) * NC + j0) * 4),
                            _mm256_permute2x128_si256(r[i], r[i + 4], 0x31));
      }
    }
    for (; q < Q; ++q)
      for (int64_t j = 0; j < 8; ++j) {
        uint32_t v;
        std::memcpy(&v, rows[j] + 4 * q, 4);
        v ^= W_XOR * 0x01010101u;
        std::memcpy(panel + ((q * NC) + j0 + j) * 4, &v, 4);
      }
  }
}

// an R x NC tile of y, rows [m0, m0 + R) and features [n0, n0 + NC): per block, R x 2 int32 vectors of exact dot
// products (R broadcast groups of codes against the panel's two vectors a step), then scaled and added to R x 2
// fp32 vectors, lane j the feature n0 + 8c + j
template <int R, int BS>
void tile(const Work& t, const uint8_t* panel, const float* scales, int64_t m0, int64_t n0) {
  const int64_t KB = t.KB, BLOCK = BS ? BS : t.BLOCK, G = BLOCK / 4, KP = KB * BLOCK;
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m256i d[R][2];
    for (int r = 0; r < R; ++r)
      d[r][0] = d[r][1] = VNNI ? _mm256_set1_epi32(-t.corr[(m0 + r) * KB + b]) : _mm256_setzero_si256();
    const uint8_t* p = panel + b * G * NC * 4;
    for (int64_t g = 0; g < G; ++g) {
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g * NC * 4));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g * NC * 4 + 32));
      for (int r = 0; r < R; ++r) {
        int32_t group;
        std::memcpy(&group, t.codes + (m0 + r) * KP + b * BLOCK + 4 * g, 4);
        const __m256i a = _mm256_set1_epi32(group);
        d[r][0] = dot4(d[r][0], p0, a);
        d[r][1] = dot4(d[r][1], p1, a);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(scales + b * NC), s1 = _mm256_loadu_ps(scales + b * NC + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(t.xs[(m0 + r) * KB + b]);
      f[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d[r][0]), xs), s0, f[r][0]);
      f[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d[r][1]), xs), s1, f[r][1]);
    }
  }
  const int64_t cols = std::min(NC, t.N - n0);
  for (int r = 0; r < R; ++r) {
    float out[NC];
    _mm256_storeu_ps(out, f[r][0]);
    _mm256_storeu_ps(out + 8, f[r][1]);
    std::memcpy(t.y + (m0 + r) * t.N + n0, out, sizeof(float) * size_t(cols));
  }
}

// tile for 1 to RB rows, the block size a constant 32 or read at run time
using Tile = void (*)(const Work&, const uint8_t*, const float*, int64_t, int64_t);
constexpr Tile TILES_32[RB] = {tile<1, 32>, tile<2, 32>, tile<3, 32>, tile<4, 32>};
constexpr Tile TILES[RB] = {tile<1, 0>, tile<2, 0>, tile<3, 0>, tile<4, 0>};

void gemm(void* user, size_t index) {  // a panel of NC features against M / row_tasks rows
  const Work& t = *static_cast<const Work*>(user);
  const int64_t rows = (t.M + t.row_tasks - 1) / t.row_tasks;
  const int64_t n0 = int64_t(index) / t.row_tasks * NC, r0 = int64_t(index) % t.row_tasks * rows;
  const int64_t r1 = std::min(t.M, r0 + rows);
  std::vector<uint8_t> panel(size_t(t.KB * t.BLOCK * NC));
  std::vector<float> scales(size_t(t.KB * NC));
  pack(t, n0, panel.data(), scales.data());
  const auto tiles = t.BLOCK == 32 ? TILES_32 : TILES;
  for (int64_t m = r0; m < r1; m += RB) tiles[std::min(RB, r1 - m) - 1](t, panel.data(), scales.data(), m, n0);
}
#endif

// row m of x [M, K] -> its codes [KP] (zero-padded), scales [KB] and 128 · block sums [KB], as reference.py
// `quantize_activations` in fp32: scale = absmax / 127, code = nearest-even(x / scale) clamped to +-127
void quantise_row(const float* x, int64_t K, int64_t KB, int64_t BLOCK, int8_t* codes, float* xs, int32_t* corr) {
  for (int64_t b = 0; b < KB; ++b) {
    const int64_t lo = b * BLOCK, n = std::min(BLOCK, K - lo);
    float amax = 0.f, inf_nan = 0.f;  // x - x: 0 for a finite value, NaN for a NaN or an infinity
#pragma omp simd reduction(max : amax) reduction(+ : inf_nan)
    for (int64_t i = 0; i < n; ++i) {
      amax = std::max(amax, std::abs(x[lo + i]));
      inf_nan += x[lo + i] - x[lo + i];
    }
    // a block holding a NaN or an infinity: its scale NaN, so the row's outputs are NaN as the reference's (the
    // codes' conversion to int8 is undefined for them)
    const float scale = inf_nan == 0.f ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    xs[b] = scale;
    int32_t s = 0;
    if (scale > 0.f) {
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < n; ++i) {
        const float q = std::min(std::max(std::nearbyint(x[lo + i] / scale), -127.f), 127.f);
        codes[lo + i] = int8_t(q);
        s += int32_t(q);
      }
    } else {
      std::memset(codes + lo, 0, size_t(n));
    }
    std::memset(codes + lo + n, 0, size_t(BLOCK - n));
    corr[b] = ZERO * s;
  }
}

struct Quantise {
  const float* x;
  int8_t* codes;
  float* xs;
  int32_t* corr;
  int64_t K, KB, BLOCK;
};

void quantise_task(void* user, size_t m) {  // one row of a prefill call's x
  const Quantise& q = *static_cast<const Quantise*>(user);
  const int64_t KP = q.KB * q.BLOCK;
  quantise_row(q.x + int64_t(m) * q.K, q.K, q.KB, q.BLOCK, q.codes + int64_t(m) * KP, q.xs + int64_t(m) * q.KB,
               q.corr + int64_t(m) * q.KB);
}

// y_i [..., N_i] = x [..., K] through (weight_i [N_i, KB, BLOCK] uint8, scales_i [N_i, KB] float) for each of
// the call's `parts` pairs (inputs 1 + 2i, 2 + 2i; output i): x quantised once for them all (one KB and BLOCK),
// every part's tasks in one ParallelFor. `op` names the node in errors, and a group's pair by its index.
void linear_q8(Ort::KernelContext& ctx, const std::string& op, size_t parts) {
  auto x = ctx.GetInput(0);
  std::vector<int64_t> shape = shape_of(x);
  int64_t KB = 0, BLOCK = 0, K = shape.empty() ? 0 : shape.back();
  std::vector<const uint8_t*> ws(parts);
  std::vector<const float*> ss(parts);
  std::vector<int64_t> Ns(parts);
  for (size_t i = 0; i < parts; ++i) {
    auto w = ctx.GetInput(1 + 2 * i), s = ctx.GetInput(2 + 2 * i);
    const std::string which = parts == 1 ? "" : " " + std::to_string(i);
    const std::vector<int64_t> wshape = shape_of(w), sshape = shape_of(s);
    const bool fits = !shape.empty() && wshape.size() == 3 && sshape == std::vector<int64_t>{wshape[0], wshape[1]} &&
                      wshape[1] >= 1 && (wshape[1] - 1) * wshape[2] < K && K <= wshape[1] * wshape[2];
    if (!fits)
      throw Ort::Exception(op + ": x " + dims(shape) + ", weight" + which + " " + dims(wshape) + " and scales" +
                               which + " " + dims(sshape) +
                               ": expected [..., K], [N, ceil(K / block), block] and [N, ceil(K / block)]",
                           ORT_INVALID_ARGUMENT);
    if (wshape[2] % 4)
      throw Ort::Exception(op + ": block size " + std::to_string(wshape[2]) + " (weight" + which + " " + dims(wshape) +
                               "): the kernel takes a multiple of 4",
                           ORT_INVALID_ARGUMENT);
    if (i > 0 && (wshape[1] != KB || wshape[2] != BLOCK))
      throw Ort::Exception(op + ": weight" + which + " " + dims(wshape) + " is blocked unlike weight 0 ([N, " +
                               std::to_string(KB) + ", " + std::to_string(BLOCK) +
                               "]): one call quantises x once for all",
                           ORT_INVALID_ARGUMENT);
    KB = wshape[1], BLOCK = wshape[2];
    ws[i] = w.GetTensorData<uint8_t>(), ss[i] = s.GetTensorData<float>(), Ns[i] = wshape[0];
  }
  const int64_t M = int64_t(x.GetTensorTypeAndShapeInfo().GetElementCount()) / K;
  std::vector<float*> ys(parts);
  for (size_t i = 0; i < parts; ++i) {
    shape.back() = Ns[i];
    ys[i] = ctx.GetOutput(i, shape).GetTensorMutableData<float>();
  }
  if (M == 0) return;
  const int64_t KP = KB * BLOCK;
  // the calling thread's scratch, kept between calls (no allocation nor zeroing per call: a small node's
  // fixed cost); the tasks only read it, while this call waits for them
  static thread_local std::vector<int8_t> codes;
  static thread_local std::vector<float> xs;
  static thread_local std::vector<int32_t> corr;
  codes.resize(std::max(codes.size(), size_t(M * KP)));
  xs.resize(std::max(xs.size(), size_t(M * KB)));
  corr.resize(std::max(corr.size(), size_t(M * KB)));
  Quantise q{x.GetTensorData<float>(), codes.data(), xs.data(), corr.data(), K, KB, BLOCK};
  if (M > RB) {  // a prefill's rows over the threads (M = 2,048, K = N = 1,024, 2 threads: 47.5 -> 44.5 ms a node)
    ctx.ParallelFor(quantise_task, size_t(M), 0, &q);
  } else {
    for (int64_t m = 0; m < M; ++m) quantise_task(&q, size_t(m));
  }
  Parts<Work> run;
  int64_t bytes = 0;  // weight bytes x rows
  for (size_t i = 0; i < parts; ++i) {
    const int64_t N = Ns[i];
    if (N == 0) continue;
    Work t{codes.data(), xs.data(), corr.data(), ws[i], ss[i], ys[i], M, N, KB, BLOCK, (M + TASK_ROWS - 1) / TASK_ROWS};
    bytes += N * KP * M;
#if defined(__AVX2__)
    if (M > RB) {  // rows split over tasks only where the panels alone are too few to share out
      t.row_tasks = (N + NC - 1) / NC >= 16 ? 1 : (M + GEMM_ROWS - 1) / GEMM_ROWS;
      run.add(t, gemm, size_t((N + NC - 1) / NC * t.row_tasks));
      continue;
    }
#endif
    run.add(t, task, size_t((N + TASK_COLS - 1) / TASK_COLS * t.row_tasks));
  }
  if (run.tasks() == 0) return;
#if defined(__AVX2__)
  const bool serial_ok = M <= RB;  // a prefill's GEMM always goes to the threads
#else
  const bool serial_ok = true;
#endif
  if (serial_ok && (run.tasks() == 1 || bytes < SERIAL_BYTES)) {
    for (size_t i = 0; i < run.tasks(); ++i) Parts<Work>::run(&run, i);
    return;
  }
  ctx.ParallelFor(Parts<Work>::run, run.tasks(), 0, &run);
}

// P = 1: k3::LinearQ8(x [..., K] float, weight [N, KB, BLOCK] uint8, scales [N, KB] float) -> y [..., N] float.
// P = 2..8: k3x.fused::LinearQ8Group<P>(x, weight_0, scales_0, .., weight_{P-1}, scales_{P-1}) -> y_0 .. y_{P-1}
// (op types LinearQ8Group2 .. LinearQ8Group8): P LinearQ8s of one x (custom_ops/fused.py), each y_i as the
// one-projection kernel gives it (the same tasks, the same sums), x quantised once and every projection's tasks
// in one dispatch to the threads.
struct LinearQ8s {
  static constexpr const char* names[MAX_GROUP + 1] = {"", "LinearQ8", "LinearQ8Group2", "LinearQ8Group3",
                                                       "LinearQ8Group4", "LinearQ8Group5", "LinearQ8Group6",
                                                       "LinearQ8Group7", "LinearQ8Group8"};
  static constexpr size_t per_part = 2;  // weight_i, scales_i
  static ONNXTensorElementDataType part_input_type(size_t j) {
    return j == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  static void run(Ort::KernelContext& ctx, const std::string& op, size_t parts) { linear_q8(ctx, op, parts); }
};

}  // namespace

void k3x_add_linear_q8(Ort::CustomOpDomain& k3, Ort::CustomOpDomain& fused) {
  Projections<LinearQ8s>::add(k3, fused);
}
