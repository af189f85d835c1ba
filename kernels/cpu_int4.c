/* int4 weight-only matmul with float32 activations for the CPU (AVX2 + FMA + F16C, or AVX-512): asymmetric groups
   of 32 inputs, two 4-bit values per byte, an fp16 scale and an fp16 minimum per group (GGUF's Q4_1 block).

   y[m, n] = sum_g ( scale[n, g] * sum_{k < 32} x[m, 32 g + k] * q[n, 32 g + k]
                     + minimum[n, g] * sum_{k < 32} x[m, 32 g + k] )

   i.e. x times the weight w[n, 32 g + k] = scale[n, g] * q[n, 32 g + k] + minimum[n, g], q in 0 .. 15.

   x        float32 [M, K] row-major, K = 32 G
   packed   uint8   [N, K / 2]: group g of channel n is the 16 bytes at packed[n, 16 g ..]; byte j holds input
                    32 g + j in its low nibble and input 32 g + 16 + j in its high nibble, so one 16-byte load, an
                    AND and a shift give the group's first and second halves in input order (no shuffle)
   scale    fp16    [N, G] (IEEE half, as uint16)
   minimum  fp16    [N, G]
   xsum     float32 [M, G] scratch: each row's group sums, computed here first
   y        float32 [M, N] row-major (written, not accumulated)

   The arithmetic is cpu_int8.c's, value for value: a group's dot product is one 8-lane chain over its four
   blocks of 8 inputs (the nibbles widened to floats exactly), scaled into one 8-lane accumulator per row (an FMA)
   and reduced once at the end; the minima's terms are one 8-lane dot product over the groups, then the remainder
   in order. The fp16 scales and minima are widened to fp32 exactly (F16C) before use. So a row's bits never
   depend on M (a decode row alone or among others) nor on the thread count (threads split output channels, each
   channel's sum is one thread's), and rows run in eights, then the rest together, only to unpack each weight
   byte once for several rows.

   Built with KVCHAT_AVX512 (cpu_build.py's avx512 variant), channels go in pairs: one 16-lane register holds
   channel n's 8 lanes below channel n + 1's, each half doing exactly the 8-lane operations above, in the same
   order, so the bits equal the AVX2 build's.

   Threads: an OpenMP team of `threads` splits the N output channels (blocks of 8); torch's pool (cpu_build.py). */

#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define MAX_GROUPS 1024 /* a channel's widened scales and minima live on the stack: K up to 32768 inputs */

/* The G fp16 values at h as floats at f (exact). */
static inline void widen_halves(const uint16_t *h, float *f, int64_t G) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) _mm256_storeu_ps(f + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
  for (; g < G; ++g) f[g] = _cvtsh_ss(h[g]);
}

/* The 8 values in the low 8 bytes of v (each 0 .. 15) as floats. */
static inline __m256 widen8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* Output channel n for rows m .. m + ROWS - 1 (ROWS a compile-time constant at each call). */
static inline __attribute__((always_inline)) void channel(const float *x, const uint8_t *packed, const uint16_t *scale,
                                                         const uint16_t *minimum, const float *xsum, float *y,
                                                         int64_t N, int64_t G, int64_t n, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  const float *x0 = x + m * K;
  const uint8_t *w = packed + n * (K / 2);
  float sc[MAX_GROUPS], mn[MAX_GROUPS];
  widen_halves(scale + n * G, sc, G);
  widen_halves(minimum + n * G, mn, G);
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[8];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(w + g * (GROUP / 2)));
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m256 w0 = widen8(lo), w1 = widen8(_mm_unpackhi_epi64(lo, lo)), w2 = widen8(hi),
                 w3 = widen8(_mm_unpackhi_epi64(hi, hi));
    const __m256 s = _mm256_broadcast_ss(sc + g);
    for (int i = 0; i < ROWS; ++i)
      acc[i] = _mm256_fmadd_ps(group_dot(w0, w1, w2, w3, x0 + i * K + g * GROUP), s, acc[i]);
  }
  for (int i = 0; i < ROWS; ++i) y[(m + i) * N + n] = hsum8(acc[i]) + groups_dot(mn, xsum + (m + i) * G, G);
}

#ifdef KVCHAT_AVX512
/* The 8 values in the low 8 bytes of a (lanes 0-7) and of b (lanes 8-15) as floats. */
static inline __m512 widen8x2(__m128i a, __m128i b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(a, b)));
}

/* channel() for output channels n and n + 1 at once (see the comment at the top). */
static inline __attribute__((always_inline)) void channel2(const float *x, const uint8_t *packed, const uint16_t *scale,
                                                          const uint16_t *minimum, const float *xsum, float *y,
                                                          int64_t N, int64_t G, int64_t n, int64_t m, const int ROWS) {
  const int64_t K = G * GROUP;
  const float *x0 = x + m * K;
  const uint8_t *w = packed + n * (K / 2);
  float sc[2 * MAX_GROUPS], mn[2 * MAX_GROUPS];
  widen_halves(scale + n * G, sc, 2 * G); /* channel n's G scales, then channel n + 1's */
  widen_halves(minimum + n * G, mn, 2 * G);
  const __m128i low = _mm_set1_epi8(0x0F);
  __m512 acc[8];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m128i a = _mm_loadu_si128((const __m128i *)(w + g * (GROUP / 2)));
    const __m128i b = _mm_loadu_si128((const __m128i *)(w + K / 2 + g * (GROUP / 2)));
    const __m128i alo = _mm_and_si128(a, low), ahi = _mm_and_si128(_mm_srli_epi16(a, 4), low);
    const __m128i blo = _mm_and_si128(b, low), bhi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m512 w0 = widen8x2(alo, blo), w1 = widen8x2(_mm_unpackhi_epi64(alo, alo), _mm_unpackhi_epi64(blo, blo)),
                 w2 = widen8x2(ahi, bhi), w3 = widen8x2(_mm_unpackhi_epi64(ahi, ahi), _mm_unpackhi_epi64(bhi, bhi));
    const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sc[g]), _mm256_set1_ps(sc[G + g]), 1);
    for (int i = 0; i < ROWS; ++i)
      acc[i] = _mm512_fmadd_ps(group_dot2(w0, w1, w2, w3, x0 + i * K + g * GROUP), s, acc[i]);
  }
  for (int i = 0; i < ROWS; ++i) {
    const float *xs = xsum + (m + i) * G;
    y[(m + i) * N + n] = hsum8(_mm512_castps512_ps256(acc[i])) + groups_dot(mn, xs, G);
    y[(m + i) * N + n + 1] = hsum8(_mm512_extractf32x8_ps(acc[i], 1)) + groups_dot(mn + G, xs, G);
  }
}
#endif

/* Output channel n (and n + 1 too where built with KVCHAT_AVX512, for 4 to 8 rows, when n + 1 < n1) for ROWS rows
   from m; returns the channels done. Pairs from 4 rows as cpu_int8.c (the pairing's extra shuffles cost more than
   they save for one or two rows). */
static inline __attribute__((always_inline)) int64_t channels(const float *x, const uint8_t *packed,
                                                             const uint16_t *scale, const uint16_t *minimum,
                                                             const float *xsum, float *y, int64_t N, int64_t G,
                                                             int64_t n, int64_t n1, int64_t m, const int ROWS) {
#ifdef KVCHAT_AVX512
  if (ROWS >= 4 && n + 1 < n1) {
    channel2(x, packed, scale, minimum, xsum, y, N, G, n, m, ROWS);
    return 2;
  }
#else
  (void)n1;
#endif
  channel(x, packed, scale, minimum, xsum, y, N, G, n, m, ROWS);
  return 1;
}

int64_t kvchat_int4_max_groups(void) { return MAX_GROUPS; }

void kvchat_int4_matmul(const float *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum,
                        float *xsum, float *y, int64_t M, int64_t N, int64_t G, int threads) {
  group_sums(x, xsum, M, G);
  const int64_t blocks = (N + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n1 = (blk + 1) * 8 < N ? (blk + 1) * 8 : N;
    for (int64_t m = 0; m < M;) { /* rows in eights, then the 1-7 left together (as many FMA chains as rows) */
      const int rows = M - m >= 8 ? 8 : (int)(M - m);
      for (int64_t n = blk * 8; n < n1;) {
#define ROWS_CASE(R) case R: n += channels(x, packed, scale, minimum, xsum, y, N, G, n, n1, m, R); break;
        switch (rows) { ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5) ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) ROWS_CASE(1) }
#undef ROWS_CASE
      }
      m += rows;
    }
  }
}
