// k3::MLAPaged on ONNX Runtime's CPU provider, fp32: absorbed MLA attention over the paged latent cache, each
// query row reading only its own sequence's keys (the function body in onnx.py pads the sequences to the
// step's longest, concatenates and transposes the queries, masks and unpads: ~60 graph ops, a third of an MLA
// layer's time on a k3-bench prefill). Compiled into the custom-op library by runtime/ort_kernels.py, which calls
// k3x_add_mla_paged. Sequence b's key j is its past position j < P = past_lens[b] (pool row j % BS of block
// block_table[b, j / BS]) or this step's row cu_seqlens[b] + j - P of `latent`; query row t (local) sees keys
// 0..P + t:
//   s_j = scale (q_latent . key_j[:C] + q_rope . key_j[C:]),  o = sum_j softmax(s)_j key_j[:C]
// One task per (sequence, head, block of up to QB rows); keys in blocks of KB with an online softmax, so a task's
// scratch is QB x KB scores whatever the context length (a 1 M-position past included).
// Also k3x.fused::LatentAttention (custom_ops/fused.py): the batch interface's attention over the latent cache
// (model/mla.py `forward`), q [B, M, L] (M = H T rows, head-major: row r is query position r % T), present
// [B, S, L], hidden [T, S] bool (True: key s is hidden from position t), scale:
//   s_j = scale q_r . present_j (j not hidden),  o_r = sum_j softmax(s)_j present_j   (all L columns)
// on the same loops: one task per (batch element, block of 8 rows, chunk of keys), keys up to the last one a row
// of the block sees (a causal prefill's task skips the keys after its rows); a step of few row blocks (decode) is
// split over chunks of >= CHUNK keys, their partial sums merged after (flash-decoding), so both threads stream
// half the cache. ONNX Runtime's MatMuls for the body pack the
// whole cache for a decode step's 8 rows and ran on one thread each, with a copy of the cache's C columns
// between them: what made a decode step grow with the context. And k3x.fused::LatentAttentionAppend: the same
// over present = Concat(past, latent), which it writes, each task copying its key chunk's rows before reading
// them (LatentKernel below).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include "ort_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t QB = 4;    // query rows per task: each key row loaded once for QB dot products
constexpr int64_t KB = 128;  // keys per online-softmax block

struct Attention {
  const float *q_latent, *q_rope, *latent, *pool;
  const int32_t* table;  // [B, MB]
  const int64_t *cu, *past;
  float* o;
  int64_t H, C, R, BS, MB;
  float scale;
  std::vector<int64_t> task_seq, task_row;  // per task: its sequence and first local row (head = task % H)
};

// key j of sequence b (L = C + R floats)
const float* key(const Attention& a, int64_t b, int64_t j) {
  const int64_t L = a.C + a.R, P = a.past[b];
  if (j < P) return a.pool + (int64_t(a.table[b * a.MB + j / a.BS]) * a.BS + j % a.BS) * L;
  return a.latent + (a.cu[b] + j - P) * L;
}

typedef float Vec __attribute__((vector_size(32), aligned(4)));  // 8 floats, unaligned loads and stores

// a * b + c, one rounding where the target has FMA (-march decides), written out rather than left to the
// compiler's contraction (g++'s default contracts a * b + c, scalar or vector; other compilers and flags need
// not): the loops below are a multiply and an add per element, twice as many instructions without it
inline Vec fmadd(Vec a, Vec b, Vec c) {
#ifdef __FMA__
  return __builtin_ia32_vfmaddps256(a, b, c);
#else
  return a * b + c;
#endif
}

float lanes(Vec v) {  // ort_kernel.h's hsum: the halves' sum, then the quarters' (eight scalar adds in a chain before)
#if defined(__AVX__)
  return hsum(reinterpret_cast<__m256>(v));
#else
  float sum = 0.f;
  for (int i = 0; i < 8; ++i) sum += v[i];
  return sum;
#endif
}

// s[r, j..j+NK) for QB rows and NK keys: QB x NK sums in registers, a step of 8 floats loading NK + QB vectors
// for QB x NK products
template <int NK>
void score_keys(const float* q, int64_t L, const float* const* k, float* s) {
  Vec a[QB][NK] = {};
  int64_t l = 0;
  for (; l + 8 <= L; l += 8) {
    Vec kv[NK];
    for (int i = 0; i < NK; ++i) {
      kv[i] = *reinterpret_cast<const Vec*>(k[i] + l);
      in_register(kv[i]);
    }
    for (int64_t r = 0; r < QB; ++r) {
      Vec x = *reinterpret_cast<const Vec*>(q + r * L + l);
      in_register(x);
      for (int i = 0; i < NK; ++i) a[r][i] = fmadd(x, kv[i], a[r][i]);
    }
  }
  for (int64_t r = 0; r < QB; ++r)
    for (int i = 0; i < NK; ++i) {
      float sum = lanes(a[r][i]);
      for (int64_t t = l; t < L; ++t) sum += q[r * L + t] * k[i][t];
      s[r * KB + i] = sum;
    }
}

// s[r, j] = q_r . key_j over L floats (rows x KB), for the rows' scaled queries q (rows x L) and the block's
// `width` keys. Four rows by two keys at once: a step of 8 floats loads 6 vectors for 8 products (a key at a
// time loaded 5 for 4: ~5 % slower); by four keys where there are 32 vector registers (LatentAttention's
// decode step: ~6 % faster than two)
void scores(const float* q, int64_t rows, int64_t L, const float* const* k, int64_t width, float* s) {
  int64_t j = 0;
  if (rows == QB) {
#ifdef __AVX512VL__  // 32 vector registers: four keys at a time (16 sums) load 8 vectors for 16 products
    for (; j + 4 <= width; j += 4) score_keys<4>(q, L, k + j, s + j);
#endif
    for (; j + 2 <= width; j += 2) score_keys<2>(q, L, k + j, s + j);
  }
  for (; j < width; ++j)  // fewer rows, or the block's odd last key
    for (int64_t r = 0; r < rows; ++r) {
      const float *qr = q + r * L, *kj = k[j];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t l = 0; l < L; ++l) sum += qr[l] * kj[l];
      s[r * KB + j] = sum;
    }
}

// acc[r, :C] += sum_j p[r, j] key_j[:C] for the block's weights p (rows x KB; a row skipped above is all 0).
// Four rows at once: 16 columns of each row's sum held in registers over the keys (8 vectors of 8), so a key's
// two vectors are loaded once for the four rows and each sum stored once per block (a load and a store of
// every row's sum per key made it load-bound: the k3-bench prefill's kernel took 1.4x the time)
void mix(const float* p, int64_t rows, int64_t width, const float* const* k, int64_t C, float* acc) {
  int64_t c0 = 0;
  if (rows == QB) {
    for (; c0 + 16 <= C; c0 += 16) {
      Vec a[QB][2] = {};
      for (int64_t j = 0; j < width; ++j) {
        const Vec k0 = *reinterpret_cast<const Vec*>(k[j] + c0), k1 = *reinterpret_cast<const Vec*>(k[j] + c0 + 8);
        for (int64_t r = 0; r < QB; ++r) {
          const Vec w = splat<Vec>(p[r * KB + j]);
          a[r][0] = fmadd(w, k0, a[r][0]);
          a[r][1] = fmadd(w, k1, a[r][1]);
        }
      }
      for (int64_t r = 0; r < QB; ++r) {
        Vec* o = reinterpret_cast<Vec*>(acc + r * C + c0);
        o[0] += a[r][0];
        o[1] += a[r][1];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // fewer rows, or the columns past the last whole 16
    float* o = acc + r * C;
    for (int64_t j = 0; j < width; ++j) {
      const float w = p[r * KB + j], *kj = k[j];
#pragma omp simd
      for (int64_t c = c0; c < C; ++c) o[c] += w * kj[c];
    }
  }
}

// One online-softmax step over a key block: the rows' scores s (rows x KB, -inf where a key is hidden) become
// their weights in place (a hidden key weighs exactly 0), and each row's running maximum `top`, `total` and
// sums `acc` (C columns) are rescaled to the new maximum. A row that has seen no visible key keeps weight 0.
void softmax_block(float* s, int64_t rows, int64_t width, float* top, float* total, float* acc, int64_t C) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * KB;
    float m = top[r];
    for (int64_t j = 0; j < width; ++j) m = std::max(m, sr[j]);
    if (m == -INFINITY) {  // no key of this block visible to the row, nor before it: it weighs nothing
      std::fill(sr, sr + width, 0.f);
      continue;
    }
    const float shrink = exp_approx(top[r] - m);  // the running sums to the new maximum (0 on the first)
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < width; ++j) {
      sr[j] = sr[j] == -INFINITY ? 0.f : exp_approx(sr[j] - m);  // a masked key weighs exactly 0
      sum += sr[j];
    }
    top[r] = m;
    total[r] = total[r] * shrink + sum;
    float* o = acc + r * C;
    for (int64_t c = 0; c < C; ++c) o[c] *= shrink;
  }
}

void attend(void* user, size_t task) {
  const Attention& a = *static_cast<const Attention*>(user);
  const int64_t H = a.H, C = a.C, R = a.R, L = C + R, h = int64_t(task) % H;
  const int64_t b = a.task_seq[task / H], t0 = a.task_row[task / H], P = a.past[b];
  const int64_t rows = std::min(QB, a.cu[b + 1] - a.cu[b] - t0), keys = P + t0 + rows;  // the last row's view
  std::vector<float> q(QB * L), acc(QB * C, 0.f), s(QB * KB), top(QB, -INFINITY), total(QB, 0.f);
  for (int64_t r = 0; r < rows; ++r) {  // scaled queries, [q_latent | q_rope], contiguous
    const int64_t n = a.cu[b] + t0 + r;
    const float *ql = a.q_latent + (n * H + h) * C, *qr = a.q_rope + (n * H + h) * R;
    for (int64_t c = 0; c < C; ++c) q[r * L + c] = a.scale * ql[c];
    for (int64_t c = 0; c < R; ++c) q[r * L + C + c] = a.scale * qr[c];
  }
  std::vector<const float*> k(KB);
  for (int64_t k0 = 0; k0 < keys; k0 += KB) {
    const int64_t width = std::min(KB, keys - k0);
    for (int64_t j = 0; j < width; ++j) k[j] = key(a, b, k0 + j);
    scores(q.data(), rows, L, k.data(), width, s.data());
    for (int64_t r = 0; r < rows; ++r)  // causal: row r sees keys up to P + t0 + r
      for (int64_t j = std::max<int64_t>(0, P + t0 + r + 1 - k0); j < width; ++j) s[r * KB + j] = -INFINITY;
    softmax_block(s.data(), rows, width, top.data(), total.data(), acc.data(), C);
    mix(s.data(), rows, width, k.data(), C, acc.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = a.o + ((a.cu[b] + t0 + r) * H + h) * C;
    const float inv = 1.f / total[r];
    for (int64_t c = 0; c < C; ++c) out[c] = acc[r * C + c] * inv;
  }
}

constexpr const char* OP = "k3::MLAPaged";  // errors name the node

struct MLAPagedKernel : Fp32Int32<7, 4, 1> {
  static constexpr const char* name = "MLAPaged";
  float scale;
  MLAPagedKernel(const OrtApi&, const OrtKernelInfo* info) {
    scale = Ort::ConstKernelInfo(info).GetAttribute<float>("scale");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q_latent = ctx.GetInput(0), q_rope = ctx.GetInput(1), latent = ctx.GetInput(2), pool = ctx.GetInput(3);
    auto table = ctx.GetInput(4), past = ctx.GetInput(5), cu = ctx.GetInput(6);
    const auto qs = shape_of(q_latent), rs = shape_of(q_rope), ls = shape_of(latent), ps = shape_of(pool);
    const auto ts = shape_of(table), pls = shape_of(past), cs = shape_of(cu);
    require(OP, qs.size() == 3, "q_latent " + dims(qs) + ": expected [N, H, C]");
    const int64_t N = qs[0], H = qs[1], C = qs[2];
    require(OP, rs.size() == 3 && rs[0] == N && rs[1] == H, "q_rope " + dims(rs) + ": expected [N, H, R]");
    const int64_t R = rs[2], L = C + R;
    require(OP, ls == std::vector<int64_t>{N, L},
            "latent " + dims(ls) + ": expected [N, C + R] = [" + std::to_string(N) + ", " + std::to_string(L) + "]");
    require(OP, ps.size() == 3 && ps[2] == L && ps[1] > 0, "latent_pool " + dims(ps) + ": expected [NB, BS, C + R]");
    require(OP, ts.size() == 2 && pls == std::vector<int64_t>{ts[0]} && cs == std::vector<int64_t>{ts[0] + 1},
            "block_table " + dims(ts) + ", past_lens " + dims(pls) + " and cu_seqlens " + dims(cs) +
                ": expected [B, MB], [B] and [B+1]");
    const int64_t B = ts[0], MB = ts[1], NB = ps[0], BS = ps[1];
    const int32_t *p32 = past.GetTensorData<int32_t>(), *tab = table.GetTensorData<int32_t>();
    Attention a{q_latent.GetTensorData<float>(), q_rope.GetTensorData<float>(), latent.GetTensorData<float>(),
                pool.GetTensorData<float>(), tab, nullptr, nullptr,
                ctx.GetOutput(0, qs).GetTensorMutableData<float>(), H, C, R, BS, MB, scale, {}, {}};
    std::vector<int64_t> starts = offsets("k3::MLAPaged", cu, B, N), pasts(p32, p32 + B);
    for (int64_t b = 0; b < B; ++b) {
      require(OP, pasts[b] >= 0 && (pasts[b] + BS - 1) / BS <= MB,
              "past_lens[" + std::to_string(b) + "] = " + std::to_string(pasts[b]) + ": expected 0.." +
                  std::to_string(MB * BS) + ", what a block_table row of " + std::to_string(MB) + " blocks of " +
                  std::to_string(BS) + " positions holds");
      for (int64_t i = 0; i < (pasts[b] + BS - 1) / BS; ++i)
        require(OP, tab[b * MB + i] >= 0 && tab[b * MB + i] < NB,
                "block_table[" + std::to_string(b) + ", " + std::to_string(i) + "] = " +
                    std::to_string(tab[b * MB + i]) + ": outside the pool of " + std::to_string(NB) + " blocks");
      for (int64_t t0 = 0; t0 < starts[b + 1] - starts[b]; t0 += QB) {
        a.task_seq.push_back(b);
        a.task_row.push_back(t0);
      }
    }
    a.cu = starts.data();
    a.past = pasts.data();
    const size_t tasks = a.task_seq.size() * size_t(H);
    if (tasks > 0 && C > 0) ctx.ParallelFor(attend, tasks, 0, &a);
  }
};

CpuOp<MLAPagedKernel> mla_paged_op;

constexpr int64_t RB = 2 * QB;   // rows per LatentAttention task: a key block read once for 8 rows (a decode
                                 // step's heads), the second four from L2
constexpr int64_t CHUNK = 64;    // fewest keys per task when a step's few rows are split over the keys (512 left
                                 // a k3-bench decode step at 128 positions on one thread: 70-73 -> 49-50 us)

struct Latent {
  const float *q, *present;
  const bool* hidden;
  float *o, *part;  // part: per task RB x (L + 2) floats (the rows' sums, maxima, totals) when chunks > 1
  int64_t M, S, L, T, blocks, chunks, chunk;  // row blocks of RB per batch element, key chunks per row block
  float scale;
  // LatentAttentionAppend: present = Concat(past [B, P, L], latent [B, S - P, L]), written to `appended` (which
  // is never read here: the keys are read from past and latent); by each task, its chunk's rows as it reads
  // them, where each batch element's keys have one row block
  const float *past = nullptr, *latent = nullptr;
  float* appended = nullptr;
  int64_t P = 0;

  // each task copies its own keys: the append form where one row block reads each key (else copied first, once)
  bool copy_in_task() const { return appended && blocks == 1; }
};

// key j of batch element b: present's row, or in the append form the row of past or latent that it copies
const float* key_row(const Latent& a, int64_t b, int64_t j) {
  if (!a.appended) return a.present + (b * a.S + j) * a.L;
  return j < a.P ? a.past + (b * a.P + j) * a.L : a.latent + (b * (a.S - a.P) + j - a.P) * a.L;
}

// dst[0..n) = src[0..n), with streaming stores where dst is 64-byte aligned under AVX-512: present is written and
// not read again here, so its lines are not read in first (by count, a k3-bench MLA layer's copy at 2,048
// positions moved 7 MB where 4.8 is the past read once and present written once)
void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0)
    for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#endif
  std::copy(src + i, src + n, dst + i);
}

// present rows [k0, k0 + n) of batch element b from past and latent (the Concat's rows)
void append_rows(const Latent& a, int64_t b, int64_t k0, int64_t n) {
  const int64_t L = a.L, P = a.P, fresh = a.S - P;
  float* out = a.appended + (b * a.S + k0) * L;
  const int64_t from_past = std::max<int64_t>(0, std::min(n, P - k0));
  if (from_past > 0) stream_copy(out, a.past + (b * P + k0) * L, from_past * L);
  if (n > from_past) stream_copy(out + from_past * L, a.latent + (b * fresh + k0 + from_past - P) * L,
                                 (n - from_past) * L);
}

// the stores above ordered before whatever reads present after this call (streaming stores are weakly ordered)
inline void stores_done() {
#ifdef __AVX512F__
  _mm_sfence();
#endif
}

void append_block(void* user, size_t task) {  // one batch element's KB rows, when tasks do not copy their own
  const Latent& a = *static_cast<const Latent*>(user);
  const int64_t per_b = (a.S + KB - 1) / KB, b = int64_t(task) / per_b, k0 = int64_t(task) % per_b * KB;
  append_rows(a, b, k0, std::min(KB, a.S - k0));
  stores_done();
}

void attend_latent(void* user, size_t task) {
  const Latent& a = *static_cast<const Latent*>(user);
  const int64_t L = a.L, S = a.S, c = int64_t(task) % a.chunks, rb = int64_t(task) / a.chunks;
  const int64_t b = rb / a.blocks, r0 = rb % a.blocks * RB, rows = std::min(RB, a.M - r0);
  std::vector<float> q(RB * L), acc(RB * L, 0.f), s(RB * KB), top(RB, -INFINITY), total(RB, 0.f);
  int64_t keys = 0;  // 1 + the last key a row of the block sees
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = a.q + (b * a.M + r0 + r) * L;
    for (int64_t i = 0; i < L; ++i) q[r * L + i] = a.scale * qr[i];
    const bool* hidden = a.hidden + (r0 + r) % a.T * S;
    int64_t last = S;
    while (last > keys && hidden[last - 1]) --last;
    keys = std::max(keys, last);
  }
  std::vector<const float*> k(KB);
  const int64_t end = std::min(S, (c + 1) * a.chunk);  // this chunk's keys: [c chunk, end)
  for (int64_t k0 = c * a.chunk; k0 < (a.copy_in_task() ? end : std::min(keys, end)); k0 += KB) {
    if (a.copy_in_task()) append_rows(a, b, k0, std::min(KB, end - k0));  // the keys below then come from L2
    const int64_t width = std::min({KB, keys - k0, end - k0});
    if (width <= 0) continue;  // rows no query of the block sees: copied only
    for (int64_t j = 0; j < width; ++j) k[j] = key_row(a, b, k0 + j);
    for (int64_t sub = 0; sub < rows; sub += QB) {
      const int64_t n = std::min(QB, rows - sub);
      float* ss = s.data() + sub * KB;
      scores(q.data() + sub * L, n, L, k.data(), width, ss);
      for (int64_t r = 0; r < n; ++r) {
        const bool* hidden = a.hidden + (r0 + sub + r) % a.T * S + k0;
        for (int64_t j = 0; j < width; ++j)
          if (hidden[j]) ss[r * KB + j] = -INFINITY;
      }
      softmax_block(ss, n, width, top.data() + sub, total.data() + sub, acc.data() + sub * L, L);
      mix(ss, n, width, k.data(), L, acc.data() + sub * L);
    }
  }
  if (a.copy_in_task()) stores_done();
  if (a.chunks > 1) {  // this chunk's partial sums, merged by `merge_chunks`
    float* part = a.part + int64_t(task) * RB * (L + 2);
    std::copy(acc.begin(), acc.begin() + rows * L, part);
    std::copy(top.begin(), top.begin() + rows, part + RB * L);
    std::copy(total.begin(), total.begin() + rows, part + RB * L + RB);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // a row that sees no key: 0 / 0, NaN, as ONNX's Softmax over all -inf
    float* out = a.o + (b * a.M + r0 + r) * L;
    const float inv = 1.f / total[r];
    for (int64_t i = 0; i < L; ++i) out[i] = acc[r * L + i] * inv;
  }
}

// o of every row from its chunks' partial sums, each rescaled to the rows' overall maximum
void merge_chunks(const Latent& a, int64_t B) {
  const int64_t L = a.L, stride = RB * (L + 2);
  for (int64_t rb = 0; rb < B * a.blocks; ++rb) {
    const int64_t b = rb / a.blocks, r0 = rb % a.blocks * RB, rows = std::min(RB, a.M - r0);
    const float* first = a.part + rb * a.chunks * stride;
    for (int64_t r = 0; r < rows; ++r) {
      float m = -INFINITY, total = 0.f;
      for (int64_t c = 0; c < a.chunks; ++c) m = std::max(m, first[c * stride + RB * L + r]);
      float* out = a.o + (b * a.M + r0 + r) * L;
      std::fill(out, out + L, 0.f);
      for (int64_t c = 0; c < a.chunks && m != -INFINITY; ++c) {
        const float* part = first + c * stride;
        const float w = exp_approx(part[RB * L + r] - m);  // a chunk no key of which the row sees: 0
        total += w * part[RB * L + RB + r];
        for (int64_t i = 0; i < L; ++i) out[i] += w * part[r * L + i];
      }
      const float inv = 1.f / total;  // no key seen: 0 / 0, NaN, as above
      for (int64_t i = 0; i < L; ++i) out[i] *= inv;
    }
  }
}

// LatentAttention(q [B, M, L] float, present [B, S, L] float, hidden [T, S] bool, scale [] float) -> o [B, M, L];
// LatentAttentionAppend(q, past [B, P, L], latent [B, S - P, L], hidden, scale) -> (o, present [B, S, L]): the
// same attention over present = Concat(past, latent) on axis 1, which it writes (ONNX Runtime's Concat of a
// decode step's cache was one thread's copy, 120-170 us a k3-bench layer at 2,048 positions, and the attention
// then read the copy again)
template <bool Append>
struct LatentKernel {
  static constexpr const char* name = Append ? "LatentAttentionAppend" : "LatentAttention";
  static constexpr size_t inputs = Append ? 5 : 4, outputs = Append ? 2 : 1;
  static constexpr bool variadic_input = false, variadic_output = false;
  static ONNXTensorElementDataType input_type(size_t i) {
    return i == inputs - 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  static ONNXTensorElementDataType output_type(size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  LatentKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto q = ctx.GetInput(0), past = ctx.GetInput(1), hidden = ctx.GetInput(inputs - 2);
    auto scale = ctx.GetInput(inputs - 1);
    const auto qs = shape_of(q), hs = shape_of(hidden);
    std::vector<int64_t> ps = shape_of(past), ls = Append ? shape_of(ctx.GetInput(2)) : ps;  // ps: present's
    const bool joins = ps.size() == 3 && ls.size() == 3 && ls[0] == ps[0] && ls[2] == ps[2];
    const int64_t P = Append && joins ? ps[1] : 0;
    if (Append && joins) ps[1] += ls[1];
    const bool ok = joins && qs.size() == 3 && hs.size() == 2 && ps[0] == qs[0] && ps[2] == qs[2] &&
                    hs[1] == ps[1] && hs[0] > 0 && qs[1] % hs[0] == 0 &&
                    scale.GetTensorTypeAndShapeInfo().GetElementCount() == 1;
    if (!ok)
      throw Ort::Exception(std::string("k3x.fused::") + name + ": q " + dims(qs) +
                               (Append ? ", past " + dims(shape_of(past)) + ", latent " + dims(ls)
                                       : ", present " + dims(ps)) +
                               ", hidden " + dims(hs) + " and scale " + dims(shape_of(scale)) +
                               ": expected [B, H T, L]" + (Append ? ", [B, P, L], [B, S - P, L]" : ", [B, S, L]") +
                               ", [T, S] and one value",
                           ORT_INVALID_ARGUMENT);
    const int64_t B = qs[0], M = qs[1], L = qs[2], S = ps[1], blocks = (M + RB - 1) / RB;
    // a step of few rows (decode: B blocks of 8) also split over the keys, so that every thread has work
    const int64_t chunks = B * blocks >= 4 ? 1 : std::max<int64_t>(1, std::min<int64_t>(8, S / CHUNK));
    const int64_t chunk = chunks == 1 ? S : (S + chunks - 1) / chunks;
    std::vector<float> part(chunks > 1 ? size_t(B * blocks * chunks * RB * (L + 2)) : 0);
    float* o = ctx.GetOutput(0, qs).GetTensorMutableData<float>();
    Latent a{q.GetTensorData<float>(), Append ? nullptr : past.GetTensorData<float>(),
             hidden.GetTensorData<bool>(), o, part.data(), M, S, L, hs[0], blocks, chunks, chunk,
             scale.GetTensorData<float>()[0]};
    if (Append) {
      a.past = past.GetTensorData<float>();
      a.appended = ctx.GetOutput(1, ps).GetTensorMutableData<float>();
      a.latent = ctx.GetInput(2).GetTensorData<float>();
      a.P = P;
      if (!a.copy_in_task() && B * S * L > 0)
        ctx.ParallelFor(append_block, size_t(B * ((S + KB - 1) / KB)), 0, &a);
    }
    const size_t tasks = size_t(B * blocks * chunks);
    if (tasks == 0 || L == 0) return;
    ctx.ParallelFor(attend_latent, tasks, 0, &a);
    if (chunks > 1) merge_chunks(a, B);
  }
};

}  // namespace

void k3x_add_mla_paged(Ort::CustomOpDomain& k3, Ort::CustomOpDomain& fused) {
  k3.Add(&mla_paged_op);
  fused.Add(cpu_op<LatentKernel<false>>());
  fused.Add(cpu_op<LatentKernel<true>>());
}
