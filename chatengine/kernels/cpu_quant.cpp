// Weight-only quantized matmuls for the CPU: y = x W^T with x fp32 (M, K) and W (N, K) stored in
// blocks of 32 weights along K, GGML's Q8_0, Q4_0 and Q4_1 arithmetic:
//   q8_0: int8 q[32], fp16 d           w = d * q
//   q4_0: 4-bit q[32] (0..15), fp16 d  w = d * (q - 8)
//   q4_1: 4-bit q[32] (0..15), fp16 d, fp16 m   w = d * q + m
// Planes, not interleaved blocks: qs (N, K) int8 or (N, K/2) packed nibbles, row-major; d and m
// fp16, column-major ((K/32, N) in memory: a block's scales of neighbouring rows side by side). A
// 4-bit block's 16 bytes hold weight j in the low nibble of byte j and weight j + 16 in its high
// nibble (GGML's order).
//
// Plain C ABI (loaded with ctypes, no torch headers: it compiles in a second). OpenMP splits the
// output rows; in a torch process `-fopenmp` binds to the libgomp torch already loaded (same
// soname), so both share one thread pool. AVX2 + FMA + F16C.
//
// Three GEMVs for decode steps (M small):
//   gemv_f32: x stays fp32; each block is unpacked to 4 x 8 floats and FMA'd (as exact as the
//     weights: greedy output agrees with the fp32 model's).
//   gemv_q8: llama.cpp's arithmetic. Each row of x is quantized once to q8 blocks (int8 levels, an
//     fp32 scale per 32); each weight block then costs one integer dot of 32 bytes
//     (_mm256_maddubs_epi16 + _mm256_madd_epi16), scaled in fp32. Less exact (x's rounding), and on
//     CPUs with one vector-integer multiply pipe (AMD Zen 1) no faster than gemv_f32.
//   gemv_q16: x as int16 blocks, eight rows of W at a time (below): the default for every format.
// dequant: W to fp32 (N, K), for the large-M path (prefill), where torch's GEMM multiplies.

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

namespace {

enum Format { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
constexpr int QK = 32;  // weights per block

struct Weights {
  const uint8_t* qs;
  const uint16_t* d;  // fp16 bits
  const uint16_t* m;  // fp16 bits (q4_1 only)
  int64_t N, K;
};

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The row-at-a-time GEMVs read a row's scales down a column of the (K/32, N) planes: one cache line
// a block, shared by 32 neighbouring rows, which no hardware prefetcher follows. Every 8 rows, the
// lines of the rows 32 ahead are asked for (without it a cold GEMV ran ~30% slower).
inline void prefetch_scales(const Weights& w, int64_t n) {
  if (n % 8 || n + 32 >= w.N) return;
  for (int64_t g = 0; g < w.K / QK; g++) {
    _mm_prefetch(reinterpret_cast<const char*>(w.d + g * w.N + n + 32), _MM_HINT_T0);
    if (w.m) _mm_prefetch(reinterpret_cast<const char*>(w.m + g * w.N + n + 32), _MM_HINT_T0);
  }
}

// Block g of row n as 4 x 8 floats: the integer levels (q, q - 8), not yet scaled.
template <int F>
inline void unpack(const Weights& w, int64_t n, int64_t g, __m256 out[4]) {
  if (F == Q8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(w.qs) + n * w.K + g * QK;
    for (int i = 0; i < 4; i++) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
      out[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
  } else {
    const uint8_t* p = w.qs + n * (w.K / 2) + g * (QK / 2);
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(v, mask);                     // weights 0..15
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);  // weights 16..31
    if (F == Q4_0) {
      const __m128i eight = _mm_set1_epi8(8);
      lo = _mm_sub_epi8(lo, eight);
      hi = _mm_sub_epi8(hi, eight);
    }
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// y[m0 + t, n] for t < MT: sum over blocks of d * (q . x_block) (+ m * sum(x_block) for q4_1,
// from xsum (M, K/32)).
template <int F, int MT>
inline void row_tile(const Weights& w, int64_t n, const float* x, int64_t ldx, const float* xsum, float* y,
                     int64_t ldy) {
  const int64_t G = w.K / QK;
  __m256 acc[MT];
  float acc_min[MT];
  for (int t = 0; t < MT; t++) {
    acc[t] = _mm256_setzero_ps();
    acc_min[t] = 0.f;
  }
  __m256 q[4];
  for (int64_t g = 0; g < G; g++) {
    unpack<F>(w, n, g, q);
    const __m256 d = _mm256_set1_ps(h2f(w.d[g * w.N + n]));
    for (int t = 0; t < MT; t++) {
      const float* xp = x + t * ldx + g * QK;
      __m256 p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
      p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 8), p);
      p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp + 16), p);
      p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 24), p);
      acc[t] = _mm256_fmadd_ps(p, d, acc[t]);
    }
    if (F == Q4_1) {
      const float m = h2f(w.m[g * w.N + n]);
      for (int t = 0; t < MT; t++) acc_min[t] += m * xsum[t * G + g];
    }
  }
  for (int t = 0; t < MT; t++) y[t * ldy + n] = hsum(acc[t]) + acc_min[t];
}

template <int F>
void gemv_f32(const Weights& w, const float* x, int64_t M, int64_t ldx, const float* xsum, float* y, int64_t ldy,
          int threads) {
  const int64_t G = w.K / QK;
  const int64_t rows_per_task = 8;
  const int64_t tasks = (w.N + rows_per_task - 1) / rows_per_task;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < tasks; task++) {
    const int64_t n1 = std::min(w.N, (task + 1) * rows_per_task);
    for (int64_t n = task * rows_per_task; n < n1; n++) {
      prefetch_scales(w, n);
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = x + m * ldx;
        const float* sm = xsum ? xsum + m * G : nullptr;
        float* ym = y + m * ldy;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: row_tile<F, 1>(w, n, xm, ldx, sm, ym, ldy); break;
          case 2: row_tile<F, 2>(w, n, xm, ldx, sm, ym, ldy); break;
          case 3: row_tile<F, 3>(w, n, xm, ldx, sm, ym, ldy); break;
          default: row_tile<F, 4>(w, n, xm, ldx, sm, ym, ldy); break;
        }
      }
    }
  }
}

// -- activations as q8 blocks (llama.cpp's arithmetic for a decode step) -------------------------
// Each row of x (K) becomes int8 levels qx (K), a scale dx (K/32) and the scaled block sums
// xs = dx * sum(qx) (K/32): dx = amax / 127, qx = round-half-even(x * (1 / dx)), as GGML's AVX2
// quantize_row_q8_0 rounds. A weight block then meets it as one integer dot:
//   q8_0: dw * dx * (q . qx)
//   q4_0: dw * dx * (q . qx) - 8 * dw * xs     (q in 0..15: an unsigned x signed byte product)
//   q4_1: dw * dx * (q . qx) + m * xs
struct Q8Rows {
  int8_t* q;   // (M, K)
  float* d;    // (M, G)
  float* s;    // (M, G)
};

inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / QK; g++) {
    const float* xp = x + g * QK;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(xp + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float dd = _mm_cvtss_f32(m4) / 127.f;
    const __m256 inv = _mm256_set1_ps(dd != 0.f ? 1.f / dd : 0.f);
    __m256i sum = _mm256_setzero_si256();
    int32_t lv[32];
    for (int i = 0; i < 4; i++) {
      __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      sum = _mm256_add_epi32(sum, r);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lv + 8 * i), r);
    }
    for (int i = 0; i < 32; i++) q[g * QK + i] = static_cast<int8_t>(lv[i]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    d[g] = dd;
    s[g] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// Block g of row n as 32 bytes in x's order: q8_0 signed levels, q4 unsigned levels 0..15.
template <int F>
inline __m256i load_levels(const Weights& w, int64_t n, int64_t g) {
  if (F == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * w.K + g * QK));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.K / 2) + g * (QK / 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// 8 int32 partial sums of the 32 products w . x (w: levels as load_levels gives them, x int8).
template <int F>
inline __m256i dot32(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (F == Q8_0) {  // maddubs takes unsigned x signed: |w| . (x with w's sign); levels are >= -127
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
  }
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  // 15 * 127 * 2 fits in int16
}

// sum_g c[g * ldc] * s[g] over a row's blocks, c fp16 (a column of the (K/32, N) plane): q4_1's
// minimums (or q4_0's scales) meet x's scaled block sums.
inline float dot_f16(const uint16_t* c, int64_t ldc, const float* s, int64_t G) {
  float out = 0.f;
  for (int64_t g = 0; g < G; g++) out += h2f(c[g * ldc]) * s[g];
  return out;
}

// y[t, n + r] for r < R rows of W and t < MT rows of x, from x's q8 blocks: R * MT independent
// accumulators, so the FMA latency of one block's sum hides behind the others', and each x block
// is loaded once for R rows, each weight block once for MT rows.
template <int F, int R, int MT>
inline void tile_q8(const Weights& w, int64_t n, const Q8Rows& x, float* y, int64_t ldy) {
  const int64_t G = w.K / QK;
  __m256 acc[R][MT];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m256i qx[MT];
    for (int t = 0; t < MT; t++) qx[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + t * w.K + g * QK));
    for (int r = 0; r < R; r++) {
      const __m256i q = load_levels<F>(w, n + r, g);
      const float dw = h2f(w.d[g * w.N + n + r]);
      for (int t = 0; t < MT; t++) {
        const __m256 p = _mm256_cvtepi32_ps(dot32<F>(q, qx[t]));
        acc[r][t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * x.d[t * G + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) {
      float off = 0.f;  // q4_0: -8 dw s; q4_1: m s (per block, summed)
      if (F == Q4_0) off = -8.f * dot_f16(w.d + n + r, w.N, x.s + t * G, G);
      if (F == Q4_1) off = dot_f16(w.m + n + r, w.N, x.s + t * G, G);
      y[t * ldy + n + r] = hsum(acc[r][t]) + off;
    }
}

// Rows [n0, n1) of W against MT rows of x: 4 rows at a time for one row of x (latency-bound), 2 for
// more (register-bound: R * MT accumulators), then one at a time.
template <int F, int MT>
inline void rows_q8(const Weights& w, int64_t n0, int64_t n1, const Q8Rows& x, float* y, int64_t ldy) {
  constexpr int R = MT == 1 ? 4 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    prefetch_scales(w, n);
    tile_q8<F, R, MT>(w, n, x, y, ldy);
  }
  for (; n < n1; n++) tile_q8<F, 1, MT>(w, n, x, y, ldy);
}

template <int F>
void gemv_q8(const Weights& w, const Q8Rows& x, int64_t M, float* y, int64_t ldy, int threads) {
  const int64_t G = w.K / QK;
  const int64_t rows_per_task = 16;
  const int64_t tasks = (w.N + rows_per_task - 1) / rows_per_task;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
  for (int64_t task = 0; task < tasks; task++) {
    const int64_t n0 = task * rows_per_task, n1 = std::min(w.N, n0 + rows_per_task);
    for (int64_t m = 0; m < M; m += 4) {
      const Q8Rows xm{x.q + m * w.K, x.d + m * G, x.s + m * G};
      float* ym = y + m * ldy;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: rows_q8<F, 1>(w, n0, n1, xm, ym, ldy); break;
        case 2: rows_q8<F, 2>(w, n0, n1, xm, ym, ldy); break;
        case 3: rows_q8<F, 3>(w, n0, n1, xm, ym, ldy); break;
        default: rows_q8<F, 4>(w, n0, n1, xm, ym, ldy); break;
      }
    }
  }
}

// -- activations as q16 blocks -------------------------------------------------------------------
// Each row of x (K) becomes int16 levels qx (K), a scale dx = amax / 32767 per block of 32, the
// block's fp32 sum xs (for q4_1's minimums) and the sum of its levels (for q4_0's - 8). A weight
// block then meets it as two _mm256_madd_epi16 (16 products each, in int32: 32 * 127 * 32767 fits):
// dw * dx * (q . qx) (+ m * xs for q4_1; q4_0's levels are q - 8: dw * dx * (q . qx - 8 sum qx)).
// x's rounding moves each input by at most amax / 65534, ~260x less than q8's.
//
// Eight rows of W at a time: their eight scales of a block sit side by side (d and m are stored
// column-major, (K/32, N)), so one 16-byte load and one conversion give all eight, and the eight
// integer dots reduce into one vector (lane r: row r) that a single FMA scales. Per weight block
// that leaves a broadcast load, a shift, a mask, two unpacks, two multiply-adds and an add: on this
// machine's AVX2 the GEMV then streams the weights near memory speed instead of being bound by a
// scalar scale conversion and a horizontal sum per block.
struct Q16Rows {
  int16_t* q;  // (M, K) levels, x's order
  float* d;    // (M, G)
  float* s;    // (M, G): sum of each block of x, fp32
  int32_t* l;  // (M, G): sum of each block's levels (q4_0 in the tile order)
  int16_t* p;  // (M, K) the levels with each block in the tile order (q16_slot), for tile8_q16

  Q16Rows rows_from(int64_t t, int64_t K) const {  // rows t.. of x
    const int64_t G = K / QK;
    return {q + t * K, d + t * G, s + t * G, l + t * G, p != nullptr ? p + t * K : nullptr};
  }
};

// Position of x's level i (0..31) within its block in the tile order: two vectors of 16 int16,
// [x0..7 | x16..23] and [x8..15 | x24..31], as tile8_q16 unpacks a weight block's bytes.
inline int q16_slot(int i) { return (i & 7) + ((i >> 3 & 1) ? 16 : 0) + ((i >> 4) ? 8 : 0); }

// q (K) in x's order -> p (K) with each block in the tile order.
inline void permute_row16(const int16_t* q, int64_t K, int16_t* p) {
  for (int64_t g = 0; g < K / QK; g++)
    for (int i = 0; i < QK; i++) p[g * QK + q16_slot(i)] = q[g * QK + i];
}

inline void quantize_row16(const float* x, int64_t K, int16_t* q, float* d, float* s, int32_t* l) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / QK; g++) {
    const float* xp = x + g * QK;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(xp + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      sum = _mm256_add_ps(sum, v[i]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float dd = _mm_cvtss_f32(m4) / 32767.f;
    const __m256 inv = _mm256_set1_ps(dd != 0.f ? 1.f / dd : 0.f);
    int32_t lv[32];
    for (int i = 0; i < 4; i++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lv + 8 * i),
                          _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    int32_t total = 0;
    for (int i = 0; i < 32; i++) {
      q[g * QK + i] = static_cast<int16_t>(lv[i]);
      total += lv[i];
    }
    d[g] = dd;
    s[g] = hsum(sum);
    l[g] = total;
  }
}

// Block g of row n as two vectors of 16 int16 levels in x's natural order (weights 0..15, 16..31):
// q8_0 q, q4_0 q - 8, q4_1 q.
template <int F>
inline void load_levels16(const Weights& w, int64_t n, int64_t g, __m256i& lo, __m256i& hi) {
  if (F == Q8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(w.qs) + n * w.K + g * QK;
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    return;
  }
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.K / 2) + g * (QK / 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i l = _mm_and_si128(v, mask), h = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  if (F == Q4_0) {
    l = _mm_sub_epi8(l, _mm_set1_epi8(8));
    h = _mm_sub_epi8(h, _mm_set1_epi8(8));
  }
  lo = _mm256_cvtepi8_epi16(l);
  hi = _mm256_cvtepi8_epi16(h);
}

// Block g of row n as two vectors of 16 int16 levels in the tile order (q16_slot): q8_0 q, q4 q
// (0..15; q4_0's - 8 comes after the sum).
template <int F>
inline void load_levels16_tiled(const Weights& w, int64_t n, int64_t g, __m256i& lo, __m256i& hi) {
  if (F == Q8_0) {  // bytes 0..15 | 16..31, sign-extended by interleaving with their signs
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * w.K + g * QK));
    const __m256i sg = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
    lo = _mm256_unpacklo_epi8(v, sg);
    hi = _mm256_unpackhi_epi8(v, sg);
    return;
  }
  // the 16 bytes in both halves, the high half shifted by 4: low nibbles (weights 0..15) | high
  // nibbles (16..31), zero-extended by interleaving with zeros
  const __m256i v = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.K / 2) + g * (QK / 2))));
  const __m256i b = _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
  lo = _mm256_unpacklo_epi8(b, _mm256_setzero_si256());
  hi = _mm256_unpackhi_epi8(b, _mm256_setzero_si256());
}

// Eight vectors of partial sums -> one vector whose lane r is the total of vector r.
inline __m256i reduce8(const __m256i v[8]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Prefetch distance of tile8_q16, in tiles: the weights and scales a few tiles ahead are on their
// way while this tile multiplies (the hardware prefetcher alone left the GEMV of a whole 135M model
// at ~7 GB/s on a 2-core AMD EPYC VM, 12.5 GB/s with this; 1 to 4 tiles measured within noise).
constexpr int PF_TILES = 3;

// y[t, n .. n + 8) for t < MT rows of x: W rows n..n+7, every block; each weight block is unpacked
// once for the MT rows of x. `first`: the first pass over this tile, which prefetches the tiles to come.
template <int F, int MT>
inline void tile8_q16(const Weights& w, int64_t n, const Q16Rows& x, float* y, int64_t ldy, bool first) {
  const int64_t G = w.K / QK;
  __m256 acc[MT], acc_min[MT];
  for (int t = 0; t < MT; t++) acc[t] = acc_min[t] = _mm256_setzero_ps();
  // the tile PF_TILES ahead: 8 rows of K weights, 64 (q4) or 128 (q8_0) bytes a block step
  const int lines = F == Q8_0 ? 4 : 2;
  const char* ahead = reinterpret_cast<const char*>(w.qs) + (n + 8 * PF_TILES) * (F == Q8_0 ? w.K : w.K / 2);
  const bool prefetch = first && n + 8 * PF_TILES + 8 <= w.N;
  for (int64_t g = 0; g < G; g++) {
    if (prefetch) {  // the weights, and the scale lines (a line holds 32 rows' scales of a block)
      for (int i = 0; i < lines; i++) _mm_prefetch(ahead + (g * lines + i) * 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w.d + g * w.N + n + 8 * PF_TILES), _MM_HINT_T0);
      if (F == Q4_1) _mm_prefetch(reinterpret_cast<const char*>(w.m + g * w.N + n + 8 * PF_TILES), _MM_HINT_T0);
    }
    __m256i xa[MT], xb[MT];
    for (int t = 0; t < MT; t++) {
      xa[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.p + t * w.K + g * QK));
      xb[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.p + t * w.K + g * QK + 16));
    }
    __m256i dots[MT][8];
    for (int r = 0; r < 8; r++) {
      __m256i lo, hi;
      load_levels16_tiled<F>(w, n + r, g, lo, hi);
      for (int t = 0; t < MT; t++)
        dots[t][r] = _mm256_add_epi32(_mm256_madd_epi16(lo, xa[t]), _mm256_madd_epi16(hi, xb[t]));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + g * w.N + n)));
    const __m256 m =
        F == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + g * w.N + n))) : dw;
    for (int t = 0; t < MT; t++) {
      __m256i sum = reduce8(dots[t]);
      if (F == Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * x.l[t * G + g]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[t * G + g])), acc[t]);
      if (F == Q4_1) acc_min[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[t * G + g]), acc_min[t]);
    }
  }
  for (int t = 0; t < MT; t++) _mm256_storeu_ps(y + t * ldy + n, _mm256_add_ps(acc[t], acc_min[t]));
}

// y[t, n + r] for r < R rows of W and t < MT rows of x in natural order (a batch of decode steps):
// each weight block's unpack serves MT rows of x, each x block R rows of W, and the horizontal sums
// come once a row instead of once a block.
template <int F, int R, int MT>
inline void rows_tile_q16(const Weights& w, int64_t n, const Q16Rows& x, float* y, int64_t ldy) {
  const int64_t G = w.K / QK;
  __m256 acc[R][MT];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m256i xlo[MT], xhi[MT];
    for (int t = 0; t < MT; t++) {
      const int16_t* xp = x.q + t * w.K + g * QK;
      xlo[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      xhi[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16));
    }
    for (int r = 0; r < R; r++) {
      __m256i lo, hi;
      load_levels16<F>(w, n + r, g, lo, hi);
      const float dw = h2f(w.d[g * w.N + n + r]);
      for (int t = 0; t < MT; t++) {
        const __m256i dots = _mm256_add_epi32(_mm256_madd_epi16(lo, xlo[t]), _mm256_madd_epi16(hi, xhi[t]));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(dw * x.d[t * G + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++)
      y[t * ldy + n + r] = hsum(acc[r][t]);  // q4_1's minimums come after (add_minimums)
}

// q4_1: y[t, a..b) += sum_g m[a..b, g] * s[t, g], eight rows of W a vector (the minimums of
// neighbouring rows sit side by side).
inline void add_minimums(const Weights& w, int64_t a, int64_t b, const Q16Rows& x, int64_t M, float* y, int64_t ldy) {
  const int64_t G = w.K / QK;
  int64_t n = a;
  for (; n + 8 <= b; n += 8)
    for (int64_t t = 0; t < M; t++) {
      __m256 acc = _mm256_loadu_ps(y + t * ldy + n);
      for (int64_t g = 0; g < G; g++) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + g * w.N + n)));
        acc = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[t * G + g]), acc);
      }
      _mm256_storeu_ps(y + t * ldy + n, acc);
    }
  for (; n < b; n++)
    for (int64_t t = 0; t < M; t++) y[t * ldy + n] += dot_f16(w.m + n, w.N, x.s + t * G, G);
}

template <int F, int MT>
inline void rows_q16(const Weights& w, int64_t n0, int64_t n1, const Q16Rows& x, float* y, int64_t ldy) {
  constexpr int R = MT == 1 ? 4 : MT == 2 ? 2 : 1;  // registers: R * MT accumulators + 2 MT x vectors
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    prefetch_scales(w, n);
    rows_tile_q16<F, R, MT>(w, n, x, y, ldy);
  }
  for (; n < n1; n++) rows_tile_q16<F, 1, MT>(w, n, x, y, ldy);
}

// Eight rows of W at a time (tile8_q16), for every row of x: two rows of x a pass over the tile (the
// registers hold no more), the tile's weights read from memory once and from the cache by the later
// passes. On a 2-core AMD EPYC VM (AVX-512) the 135M model's layers took 5.7 / 10.8 / 20.6 ms for 4 /
// 8 / 16 rows this way, 6.8 / 11.6 / 21.1 with the row-at-a-time path (rows_q16, now only for the
// last N % 8 rows), its q8_0 LM head 1.2 / 2.3 / 4.6 against 1.7 / 2.9 / 5.3 (cpu_gemv_bench.py).
template <int F>
void gemv_q16(const Weights& w, const Q16Rows& x, int64_t M, float* y, int64_t ldy, int threads) {
  const int64_t tiles = x.p != nullptr ? w.N / 8 : 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
  for (int64_t tile = 0; tile < tiles; tile++) {
    int64_t t = 0;
    for (; t + 2 <= M; t += 2)
      tile8_q16<F, 2>(w, 8 * tile, x.rows_from(t, w.K), y + t * ldy, ldy, t == 0);
    if (t < M) tile8_q16<F, 1>(w, 8 * tile, x.rows_from(t, w.K), y + t * ldy, ldy, t == 0);
  }
  const int64_t n0 = 8 * tiles;  // the rows past the tiles (all of them when N < 8)
  const int64_t rows_per_task = 16, tasks = (w.N - n0 + rows_per_task - 1) / rows_per_task;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
  for (int64_t task = 0; task < tasks; task++) {  // each thread a contiguous range of rows
    const int64_t a = n0 + task * rows_per_task, b = std::min(w.N, a + rows_per_task);
    for (int64_t t = 0; t < M; t += 4) {
      const Q16Rows xt = x.rows_from(t, w.K);
      switch (std::min<int64_t>(4, M - t)) {
        case 1: rows_q16<F, 1>(w, a, b, xt, y + t * ldy, ldy); break;
        case 2: rows_q16<F, 2>(w, a, b, xt, y + t * ldy, ldy); break;
        case 3: rows_q16<F, 3>(w, a, b, xt, y + t * ldy, ldy); break;
        default: rows_q16<F, 4>(w, a, b, xt, y + t * ldy, ldy); break;
      }
    }
    if (F == Q4_1) add_minimums(w, a, b, x, M, y, ldy);
  }
}

template <int F>
void dequant(const Weights& w, float* out, int threads) {
  const int64_t G = w.K / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < w.N; n++) {
    __m256 q[4];
    for (int64_t g = 0; g < G; g++) {
      unpack<F>(w, n, g, q);
      const __m256 d = _mm256_set1_ps(h2f(w.d[g * w.N + n]));
      const __m256 m = _mm256_set1_ps(F == Q4_1 ? h2f(w.m[g * w.N + n]) : 0.f);
      float* o = out + n * w.K + g * QK;
      for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(q[i], d, m));
    }
  }
}

}  // namespace

extern "C" {

// x (M, K) fp32 with row stride ldx -> its q8 blocks: q (M, K) int8, d and s (M, K/32) fp32.
void cq_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* d, float* s) {
  const int64_t G = K / QK;
  for (int64_t i = 0; i < M; i++) quantize_row(x + i * ldx, K, q + i * K, d + i * G, s + i * G);
}

// y (M, N) with row stride ldy = x W^T, x (M, K) fp32 with row stride ldx quantized to q8 blocks
// first (in a buffer this thread keeps). Returns 0, or -1 for an unknown format.
int cq_gemv_q8(int fmt, const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, const float* x,
            int64_t M, int64_t ldx, float* y, int64_t ldy, int threads) {
  thread_local std::vector<int8_t> bq;
  thread_local std::vector<float> bds;
  const int64_t G = K / QK;
  if (static_cast<int64_t>(bq.size()) < M * K) bq.resize(M * K);
  if (static_cast<int64_t>(bds.size()) < 2 * M * G) bds.resize(2 * M * G);
  const Q8Rows xq{bq.data(), bds.data(), bds.data() + M * G};
  cq_quantize_rows(x, M, K, ldx, xq.q, xq.d, xq.s);
  const Weights w{qs, d, m, N, K};
  switch (fmt) {
    case Q8_0: gemv_q8<Q8_0>(w, xq, M, y, ldy, threads); return 0;
    case Q4_0: gemv_q8<Q4_0>(w, xq, M, y, ldy, threads); return 0;
    case Q4_1: gemv_q8<Q4_1>(w, xq, M, y, ldy, threads); return 0;
  }
  return -1;
}

// x (M, K) fp32 with row stride ldx -> its q16 blocks: q (M, K) int16, d and s (M, K/32) fp32, l
// (M, K/32) int32.
void cq_quantize_rows16(const float* x, int64_t M, int64_t K, int64_t ldx, int16_t* q, float* d, float* s,
                        int32_t* l) {
  const int64_t G = K / QK;
  for (int64_t i = 0; i < M; i++) quantize_row16(x + i * ldx, K, q + i * K, d + i * G, s + i * G, l + i * G);
}

// As cq_gemv_q8 with x's q16 blocks.
int cq_gemv_q16(int fmt, const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, const float* x,
                int64_t M, int64_t ldx, float* y, int64_t ldy, int threads) {
  if (M == 0) return 0;
  thread_local std::vector<int16_t> bq;
  thread_local std::vector<float> bds;
  thread_local std::vector<int32_t> bl;
  const int64_t G = K / QK;
  const bool tiled = N >= 8;
  if (static_cast<int64_t>(bq.size()) < 2 * M * K) bq.resize(2 * M * K);
  if (static_cast<int64_t>(bds.size()) < 2 * M * G) bds.resize(2 * M * G);
  if (static_cast<int64_t>(bl.size()) < M * G) bl.resize(M * G);
  const Q16Rows xq{bq.data(), bds.data(), bds.data() + M * G, bl.data(), tiled ? bq.data() + M * K : nullptr};
  cq_quantize_rows16(x, M, K, ldx, xq.q, xq.d, xq.s, xq.l);
  if (tiled)
    for (int64_t i = 0; i < M; i++) permute_row16(xq.q + i * K, K, xq.p + i * K);
  const Weights w{qs, d, m, N, K};
  switch (fmt) {
    case Q8_0: gemv_q16<Q8_0>(w, xq, M, y, ldy, threads); return 0;
    case Q4_0: gemv_q16<Q4_0>(w, xq, M, y, ldy, threads); return 0;
    case Q4_1: gemv_q16<Q4_1>(w, xq, M, y, ldy, threads); return 0;
  }
  return -1;
}

// y (M, N) with row stride ldy = x (M, K) fp32 with row stride ldx, times W^T, x kept in fp32. Returns 0, or -1 for an
// unknown format.
int cq_gemv_f32(int fmt, const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, const float* x,
            int64_t M, int64_t ldx, float* y, int64_t ldy, int threads) {
  const Weights w{qs, d, m, N, K};
  switch (fmt) {
    case Q8_0: gemv_f32<Q8_0>(w, x, M, ldx, nullptr, y, ldy, threads); return 0;
    case Q4_0: gemv_f32<Q4_0>(w, x, M, ldx, nullptr, y, ldy, threads); return 0;
    case Q4_1: {  // q4_1's min term needs each block's sum of x: (M, K/32), once for all rows
      const int64_t G = K / QK;
      std::vector<float> xsum(M * G);
      for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < G; g++) {
          const float* xp = x + i * ldx + g * QK;
          __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xp), _mm256_loadu_ps(xp + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(xp + 16), _mm256_loadu_ps(xp + 24)));
          xsum[i * G + g] = hsum(s);
        }
      gemv_f32<Q4_1>(w, x, M, ldx, xsum.data(), y, ldy, threads);
      return 0;
    }
  }
  return -1;
}

// out (N, K) fp32 = W.
int cq_dequant(int fmt, const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, float* out,
               int threads) {
  const Weights w{qs, d, m, N, K};
  switch (fmt) {
    case Q8_0: dequant<Q8_0>(w, out, threads); return 0;
    case Q4_0: dequant<Q4_0>(w, out, threads); return 0;
    case Q4_1: dequant<Q4_1>(w, out, threads); return 0;
  }
  return -1;
}

}  // extern "C"
