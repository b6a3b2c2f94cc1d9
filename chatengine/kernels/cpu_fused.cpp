// Fused per-layer ops for a CPU decode step, fp32: RMSNorm (+ residual add), SiLU(gate) * up, RoPE
// with the new K/V's store into the paged cache, and single-query attention over the paged cache.
//
// In eager torch these are ~30 small ops a layer (RMSNorm ~8, RoPE ~6, the page gather + SDPA ~10,
// SiLU-mul 3), each costing its dispatch and an allocation more than its arithmetic at decode sizes
// (a 576-wide row). Each function here is one ctypes call that reads its inputs once.
//
// Numerics follow the torch references (fused_ops.py's *_ref, attention.py's rotary): RMSNorm rounds
// x + residual to fp32 before squaring it, normalises in fp32, then scales by the weight; RoPE is
// x1 c - x2 s, x2 c + x1 s with each product rounded (no FMA contraction: the pragma below);
// sums run in another order than torch's, so results agree to a few ulp, not bit for bit.
//
// Plain C ABI, loaded with ctypes (cpu_fused.py); built like cpu_quant.cpp (AVX2 + FMA, OpenMP).

#pragma GCC optimize("fp-contract=off")  // scalar a * b + c rounds twice, as torch's ops; intrinsics still FMA

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// a . b over n floats, n a multiple of 8.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

// out += p * v over n floats, n a multiple of 8.
inline void axpy(float p, const float* v, float* out, int64_t n) {
  const __m256 pp = _mm256_set1_ps(p);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
}

}  // namespace

extern "C" {

// out (T, N) = RMSNorm(h) * w with h = x (+ res); with res, h is also written to res_out (the
// residual stream's next value). Row strides ldx, ldr, ldo, ldro.
void cf_rms_norm(const float* x, int64_t ldx, const float* res, int64_t ldr, const float* w, float* out, int64_t ldo,
                 float* res_out, int64_t ldro, int64_t T, int64_t N, float eps) {
  for (int64_t t = 0; t < T; t++) {
    const float* xt = x + t * ldx;
    const float* h = xt;
    if (res) {  // h = x + res, rounded to fp32 as torch's add
      float* ro = res_out + t * ldro;
      const float* rt = res + t * ldr;
      for (int64_t i = 0; i < N; i++) ro[i] = xt[i] + rt[i];
      h = ro;
    }
    double ss = 0;  // the mean of squares: double, so its order hardly matters
    for (int64_t i = 0; i < N; i++) ss += static_cast<double>(h[i] * h[i]);
    const float inv = 1.f / sqrtf(static_cast<float>(ss / N) + eps);
    float* o = out + t * ldo;
    for (int64_t i = 0; i < N; i++) o[i] = w[i] * (h[i] * inv);
  }
}

// out (T, I) = silu(gate) * up for gate_up = [gate | up] (T, 2I) with row stride ldg.
// Rows split over `threads` from 32 rows (a prefill chunk); each row's arithmetic is the same either
// way, so the result does not depend on how many rows a step holds.
void cf_silu_mul(const float* gate_up, int64_t ldg, float* out, int64_t ldo, int64_t T, int64_t I, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 32)
  for (int64_t t = 0; t < T; t++) {
    const float* g = gate_up + t * ldg;
    const float* u = g + I;
    float* o = out + t * ldo;
    for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}

// Token t at position pos[t]: its H_q query heads of q rotated into q_out (T, H_q, D) contiguous; its
// H_kv key heads rotated
// and, with its value heads, written to cache slot slots[t] (< 0: not stored). q, k, v: token
// strides ldq, ldk, ldv, head stride D. cos, sin: fp32 tables with row stride ldc, each row
// [c, c] (the first half serves both halves). Caches: page stride page_stride, bs slots a page,
// each slot (H_kv, D) contiguous.
void cf_rope_store(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
                   int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* cos, const float* sin, int64_t ldc,
                   const int32_t* pos, const int32_t* slots, float* q_out, float* k_cache, float* v_cache,
                   int64_t page_stride, int64_t bs) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; t++) {
    const float* c = cos + static_cast<int64_t>(pos[t]) * ldc;
    const float* s = sin + static_cast<int64_t>(pos[t]) * ldc;
    auto rotate = [&](const float* x, float* y) {
      for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
      }
    };
    for (int64_t h = 0; h < Hq; h++) rotate(q + t * ldq + h * D, q_out + (t * Hq + h) * D);
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t at = slot / bs * page_stride + slot % bs * Hkv * D;
    for (int64_t h = 0; h < Hkv; h++) {
      rotate(k + t * ldk + h * D, k_cache + at + h * D);
      std::copy(v + t * ldv + h * D, v + t * ldv + (h + 1) * D, v_cache + at + h * D);
    }
  }
}

// One query token per sequence (a decode step): out (B, H_q, D) contiguous. Sequence b's query
// q + b * ldq (heads at stride D) attends over its first lens[b] cached keys (the last `window`
// of them when window > 0), found through its row of the block table (stride ldt). Query heads
// h_kv * G .. h_kv * G + G - 1 share KV head h_kv (G = H_q / H_kv). One task per (sequence, query
// head): a decode of one sequence has H_q tasks to share out, not H_kv (3 tasks on 2 threads left
// one thread a third idle). The keys are walked page by page (one table lookup a page, no division
// a key); scores go to a buffer, then an exact softmax (max subtracted) weights the values, which
// each head adds in key order. D a multiple of 8.
void cf_decode_attention(const float* q, int64_t ldq, const float* k_cache, const float* v_cache, int64_t page_stride,
                         int64_t bs, int64_t Hq, int64_t Hkv, int64_t D, const int32_t* tables, int64_t ldt,
                         const int32_t* lens, int64_t B, float scale, int64_t window, float* out, int threads) {
  const int64_t G = Hq / Hkv, row = Hkv * D;  // row: a slot's stride inside a page
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && B * Hq > 1)
  for (int64_t task = 0; task < B * Hq; task++) {
    const int64_t b = task / Hq, hq = task % Hq, h = hq / G;
    const int64_t L = lens[b];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    const int32_t* table = tables + b * ldt;
    thread_local std::vector<float> scores;
    if (static_cast<int64_t>(scores.size()) < L) scores.resize(L);
    float* sc = scores.data();
    const float* qh = q + b * ldq + hq * D;
    float* out_h = out + (b * Hq + hq) * D;
    std::fill(out_h, out_h + D, 0.f);
    if (L <= lo) continue;
    // visit(cache, f): f(s, the slot's row of head h) for s in [lo, L), a page at a time
    auto visit = [&](const float* cache, auto&& f) {
      for (int64_t s = lo; s < L;) {
        const int64_t off = s % bs, n = std::min(bs - off, L - s);
        const float* at = cache + static_cast<int64_t>(table[s / bs]) * page_stride + off * row + h * D;
        for (int64_t i = 0; i < n; i++) f(s + i, at + i * row);
        s += n;
      }
    };
    float mx = -INFINITY;
    visit(k_cache, [&](int64_t s, const float* ks) {
      sc[s] = dot(qh, ks, D) * scale;
      mx = std::max(mx, sc[s]);
    });
    float sum = 0.f;
    for (int64_t s = lo; s < L; s++) {
      sc[s] = expf(sc[s] - mx);
      sum += sc[s];
    }
    const float inv = 1.f / sum;
    for (int64_t s = lo; s < L; s++) sc[s] *= inv;
    visit(v_cache, [&](int64_t s, const float* vs) { axpy(sc[s], vs, out_h, D); });
  }
}

// -- a whole decoder layer of a decode step ----------------------------------------------------
// Each op above is one ctypes call, and on a slow CPU a ctypes call with a dozen arguments plus its
// Python wrapper costs ~15-20 us: a layer's ~9 calls (4 GEMVs, 4 fused ops) and its modules cost
// more than its arithmetic at 135M. A plain Llama layer (pre-norm, SwiGLU, one rank) in a decode
// step therefore runs as one call: the same ops in the same order, the GEMVs through cpu_quant's
// entry points (function pointers the caller fills), intermediates in buffers this thread keeps.

// cq_gemv_f32 / cq_gemv_q16 / cq_gemv_q8's signature (cpu_quant.cpp).
typedef int (*GemvFn)(int, const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, const float*, int64_t,
                      int64_t, float*, int64_t, int);

struct QLinear {  // one quantized projection: y (M, N) = x (M, K) W^T (+ bias)
  GemvFn gemv;
  int64_t fmt;
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;  // q4_1's, else null
  const float* bias;  // or null
  int64_t N, K;
};

struct Layer {  // what stays the same from step to step (cpu_fused.Layer mirrors it)
  QLinear qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;
  double eps, scale;
  int64_t H, Hq, Hkv, D, I, window;
  float* k_cache;  // this layer's (N, bs, H_kv, D) views: page stride page_stride
  float* v_cache;
  int64_t page_stride, bs;
  const float* cos;  // (P, D) tables, row stride ldc
  const float* sin;
  int64_t ldc;
};

struct Step {  // one decode step: B sequences, one new token each
  int64_t B;
  const int32_t* pos;    // (B,)
  const int32_t* slots;  // (B,)
  const int32_t* tables;  // (B, ldt)
  int64_t ldt;
  const int32_t* lens;  // (B,)
  int64_t threads;
};

static int run_linear(const QLinear& l, const float* x, int64_t M, float* y, int threads) {
  const int rc = l.gemv(static_cast<int>(l.fmt), l.qs, l.d, l.m, l.N, l.K, x, M, l.K, y, l.N, threads);
  if (l.bias)
    for (int64_t t = 0; t < M; t++)
      for (int64_t n = 0; n < l.N; n++) y[t * l.N + n] += l.bias[n];
  return rc;
}

// x (B, H): the layer's input (the embedding when residual is null, else the last layer's MLP
// output, with residual the stream before it). Writes out (B, H), this layer's MLP output, and
// res_out (B, H), the residual stream after its attention: what DecoderLayer.forward returns.
// Returns 0, or the first GEMV's error.
int cf_decode_layer(const Layer* L, const Step* S, const float* x, const float* residual, float* out, float* res_out) {
  const int64_t B = S->B, H = L->H, D = L->D, Hq = L->Hq, Hkv = L->Hkv;
  const int64_t width = (Hq + 2 * Hkv) * D;
  const int threads = static_cast<int>(S->threads);
  thread_local std::vector<float> buf;
  const int64_t hw = std::max(H, L->I);
  const int64_t need = B * (hw + width + 2 * Hq * D + 2 * L->I + H);
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  float* h = buf.data();         // (B, H) a normed input, later (B, I) the MLP's activation
  float* qkv = h + B * hw;       // (B, width)
  float* q = qkv + B * width;    // (B, Hq, D): rotated queries
  float* att = q + B * Hq * D;   // (B, Hq, D)
  float* gu = att + B * Hq * D;  // (B, 2I)
  float* o = gu + B * 2 * L->I;  // (B, H): attention output
  const float eps = static_cast<float>(L->eps);
  if (residual)
    cf_rms_norm(x, H, residual, H, L->input_norm, h, H, res_out, H, B, H, eps);
  else {  // the first layer: the stream starts as the embedding
    std::copy(x, x + B * H, res_out);
    cf_rms_norm(x, H, nullptr, 0, L->input_norm, h, H, nullptr, 0, B, H, eps);
  }
  int rc = run_linear(L->qkv, h, B, qkv, threads);
  cf_rope_store(qkv, width, qkv + Hq * D, width, qkv + (Hq + Hkv) * D, width, B, Hq, Hkv, D, L->cos, L->sin, L->ldc,
                S->pos, S->slots, q, L->k_cache, L->v_cache, L->page_stride, L->bs);
  cf_decode_attention(q, Hq * D, L->k_cache, L->v_cache, L->page_stride, L->bs, Hq, Hkv, D, S->tables, S->ldt, S->lens,
                      B, static_cast<float>(L->scale), L->window, att, threads);
  rc = rc ? rc : run_linear(L->o, att, B, o, threads);
  cf_rms_norm(o, H, res_out, H, L->post_norm, h, H, res_out, H, B, H, eps);  // res_out += o, in place
  rc = rc ? rc : run_linear(L->gate_up, h, B, gu, threads);
  cf_silu_mul(gu, 2 * L->I, h, L->I, B, L->I, static_cast<int>(threads));
  rc = rc ? rc : run_linear(L->down, h, B, out, threads);
  return rc;
}

}  // extern "C"
