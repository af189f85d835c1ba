/* int8 weight-only matmul with float32 activations for the CPU (AVX2 + FMA, or AVX-512): asymmetric groups of 32 inputs.

   y[m, n] = sum_g ( scale[n, g] * sum_{k < 32} x[m, 32 g + k] * q[n, 32 g + k]
                     + offset[n, g] * sum_{k < 32} x[m, 32 g + k] )

   i.e. x times the weight w[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + offset[n, g].

   x       float32 [M, K] row-major, K = 32 G
   q       int8    [N, K] row-major
   scale   float32 [N, G]
   offset  float32 [N, G]
   xsum    float32 [M, G] scratch: each row's group sums, computed here first
   y       float32 [M, N] row-major (written, not accumulated)

   A row's arithmetic never depends on M: each group's dot product is one
   8-lane chain over its four blocks of 8 inputs, scaled into one 8-lane
   accumulator per row (an FMA) and reduced once at the end; the offsets'
   terms are one 8-lane dot product over the groups, then the remainder in
   order. So a token gets the same bits
   whether it runs alone (decode) or among others (a question after a resume,
   a batched decode), and rows are computed in eights, then the rest together,
   only to read and widen each weight byte once for several rows (fewer rows are fewer independent FMA chains:
   SmolLM2's 30 layers at 15 rows, 2 threads, side by side, AVX2 build: 8 + 7 rows 24.0 ms, 8 + 4 + 2 + 1 rows
   27.0 ms; the AVX-512 build 20.4 ms).

   Built with KVCHAT_AVX512 (cpu_build.py's avx512 variant), channels go in pairs: one 16-lane register holds
   channel n's 8 lanes below channel n + 1's, each half doing exactly the 8-lane operations above, in the same
   order, so the bits equal the AVX2 build's while each instruction does two channels' work.

   Threads: an OpenMP team of `threads` splits the N output channels
   (blocks of 8). Loaded into a process that already runs torch, libgomp.so.1
   resolves to torch's own copy, so the team is torch's thread pool. */

#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels.h"


/* 8 int8 weights at w as floats: one sign-extending load (vpmovsxbd from memory), one conversion. */
static inline __m256 widen(const int8_t *w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* Output channel n for rows m .. m + ROWS - 1 (ROWS a compile-time constant at each call): each weight group
   widened once for all of them, then for each row its 8-lane group dot product scaled into its accumulator. */
static inline __attribute__((always_inline)) void channel(const float *x, const int8_t *q, const float *scale,
                                                         const float *offset, const float *xsum, float *y, int64_t N,
                                                         int64_t G, int64_t n, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  const float *x0 = x + m * K;
  const int8_t *w = q + n * K;
  const float *sc = scale + n * G;
  const int8_t *next = n + 1 < N ? w + K : w; /* the next channel's weights; the last one's own, never past q */
  __m256 acc[8];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k = g * GROUP;
    /* the next channel's line of these 2 groups, so its short stream starts warm (cpu_int4.c). Measured on the
       135M model's decode at 2,048 tokens, 2 threads, five pairs of fresh processes alternated (two runs each):
       median 91.1 against 85.9 tok/s */
    if (g % 2 == 0)
      _mm_prefetch((const char *)(next + k), _MM_HINT_T0);
    const __m256 w0 = widen(w + k), w1 = widen(w + k + 8), w2 = widen(w + k + 16), w3 = widen(w + k + 24);
    const __m256 s = _mm256_broadcast_ss(sc + g);
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_fmadd_ps(group_dot(w0, w1, w2, w3, x0 + i * K + k), s, acc[i]);
  }
  const float *of = offset + n * G;
  for (int i = 0; i < ROWS; ++i) y[(m + i) * N + n] = hsum8(acc[i]) + groups_dot(of, xsum + (m + i) * G, G);
}

#ifdef KVCHAT_AVX512
/* 8 weights of channel n (lanes 0-7) and the same 8 of channel n + 1 (lanes 8-15, at w + K), as floats. */
static inline __m512 widen2(const int8_t *w, int64_t K) {
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)w), _mm_loadl_epi64((const __m128i *)(w + K)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* channel() for output channels n and n + 1 at once (see the comment at the top). */
static inline __attribute__((always_inline)) void channel2(const float *x, const int8_t *q, const float *scale,
                                                          const float *offset, const float *xsum, float *y, int64_t N,
                                                          int64_t G, int64_t n, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  const float *x0 = x + m * K;
  const int8_t *w = q + n * K;
  const float *sc = scale + n * G;
  __m512 acc[8];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k = g * GROUP;
    const __m512 w0 = widen2(w + k, K), w1 = widen2(w + k + 8, K), w2 = widen2(w + k + 16, K),
                 w3 = widen2(w + k + 24, K);
    const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sc[g]), _mm256_set1_ps(sc[G + g]), 1);
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_fmadd_ps(group_dot2(w0, w1, w2, w3, x0 + i * K + k), s, acc[i]);
  }
  const float *of = offset + n * G;
  for (int i = 0; i < ROWS; ++i) {
    const float *xs = xsum + (m + i) * G;
    y[(m + i) * N + n] = hsum8(_mm512_castps512_ps256(acc[i])) + groups_dot(of, xs, G);
    y[(m + i) * N + n + 1] = hsum8(_mm512_extractf32x8_ps(acc[i], 1)) + groups_dot(of + G, xs, G);
  }
}
#endif

/* Output channel n (and n + 1 too where built with KVCHAT_AVX512, for 4 to 8 rows, when n + 1 < n1) for ROWS rows
   from m; returns the channels done. */
static inline __attribute__((always_inline)) int64_t channels(const float *x, const int8_t *q, const float *scale,
                                                             const float *offset, const float *xsum, float *y,
                                                             int64_t N, int64_t G, int64_t n, int64_t n1, int64_t m,
                                                             const int ROWS) {
#ifdef KVCHAT_AVX512
  if (ROWS >= 4 && n + 1 < n1) { /* measured: one or two rows ran slower in pairs (the widening's shuffles) */
    channel2(x, q, scale, offset, xsum, y, N, G, n, m, ROWS);
    return 2;
  }
#else
  (void)n1;
#endif
  channel(x, q, scale, offset, xsum, y, N, G, n, m, ROWS);
  return 1;
}

void kvchat_int8_matmul(const float *x, const int8_t *q, const float *scale, const float *offset, float *xsum, float *y,
                        int64_t M, int64_t N, int64_t G, int threads) {
  group_sums(x, xsum, M, G);
  const int64_t blocks = (N + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n1 = (blk + 1) * 8 < N ? (blk + 1) * 8 : N;
    for (int64_t m = 0; m < M;) { /* rows in eights, then the 1-7 left together (as many FMA chains as rows) */
      const int rows = M - m >= 8 ? 8 : (int)(M - m);
      for (int64_t n = blk * 8; n < n1;) {
#define ROWS_CASE(R) case R: n += channels(x, q, scale, offset, xsum, y, N, G, n, n1, m, R); break;
        switch (rows) { ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5) ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) ROWS_CASE(1) }
#undef ROWS_CASE
      }
      m += rows;
    }
  }
}
