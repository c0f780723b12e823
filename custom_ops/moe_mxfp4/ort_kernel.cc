// k3::MoEMXFP4 on ONNX Runtime's CPU provider, fp32 math on the packed experts as they are stored. Compiled into
// the custom-op library by runtime/ort_kernels.py, which calls k3x_add_moe_mxfp4. Its function body (onnx.py)
// decodes every hit expert's nibbles to fp32 with about ten graph ops per call before its GEMMs; here:
//
// - Routing (sigmoid router, biased top-k, renormalised unbiased weights, another rank's experts weigh 0) and the
//   stable sort of the (token, slot) pairs by expert are the dense MoE kernel's (`route`, custom_ops/ort_kernel.h).
//   The router GEMM [N, d] x [E, d]^T is here too, eight experts a pass: the only work that grows with E (E·d MACs
//   and E·d fp32 bytes per token; at d = 1024, top-4 of 256 experts, ~15 % of a one-token call on k3-bench's
//   expert shapes, its bytes from memory).
// - Only the hit experts' bytes are read: tasks are (hit expert, chunk of CHUNK output features).
// - The weights are decoded inside the GEMM: a block of 32 E2M1 codes (16 bytes) becomes 32 floats through a
//   16-entry table of 2·E2M1 (integers: an int8 byte shuffle under AVX2) times the block's power of two
//   2^(byte-128), exact like the codec's decode (every E2M1 value times a power of two is an fp32 number); the
//   low and high nibbles' values interleaved back into element order (two byte unpacks). An expert with at most
//   FUSED_ROWS rows (a decode step) FMAs the decoded registers straight into its dot products (under AVX-512 its
//   rows split into even and odd elements once a call); with more rows each OUTS output features are decoded once
//   into a small scratch (OUTS·K floats, in L1) and swept over the rows four at a time.
// - SiTU-GLU as the dense kernel's (`situ_glu_span`), SiLU-GLU a·σ(a)·u; each pair's row weighted and its
//   token's k slots summed in slot order (the dense MoECombine's order).
// - activations="mxfp8": both GEMM inputs (the expert's rows of z, the GLU output h) rounded through MXFP8 first,
//   custom_ops/moe_mxfp4/mxfp8.py's rule (bit for bit: each step is exact but the one rounding to E4M3, done with
//   the same ties-to-even; a block with a NaN or an infinity becomes NaN).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;     // elements per E8M0 scale (MXFP4 weights, MXFP8 activations)
constexpr int64_t CHUNK = 32;     // output features per task
constexpr int64_t FUSED_ROWS = 4;  // rows an expert may have for the register-decoded path
constexpr int64_t TOKENS = 8;     // tokens per combine task
constexpr int64_t INLINE_ROWS = 16;  // rows gathered (and GLU outputs finished) on the calling thread

constexpr int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // 2·E2M1 by code

// 2^(byte - 128) by E8M0 byte (the half folds the table's factor 2); 255 gives infinity, as the codec's 2^128
struct Scales {
  float of[256];
  Scales() {
    for (int b = 0; b < 255; ++b) of[b] = std::ldexp(1.f, b - 128);
    of[255] = INFINITY;
  }
};
const Scales scales;

#if !defined(__AVX2__)
// the 32 weights of a block (16 bytes): element 2j in byte j's low nibble, 2j + 1 in its high one
void decode_block(const uint8_t* b, float s, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[2 * j] = float(E2M1_X2[b[j] & 15]) * s;
    w[2 * j + 1] = float(E2M1_X2[b[j] >> 4]) * s;
  }
}
#endif

// One expert's packed matrix: row o of [O, K] is packed[o K/2 ..] (two codes a byte) and scale[o K/32 ..].
struct Packed {
  const uint8_t *packed, *scale;
  int64_t K;
};

#if defined(__AVX2__)
inline void decode_avx2(const uint8_t* b, float s, __m256 w[4]) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(E2M1_X2)), low = _mm_set1_epi8(15);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
  const __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
  const __m128i lo = _mm_unpacklo_epi8(even, odd), hi = _mm_unpackhi_epi8(even, odd);  // elements 0-15, 16-31
  const __m256 sv = _mm256_set1_ps(s);
  w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), sv);
  w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), sv);
  w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), sv);
  w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), sv);
}
#endif

// out[r ldo + o - lo] = a_r . W_o for o in [lo, hi), R <= FUSED_ROWS rows a (K apart): each block decoded
// in registers and used at once
#if defined(__AVX512F__)
// With AVX-512 a block's 16 bytes become its 32 weights in two table lookups of 16 floats (vpermps reads an
// index's low four bits: a byte's low nibble as it is, its high one shifted down), the even elements' and the odd
// ones', never interleaved: the rows of a are split into their even and odd elements once per call instead. A
// block's two products are summed and scaled by its power of two at once (one FMA), and four output features a
// pass share each x load, their accumulators in registers. ~9 instructions a block
// where the AVX2 path's byte shuffles, unpacks and conversions take ~25 (one-token k3-bench expert shapes, one
// thread, caches warm on the 2-core EPYC, load 1.4-1.8: 158-180 -> 109-142 us a k3-bench call, d 1024, L 512,
// I 256, top 4 of 16). The rows come split (`split_row`) once a call for all its tasks, where each task split
// them before (a k3-bench decode call in the int8 trunk's step: 69-74 -> 62-65 us, three interleaved runs).
constexpr bool SPLIT_ROWS = true;

// row a [K] as the fused GEMM reads it: its even elements, then its odd ones
void split_row(const float* a, int64_t K, float* out) {
  const int64_t half = K / 2;
  for (int64_t j = 0; j < half; ++j) {
    out[j] = a[2 * j];
    out[half + j] = a[2 * j + 1];
  }
}

template <int R>
void gemm_fused(const float* split, const Packed& W, int64_t lo, int64_t hi, float* out, int64_t ldo) {
  constexpr int OB = 4;  // output features a pass: OB·R accumulators and 2R x vectors in 32 zmm registers
  const int64_t K = W.K, half = K / 2, KB = K / BLOCK;  // split: R rows K apart (`split_row`)
  const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f, 0.f, -1.f, -2.f, -3.f, -4.f, -6.f,
                                      -8.f, -12.f);  // 2·E2M1 by code, as E2M1_X2
  for (int64_t o = lo; o < hi; o += OB) {  // OB output features at once: each x vector loaded once for them
    const uint8_t* p[OB];
    const uint8_t* sc[OB];
    for (int j = 0; j < OB; ++j) {  // a tail repeats the last feature (computed, not stored)
      const int64_t oj = std::min(o + j, hi - 1);
      p[j] = W.packed + oj * half;
      sc[j] = W.scale + oj * KB;
    }
    __m512 acc[OB][R];
    for (int j = 0; j < OB; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      __m512 xe[R], xo[R];
      for (int r = 0; r < R; ++r) {
        xe[r] = _mm512_loadu_ps(split + r * K + b * 16);
        xo[r] = _mm512_loadu_ps(split + r * K + half + b * 16);
        in_register(xe[r]);  // g++ loaded them again for each feature's FMAs
        in_register(xo[r]);
      }
      for (int j = 0; j < OB; ++j) {
        // the next pass's feature: with the caches evicted (a decode step's experts come from memory) the
        // node took 260 -> 208 us on one thread (one pass ahead, two, four and eight measured alike)
        _mm_prefetch(reinterpret_cast<const char*>(p[j] + OB * half + b * 16), _MM_HINT_T0);
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j] + b * 16)));
        const __m512 even = _mm512_permutexvar_ps(idx, table);
        const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
        const __m512 s = _mm512_set1_ps(scales.of[sc[j][b]]);
        for (int r = 0; r < R; ++r)
          acc[j][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(odd, xo[r], _mm512_mul_ps(even, xe[r])), s, acc[j][r]);
      }
    }
    for (int j = 0; j < OB && o + j < hi; ++j)
      for (int r = 0; r < R; ++r) out[r * ldo + o + j - lo] = _mm512_reduce_add_ps(acc[j][r]);
  }
}
#else
constexpr bool SPLIT_ROWS = false;  // the rows as they are
void split_row(const float*, int64_t, float*) {}

template <int R>
void gemm_fused(const float* a, const Packed& W, int64_t lo, int64_t hi, float* out, int64_t ldo) {
  const int64_t K = W.K;
  for (int64_t o = lo; o < hi; ++o) {
    const uint8_t *p = W.packed + o * (K / 2), *sc = W.scale + o * (K / BLOCK);
#if defined(__AVX2__)
    constexpr int A = R <= 2 ? 4 : 2;  // accumulators per row: independent FMA chains
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < A; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / BLOCK; ++b) {
      __m256 w[4];
      decode_avx2(p + b * 16, scales.of[sc[b]], w);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i)
          acc[r][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(a + r * K + b * BLOCK + 8 * i), acc[r][i % A]);
    }
    for (int r = 0; r < R; ++r) {
      __m256 sum = acc[r][0];
      for (int i = 1; i < A; ++i) sum = _mm256_add_ps(sum, acc[r][i]);
      out[r * ldo + o - lo] = hsum(sum);
    }
#else
    float sum[R] = {}, w[BLOCK];
    for (int64_t b = 0; b < K / BLOCK; ++b) {
      decode_block(p + b * 16, scales.of[sc[b]], w);
      for (int r = 0; r < R; ++r) {
        const float* ar = a + r * K + b * BLOCK;
        float s = 0.f;  // (a build without AVX2: the scalar fallback)
        for (int j = 0; j < BLOCK; ++j) s += w[j] * ar[j];
        sum[r] += s;
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo + o - lo] = sum[r];
#endif
  }
}
#endif

constexpr int64_t LANES = 8;  // floats a vector (AVX2's ymm; 16-wide vectors measured no faster on AVX-512)
typedef float Vec __attribute__((vector_size(4 * LANES), aligned(4)));  // unaligned loads and stores

inline float lanes(Vec v) {
  float sum = 0.f;
  for (int i = 0; i < LANES; ++i) sum += v[i];
  return sum;
}

// output features decoded together for the scratch path: a four-row tile's 4·OUTS accumulators, OUTS weight
// vectors and one input vector fill AVX2's 16 ymm registers (OUTS = 4 spilled: 28 -> 40-44 GMAC/s a core)
constexpr int64_t OUTS = 3;

// `rows` rows a against OUTS decoded weight rows w (K floats apart): out[r ldo + j] for j < n; four rows at
// a time (a step of LANES floats: 8 loads for 16 products, 16 accumulators), then one
void sweep(const float* a, int64_t rows, int64_t K, const float* w, float* out, int64_t ldo, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    Vec acc[4][OUTS] = {};
    for (int64_t k = 0; k < K; k += LANES) {
      Vec v[OUTS];
      for (int64_t j = 0; j < OUTS; ++j) {
        v[j] = *reinterpret_cast<const Vec*>(w + j * K + k);
        in_register(v[j]);
      }
      for (int64_t i = 0; i < 4; ++i) {
        Vec x = *reinterpret_cast<const Vec*>(a + (r + i) * K + k);
        in_register(x);
        for (int64_t j = 0; j < OUTS; ++j) acc[i][j] += x * v[j];
      }
    }
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < n; ++j) out[(r + i) * ldo + j] = lanes(acc[i][j]);
  }
  for (; r < rows; ++r) {
    Vec acc[OUTS] = {};
    for (int64_t k = 0; k < K; k += LANES) {
      const Vec x = *reinterpret_cast<const Vec*>(a + r * K + k);
      for (int64_t j = 0; j < OUTS; ++j) acc[j] += x * *reinterpret_cast<const Vec*>(w + j * K + k);
    }
    for (int64_t j = 0; j < n; ++j) out[r * ldo + j] = lanes(acc[j]);
  }
}

void decode_row(const Packed& W, int64_t o, float* w) {
  const uint8_t *p = W.packed + o * (W.K / 2), *sc = W.scale + o * (W.K / BLOCK);
  for (int64_t b = 0; b < W.K / BLOCK; ++b) {
#if defined(__AVX2__)
    __m256 v[4];
    decode_avx2(p + b * 16, scales.of[sc[b]], v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + b * BLOCK + 8 * i, v[i]);
#else
    decode_block(p + b * 16, scales.of[sc[b]], w + b * BLOCK);
#endif
  }
}

// out[r ldo + o - lo] = a_r . W_o for o in [lo, hi) and `rows` rows a (K apart); `split`: the same rows as
// `split_row` gives them (read instead of a where SPLIT_ROWS, at most FUSED_ROWS rows)
void gemm(const float* a, const float* split, int64_t rows, const Packed& W, int64_t lo, int64_t hi, float* out,
          int64_t ldo) {
  const float* fused = SPLIT_ROWS ? split : a;
  switch (rows) {
    case 1: return gemm_fused<1>(fused, W, lo, hi, out, ldo);
    case 2: return gemm_fused<2>(fused, W, lo, hi, out, ldo);
    case 3: return gemm_fused<3>(fused, W, lo, hi, out, ldo);
    case 4: return gemm_fused<4>(fused, W, lo, hi, out, ldo);
  }
  static_assert(FUSED_ROWS == 4, "gemm dispatches 1 to 4 rows to gemm_fused");
  std::vector<float> w(OUTS * W.K);
  for (int64_t o = lo; o < hi; o += OUTS) {
    const int64_t n = std::min(OUTS, hi - o);
    for (int64_t j = 0; j < OUTS; ++j) decode_row(W, o + std::min(j, n - 1), w.data() + j * W.K);  // a tail repeats
    sweep(a, rows, W.K, w.data(), out + o - lo, ldo, n);
  }
}

// x [K] rounded through MXFP8 and back in place (mxfp8.py fake_quantize), K a multiple of 32
void mxfp8_round(float* x, int64_t K) {
  for (int64_t b = 0; b < K; b += BLOCK) {
    float* v = x + b;
    float amax = 0.f;
    bool finite = true;
    for (int j = 0; j < BLOCK; ++j) {
      finite = finite && std::isfinite(v[j]);
      amax = std::max(amax, std::abs(v[j]));
    }
    if (!finite) {
      std::fill(v, v + BLOCK, NAN);
      continue;
    }
    const int32_t e = ((__builtin_bit_cast(int32_t, std::max(amax, 0x1p-120f)) >> 23) & 0xff) - 127;
    const int32_t s = std::max(e - 8, -127);              // the block's shared exponent
    const float inv = __builtin_bit_cast(float, (127 - s) << 23), scale = std::ldexp(1.f, s);  // 2^-s, 2^s
    for (int j = 0; j < BLOCK; ++j) {
      const float y = std::min(std::max(v[j] * inv, -448.f), 448.f);
      const int32_t binade = ((__builtin_bit_cast(int32_t, std::max(std::abs(y), 0x1p-6f)) >> 23) & 0xff) - 127;
      const float ulp = __builtin_bit_cast(float, (binade - 3 + 127) << 23);
      const float q = (y / ulp + 12582912.f) - 12582912.f;  // |y / ulp| <= 16: nearest, ties to even
      v[j] = q * ulp * scale;
    }
  }
}

struct Work {
  const float* z;                  // [N, L]
  const Routed* routed;
  Packed w1, w3, w2;               // this call's expert 0; expert e is e·(per-expert bytes) further
  int64_t w13_bytes, w13_scales, w2_bytes, w2_scales;
  int64_t L, I;
  bool situ, mxfp8;
  float b1, b2;
  float *zs, *h, *y;               // [M, L] rows of z in sorted order, [M, I] GLU outputs, [M, L] outputs
  float *zs_split, *h_split;       // where SPLIT_ROWS: the fused experts' rows of zs and h split (`split_row`)
  const uint8_t* fused;            // fused[i]: position i's expert has at most FUSED_ROWS rows
  std::vector<int64_t> task_expert, task_lo;
  const float* pair_w;
  float* u;
  int64_t N, k;

  Packed expert(const Packed& W, int64_t e, int64_t bytes, int64_t scale_bytes) const {
    return {W.packed + e * bytes, W.scale + e * scale_bytes, W.K};
  }
};

void gather_rows(void* user, size_t i) {  // sorted position i: its token's z (MXFP8-rounded), and split
  const Work& w = *static_cast<const Work*>(user);
  float* row = w.zs + int64_t(i) * w.L;
  std::memcpy(row, w.z + w.routed->token[i] * w.L, sizeof(float) * w.L);
  if (w.mxfp8) mxfp8_round(row, w.L);
  if (SPLIT_ROWS && w.fused[i]) split_row(row, w.L, w.zs_split + int64_t(i) * w.L);
}

void gate_up(void* user, size_t t) {  // expert e's GLU outputs for features [lo, lo + CHUNK)
  const Work& w = *static_cast<const Work*>(user);
  const int64_t e = w.task_expert[t], lo = w.task_lo[t], hi = std::min(w.I, lo + CHUNK), n = hi - lo;
  const int64_t first = w.routed->start[e], rows = w.routed->start[e + 1] - first;
  std::vector<float> a(rows * n), u(rows * n);
  const float *zs = w.zs + first * w.L, *split = w.zs_split ? w.zs_split + first * w.L : nullptr;
  gemm(zs, split, rows, w.expert(w.w1, e, w.w13_bytes, w.w13_scales), lo, hi, a.data(), n);
  gemm(zs, split, rows, w.expert(w.w3, e, w.w13_bytes, w.w13_scales), lo, hi, u.data(), n);
  for (int64_t r = 0; r < rows; ++r) {
    const float *ar = a.data() + r * n, *ur = u.data() + r * n;
    float* hr = w.h + (first + r) * w.I + lo;
    if (w.situ) {
      situ_glu_span(ar, ur, hr, 0, n, w.b1, w.b2);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) hr[i] = ar[i] * ur[i] / (1.f + exp_approx(-ar[i]));
    }
  }
}

void finish_h(void* user, size_t i) {  // GLU output row i as the down GEMM reads it: MXFP8-rounded, split
  const Work& w = *static_cast<const Work*>(user);
  float* row = w.h + int64_t(i) * w.I;
  if (w.mxfp8) mxfp8_round(row, w.I);
  if (SPLIT_ROWS && w.fused[i]) split_row(row, w.I, w.h_split + int64_t(i) * w.I);
}

void down(void* user, size_t t) {  // expert e's output features [lo, lo + CHUNK) of its rows
  const Work& w = *static_cast<const Work*>(user);
  const int64_t e = w.task_expert[t], lo = w.task_lo[t], hi = std::min(w.L, lo + CHUNK);
  const int64_t first = w.routed->start[e], rows = w.routed->start[e + 1] - first;
  const float* split = w.h_split ? w.h_split + first * w.I : nullptr;
  gemm(w.h + first * w.I, split, rows, w.expert(w.w2, e, w.w2_bytes, w.w2_scales), lo, hi, w.y + first * w.L + lo,
       w.L);
}

void combine(void* user, size_t block) {  // u[n] = sum over slots j of pair_w · its expert's output row
  const Work& w = *static_cast<const Work*>(user);
  const int64_t lo = int64_t(block) * TOKENS, hi = std::min(w.N, lo + TOKENS), L = w.L;
  for (int64_t n = lo; n < hi; ++n) {
    float* out = w.u + n * L;
    std::fill(out, out + L, 0.f);
    for (int64_t j = 0; j < w.k; ++j) {
      const int64_t pos = w.routed->pos[n * w.k + j];
      if (pos < 0) continue;  // another rank's expert
      const float pw = w.routed->w[n * w.k + j], *y = w.y + pos * L;
#pragma omp simd
      for (int64_t c = 0; c < L; ++c) out[c] += pw * y[c];
    }
  }
}

struct Router {
  const float *x, *gate;
  float* logits;
  int64_t E, d;
};

// The router reads all E_all·d fp32 gate rows on every call, from memory in a decode step (1 MB at 256 experts
// of d = 1024: 35-50 us on one core, about what one core streams from memory). It is the node's only cost that
// grows with E: with the router skipped, one node's time was flat over 16 to 256 experts (1.04x). Eight rows a
// pass (x_n loaded once for eight dot products, eight independent FMA chains, eight rows streamed at once)
// measured faster than four a pass, the earlier form (256 rows, caches cold, one core, alone: 44 -> 35 us; the
// node at 256 experts, caches evicted: 0.307 -> 0.287 ms); software prefetch of the passes ahead measured
// slower (49 us). Tasks of 32 experts: a decode step's router over 64 experts splits over two threads.
constexpr int64_t ROUTER_EXPERTS = 32;  // experts per router task
constexpr int64_t ROUTER_ROWS = 8;      // gate rows a pass

void router(void* user, size_t task) {  // logits[n, e] = x_n . gate_e for one token's block of experts
  const Router& r = *static_cast<const Router*>(user);
  const int64_t blocks = (r.E + ROUTER_EXPERTS - 1) / ROUTER_EXPERTS, n = int64_t(task) / blocks, d = r.d;
  const int64_t lo = int64_t(task) % blocks * ROUTER_EXPERTS, hi = std::min(r.E, lo + ROUTER_EXPERTS);
  const float* xn = r.x + n * d;
  float* out = r.logits + n * r.E;
  int64_t e = lo;
  for (; d % LANES == 0 && e + ROUTER_ROWS <= hi; e += ROUTER_ROWS) {
    const float* g = r.gate + e * d;
    Vec acc[ROUTER_ROWS] = {};
    for (int64_t c = 0; c < d; c += LANES) {
      Vec x = *reinterpret_cast<const Vec*>(xn + c);
      in_register(x);
      for (int64_t j = 0; j < ROUTER_ROWS; ++j) acc[j] += x * *reinterpret_cast<const Vec*>(g + j * d + c);
    }
    for (int64_t j = 0; j < ROUTER_ROWS; ++j) out[e + j] = lanes(acc[j]);
  }
  for (; e < hi; ++e) {  // the rows left (and every row when d is not a multiple of LANES)
    const float* g = r.gate + e * d;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < d; ++c) s += xn[c] * g[c];
    out[e] = s;
  }
}

// MoEMXFP4(x [N, d], z [N, L], gate_weight [E_all, d], gate_bias [E_all], w1, w3 [E, I, L/2] u8, w2 [E, L, I/2]
// u8, w1_scale, w3_scale [E, I, L/32] u8, w2_scale [E, L, I/32] u8, expert_offset [1] int32) -> u [N, L]
struct MoEMXFP4Kernel {
  static constexpr const char* name = "MoEMXFP4";
  static constexpr size_t inputs = 11, outputs = 1;
  static constexpr bool variadic_input = false, variadic_output = false;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i < 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                 : i < 10 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

  int64_t top_k;
  float factor, renormalize, b1 = 1.f, b2 = 1.f;
  bool situ, mxfp8;

  MoEMXFP4Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo i(info);
    top_k = i.GetAttribute<int64_t>("top_k");
    factor = i.GetAttribute<float>("routed_scaling_factor");
    renormalize = float(i.GetAttribute<int64_t>("renormalize") != 0);
    const std::string activation = i.GetAttribute<std::string>("activation");
    if (activation != "situ" && activation != "silu")
      fail("activation '" + activation + "': expected 'situ' or 'silu'");
    situ = activation == "situ";
    if (situ) {
      b1 = i.GetAttribute<float>("situ_beta");
      b2 = i.GetAttribute<float>("situ_linear_beta");
    }
    std::string activations = "bf16";
    try {
      activations = i.GetAttribute<std::string>("activations");
    } catch (const Ort::Exception&) {  // a node from before the attribute: activations as computed
    }
    if (activations != "bf16" && activations != "mxfp8")
      fail("activations '" + activations + "': expected 'bf16' or 'mxfp8'");
    mxfp8 = activations == "mxfp8";
  }

  [[noreturn]] static void fail(const std::string& what) {
    throw Ort::Exception("k3::MoEMXFP4: " + what, ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    std::vector<Ort::ConstValue> in;
    std::vector<std::vector<int64_t>> s;
    for (size_t i = 0; i < inputs; ++i) {
      in.push_back(ctx.GetInput(i));
      s.push_back(shape_of(in.back()));
    }
    const char* names[] = {"x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2", "w1_scale", "w3_scale",
                           "w2_scale", "expert_offset"};
    auto need = [&](size_t i, const std::vector<int64_t>& want, const char* what) {
      if (s[i] != want) fail(std::string(names[i]) + " " + dims(s[i]) + ": expected " + what + " = " + dims(want));
    };
    if (s[1].size() != 2 || s[4].size() != 3) fail("z " + dims(s[1]) + " and w1 " + dims(s[4]) +
                                                   ": expected [N, L] and [E, I, L/2]");
    const int64_t N = s[1][0], L = s[1][1], E = s[4][0], I = s[4][1];
    if (L % BLOCK || I % BLOCK)
      fail("z " + dims(s[1]) + ", w1 " + dims(s[4]) + ": L and I must be multiples of 32");
    need(4, {E, I, L / 2}, "[E, I, L/2]");
    need(5, {E, I, L / 2}, "[E, I, L/2]");
    need(6, {E, L, I / 2}, "[E, L, I/2]");
    need(7, {E, I, L / BLOCK}, "[E, I, L/32]");
    need(8, {E, I, L / BLOCK}, "[E, I, L/32]");
    need(9, {E, L, I / BLOCK}, "[E, L, I/32]");
    need(10, {1}, "one value");
    if (s[0].size() != 2 || s[0][0] != N || s[2].size() != 2 || s[2][1] != s[0][1] || s[2][0] < E)
      fail("x " + dims(s[0]) + ", gate_weight " + dims(s[2]) + ": expected [N, d] and [E_all >= " +
           std::to_string(E) + ", d] for z " + dims(s[1]));
    const int64_t d = s[0][1], E_all = s[2][0], offset = in[10].GetTensorData<int32_t>()[0];
    need(3, {E_all}, "[E_all]");
    if (top_k < 1 || top_k > E_all) fail("top_k " + std::to_string(top_k) + " outside 1.." + std::to_string(E_all));

    float* u = ctx.GetOutput(0, {N, L}).GetTensorMutableData<float>();
    if (N == 0 || L == 0) return;
    std::vector<float> logits(N * E_all);
    Router r{in[0].GetTensorData<float>(), in[2].GetTensorData<float>(), logits.data(), E_all, d};
    ctx.ParallelFor(router, size_t(N * ((E_all + ROUTER_EXPERTS - 1) / ROUTER_EXPERTS)), 0, &r);
    const Routed routed = route(logits.data(), in[3].GetTensorData<float>(), N, E_all, top_k, renormalize, factor,
                                offset, E);
    const int64_t M = routed.start[E];
    std::vector<float> zs(M * L), h(M * I), y(M * L);
    std::vector<uint8_t> fused(M, 0);
    bool any_fused = false;
    for (int64_t e = 0; e < E; ++e)
      if (routed.start[e + 1] - routed.start[e] <= FUSED_ROWS) {
        std::fill(fused.begin() + routed.start[e], fused.begin() + routed.start[e + 1], 1);
        any_fused = any_fused || routed.start[e + 1] > routed.start[e];
      }
    const bool split = SPLIT_ROWS && any_fused;  // uninitialised: only the fused experts' rows are written and read
    std::unique_ptr<float[]> zs_split(split ? new float[M * L] : nullptr);
    std::unique_ptr<float[]> h_split(split ? new float[M * I] : nullptr);
    auto packed = [&](size_t i, size_t scale, int64_t K) {
      return Packed{in[i].GetTensorData<uint8_t>(), in[scale].GetTensorData<uint8_t>(), K};
    };
    Work w{in[1].GetTensorData<float>(), &routed, packed(4, 7, L), packed(5, 8, L), packed(6, 9, I),
           I * L / 2, I * L / BLOCK, L * I / 2, L * I / BLOCK, L, I, situ, mxfp8, b1, b2,
           zs.data(), h.data(), y.data(), zs_split.get(), h_split.get(), fused.data(), {}, {}, routed.w.data(), u, N,
           top_k};
    auto rows = [&](void (*fn)(void*, size_t)) {  // fn over the M rows: a few inline, where a dispatch costs more
      if (M <= INLINE_ROWS) {
        for (int64_t i = 0; i < M; ++i) fn(&w, size_t(i));
      } else {
        ctx.ParallelFor(fn, size_t(M), 0, &w);
      }
    };
    if (M > 0) {
      rows(gather_rows);
      for (int step = 0; step < 2; ++step) {  // gate and up over I, then down over L: tasks of hit experts only
        w.task_expert.clear();
        w.task_lo.clear();
        for (int64_t e = 0; e < E; ++e)
          for (int64_t lo = 0; routed.start[e + 1] > routed.start[e] && lo < (step ? L : I); lo += CHUNK) {
            w.task_expert.push_back(e);
            w.task_lo.push_back(lo);
          }
        ctx.ParallelFor(step ? down : gate_up, w.task_expert.size(), 0, &w);
        if (step == 0 && (mxfp8 || split)) rows(finish_h);
      }
    }
    ctx.ParallelFor(combine, size_t((N + TOKENS - 1) / TOKENS), 0, &w);
  }
};

CpuOp<MoEMXFP4Kernel> moe_mxfp4_op;

}  // namespace

void k3x_add_moe_mxfp4(Ort::CustomOpDomain& k3, Ort::CustomOpDomain&) { k3.Add(&moe_mxfp4_op); }
