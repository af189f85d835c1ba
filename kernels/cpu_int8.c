/* int8 weight-only matmul with float32 activations for the CPU (AVX2 + FMA), few rows at a time.

   y[m, n] = sum_g scale[g, n] * sum_{k < group} x[m, g * group + k] * q[g, n, k]

   x      float32 [M, K] row-major, K = G * group
   q      int8    [G, N, group] (each q[g] row-major: the layout of kvchat.model.quant.Int8Linear)
   scale  float32 [G, N]
   y      float32 [M, N] row-major (written, not accumulated)

   A row's arithmetic never depends on M: each dot product over one group
   keeps four 8-lane accumulators (k mod 32 in blocks of 8), reduced in a
   fixed order, then scaled and summed over the groups in order. So a token
   gets the same bits whether it runs alone (decode) or among others (a
   question after a resume), and rows are computed in pairs only to read
   each weight byte once per pair. group must be a multiple of 32.

   Threads: an OpenMP team of `threads` splits the N output channels
   (blocks of 8). Loaded into a process that already runs torch, libgomp.so.1
   resolves to torch's own copy, so the team is torch's thread pool. */

#include <immintrin.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static inline __m256 widen(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8)); }

static inline float reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* Output channel n for rows m and m + 1 (pair) or m alone. */
static void channel(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N,
                    int64_t G, int64_t group, int64_t n, int64_t m, int pair) {
  const int64_t K = G * group;
  const float *x0 = x + m * K, *x1 = x0 + K;
  float y0 = 0.0f, y1 = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const int8_t *w = q + (g * N + n) * group;
    const float *a = x0 + g * group, *b = x1 + g * group;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    __m256 t0 = s0, t1 = s0, t2 = s0, t3 = s0;
    for (int64_t k = 0; k < group; k += 32) {
      const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + k));
      const __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
      const __m256 w0 = widen(lo), w1 = widen(_mm_srli_si128(lo, 8));
      const __m256 w2 = widen(hi), w3 = widen(_mm_srli_si128(hi, 8));
      s0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a + k), s0);
      s1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a + k + 8), s1);
      s2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(a + k + 16), s2);
      s3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(a + k + 24), s3);
      if (pair) {
        t0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(b + k), t0);
        t1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(b + k + 8), t1);
        t2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(b + k + 16), t2);
        t3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(b + k + 24), t3);
      }
    }
    const float sc = scale[g * N + n];
    y0 += sc * reduce4(s0, s1, s2, s3);
    if (pair) y1 += sc * reduce4(t0, t1, t2, t3);
  }
  y[m * N + n] = y0;
  if (pair) y[(m + 1) * N + n] = y1;
}

void kvchat_int8_matmul(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N,
                        int64_t G, int64_t group, int threads) {
  const int64_t blocks = (N + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n1 = (blk + 1) * 8 < N ? (blk + 1) * 8 : N;
    for (int64_t m = 0; m < M; m += 2) {
      const int pair = m + 1 < M;
      for (int64_t n = blk * 8; n < n1; ++n) channel(x, q, scale, y, M, N, G, group, n, m, pair);
    }
  }
}
