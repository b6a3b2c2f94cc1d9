// Weight-only quantized matmuls for the CPU: y = x W^T with x fp32 (M, K) and W (N, K) stored in
// blocks of 32 weights along K, GGML's Q8_0, Q4_0 and Q4_1 arithmetic:
//   q8_0: int8 q[32], fp16 d           w = d * q
//   q4_0: 4-bit q[32] (0..15), fp16 d  w = d * (q - 8)
//   q4_1: 4-bit q[32] (0..15), fp16 d, fp16 m   w = d * q + m
// Planes, not interleaved blocks: qs (N, K) int8 or (N, K/2) packed nibbles, d and m (N, K/32)
// fp16. A 4-bit block's 16 bytes hold weight j in the low nibble of byte j and weight j + 16 in
// its high nibble (GGML's order).
//
// Plain C ABI (loaded with ctypes, no torch headers: it compiles in a second). OpenMP splits the
// output rows; in a torch process `-fopenmp` binds to the libgomp torch already loaded (same
// soname), so both share one thread pool. AVX2 + FMA + F16C.
//
// gemv: for each output row, each block is unpacked once to 4 x 8 floats and multiplied into up to
// 4 activation rows at a time (M small: decode steps). dequant: W to fp32 (N, K), for the large-M
// path (prefill), where torch's fp32 GEMM does the multiply.

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
    const __m256 d = _mm256_set1_ps(h2f(w.d[n * G + g]));
    for (int t = 0; t < MT; t++) {
      const float* xp = x + t * ldx + g * QK;
      __m256 p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
      p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 8), p);
      p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp + 16), p);
      p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 24), p);
      acc[t] = _mm256_fmadd_ps(p, d, acc[t]);
    }
    if (F == Q4_1) {
      const float m = h2f(w.m[n * G + g]);
      for (int t = 0; t < MT; t++) acc_min[t] += m * xsum[t * G + g];
    }
  }
  for (int t = 0; t < MT; t++) y[t * ldy + n] = hsum(acc[t]) + acc_min[t];
}

template <int F>
void gemv(const Weights& w, const float* x, int64_t M, int64_t ldx, const float* xsum, float* y, int64_t ldy,
          int threads) {
  const int64_t G = w.K / QK;
  const int64_t rows_per_task = 8;
  const int64_t tasks = (w.N + rows_per_task - 1) / rows_per_task;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < tasks; task++) {
    const int64_t n1 = std::min(w.N, (task + 1) * rows_per_task);
    for (int64_t n = task * rows_per_task; n < n1; n++) {
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

template <int F>
void dequant(const Weights& w, float* out, int threads) {
  const int64_t G = w.K / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < w.N; n++) {
    __m256 q[4];
    for (int64_t g = 0; g < G; g++) {
      unpack<F>(w, n, g, q);
      const __m256 d = _mm256_set1_ps(h2f(w.d[n * G + g]));
      const __m256 m = _mm256_set1_ps(F == Q4_1 ? h2f(w.m[n * G + g]) : 0.f);
      float* o = out + n * w.K + g * QK;
      for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(q[i], d, m));
    }
  }
}

}  // namespace

extern "C" {

// y (M, N) with row stride ldy = x (M, K) with row stride ldx, times W^T. Returns 0, or -1 for an
// unknown format.
int cq_gemv(int fmt, const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, const float* x,
            int64_t M, int64_t ldx, float* y, int64_t ldy, int threads) {
  const Weights w{qs, d, m, N, K};
  switch (fmt) {
    case Q8_0: gemv<Q8_0>(w, x, M, ldx, nullptr, y, ldy, threads); return 0;
    case Q4_0: gemv<Q4_0>(w, x, M, ldx, nullptr, y, ldy, threads); return 0;
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
      gemv<Q4_1>(w, x, M, ldx, xsum.data(), y, ldy, threads);
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
