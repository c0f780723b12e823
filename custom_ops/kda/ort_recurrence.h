// The gated delta rule's CPU recurrence, shared by the k3::KDA kernel (custom_ops/kda/ort_kernel.cc: B sequences of
// T rows each, the batch interface) and the k3::KDAPacked kernel (custom_ops/kda_packed/ort_kernel.cc: B sequences
// packed end to end over the rows of a serving step): fp32, one task per (sequence, head, block of VB state
// columns) running every row of its sequence. Per row t of sequence b, head h, state S [K, V] (from
// pool[slots[b], h]):
//   S = diag(exp(g_t)) S;  e = beta_t (v_t - S^T k_t);  S = S + k_t e^T;  o_t = S^T (scale q_t)
//   final_state[b, h] = S after the sequence's last row (the pool is only read)
// Header-only, internal linkage; include it after ort_kernel.h. The build (runtime/ort_kernels.py) puts
// custom_ops/ on the include path and keys the library by every header there.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// state columns per task: four vectors per row, so the sums over rows run as four independent FMA chains (one
// 16-wide chain waited on its FMA latency: 1.9x slower); S[:, block] is K x VB floats, in L1 (64 columns,
// 32 KB at K = 128, filled a 32 KB L1 on an AVX2 Zen 3: 32 columns there ran 0.87-0.96x the time)
#ifdef __AVX512F__
constexpr int64_t VB = 64;
#else
constexpr int64_t VB = 32;
#endif

struct Packed {
  const float *q, *k, *v, *decay, *beta, *pool;  // decay: exp(g), [N, H, K]
  const int64_t *cu, *slots;
  float *o, *final_state;
  int64_t H, K, V, blocks;  // blocks: column blocks per head, ceil(V / VB)
  float scale;
};

struct Decay {
  const float* g;
  float* decay;
  int64_t width;  // H * K
};

void decay_row(void* user, size_t row) {  // exp(g) of one [H, K] row, once for every column block
  const Decay& d = *static_cast<const Decay*>(user);
  const int64_t width = d.width;
  const float* in = d.g + int64_t(row) * width;
  float* out = d.decay + int64_t(row) * width;
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = exp_approx(in[i]);
}

// e = beta_t (v_t - acc) on the block's w real columns (the padding columns stay 0)
void error_row(const Packed& p, int64_t row, int64_t j0, int64_t w, const float* acc, float* e) {
  const float bt = p.beta[row];
  const float* v = p.v + row * p.V + j0;
  for (int64_t c = 0; c < VB; ++c) e[c] = c < w ? bt * (v[c] - acc[c]) : 0.f;
}

// A sequence of one row (a decode step) on a full block of columns: S read from the pool twice (the second
// time from the caches) and the update stored straight to final_state, with no copy of S in and out (the copy in alone
// took ~60 % of a decode task; 32 one-token sequences at K = V = 128, one thread on a Zen 3, 9 layers' pools:
// 10.2-10.7 -> 7.2 us a sequence and head, 7.5 -> 3.6-3.9 us with one pool, which the L3 holds).
// The same operations as run_block's first and last sweeps, so the same values: the rank-1 updates are written
// as std::fma in both, not left to the compiler's contraction (`r * di + ki * e` contracted the other way and
// differed in the last bit from the sweeps; a sequence's two rows in one step must equal two one-row steps).
void one_row(const Packed& p, const float* s0, float* final_state, int64_t row, int64_t j0) {
  const int64_t K = p.K, V = p.V;
  const float *q = p.q + row * K, *k = p.k + row * K, *d = p.decay + row * K;
  float acc[VB] = {}, e[VB], out[VB] = {};
  for (int64_t i = 0; i < K; ++i) {
    const float *r = s0 + i * V, di = d[i], ki = k[i];
#pragma omp simd
    for (int64_t c = 0; c < VB; ++c) acc[c] += ki * (r[c] * di);
  }
  error_row(p, row, j0, VB, acc, e);
#ifdef __AVX512F__
  // final_state with streaming stores where its rows are 64-byte aligned: it is not read again in this call, so
  // its lines are not read in first (by count, a layer's state traffic 1.5 -> 1 MB at K = V = 128); the same operations
  if (V % 16 == 0 && reinterpret_cast<uintptr_t>(final_state) % 64 == 0) {
    __m512 ev[VB / 16], ov[VB / 16];
    for (int u = 0; u < VB / 16; ++u) {
      ev[u] = _mm512_loadu_ps(e + 16 * u);
      ov[u] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < K; ++i) {
      const float* r = s0 + i * V;
      const __m512 di = _mm512_set1_ps(d[i]), ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i] * p.scale);
      for (int u = 0; u < VB / 16; ++u) {
        const __m512 x = _mm512_fmadd_ps(ki, ev[u], _mm512_mul_ps(_mm512_loadu_ps(r + 16 * u), di));
        ov[u] = _mm512_fmadd_ps(qi, x, ov[u]);  // out += qi * x as g++ contracts the loop below (one FMA)
        _mm512_stream_ps(final_state + i * V + 16 * u, x);
      }
    }
    for (int u = 0; u < VB / 16; ++u) _mm512_storeu_ps(out + 16 * u, ov[u]);
    _mm_sfence();  // the streamed state ordered before whatever reads it after this call
    std::copy(out, out + VB, p.o + row * V + j0);
    return;
  }
#endif
  for (int64_t i = 0; i < K; ++i) {
    const float *r = s0 + i * V, di = d[i], ki = k[i], qi = q[i] * p.scale;
    float* f = final_state + i * V;
#pragma omp simd
    for (int64_t c = 0; c < VB; ++c) {
      const float x = std::fma(ki, e[c], r[c] * di);
      out[c] += qi * x;
      f[c] = x;
    }
  }
  std::copy(out, out + VB, p.o + row * V + j0);
}

// The columns of S evolve independently (the decay and k act on rows; e_j reads column j only), so a task
// runs every row of its sequence on one block of VB columns, which stays in L1 (the whole [K, V] state, 64 KB
// at K = V = 128, went through L2). One sweep over S per row, storing each row once: token t's update and
// output, then token t+1's decay and S^T k (a sweep per half stored every row twice: the stores bound it).
void run_block(void* user, size_t task) {
  const Packed& p = *static_cast<const Packed*>(user);
  const int64_t H = p.H, K = p.K, V = p.V, jb = int64_t(task) % p.blocks, bh = int64_t(task) / p.blocks;
  const int64_t b = bh / H, h = bh % H, j0 = jb * VB, w = std::min(VB, V - j0);
  const int64_t first = p.cu[b], end = p.cu[b + 1];
  const float* s0 = p.pool + (p.slots[b] * H + h) * K * V;
  float* final_state = p.final_state + (b * H + h) * K * V;
  if (end - first == 1 && w == VB) return one_row(p, s0 + j0, final_state + j0, first * H + h, j0);
  std::vector<float> s(K * VB);  // S[i, j0 + c] at s[i * VB + c]
  for (int64_t i = 0; i < K; ++i)
    for (int64_t c = 0; c < VB; ++c) s[i * VB + c] = c < w ? s0[i * V + j0 + c] : 0.f;
  float e[VB] = {};
  if (first < end) {  // the first row's decay and S^T k
    const int64_t row = first * H + h;
    const float *k = p.k + row * K, *d = p.decay + row * K;
    float acc[VB] = {};
    for (int64_t i = 0; i < K; ++i) {
      float* r = s.data() + i * VB;
      const float di = d[i], ki = k[i];
#pragma omp simd
      for (int64_t c = 0; c < VB; ++c) {
        r[c] *= di;
        acc[c] += ki * r[c];
      }
    }
    error_row(p, row, j0, w, acc, e);
  }
  for (int64_t t = first; t < end; ++t) {
    const int64_t row = t * H + h, next = row + H;
    const float *q = p.q + row * K, *k = p.k + row * K;
    float out[VB] = {}, acc[VB] = {};
    if (t + 1 < end) {
      const float *k1 = p.k + next * K, *d1 = p.decay + next * K;
      for (int64_t i = 0; i < K; ++i) {
        float* r = s.data() + i * VB;
        const float ki = k[i], qi = q[i] * p.scale, di = d1[i], k1i = k1[i];
#pragma omp simd
        for (int64_t c = 0; c < VB; ++c) {
          const float x = std::fma(ki, e[c], r[c]);  // token t's rank-1 update
          out[c] += qi * x;                  // its output reads the updated state
          r[c] = x * di;                     // token t+1's decay
          acc[c] += k1i * r[c];              // and its S^T k
        }
      }
    } else {
      for (int64_t i = 0; i < K; ++i) {
        float* r = s.data() + i * VB;
        const float ki = k[i], qi = q[i] * p.scale;
#pragma omp simd
        for (int64_t c = 0; c < VB; ++c) {
          r[c] = std::fma(ki, e[c], r[c]);
          out[c] += qi * r[c];
        }
      }
    }
    std::copy(out, out + w, p.o + row * V + j0);
    if (t + 1 < end) error_row(p, next, j0, w, acc, e);
  }
  for (int64_t i = 0; i < K; ++i) std::copy(s.data() + i * VB, s.data() + i * VB + w, final_state + i * V + j0);
}

// exp(g) for every row of g [N, H·K], then every (sequence, head, column block) task of p (p.decay is set to
// the exp(g) buffer), on the kernel context's intra-op threads
inline void run_recurrence(Ort::KernelContext& ctx, Packed& p, const float* g, int64_t N, int64_t B) {
  std::vector<float> decay(N * p.H * p.K);
  Decay exp_g{g, decay.data(), p.H * p.K};
  if (N > 0) ctx.ParallelFor(decay_row, size_t(N), 0, &exp_g);
  p.decay = decay.data();
  if (B * p.H * p.blocks > 0) ctx.ParallelFor(run_block, size_t(B * p.H * p.blocks), 0, &p);
}

}  // namespace
